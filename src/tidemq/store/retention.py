"""Retention (ref ST7): delete old CommitLog segments and the index entries below them.

RocketMQ's CleanCommitLogService, with its defaults: a segment whose last write is older than
``file_reserved_hours`` (72 h) is deleted at ``delete_when_hour`` (04:00) or at any time once disk
use passes ``disk_max_used_ratio`` (75 %); past ``disk_refuse_writes_ratio`` (90 %) the store
refuses puts with DiskFullError until space is freed. The active segment is never deleted.
After segments go, consume queue files and index files wholly below the new CommitLog minimum
are deleted and each queue's minimum offset is corrected (CleanConsumeQueueService).

**Disk pressure without silent loss -- a deliberate change from RocketMQ.** RocketMQ deletes
the oldest segments past ``disk_clean_forcibly_ratio`` (85 %) even when they have not expired
(``cleanFileForciblyEnable=true``), whether or not anyone has read them. Here, by default, an
unexpired segment is deleted under pressure only when every message in it has been
*consumed*; otherwise the store keeps it and, past 90 %, refuses writes (DISK_FULL, naming the
queue and reader that hold the space). ``clean_file_forcibly = True`` restores RocketMQ's
behaviour, and every deletion of unconsumed messages -- forced, or by expiry -- is logged with
what went: topic, queue, offset range and count.

"Consumed", per queue, with RocketMQ's own bookkeeping: the lowest committed offset of the
consumer groups that have offsets on the queue's topic (a group that never committed on one
of the topic's queues holds all of it); for the broker's internal topics, the progress of the
service reading them (delay levels, transaction checks). A queue nobody has offsets for -- a
topic without consumer groups, a dead-letter queue, the timer topic -- is governed by age
only: kept until it expires. The store alone knows no readers (``consumed`` is None): every
unexpired message counts as unconsumed; the broker sets ``consumed``.

Runs on the store's housekeeping thread; ``run_once`` may also be called directly (tests, CLI).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidemq.store.message_store import MessageStore

log = logging.getLogger(__name__)

#: ``consumed()``: (topic, queue id) -> (lowest queue offset a reader still needs, who that
#: reader is, for the logs). Queues missing from it are read by nobody: kept until expiry.
ConsumedPositions = Callable[[], dict[tuple[str, int], tuple[int, str]]]

_NOBODY = "no consumer group has offsets on it: kept until it expires"
_MAX_DROP_LINES = 20


@dataclass
class DroppedRange:
    """Unconsumed messages a deletion removed from one queue."""

    topic: str
    queue_id: int
    first: int  # queue offsets [first, end)
    end: int
    reader: str

    @property
    def count(self) -> int:
        return self.end - self.first


@dataclass
class RetentionResult:
    disk_ratio: float
    segments_deleted: int
    queue_files_deleted: int
    index_files_deleted: int
    refuse_writes: bool
    #: under pressure, an unexpired segment was kept because it holds unconsumed messages
    kept_unconsumed: str | None = None
    #: unconsumed messages the deletion removed (expired, or forced)
    dropped: list[DroppedRange] = field(default_factory=list)


def disk_used_ratio(path: str | os.PathLike[str]) -> float:
    u = shutil.disk_usage(path)
    return (u.total - u.free) / u.total if u.total else 0.0


class RetentionService:
    def __init__(self, store: MessageStore) -> None:
        self.store = store
        #: Replaceable for tests: returns the used fraction of the disk holding the store.
        self.usage: Callable[[], float] = lambda: disk_used_ratio(store.dir)
        self.clock: Callable[[], float] = time.time
        #: Who still needs what (set by the broker; see the module docstring).
        self.consumed: ConsumedPositions | None = None
        #: Why the last round under pressure could not free space (None when it could).
        self.blocked: str | None = None

    # -- who needs what ------------------------------------------------------------------------
    def _positions(self) -> dict[tuple[str, int], tuple[int, str]]:
        if self.consumed is None:
            return {}
        try:
            return self.consumed()
        except Exception:  # never let a bad hook turn into deleting: keep everything
            log.exception("retention: reading consumer positions failed; keeping everything")
            return {}

    def _oldest_needed(
        self, positions: dict[tuple[str, int], tuple[int, str]]
    ) -> tuple[int, str]:
        """(CommitLog offset of the oldest message some reader still needs, which queue and
        reader that is); (2**63, "") when nothing unconsumed is stored."""
        best, why = 2**63, ""
        for cq in self.store.cqs.all():
            mn, mx = cq.min_offset, cq.max_offset
            off, who = positions.get((cq.topic, cq.queue_id), (mn, _NOBODY))
            off = max(off, mn)
            if off >= mx:
                continue
            unit = cq.get(off)
            if unit is not None and unit[0] < best:
                best = unit[0]
                why = f"topic {cq.topic} queue {cq.queue_id} from offset {off} ({who})"
        return best, why

    # -- one round -----------------------------------------------------------------------------
    def run_once(self, *, force_time: bool = False) -> RetentionResult:
        store, cfg = self.store, self.store.config
        ratio = self.usage()
        store.disk_full = ratio >= cfg.disk_refuse_writes_ratio
        now = self.clock()
        hour_ok = time.localtime(now).tm_hour == cfg.delete_when_hour
        space_pressure = ratio >= cfg.disk_max_used_ratio
        forcibly = ratio >= cfg.disk_clean_forcibly_ratio
        deleted = 0
        kept: str | None = None
        forced = False
        positions: dict[tuple[str, int], tuple[int, str]] | None = None
        if hour_ok or space_pressure or force_time:
            cl = store.commitlog
            expire = cfg.file_reserved_hours * 3600
            count = 0
            needed: tuple[int, str] | None = None
            for seg in cl.segments[:-1]:
                try:
                    mtime = os.stat(seg.path).st_mtime
                except OSError:
                    mtime = 0.0
                if now - mtime >= expire:
                    count += 1
                    continue
                if not forcibly:
                    break
                # Unexpired, under pressure: under force, one segment per round, oldest first.
                if cfg.clean_file_forcibly:
                    count += 1
                    forced = True
                    break
                if needed is None:
                    positions = self._positions()
                    needed = self._oldest_needed(positions)
                if seg.end <= needed[0]:
                    count += 1  # everything in it was consumed: it may go
                    break
                kept = needed[1]
                break
            if count:
                if positions is None:
                    positions = self._positions()
                before = {(cq.topic, cq.queue_id): cq.min_offset for cq in store.cqs.all()}
                with store._put_lock:
                    gone = cl.delete_segments(count)
                deleted = len(gone)
                for seg in gone:
                    log.info("retention deleted segment %s", seg.path)
        qfiles = ifiles = 0
        dropped: list[DroppedRange] = []
        if deleted:
            cl_min = store.commitlog.min_offset
            qfiles += store.cqs.delete_expired(cl_min)  # the shared index log's old files
            for cq in store.cqs.all():
                qfiles += cq.delete_expired_files(cl_min)
            ifiles = store.index.delete_expired(cl_min)
            assert positions is not None
            dropped = self._dropped(before, positions)
            if dropped:
                self._log_dropped(dropped, forced, ratio)
        if kept is not None and ratio >= cfg.disk_clean_forcibly_ratio:
            self.blocked = (
                f"the oldest segment holds unconsumed messages ({kept}); consume them, reset "
                "stale consumer groups, free disk space, or set store.clean_file_forcibly=true "
                "to delete them anyway"
            )
        elif deleted or ratio < cfg.disk_clean_forcibly_ratio:
            self.blocked = None
        if deleted and store.disk_full:
            ratio = self.usage()
            store.disk_full = ratio >= cfg.disk_refuse_writes_ratio
        if store.disk_full:
            log.error(
                "disk %.0f%% full (limit %.0f%%): refusing writes to %s%s",
                ratio * 100, cfg.disk_refuse_writes_ratio * 100, store.dir,
                f"; {self.blocked}" if self.blocked else "",
            )
        elif kept is not None:
            log.warning("disk %.0f%% full: %s", ratio * 100, self.blocked)
        return RetentionResult(ratio, deleted, qfiles, ifiles, store.disk_full, kept, dropped)

    def _dropped(
        self, before: dict[tuple[str, int], int],
        positions: dict[tuple[str, int], tuple[int, str]],
    ) -> list[DroppedRange]:
        """Unconsumed messages each queue lost in this round (its minimum moved past them)."""
        out = []
        for cq in self.store.cqs.all():
            key = (cq.topic, cq.queue_id)
            old_min = before.get(key)
            if old_min is None:
                continue
            off, who = positions.get(key, (old_min, _NOBODY))
            first = max(off, old_min)
            if cq.min_offset > first:
                out.append(DroppedRange(cq.topic, cq.queue_id, first, cq.min_offset, who))
        return out

    def _log_dropped(self, dropped: list[DroppedRange], forced: bool, ratio: float) -> None:
        total = sum(d.count for d in dropped)
        cause = (f"forced deletion (disk {ratio:.0%} full, store.clean_file_forcibly=true)"
                 if forced else "expired segments (file_reserved_hours)")
        log.warning("retention dropped %d unconsumed messages of %d queues by %s:", total,
                    len(dropped), cause)
        for d in dropped[:_MAX_DROP_LINES]:
            log.warning("  topic %s queue %d offsets [%d, %d): %d messages (%s)", d.topic,
                        d.queue_id, d.first, d.end, d.count, d.reader)
        if len(dropped) > _MAX_DROP_LINES:
            log.warning("  ... and %d more queues", len(dropped) - _MAX_DROP_LINES)
