"""MessageStore: the facade of the storage engine (ref ST1-ST9).

It owns one data directory::

    <data_dir>/lock            flock'ed while open: a second process gets StoreLockedError
    <data_dir>/abort           exists while open; found at start-up => the last run crashed
    <data_dir>/checkpoint      what is durable (store/checkpoint.py)
    <data_dir>/commitlog/      segments (store/commit_log.py)
    <data_dir>/cqlog/          every consume queue's units in one shared log (store/index_log.py)
    <data_dir>/consumequeue/   the older layout, a directory per queue (store/consume_queue.py):
                               copied into cqlog/ and removed at open
    <data_dir>/index/          key and id index files (store/index_file.py)

Threads and who may call what:
- ``put`` may be called from any thread; puts are serialised by one lock (RocketMQ's put message
  lock), which also covers the dispatch to the consume queue and the index. Dispatch listeners
  run on the putting thread, inside the lock: they must be quick and must not call ``put``.
- ``get_messages``, ``min_offset``/``max_offset``, ``query_by_key``, ``get_by_id`` and
  ``read_batch`` may be called from any thread at any time, concurrently with puts.
- SYNC_FLUSH durability callbacks (``on_durable``) run on the flush thread.
- Two background threads: the flush service, and housekeeping (consume queue / index flush and
  checkpoint every second, retention every ten seconds).
- A slave's store is written by ``append_replicated`` (never ``put``), ``truncate_to`` and
  ``reset_to``, from one replication thread; they take the put lock like ``put``.
- ``close`` once, from the thread that owns the store, after the callers have stopped.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import logging
import mmap
import os
import resource
import shutil
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tidemq.protocol.batch.columns import BatchColumns
from tidemq.protocol.batch.layout import index_hashes
from tidemq.protocol.corrupt import CorruptRecords
from tidemq.protocol.errors import (
    CorruptBatchError,
    DiskFullError,
    MessageTooLargeError,
    OffsetOutOfRangeError,
    StoreClosedError,
    StoreError,
    StoreLockedError,
)
from tidemq.protocol.record import (
    BATCH_MAGIC,
    CRC_FIELD,
    FILLER_MAGIC,
    FILLER_MIN,
    INDEX_ENTRY,
    INDEX_ENTRY_SIZE,
    PRODUCER_HEADER_SIZE,
    STORE_CRC_FROM,
    STORE_CRC_OFFSET,
    STORE_FIELDS,
    STORE_FIELDS_OFFSET,
    STORE_HEADER_SIZE,
    STORE_TAIL,
    TOTAL_SIZE_MAGIC,
    BatchView,
    StoredMessage,
    crc32c,
    decode_utf8,
    pack_host,
    parse_unique_id,
    stored_span,
)
from tidemq.store.checkpoint import (
    Checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from tidemq.store.commit_log import CommitLog
from tidemq.store.config import StoreConfig
from tidemq.store.consume_queue import ConsumeQueueTable
from tidemq.store.flush import FlushCallback, FlushMode, FlushService
from tidemq.store.index_file import IndexService, key_hash
from tidemq.store.index_log import UNIT_DTYPE, UNIT_SIZE, IndexLog, LogQueue
from tidemq.store.pull_outcome import (
    GetResult,
    ReadBatch,
    position_outcome,
    read_outcome,
)

# GetStatus is re-exported: readers of the store import it from here.
from tidemq.store.pull_outcome import GetStatus as GetStatus
from tidemq.store.recovery import RecoveryReport, scan
from tidemq.store.retention import RetentionService

# get_messages reads up to this many index units with one struct unpack (phys, size, tag per
# unit: UNIT_DTYPE's layout) instead of a numpy array: 0.4 against 0.9 us for the unit or two
# a queue holds when a backlog is spread over 100,000 queues
_UNITS_BY_STRUCT = 16
_UNITS_OF = [struct.Struct("<" + "QIQ" * k) for k in range(_UNITS_BY_STRUCT + 1)]
assert _UNITS_OF[1].size == UNIT_SIZE

log = logging.getLogger(__name__)


#: Messages per id-index block: a batch is indexed once per block of sequence ids it covers.
ID_BLOCK_BITS = 10


_ZERO_CHUNK = bytes(1 << 20)
#: the refusal of a batch whose batch CRC does not match (put, put_many, put_frame)
_DAMAGED = "batch CRC32C mismatch: the batch was damaged on its way"

# put_frame's stamps: the store fields set at append time (STORE_FIELDS at
# STORE_FIELDS_OFFSET) and the broker's port and host (STORE_HEADER's last two fields)
_STAMP_DTYPE = np.dtype([("phys", "<u8"), ("qoff", "<u8"), ("ts", "<i8")])
assert _STAMP_DTYPE.itemsize == STORE_FIELDS.size
_STAMP_VOID = np.dtype(f"V{_STAMP_DTYPE.itemsize}")
_HOST_DTYPE = np.dtype([("port", "<u2"), ("host", "V16")])
_HOST_VOID = np.dtype(f"V{_HOST_DTYPE.itemsize}")
_HOST_OFFSET = STORE_HEADER_SIZE - _HOST_DTYPE.itemsize


def _garbage_end(fd: int, rel: int, size: int) -> int:
    """End of the non-zero bytes after ``rel``: the torn tail ends at the first all-zero MiB.

    Writes are sequential, so whatever a crash left after the last valid batch is contiguous;
    reading with pread (not through the mapping) avoids faulting in a pre-allocated segment.
    """
    pos = rel
    end = rel
    while pos < size:
        chunk = os.pread(fd, min(len(_ZERO_CHUNK), size - pos), pos)
        if not chunk or chunk == _ZERO_CHUNK[: len(chunk)]:
            break
        end = pos + len(chunk.rstrip(b"\0"))
        pos += len(chunk)
    return end


def id_block_key(producer_id: int, seq: int) -> str:
    return f"#id#{producer_id:016X}#{seq >> ID_BLOCK_BITS:X}"


def key_index_key(topic: str, key: str) -> str:
    return f"{topic}#{key}"


class PutStatus(enum.StrEnum):
    PUT_OK = "PUT_OK"
    FLUSH_DISK_TIMEOUT = "FLUSH_DISK_TIMEOUT"


@dataclass(slots=True)
class PutResult:
    status: PutStatus
    topic: str
    queue_id: int
    phys_offset: int
    queue_offset: int  # of the batch's first message
    count: int
    size: int
    store_ts: int

    @property
    def end_offset(self) -> int:
        return self.phys_offset + self.size


#: PutStatus.PUT_OK, looked up once (a StrEnum member lookup costs ~0.2 us; puts are hot)
_PUT_OK = PutStatus.PUT_OK

#: (topic, queue id, new max offset, the batch stored -- or, from put_frame, its tag hashes)
DispatchListener = Callable[[str, int, int, "BatchView | list[int]"], None]


class MessageStore:
    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.dir = Path(config.data_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._raise_open_file_limit()
        self._lock_fd = self._acquire_lock()
        self._closed = False
        self._put_lock = threading.Lock()
        # One checkpoint at a time: the housekeeper and flush() callers (the broker's loop, a
        # worker thread) would otherwise share checkpoint.tmp -- one's O_TRUNC under the
        # other's write, one's rename under the other's fsync -- and a newer checkpoint could
        # be replaced by an older one.
        self._checkpoint_lock = threading.Lock()
        # What the checkpoint on disk records (None: write the next one whatever it holds).
        # An idle store writes nothing: a checkpoint equal to it is skipped (issue 17).
        self._saved_cp: tuple[int, int, int, int] | None = None
        self._listeners: list[DispatchListener] = []
        # A queue's next offset has one owner: its LogQueue (``max_offset``), read and advanced
        # by the put paths under the put lock (issue 17: a second per-queue dict beside the
        # index log's cost a lookup and a store among 100,000 entries per batch).
        self._store_port = config.store_port
        self._store_host = pack_host(config.store_host)
        self._max_batch_bytes = config.max_batch_bytes
        self._pwrite_min = config.pwrite_min_bytes
        self._index_enabled = config.index_enabled
        self._sync_flush = config.flush_mode is FlushMode.SYNC
        #: SYNC_MASTER (set by the broker's replication): ``gate(callback, end)`` returns the
        #: callback to call once durable, which also waits until the slaves hold ``end``
        self.replication_gate: Callable[[FlushCallback, int], FlushCallback] | None = None
        self.quarantine: dict[int, str] = {}  # phys offset -> reason (never served)
        self.disk_full = False
        self._id_hashes: dict[tuple[int, int], int] = {}
        #: records readers of the store skipped as undecodable (index building, queries,
        #: recovery); the broker adds its own readers' counts next to these
        self.corrupt = CorruptRecords(log)
        #: (phys, size) of the last replicated batch that failed its checks (a slave's copy)
        self._copied_bad: tuple[int, int] | None = None
        self._put_batches = self._put_messages = self._put_bytes = self._get_messages = 0
        self._put_frames = 0  # put_frame calls that stored batches (one CommitLog write each)
        try:
            self.recovery_report = self._open()
        except BaseException:
            self._release_lock()
            raise
        #: reads verify the CRCs of batches below this CommitLog position only (with
        #: ``verify_reads``): those an earlier process wrote, read back from the disk. Every
        #: batch from here on was appended by this process after its checks -- put: the batch
        #: CRC, the store header's CRC computed over these very bytes; a replica's copy: both,
        #: the damaged ones quarantined -- and is served from the same memory; re-verifying it
        #: on every read cost a consumer of 10,000 queues ~18 % of the broker's CPU (issue 17).
        #: Consumers still check every batch they receive (``check_crc``) and skip and count
        #: what fails.
        self.verified_from = self.commitlog.write_pos
        self.flush_service = FlushService(
            self.commitlog, config.flush_mode, config.flush_interval_ms, config.flush_dirty_bytes
        )
        self.retention = RetentionService(self)
        self._stop = threading.Event()
        self._housekeeper = threading.Thread(
            target=self._housekeeping, name="store-housekeeping", daemon=True
        )
        self._housekeeper.start()

    # -- open / recover ----------------------------------------------------------------------
    @staticmethod
    def _raise_open_file_limit() -> None:
        """Every consume-queue file holds a descriptor (its mapping): a broker with 10,000
        queues needs more than the usual soft limit of 1,024."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard and (hard == resource.RLIM_INFINITY or soft < hard):
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    def _acquire_lock(self) -> int:
        path = self.dir / "lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreLockedError(
                f"{self.dir} is in use by another tidemq process (lock file {path}); stop it or "
                "use another --data-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        return fd

    def _release_lock(self) -> None:
        with contextlib.suppress(OSError):
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)

    def _open(self) -> RecoveryReport:
        t0 = time.perf_counter()
        cfg = self.config
        report = self._scan_report = RecoveryReport()
        abort = self.dir / "abort"
        report.clean_shutdown = not abort.exists()
        cp, problem = load_checkpoint(self.dir / "checkpoint")
        if problem:
            report.problems.append(problem)
        self.commitlog = CommitLog(
            self.dir / "commitlog", cfg.segment_size, preallocate=cfg.preallocate,
            warm_ahead_bytes=cfg.warm_ahead_bytes
        )
        report.problems += self.commitlog.open_segments()
        self.cqs = IndexLog(self.dir / "cqlog")
        self.cqs.load(cp.index_log_end if cp is not None else 0)
        self._migrate_old_layout(report)
        self.index = IndexService(self.dir / "index", cfg.index_slots, cfg.index_max_entries,
                                  cfg.index_max_free_ratio)
        report.problems += self.index.load_errors
        cl_min = self.commitlog.min_offset
        start = self._trusted_start(cp, report)
        if start is None:  # rebuild every index from the CommitLog
            report.rebuilt_indexes = True
            self.cqs.close_all()
            self.index.close()
            shutil.rmtree(self.dir / "cqlog", ignore_errors=True)
            shutil.rmtree(self.dir / "index", ignore_errors=True)
            self.cqs = IndexLog(self.dir / "cqlog")
            self.cqs.load()
            self.index = IndexService(self.dir / "index", cfg.index_slots,
                                      cfg.index_max_entries, cfg.index_max_free_ratio)
            start = cl_min
        start = max(start, cl_min)
        report.scanned_from = start
        # Units and index entries at or beyond `start` may be stale or missing: drop, then
        # re-dispatch them from the CommitLog.
        for cq in self.cqs.all():
            cq.truncate_dirty(start)
        self.index.truncate_dirty(start)
        for cq in self.cqs.all():
            cq.correct_min_offset(cl_min)
        durable_end = cp.commitlog_flushed if cp is not None else start
        if report.clean_shutdown and cp is not None:
            durable_end = max(durable_end, cp.dispatched)
        end = scan(self.commitlog, start, durable_end, self._dispatch_recovered, report)
        self._truncate_tail(end, report)
        self.commitlog.ensure_full_size()
        self.commitlog.warm_active()
        for q in report.quarantined:
            self.quarantine[q.phys_offset] = q.reason
        abort.touch()
        self._save_checkpoint()
        report.seconds = time.perf_counter() - t0
        if report.truncated or report.quarantined or report.problems or not report.clean_shutdown:
            log.warning("store recovery: %s", report.summary())
        return report

    def _migrate_old_layout(self, report: RecoveryReport) -> None:
        """Copy the consume queues of the older layout (a directory of files per queue,
        store/consume_queue.py) into the shared log, then remove them. Queues that do not
        validate are not copied: the version 1 checkpoint's queue list then finds them missing
        and the indexes are rebuilt from the CommitLog."""
        old_dir = self.dir / "consumequeue"
        if not old_dir.is_dir():
            return
        old = ConsumeQueueTable(old_dir, self.config.cq_units_per_file)
        try:
            old.load()
            segs = self.commitlog.segments
            bad = old.validate_all(segs[-1].end if segs else 0)
            if bad:
                report.problems += [f"{p} (older consume queue layout)" for p in bad.values()]
            else:
                n = self.cqs.migrate_from(old.all())
                log.info("copied %d consume queues of the older layout into %s", n,
                         self.cqs.root)
        except (StoreError, OSError) as exc:
            report.problems.append(f"older consume queue layout unreadable ({exc})")
        finally:
            old.close_all()
        shutil.rmtree(old_dir, ignore_errors=True)

    def _trusted_start(self, cp: Checkpoint | None, report: RecoveryReport) -> int | None:
        """Where re-dispatch may start, or None when the indexes must be rebuilt entirely."""
        if cp is None:
            if self.commitlog.segments and (self.cqs.all() or report.problems):
                report.problems.append("no usable checkpoint: rebuilding indexes")
                return None
            return self.commitlog.min_offset if self.commitlog.segments else 0
        segs = self.commitlog.segments
        bad = self.cqs.validate_all(segs[-1].end if segs else 0)
        if not bad and self.cqs.end < cp.index_log_end:
            bad = {("", -1): f"the consume queue log ends at {self.cqs.end} but the checkpoint "
                             f"recorded {cp.index_log_end}"}
        if bad:
            report.problems += [f"{p}: rebuilding indexes from the CommitLog" for p in bad.values()]
            return None
        for key, durable_max in cp.queues.items():
            topic, _, qid = key.rpartition("\x00")
            cq = self.cqs.find(topic, int(qid))
            if cq is None or cq.max_offset < durable_max:
                report.problems.append(
                    f"consume queue {topic}/{qid} is missing or shorter than its checkpoint "
                    f"({durable_max} messages): rebuilding indexes from the CommitLog"
                )
                return None
        if self.index.load_errors:
            return None
        if self.index.max_phys_offset < cp.index_phys:
            report.problems.append(
                f"index ends at batch {self.index.max_phys_offset} but the checkpoint recorded "
                f"{cp.index_phys}: rebuilding indexes from the CommitLog"
            )
            return None
        return cp.dispatched

    def _dispatch_recovered(self, v: BatchView, phys: int) -> None:
        key = (v.topic, v.queue_id)
        found = self.cqs.find(*key)
        expected = found.max_offset if found is not None else 0
        quarantined = self._scan_report.quarantined
        if v.queue_offset > expected and quarantined:
            # Messages of this queue were in a quarantined batch: keep offsets contiguous with
            # units pointing at the quarantined batch (readers skip it).
            qphys, qsize = quarantined[-1].phys_offset, quarantined[-1].size
            gap = v.queue_offset - expected
            self.cqs.get_or_create(*key).append_batch(expected, qphys, qsize, bytes(12 * gap))
        self._dispatch(v, key, phys, v.queue_offset, v.total_size, v.store_ts)

    def _truncate_tail(self, end: int, report: RecoveryReport) -> None:
        """Cut the CommitLog at ``end``: zero the torn bytes after it, drop later segments."""
        cl = self.commitlog
        dirty_end = end
        if cl.segments and end < cl.segments[-1].end:
            seg = cl.segment_for(end)
            rel = end - seg.start
            dirty_end = seg.start + _garbage_end(seg.fd, rel, seg.size)
            if dirty_end > end:
                report.truncated.append((str(seg.path), rel, dirty_end - end))
        for s in cl.segments:
            # a segment after the end holding only zeros is the allocator's next segment
            if s.start > end and TOTAL_SIZE_MAGIC.unpack_from(s.mm, 0) != (0, 0):
                report.truncated.append((str(s.path), 0, s.size))
        cl.truncate(end, dirty_end)
        cl.flushed_pos = end
        for cq in self.cqs.all():
            cq.truncate_dirty(end)
        self.index.truncate_dirty(end)

    # -- writing -------------------------------------------------------------------------------
    def put(
        self,
        data: bytes | bytearray | memoryview,
        *,
        queue_id: int | None = None,
        on_durable: FlushCallback | None = None,
        view: BatchView | None = None,
        topic: str | None = None,
    ) -> PutResult:
        """Append one batch (as a producer encoded it). Raises a StoreError subclass on refusal.

        SYNC_FLUSH: with ``on_durable`` the put returns at once and the callback fires (on the
        flush thread) when the batch is on disk; without it, the call blocks until then and
        answers FLUSH_DISK_TIMEOUT after sync_flush_timeout_ms. ASYNC_FLUSH: returns at once.
        ``view``: a BatchView of ``data`` the caller already built (saves parsing it twice);
        ``topic``: the view's topic as a str, which the caller compared with the batch's topic
        bytes (the broker's door: saves decoding it again).
        """
        if self._closed:
            raise StoreClosedError("the store is closed")
        size = len(data)
        if size > self._max_batch_bytes:
            raise self._too_large(size)
        if self.disk_full:
            blocked = self.retention.blocked
            raise DiskFullError(
                f"disk holding {self.dir} is over {self.config.disk_refuse_writes_ratio:.0%} "
                "full; writes are refused until retention frees space"
                + (f": {blocked}" if blocked else "")
            )
        v = BatchView(data) if view is None else view  # the broker passes the view it parsed
        if v.total_size != size or not v.batch_crc_ok():
            self._check_batch(v, size)  # raises
        if topic is None:
            topic = v.topic
        qid = v.queue_id if queue_id is None else queue_id
        count = v.count
        hashes = self._index_hashes(v, topic) if self._index_enabled else None
        with self._put_lock:
            phys, qoff, now = self._append_locked(data, v, size, topic, qid, hashes)
        self._put_batches += 1
        self._put_messages += count
        self._put_bytes += size
        result = PutResult(_PUT_OK, topic, qid, phys, qoff, count, size, now)
        if self._sync_flush:
            if on_durable is not None:
                self.flush_service.request(phys + size, on_durable)
            else:
                try:
                    self.flush_service.wait(phys + size, self.config.sync_flush_timeout_ms / 1000)
                except TimeoutError:
                    result.status = PutStatus.FLUSH_DISK_TIMEOUT
        elif on_durable is not None:
            on_durable(None)
        return result

    def _check_batch(self, v: BatchView, size: int) -> None:
        if v.total_size != size:
            raise CorruptBatchError(f"batch says {v.total_size} bytes but {size} were given")
        if not v.batch_crc_ok():
            raise CorruptBatchError(_DAMAGED)

    def _too_large(self, size: int) -> MessageTooLargeError:
        """The refusal of a batch over ``max_batch_bytes`` (put, put_many, put_frame)."""
        return MessageTooLargeError(
            f"batch of {size} bytes exceeds max_batch_bytes={self.config.max_batch_bytes}; "
            "send fewer or smaller messages per batch")

    def _append_locked(
        self, data: bytes | bytearray | memoryview, v: BatchView, size: int, topic: str,
        qid: int, hashes: list[int] | None,
    ) -> tuple[int, int, int]:
        """Write one checked batch at the end of the CommitLog, stamp its store header and
        dispatch it; (phys offset, queue offset, store timestamp). Put lock held. This runs
        once per batch, single messages included: keep it to a few calls."""
        count = v.count
        cl = self.commitlog
        seg, rel = cl.reserve(size)
        # Everything that may need new disk space comes before the batch is written, so
        # a full disk fails the put with nothing stored (no half-dispatched batch): the key
        # index's next file (a queue's units wait in memory for the index log's next block).
        cq = self.cqs.get_or_create(topic, qid)
        qoff = cq.max_offset
        now = time.time_ns() // 1_000_000
        if hashes:
            self.index.make_room(now, len(hashes))
        mm = seg.mm
        phys = seg.start + rel
        p_start = v.producer_start
        buf: mmap.mmap | bytearray
        if size < self._pwrite_min:  # copy through the mapping, then stamp it in place
            buf, at = mm, rel
            mm[rel : rel + size] = data
        else:  # stamp a copy of the store header, write both with one syscall
            buf, at = bytearray(memoryview(data)[:p_start]), 0
        STORE_TAIL.pack_into(
            buf, at + STORE_FIELDS_OFFSET, phys, qoff, now, v.prepared_offset, qid,
            v.reconsume_times, v.topic_len, self._store_port, self._store_host,
        )
        CRC_FIELD.pack_into(
            buf, at + STORE_CRC_OFFSET,
            crc32c(memoryview(buf)[at + STORE_CRC_FROM : at + p_start]),
        )
        if not isinstance(buf, mmap.mmap):
            cl.pwrite(seg, rel, (buf, memoryview(data)[p_start:]), size)
        cl.advance(size)
        self._write_dispatch(v, cq, hashes, phys, qoff, size, now)
        if self._listeners:
            for cb in self._listeners:
                cb(topic, qid, qoff + count, v)
        return phys, qoff, now

    def put_many(
        self, batches: list[tuple[bytes | bytearray | memoryview, BatchView]],
        topics: list[str] | None = None,
    ) -> list[PutResult | StoreError | CorruptBatchError]:
        """``put`` of several batches (each as a producer encoded it, with the view the
        caller parsed; the queue is the one its header names) under one acquisition of the
        put lock, in order: a SEND_MULTI_QUEUE frame of many small batches pays the lock,
        the checks that hold for all of them and the bookkeeping once, not once per batch.
        Each batch keeps its own queue offsets and store header, exactly as ``put`` writes
        it; a batch that cannot be stored gets its StoreError (CorruptBatchError: damaged)
        in its slot and the others are stored. ASYNC_FLUSH only (under SYNC_FLUSH each
        batch needs its own durability callback: call ``put``). ``topics``: each batch's
        topic as the caller decoded it from the same view (saves decoding it again)."""
        if self._sync_flush:
            raise StoreError("put_many is for ASYNC_FLUSH stores; use put under SYNC_FLUSH")
        out: list[PutResult | StoreError | CorruptBatchError] = []
        if self._closed:
            return [StoreClosedError("the store is closed")] * len(batches)
        if self.disk_full:
            blocked = self.retention.blocked
            return [DiskFullError(
                f"disk holding {self.dir} is over {self.config.disk_refuse_writes_ratio:.0%} "
                "full; writes are refused until retention frees space"
                + (f": {blocked}" if blocked else ""))] * len(batches)
        todo: list[tuple[int, bytes | bytearray | memoryview, BatchView, int, str,
                         list[int] | None]] = []
        max_bytes = self._max_batch_bytes
        index = self._index_enabled
        for i, (data, v) in enumerate(batches):
            size = len(data)
            out.append(None)  # type: ignore[arg-type]  # filled below
            try:
                if size > max_bytes:
                    raise self._too_large(size)
                self._check_batch(v, size)
                topic = v.topic if topics is None else topics[i]
                todo.append((i, data, v, size, topic,
                             self._index_hashes(v, topic) if index else None))
            except (StoreError, CorruptBatchError) as exc:
                out[i] = exc
        n_msgs = n_bytes = 0
        with self._put_lock:
            for i, data, v, size, topic, hashes in todo:
                qid = v.queue_id
                try:
                    phys, qoff, now = self._append_locked(data, v, size, topic, qid, hashes)
                except (StoreError, CorruptBatchError) as exc:
                    out[i] = exc
                    continue
                count = v.count
                n_msgs += count
                n_bytes += size
                out[i] = PutResult(_PUT_OK, topic, qid, phys, qoff, count, size, now)
        self._put_batches += len(todo)
        self._put_messages += n_msgs
        self._put_bytes += n_bytes
        return out

    def put_frame(
        self, body: bytes | bytearray | memoryview, cols: BatchColumns, rows: list[int],
        topics: list[str],
    ) -> tuple[list[int], dict[int, StoreError | CorruptBatchError]]:
        """``put_many`` of the plain batches of a SEND_MULTI_QUEUE body as one unit (issue
        17): ``rows`` of ``cols`` (``protocol.batch.columns``; batches without keys that
        ``batch_rules.plain_batches`` passed), in order, ``topics`` their topics. Each batch is
        stored exactly as ``put`` would store it, with its own queue offset and store header;
        what is per frame instead of per batch: one CommitLog write for all of them (the
        batches copied into one buffer, their store fields stamped with numpy, one store CRC
        call each), one reservation, the index room checked once. Per batch remain the batch
        CRC check, the queue offsets, the consume-queue units, the id-index entries and the
        dispatch listeners (called with the batch's tag hashes, a ``list[int]``, instead of its
        view). Returns each row's queue offset (in ``rows`` order; -1 for a refused one) and
        the refusals by position in ``rows``. ASYNC_FLUSH only, as ``put_many``."""
        if self._sync_flush:
            raise StoreError("put_frame is for ASYNC_FLUSH stores; use put under SYNC_FLUSH")
        k = len(rows)
        errors: dict[int, StoreError | CorruptBatchError] = {}
        if self._closed:
            err: StoreError = StoreClosedError("the store is closed")
            return [-1] * k, dict.fromkeys(range(k), err)
        if self.disk_full:
            blocked = self.retention.blocked
            err = DiskFullError(
                f"disk holding {self.dir} is over {self.config.disk_refuse_writes_ratio:.0%} "
                "full; writes are refused until retention frees space"
                + (f": {blocked}" if blocked else ""))
            return [-1] * k, dict.fromkeys(range(k), err)
        mv = memoryview(body).cast("B")
        sel = np.asarray(rows, dtype=np.int64)
        starts = cols.starts[sel].tolist()
        sizes = cols.sizes[sel].tolist()
        p_starts = (cols.store["topic_len"][sel].astype(np.int64) + STORE_HEADER_SIZE).tolist()
        crcs = cols.producer["batch_crc"][sel].tolist()
        max_bytes = self._max_batch_bytes
        good: list[int] = []
        for j in range(k):
            st, z, ps = starts[j], sizes[j], p_starts[j]
            if z > max_bytes:
                errors[j] = self._too_large(z)
            elif crc32c(mv[st + ps + 4 : st + z]) != crcs[j]:
                errors[j] = CorruptBatchError(_DAMAGED)
            else:
                good.append(j)
        qoffs = [-1] * k
        if not good:
            return qoffs, errors
        # One buffer of every good batch, back to back as they will lie in the CommitLog
        first, last = good[0], good[-1]
        total = sum(sizes[j] for j in good) if errors else 0
        if not errors or starts[last] + sizes[last] - starts[first] == total:
            out = bytearray(mv[starts[first] : starts[last] + sizes[last]])
        else:
            out = bytearray(b"".join([mv[starts[j] : starts[j] + sizes[j]] for j in good]))
        total = len(out)
        g = np.asarray(good, dtype=np.int64)
        g_sizes = cols.sizes[sel[g]]
        at = np.cumsum(g_sizes) - g_sizes  # each good batch's position in ``out``
        qids = cols.store["queue_id"][sel].tolist()
        tags = cols.first["tag_hash"][sel].tolist()
        pids = cols.producer["producer_id"][sel].tolist()
        seqs = cols.producer["base_seq"][sel].tolist()
        counts = cols.producer["count"][sel].tolist()
        cl = self.commitlog
        if total + FILLER_MIN > cl.segment_size // 2:
            # a frame near a segment's size (tiny test segments): batch by batch instead
            return self._put_frame_by_batch(mv, good, starts, sizes, topics, qoffs, errors)
        index = self._index_enabled
        with self._put_lock:
            seg, rel = cl.reserve(total)
            now = time.time_ns() // 1_000_000
            if index:
                self.index.make_room(now, 2 * len(good))  # at most two id blocks a batch
            phys0 = seg.start + rel
            # Queue offsets, assigned in order (a queue may have several batches here), from
            # each queue's own next offset: its LogQueue, looked up once per batch (issue 17),
            # which advances only when the units are appended after the write succeeded.
            get_cq = self.cqs.get_or_create
            nxt: dict[LogQueue, int] = {}
            g_cqs: list[LogQueue] = []
            g_qoffs: list[int] = []
            for j in good:
                cq = get_cq(topics[j], qids[j])
                q = nxt.get(cq)
                if q is None:
                    q = cq.max_offset
                nxt[cq] = q + counts[j]
                g_cqs.append(cq)
                g_qoffs.append(q)
            arr = np.frombuffer(out, dtype=np.uint8)
            fields = np.empty(len(good), _STAMP_DTYPE)
            fields["phys"] = at + phys0
            fields["qoff"] = g_qoffs
            fields["ts"] = now
            np.ndarray((total - _STAMP_DTYPE.itemsize + 1,), dtype=_STAMP_VOID, buffer=arr,
                       strides=(1,))[at + STORE_FIELDS_OFFSET] = fields.view(_STAMP_VOID)
            host = np.empty(1, _HOST_DTYPE)
            host["port"] = self._store_port
            host["host"] = np.void(self._store_host)
            np.ndarray((total - _HOST_DTYPE.itemsize + 1,), dtype=_HOST_VOID, buffer=arr,
                       strides=(1,))[at + _HOST_OFFSET] = host.view(_HOST_VOID)[0]
            om = memoryview(out)
            at_l = at.tolist()
            seal = [crc32c(om[o + STORE_CRC_FROM : o + p_starts[j]])
                    for o, j in zip(at_l, good, strict=True)]
            np.ndarray((total - 3,), dtype="<u4", buffer=arr, strides=(1,))[
                at + STORE_CRC_OFFSET] = seal
            if total < self._pwrite_min:
                seg.mm[rel : rel + total] = out
            else:
                cl.pwrite(seg, rel, (out,), total)
            cl.advance(total)
            id_hashes = self._id_hashes
            # the frame's id-index entries, added in one call after the loop
            id_hs: list[int] = []
            id_phys: list[int] = []
            listeners = self._listeners
            n_msgs = 0
            for o, j, cq, q in zip(at_l, good, g_cqs, g_qoffs, strict=True):
                phys = phys0 + o
                c = counts[j]
                n_msgs += c
                if c == 1:
                    tag_list = [tags[j]]
                    cq.append_one(q, phys, sizes[j], tag_list[0])
                else:
                    ix = o + p_starts[j] + PRODUCER_HEADER_SIZE
                    index_view = om[ix : ix + c * INDEX_ENTRY_SIZE]
                    cq.append_batch(q, phys, sizes[j], index_view)
                    tag_list = [h for h, _rel in INDEX_ENTRY.iter_unpack(index_view)]
                qoffs[j] = q
                pid = pids[j]
                if index and pid:
                    seq = seqs[j]
                    block = (pid, seq >> ID_BLOCK_BITS)
                    h = id_hashes.get(block)
                    id_hs.append(h if h is not None else self._id_block_hash(*block))
                    id_phys.append(phys)
                    for b in range(block[1] + 1, ((seq + c - 1) >> ID_BLOCK_BITS) + 1):
                        id_hs.append(self._id_block_hash(pid, b))
                        id_phys.append(phys)
                if listeners:
                    for cb in listeners:
                        cb(topics[j], qids[j], q + c, tag_list)
            if id_hs:
                self.index.put_hash_run(id_hs, id_phys, now)
        self._put_frames += 1
        self._put_batches += len(good)
        self._put_messages += n_msgs
        self._put_bytes += total
        return qoffs, errors

    def _put_frame_by_batch(
        self, mv: memoryview, good: list[int], starts: list[int], sizes: list[int],
        topics: list[str], qoffs: list[int], errors: dict[int, StoreError | CorruptBatchError],
    ) -> tuple[list[int], dict[int, StoreError | CorruptBatchError]]:
        parts = [mv[starts[j] : starts[j] + sizes[j]] for j in good]
        results = self.put_many([(p, BatchView(p)) for p in parts], [topics[j] for j in good])
        for j, r in zip(good, results, strict=True):
            if isinstance(r, PutResult):
                qoffs[j] = r.queue_offset
            else:
                errors[j] = r
        return qoffs, errors

    # -- replication (a slave's side; the broker's HA service drives it) ---------------------
    def append_replicated(
        self, data: bytes | bytearray | memoryview,
        on_written: Callable[[int], None] | None = None,
    ) -> int:
        """Append bytes copied from the master's CommitLog, which held them at
        ``max_phys_offset``: batches and fillers, byte for byte, at the same physical offsets.
        One call takes the whole records that lie in the current segment (up to a filler,
        which ends it) and returns the new ``max_phys_offset``; the caller passes the bytes
        after ``new - old`` again (``store.replica.ReplicaAppender`` does). After a filler the
        write position jumps to the next segment, past bytes that may not have arrived yet:
        they are the filler's zeros, already zero here.

        Every batch is checked (framing and both CRCs) before anything is written; a batch
        that fails is copied anyway (the logs stay identical), quarantined and never served,
        as recovery treats a damaged batch. The consume queues get room for the batches' units
        (a full disk fails here, with nothing written), the bytes are written with one pwrite,
        ``on_written(new write position)`` runs (a slave acknowledges there, as RocketMQ's does
        once its CommitLog has the bytes), and then each batch is dispatched exactly as
        recovery re-dispatches (consume queue units and index entries from the stored header)
        and the dispatch listeners run. Raises StoreError when the bytes are not CommitLog
        records (a broken stream: the caller reconnects) or the disk is full; a dispatch that
        fails cuts the CommitLog back to the batch it failed on."""
        if self._closed:
            raise StoreClosedError("the store is closed")
        if self.disk_full:
            raise DiskFullError(
                f"disk holding {self.dir} is over {self.config.disk_refuse_writes_ratio:.0%} "
                "full; replication pauses until retention frees space"
            )
        mv = memoryview(data).cast("B")
        n = len(mv)
        with self._put_lock:
            cl = self.commitlog
            if n < TOTAL_SIZE_MAGIC.size:
                return cl.write_pos
            seg, rel = cl.replica_position()
            left = seg.size - rel
            batches: list[tuple[int, BatchView | None, str]] = []
            filler = False
            pos = 0
            while pos + TOTAL_SIZE_MAGIC.size <= n:
                total, magic = TOTAL_SIZE_MAGIC.unpack_from(mv, pos)
                if magic == FILLER_MAGIC:
                    if total != left - pos:
                        raise StoreError(
                            f"replicated filler at {seg.start + rel + pos} says {total} bytes "
                            f"but {left - pos} are left in the segment (segment sizes differ?)"
                        )
                    filler = True
                    break
                if magic != BATCH_MAGIC or not 0 < total <= left - pos:
                    raise StoreError(
                        f"replicated bytes at {seg.start + rel + pos} are not a CommitLog "
                        f"record (size {total}, magic 0x{magic:04X})"
                    )
                if pos + total > n:
                    break  # the rest of this batch has not arrived yet
                try:
                    v: BatchView | None = BatchView(mv, pos)
                    v.verify()  # type: ignore[union-attr]
                    why = ""
                except CorruptBatchError as exc:
                    v, why = None, exc.message
                batches.append((pos, v, why))
                pos += total
            if pos:
                cl.pwrite(seg, rel, (mv[:pos],), pos)
                cl.advance(pos)
            if filler:
                # The filler's header is all that matters: the rest of the segment is zeros
                # here already (segments are created zero-filled and written in order).
                TOTAL_SIZE_MAGIC.pack_into(seg.mm, rel + pos, left - pos, FILLER_MAGIC)
                cl.advance(left - pos)
            if on_written is not None and (pos or filler):
                on_written(cl.write_pos)
            if pos:
                base = seg.start + rel
                for p, v, why in batches:
                    try:
                        self._dispatch_copied(v, base + p, why, mv, p)
                    except BaseException:
                        # never leave a stored batch without its units: cut it off again
                        for cq in self.cqs.all():
                            cq.truncate_dirty(base + p)
                        self.index.truncate_dirty(base + p)
                        cl.truncate_live(base + p)
                        raise
            return cl.write_pos

    def _dispatch_copied(
        self, v: BatchView | None, phys: int, why: str, mv: memoryview, p: int
    ) -> None:
        """Consume queue units, index entries and listeners of one replicated batch (put lock
        held). ``v`` is None for a batch that failed its checks: quarantined, and the queue
        offsets it held are filled with units pointing at it (readers skip it), as recovery
        does."""
        if v is None:
            total = TOTAL_SIZE_MAGIC.unpack_from(mv, p)[0]
            self.quarantine[phys] = why
            self._copied_bad = (phys, total)
            log.error("replicated batch at CommitLog offset %d is damaged (%s); quarantined, "
                      "never served", phys, why)
            return
        key = (v.topic, v.queue_id)
        qoff = v.queue_offset
        count = v.count
        cq = self.cqs.get_or_create(*key)
        if qoff and not cq.max_offset:
            cq.start_at(qoff)
        expected = cq.max_offset
        bad = self._copied_bad
        if qoff > expected and bad is not None:
            gap = qoff - expected
            cq.append_batch(expected, bad[0], bad[1], bytes(INDEX_ENTRY_SIZE * gap))
        hashes = self._index_hashes(v, key[0]) if self._index_enabled else None
        ts = v.store_ts
        if hashes:
            self.index.make_room(ts, len(hashes))
        self._write_dispatch(v, cq, hashes, phys, qoff, v.total_size, ts)
        self._put_batches += 1
        self._put_messages += count
        self._put_bytes += v.total_size
        if self._listeners:
            for cb in self._listeners:
                cb(key[0], key[1], qoff + count, v)

    def truncate_to(self, end: int) -> None:
        """Cut the CommitLog back to ``end`` (a record boundary) with everything dispatched from
        past it: a slave whose tail the master does not have (written under an older master
        that the new one never received). Consume queues and the index are cut at ``end``;
        queue offsets continue from what remains."""
        with self._checkpoint_lock, self._put_lock:
            cl = self.commitlog
            if end >= cl.write_pos:
                return
            end = max(end, cl.min_offset)
            log.warning("truncating the CommitLog from %d back to %d (%d bytes)",
                        cl.write_pos, end, cl.write_pos - end)
            for cq in self.cqs.all():
                cq.truncate_dirty(end)
            self.index.truncate_dirty(end)
            cl.truncate_live(end)
            for phys in [q for q in self.quarantine if q >= end]:
                del self.quarantine[phys]
            self._copied_bad = None
            self._saved_cp = None
        self._save_checkpoint()

    def reset_to(self, offset: int) -> None:
        """Drop everything stored and continue, empty, at CommitLog ``offset`` (a segment
        boundary): a slave whose data the master no longer has starts over at the master's
        oldest retained offset. Consume queues and the index are rebuilt from what follows."""
        cfg = self.config
        with self._checkpoint_lock, self._put_lock:
            log.warning("dropping the stored CommitLog [%d, %d); continuing empty at %d",
                        self.commitlog.min_offset, self.commitlog.write_pos, offset)
            self.cqs.close_all()
            self.index.close()
            shutil.rmtree(self.dir / "cqlog", ignore_errors=True)
            shutil.rmtree(self.dir / "index", ignore_errors=True)
            self.cqs = IndexLog(self.dir / "cqlog")
            self.cqs.load()
            self.index = IndexService(self.dir / "index", cfg.index_slots, cfg.index_max_entries)
            self.commitlog.reset(offset)
            self.quarantine.clear()
            self._copied_bad = None
            self._saved_cp = None
        self._save_checkpoint()

    def warm_ahead(self, enabled: bool) -> None:
        """Keep the pages ahead of the writer warm (a master: small batches are copied
        through the mapping) or not (a slave: append_replicated writes with pwrite)."""
        if enabled:
            self.commitlog.warm_active()
        else:
            self.commitlog.stop_warming()

    def when_durable(self, callback: FlushCallback) -> None:
        """Call ``callback(None)`` (or the flush error) once everything put so far is
        durable: SYNC_FLUSH, after the group commit covering it (through the flush service's
        executor, like a put's ``on_durable``); ASYNC_FLUSH, at once, as a put's. Under
        SYNC_MASTER (``replication_gate``) also once the slaves hold it."""
        gate = self.replication_gate
        if gate is not None:
            callback = gate(callback, self.commitlog.write_pos)
        if self._sync_flush:
            self.flush_service.request(self.commitlog.write_pos, callback)
        else:
            callback(None)

    def _dispatch(
        self, v: BatchView, key: tuple[str, int], phys: int, qoff: int, size: int, ts: int
    ) -> None:
        """Build the consume queue units and index entries of one batch (re-dispatch from
        the CommitLog at recovery; ``put`` does the same in two steps around its write)."""
        hashes = self._index_hashes(v, key[0]) if self._index_enabled else None
        cq = self.cqs.get_or_create(*key)
        if qoff and not cq.max_offset:
            # The CommitLog starts after this queue's first batches (retention, or a slave
            # that copied from the master's oldest segment): the queue starts here.
            cq.start_at(qoff)
        self._write_dispatch(v, cq, hashes, phys, qoff, size, ts)

    def _write_dispatch(
        self, v: BatchView, cq: LogQueue, hashes: list[int] | None, phys: int, qoff: int,
        size: int, ts: int,
    ) -> None:
        """The batch's consume queue units (per batch, not per message) and index entries."""
        if v.count == 1:
            cq.append_one(qoff, phys, size, v.tag_hash_at(0))
        else:
            cq.append_batch(qoff, phys, size, v.index_view())
        if hashes:
            self.index.put_hashes(hashes, phys, ts)

    def _index_hashes(self, v: BatchView, topic: str) -> list[int]:
        """Index key hashes of a batch: each key of each message that has keys, then each id
        block (2**ID_BLOCK_BITS sequence ids) the batch's unique ids fall in."""
        out: list[int] = []
        if v.keys_size:
            try:
                out = [
                    key_hash(key_index_key(topic, k))
                    for ks in v.keys().values() for k in ks.split() if k
                ]
            except CorruptBatchError:
                out = self._decodable_key_hashes(v, topic)
        pid = v.producer_id
        if pid:
            first = v.base_seq >> ID_BLOCK_BITS
            last = (v.base_seq + v.count - 1) >> ID_BLOCK_BITS
            if first == last:
                h = self._id_hashes.get((pid, first))
                out.append(h if h is not None else self._id_block_hash(pid, first))
            else:
                out += [self._id_block_hash(pid, b) for b in range(first, last + 1)]
        return out

    def _decodable_key_hashes(self, v: BatchView, topic: str) -> list[int]:
        """Index hashes of the keys of ``v`` that decode: keys that are not UTF-8 (or a keys
        section whose framing is broken) are left out of the index -- no key string could
        find them anyway -- counted and logged, and the batch is stored and dispatched as
        usual (recovery and delivery of held batches must never fail on a message's keys)."""
        where = (f"topic {topic} queue {v.queue_id} batch of producer {v.producer_id:016X} "
                 f"seq {v.base_seq}")
        try:
            raw = v.raw_keys()
        except CorruptBatchError as exc:
            self.corrupt.skipped("index", where, f"keys not indexed: {exc.message}", v.count)
            return []
        out: list[int] = []
        for i, kb in raw.items():
            try:
                ks = decode_utf8(kb, f"keys of message {i}")
            except CorruptBatchError as exc:
                self.corrupt.skipped("index", where, f"not indexed: {exc.message}")
                continue
            out += [key_hash(key_index_key(topic, k)) for k in ks.split() if k]
        return out

    def _id_block_hash(self, producer_id: int, block: int) -> int:
        """key_hash(id_block_key(...)), remembered: a producer's single-message batches share
        an id block for 2**ID_BLOCK_BITS messages, and formatting plus hashing the key is a
        quarter of a single message's put. Bounded: cleared past 4,096 blocks."""
        cache = self._id_hashes
        if len(cache) >= 4096:
            cache.clear()
        # id_block_key takes a sequence id (it shifts it to its block itself)
        h = cache[(producer_id, block)] = key_hash(
            id_block_key(producer_id, block << ID_BLOCK_BITS))
        return h

    @property
    def stats(self) -> dict[str, int]:
        """Counters since open: batches, messages and bytes put; frames stored whole
        (``put_frame``); messages read."""
        return {
            "put_batches": self._put_batches,
            "put_frames": self._put_frames,
            "put_messages": self._put_messages,
            "put_bytes": self._put_bytes,
            "get_messages": self._get_messages,
        }

    def add_dispatch_listener(self, listener: DispatchListener) -> None:
        """``listener(topic, queue_id, new_max_offset, batch)`` after every put (the broker
        wakes held pulls with it). ``batch`` views the bytes as they were put: its message
        index, keys and records are what was stored, its store header fields are not (read the
        stored batch for those); from ``put_frame`` (a SEND_MULTI_QUEUE frame's plain
        one-message batches) it is the batch's tag hashes, a ``list[int]``, instead. Runs on
        the putting thread inside the put lock."""
        self._listeners.append(listener)

    # -- reading -------------------------------------------------------------------------------
    def get_messages(
        self,
        topic: str,
        queue_id: int,
        offset: int,
        max_messages: int = 32,
        tag_hashes: frozenset[int] | None = None,
    ) -> GetResult:
        """Read from queue offset ``offset``: whole batches, each with its first wanted message.

        ``tag_hashes``: only batches holding at least one message with one of these tag hashes
        are returned (the client re-checks each message). Statuses and the next begin offset
        follow RocketMQ's DefaultMessageStore.getMessage.
        """
        cq = self.cqs.find(topic, queue_id)
        mn, mx = (cq.min_offset, cq.max_offset) if cq is not None else (0, 0)
        early = position_outcome(cq is not None, offset, mn, mx)
        if early is not None or cq is None:
            return early  # type: ignore[return-value]
        cl = self.commitlog
        cl_min = cl.min_offset
        write_pos = cl.write_pos  # read after mx: every unit below mx points below it
        wanted = np.fromiter(tag_hashes, dtype=np.uint64) if tag_hashes else None
        batches: list[ReadBatch] = []
        n = 0
        nbytes = 0
        q = offset
        removed = False
        verify = self.config.verify_reads
        verified_from = self.verified_from
        max_bytes = self.config.max_read_bytes
        quarantine = self.quarantine
        seg_start = seg_end = -1
        seg_mv = memoryview(b"")
        # Units come in one array per consume-queue file, batches are checked with
        # stored_span and the segment's view is reused: per batch this loop is a few calls,
        # which is what a backlog of single-message batches needs.
        while q < mx and n < max_messages and nbytes < max_bytes:
            raw = cq.unit_bytes(q, max_messages - n)
            k = len(raw) // UNIT_SIZE
            if not k:
                break
            base = q
            if k <= _UNITS_BY_STRUCT:
                # a queue's next unit or two (a backlog spread over many queues): one unpack
                vals = _UNITS_OF[k].unpack(raw)
                phys_l = vals[0::3]
                size_l = vals[1::3]
            else:
                units = np.frombuffer(raw, UNIT_DTYPE)
                phys_l = units["phys"].tolist()
                size_l = units["size"].tolist()
            i = 0
            while i < k and n < max_messages and nbytes < max_bytes:
                phys = phys_l[i]
                size = size_l[i]
                if not size:  # not written (a concurrent truncation): stop here
                    k = -1
                    break
                if phys < cl_min:
                    removed = True
                    q += 1
                    i += 1
                    continue
                if phys in quarantine:
                    q = self._skip_batch(cq, q, phys, mx)
                    i = q - base
                    continue
                try:
                    if not seg_start <= phys < seg_end:
                        seg = cl.segment_for(phys)
                        seg_start, seg_end = seg.start, seg.end
                        seg_mv = memoryview(seg.mm)[: max(0, min(seg.size, write_pos - seg_start))]
                    rel = phys - seg_start
                    if rel + size > len(seg_mv):
                        raise OffsetOutOfRangeError(
                            f"batch of {size} bytes at {phys} runs past the written data"
                        )
                    bq, bc = stored_span(seg_mv, rel, size, verify and phys < verified_from)
                except (CorruptBatchError, OffsetOutOfRangeError) as exc:
                    self._report_corrupt(phys, str(exc))
                    q = self._skip_batch(cq, q, phys, mx)
                    i = q - base
                    continue
                first = q - bq
                if not 0 <= first < bc:
                    self._report_corrupt(phys, f"consume queue unit {q} does not match the batch")
                    q = self._skip_batch(cq, q, phys, mx)
                    i = q - base
                    continue
                if wanted is not None:
                    v = BatchView(seg_mv, rel)
                    tags = index_hashes(v.index_view())[first:]
                    mask = np.isin(tags, wanted)
                    if not mask.any():
                        q = bq + bc
                        i = q - base
                        continue
                    first += int(mask.argmax())
                batches.append(ReadBatch(seg_mv[rel : rel + size], first, bq + first, bc - first))
                n += bc - first
                nbytes += size
                q = bq + bc
                i = q - base
            if k < 0:
                break
        self._get_messages += n
        return read_outcome(q, mn, mx, batches, removed)

    def _skip_batch(self, cq: LogQueue, q: int, phys: int, mx: int) -> int:
        """First queue offset after ``q`` whose unit points to another batch."""
        q += 1
        while q < mx:
            unit = cq.get(q)
            if unit is None or unit[0] != phys:
                break
            q += 1
        return q

    def _report_corrupt(self, phys: int, reason: str) -> None:
        if phys in self.quarantine:
            return
        self.quarantine[phys] = reason
        try:
            seg = self.commitlog.segment_for(phys)
            where = f"{seg.path} position {phys - seg.start}"
        except OffsetOutOfRangeError:
            where = f"physical offset {phys}"
        log.error("corrupt batch in %s: %s; quarantined, not served", where, reason)

    @property
    def min_phys_offset(self) -> int:
        """First CommitLog offset still stored."""
        return self.commitlog.min_offset

    @property
    def max_phys_offset(self) -> int:
        """CommitLog offset the next batch will be written at."""
        return self.commitlog.write_pos

    @property
    def flushed_phys_offset(self) -> int:
        """CommitLog offset below which everything is durable."""
        return self.commitlog.flushed_pos

    def read_batch(self, phys: int) -> BatchView:
        return self.commitlog.read_batch(phys)

    def min_offset(self, topic: str, queue_id: int) -> int:
        cq = self.cqs.find(topic, queue_id)
        return cq.min_offset if cq else 0

    def max_offset(self, topic: str, queue_id: int) -> int:
        cq = self.cqs.find(topic, queue_id)
        return cq.max_offset if cq else 0

    def queues(self) -> list[tuple[str, int]]:
        return sorted((cq.topic, cq.queue_id) for cq in self.cqs.all())

    def offset_for_timestamp(self, topic: str, queue_id: int, ts_ms: int) -> int:
        cq = self.cqs.find(topic, queue_id)
        if cq is None:
            return 0
        return cq.offset_for_timestamp(ts_ms, self.commitlog.store_ts_at)

    def query_by_key(
        self, topic: str, key: str, begin_ts: int = 0, end_ts: int = 2**62, max_num: int = 64
    ) -> list[StoredMessage]:
        """Messages of ``topic`` carrying ``key`` stored within [begin_ts, end_ts], newest first."""
        out: list[StoredMessage] = []
        limit = self._max_batch_bytes
        for phys in self.index.query(key_index_key(topic, key), begin_ts, end_ts, max_num):
            v = self._readable(phys)
            if v is None or v.topic_bytes != topic.encode():
                continue
            try:
                raw = v.raw_keys()
            except CorruptBatchError as exc:
                self._skip_query(phys, exc)
                continue
            for i, kb in raw.items():
                # A message whose keys or record do not decode is skipped (it cannot carry a
                # key given as a string, or cannot be returned); the others are found.
                try:
                    if key in decode_utf8(kb, f"keys of message {i}").split():
                        out.append(next(v.messages(i, limit)))
                except CorruptBatchError as exc:
                    self._skip_query(phys, exc)
        return out[:max_num]

    def _skip_query(self, phys: int, exc: CorruptBatchError) -> None:
        self.corrupt.skipped("query", f"batch at CommitLog offset {phys}", exc.message)

    def get_by_id(
        self, msg_id: str, begin_ts: int = 0, end_ts: int = 2**62
    ) -> StoredMessage | None:
        """The message with this unique id (32 hex digits) stored within [begin_ts, end_ts]
        (ms), or None. ValueError if ``msg_id`` is not 32 hex digits."""
        producer_id, seq = parse_unique_id(msg_id)
        for phys in self.index.query(id_block_key(producer_id, seq), begin_ts, end_ts, 256):
            v = self._readable(phys)
            if v is None or v.producer_id != producer_id:
                continue
            if v.base_seq <= seq < v.base_seq + v.count:
                try:
                    return next(v.messages(seq - v.base_seq, self._max_batch_bytes))
                except CorruptBatchError as exc:
                    self._skip_query(phys, exc)
        return None

    def _readable(self, phys: int) -> BatchView | None:
        if phys in self.quarantine or phys < self.commitlog.min_offset:
            return None
        try:
            v = self.commitlog.read_batch(phys)
            v.verify()
            return v
        except (CorruptBatchError, OffsetOutOfRangeError) as exc:
            self._report_corrupt(phys, str(exc))
            return None

    # -- topics --------------------------------------------------------------------------------
    def delete_topic(self, topic: str) -> None:
        """Drop the topic's consume queues (its batches age out of the CommitLog)."""
        with self._put_lock:
            self.cqs.delete_topic(topic)

    # -- durability and housekeeping ----------------------------------------------------------
    def _save_checkpoint(self) -> None:
        """Flush CommitLog, consume queues and index, then record what is durable."""
        with self._checkpoint_lock:
            self._save_checkpoint_locked()

    def _save_checkpoint_locked(self) -> None:
        with self._put_lock:
            dispatched = self.commitlog.write_pos
            index_phys = self.index.max_phys_offset
        flushed = self.commitlog.flush()
        log_end = self.cqs.flush()
        self.index.flush()
        state = (flushed, min(dispatched, flushed), log_end, index_phys)
        if state == self._saved_cp:
            # Nothing new since the last checkpoint (the flushes above were no-ops too): the
            # file already says this, so no tmp, fsync, rename (``written_at`` is informative).
            return
        cp = Checkpoint(
            version=2,
            commitlog_flushed=state[0],
            dispatched=state[1],
            index_log_end=state[2],
            index_phys=state[3],
            written_at=time.time_ns() // 1_000_000,
        )
        self._saved_cp = None  # a failed write leaves the file unknown: write again next time
        save_checkpoint(self.dir / "checkpoint", cp)
        self._saved_cp = state

    def flush(self) -> None:
        """Make everything put so far durable, indexes and checkpoint included."""
        self._save_checkpoint()

    def _housekeeping(self) -> None:
        cfg = self.config
        next_retention = 0.0
        while not self._stop.wait(cfg.checkpoint_interval_ms / 1000):
            try:
                self._save_checkpoint()
                now = time.monotonic()
                if now >= next_retention:
                    next_retention = now + cfg.retention_check_interval_ms / 1000
                    self.retention.run_once()
            except StoreError as exc:
                log.error("store housekeeping: %s", exc)
            except Exception:  # never let the thread die silently
                log.exception("store housekeeping failed")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._housekeeper.join()
        self.flush_service.close()
        self._save_checkpoint()
        self.cqs.close_all()
        self.index.close()
        self.commitlog.close()
        with contextlib.suppress(FileNotFoundError):
            (self.dir / "abort").unlink()
        self._release_lock()

    def __enter__(self) -> MessageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
