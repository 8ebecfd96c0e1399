"""Retention (SPEC ST7): delete old CommitLog segments and the index entries below them.

RocketMQ's CleanCommitLogService, with its defaults: a segment whose last write is older than
``file_reserved_hours`` (72 h) is deleted at ``delete_when_hour`` (04:00) or at any time once disk
use passes ``disk_max_used_ratio`` (75 %); past ``disk_clean_forcibly_ratio`` (85 %) the oldest
segments go even if they have not expired; past ``disk_refuse_writes_ratio`` (90 %) the store
refuses puts with DiskFullError until space is freed. The active segment is never deleted.
After segments go, consume queue files and index files wholly below the new CommitLog minimum
are deleted and each queue's minimum offset is corrected (CleanConsumeQueueService).

Runs on the store's housekeeping thread; ``run_once`` may also be called directly (tests, CLI).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidemq.store.message_store import MessageStore

log = logging.getLogger(__name__)


@dataclass
class RetentionResult:
    disk_ratio: float
    segments_deleted: int
    queue_files_deleted: int
    index_files_deleted: int
    refuse_writes: bool


def disk_used_ratio(path: str | os.PathLike) -> float:
    u = shutil.disk_usage(path)
    return (u.total - u.free) / u.total if u.total else 0.0


class RetentionService:
    def __init__(self, store: MessageStore) -> None:
        self.store = store
        #: Replaceable for tests: returns the used fraction of the disk holding the store.
        self.usage: Callable[[], float] = lambda: disk_used_ratio(store.dir)
        self.clock: Callable[[], float] = time.time

    def run_once(self, *, force_time: bool = False) -> RetentionResult:
        store, cfg = self.store, self.store.config
        ratio = self.usage()
        store.disk_full = ratio >= cfg.disk_refuse_writes_ratio
        if store.disk_full:
            log.error(
                "disk %.0f%% full (limit %.0f%%): refusing writes to %s",
                ratio * 100,
                cfg.disk_refuse_writes_ratio * 100,
                store.dir,
            )
        now = self.clock()
        hour_ok = time.localtime(now).tm_hour == cfg.delete_when_hour
        space_pressure = ratio >= cfg.disk_max_used_ratio
        forcibly = ratio >= cfg.disk_clean_forcibly_ratio
        deleted = 0
        if hour_ok or space_pressure or force_time:
            cl = store.commitlog
            expire = cfg.file_reserved_hours * 3600
            count = 0
            for seg in cl.segments[:-1]:
                try:
                    mtime = os.stat(seg.path).st_mtime
                except OSError:
                    mtime = 0.0
                if now - mtime >= expire or forcibly:
                    count += 1
                    if forcibly and now - mtime < expire:
                        break  # under force, free one segment per round, oldest first
                else:
                    break
            if count:
                with store._put_lock:
                    gone = cl.delete_segments(count)
                deleted = len(gone)
                for seg in gone:
                    log.info("retention deleted segment %s", seg.path)
        qfiles = ifiles = 0
        if deleted:
            cl_min = store.commitlog.min_offset
            for cq in store.cqs.all():
                qfiles += cq.delete_expired_files(cl_min)
            ifiles = store.index.delete_expired(cl_min)
            if store.disk_full:
                store.disk_full = self.usage() >= cfg.disk_refuse_writes_ratio
        return RetentionResult(ratio, deleted, qfiles, ifiles, store.disk_full)
