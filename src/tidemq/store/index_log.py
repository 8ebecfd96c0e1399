"""The shared consume-queue index log: every queue's 20-byte units in one append-only log.

Why not one file (and one memory map) per queue, as RocketMQ's ConsumeQueue and tidemq's
``store/consume_queue.py``: that design cannot reach 100,000 queues on this machine at all
(``vm.max_map_count`` 65,530, an open-file limit of 20,000), and with thousands of queues
nearly every small write faults a fresh page of a different file (81 % of the broker's time
at 10,000 queues, issue 17). An embedded key-value store (RocksDB, LMDB) would solve the file
count, but pays a per-unit key and a write path of its own for what is a pure append; the
units are already ordered per queue and the CommitLog is the source of truth, so a log of
*runs* is enough: each flush writes one block holding, for every queue that changed, its
new units as one contiguous run. A queue then costs a few small arrays in memory (where its
runs lie in the log) and nothing on disk beyond its units.

Layout: ``<data>/cqlog/<20-digit log position>`` files, each a sequence of blocks (a file is
rolled once it passes ``segment_bytes``; a block never spans files), and ``<data>/cqlog/names``,
which gives each queue a number. Little-endian::

    names  = records: crc32c u32 (of the rest) | id u32 | queue_id u32 | topic_len u16 | topic;
             a queue's record is written (and synced) before the first block naming its id,
             and the file is never cut by retention, so every block's ids stay resolvable
    block  = header (24 B) | entries | units
    header = magic u32 "TQIX" | crc32c u32 (of everything after the header) | body_len u32
             | n_entries u32 | max_phys i64 (largest CommitLog offset a unit of this block
             points at, -1 if none)
    entry  = id u32 | count i32 | first u64 (16 B)
             count > 0: ``count`` units of queue ``id`` from queue offset ``first``, stored in
                        ``units`` in entry order;
             count = 0: the queue's units end at ``first`` (a truncation, or where an empty
                        queue starts: above the queue's end, its earlier units are gone);
                        a block may hold two for a queue, the lowest cut since the
                        previous block and then where the queue now starts;
             count = -1: the queue was deleted.
    unit   = phys_offset u64 | size u32 | tag_hash u64 (as in store/consume_queue.py)

Replaying the blocks in order rebuilds every queue: an entry at an offset below the queue's
end first cuts the queue there. Recovery: the store's checkpoint (version 2) records the log
position durable with it; blocks before it are trusted and only their entries are read, the
blocks after it are checked by CRC and the log is cut at the first torn one; then the store
cuts every queue at the checkpoint's CommitLog position and re-dispatches the CommitLog tail.
Retention deletes whole log files whose units all point below the CommitLog's minimum.

Threads: one lock guards the log and every queue's in-memory state. The writer (the store's
put path, under its put lock) appends to a queue's pending units in memory; :meth:`flush`
(the store's checkpoint thread) writes every pending unit as one block and fdatasyncs;
readers may call :meth:`LogQueue.units` and friends from any thread.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import mmap
import os
import shutil
import struct
import threading
from array import array
from collections.abc import Callable, Iterable

import numpy as np

from tidemq.protocol.batch.layout import index_hashes
from tidemq.protocol.errors import StoreClosedError, StoreError, StoreWriteError
from tidemq.protocol.record import INDEX_ENTRY, INDEX_ENTRY_SIZE, MAX_BATCH_SIZE, crc32c
from tidemq.store.mapped_file import fsync_dir

__all__ = ["IndexLog", "LogQueue", "UNIT", "UNIT_SIZE", "UNIT_DTYPE", "BLOCK_HEADER",
           "ENTRY_DTYPE"]

log = logging.getLogger(__name__)

UNIT = struct.Struct("<QIQ")  # phys_offset, size, tag_hash
UNIT_SIZE = 20
UNIT_DTYPE = np.dtype([("phys", "<u8"), ("size", "<u4"), ("tag", "<u8")])
assert UNIT_DTYPE.itemsize == UNIT_SIZE == UNIT.size

BLOCK_MAGIC = 0x58495154  # b"TQIX"
BLOCK_HEADER = struct.Struct("<IIIIq")
ENTRY = struct.Struct("<IiQ")
ENTRY_DTYPE = np.dtype([("id", "<u4"), ("count", "<i4"), ("first", "<u8")])
assert ENTRY_DTYPE.itemsize == ENTRY.size == 16
_NAME = struct.Struct("<IIIH")  # crc, id, queue_id, topic length
NAMES_FILE = "names"
DROP = -1
_NAME_DIGITS = 20
#: changed queues per block at most: the lock is held while one block is built and written
BLOCK_QUEUES = 2048
_PHYS_LIMIT = 1 << 63
#: batches of up to this many messages get their units packed by struct, larger by numpy
_SMALL_BATCH = 16
_iter_index = INDEX_ENTRY.iter_unpack
_EMPTY = np.empty(0, UNIT_DTYPE)
_EMPTY.flags.writeable = False


def _check_topic(topic: str) -> None:
    if not topic or "\0" in topic or len(topic.encode()) > 0xFFFF:
        raise ValueError(f"topic {topic!r} cannot be indexed")


class LogQueue:
    """The units of one (topic, queue id): runs in the shared log plus pending units in memory.

    The store's consume queues (store/consume_queue.py's ConsumeQueue, one file per queue, is
    read only to migrate an older store). A queue's units wait in memory until the log's next
    block: nothing is reserved on disk per put."""

    __slots__ = ("topic", "queue_id", "qid", "_log", "_min", "_max", "_max_phys", "_last_phys",
                 "_rfirst", "_rcount", "_rpos", "_pend", "_pend_first", "_cut", "_cut_to",
                 "_closed", "_defined")

    UNIT_SIZE = UNIT_SIZE

    def __init__(self, log_: IndexLog, topic: str, queue_id: int, qid: int) -> None:
        self.topic = topic
        self.queue_id = queue_id
        self.qid = qid
        self._log = log_
        self._min = 0
        self._max = 0
        self._max_phys = -1  # end of the last unit's batch
        self._last_phys = -1  # start of the last unit's batch
        self._rfirst: array[int] = array("q")
        self._rcount: array[int] = array("q")
        self._rpos: array[int] = array("q")
        self._pend = bytearray()
        self._pend_first = 0
        self._cut = False  # flushed units were cut (or the queue starts above 0): log the end
        # The lowest cut into flushed units since the last block (-1: none). Logged before the
        # end: after a cut to 0 and a start_at, the end alone would not cut the logged units.
        self._cut_to = -1
        self._closed = False
        self._defined = False

    # -- reading ---------------------------------------------------------------------------
    @property
    def min_offset(self) -> int:
        return self._min

    @property
    def max_offset(self) -> int:
        """The next queue offset to write (one past the last unit)."""
        return self._max

    @property
    def max_phys_offset(self) -> int:
        return self._max_phys

    def get(self, offset: int) -> tuple[int, int, int] | None:
        u = self.units(offset, 1)
        if not len(u):
            return None
        return int(u["phys"][0]), int(u["size"][0]), int(u["tag"][0])

    def units(self, offset: int, max_count: int) -> np.ndarray:
        """Up to ``max_count`` units from ``offset`` as a read-only structured array (fields
        ``phys``, ``size``, ``tag``), never crossing the end of a run -- the caller loops.
        Empty outside [min_offset, max_offset)."""
        with self._log._lock:
            return self._units_locked(offset, max_count)

    def unit_bytes(self, offset: int, max_count: int) -> bytes:
        """:meth:`units` as their stored bytes (UNIT_SIZE each): a reader of a unit or two
        unpacks them with ``struct``, cheaper than an array (MessageStore.get_messages)."""
        with self._log._lock:
            return self._unit_bytes_locked(offset, max_count)

    def _units_locked(self, offset: int, max_count: int) -> np.ndarray:
        data = self._unit_bytes_locked(offset, max_count)
        return np.frombuffer(data, UNIT_DTYPE) if data else _EMPTY

    def _unit_bytes_locked(self, offset: int, max_count: int) -> bytes:
        mx = self._max
        if max_count <= 0 or offset >= mx or offset < self._min:
            return b""
        pend = self._pend
        if pend and offset >= self._pend_first:
            a = (offset - self._pend_first) * UNIT_SIZE
            n = min(max_count, mx - offset)
            return bytes(pend[a : a + n * UNIT_SIZE])
        k = bisect.bisect_right(self._rfirst, offset) - 1
        if k < 0:
            return b""
        first, count = self._rfirst[k], self._rcount[k]
        if offset >= first + count:
            return b""
        n = min(max_count, first + count - offset, mx - offset)
        data = self._log._pread(self._rpos[k] + (offset - first) * UNIT_SIZE, n * UNIT_SIZE)
        if len(data) != n * UNIT_SIZE:
            return b""
        return data

    def offset_for_timestamp(self, ts_ms: int, store_ts_of: Callable[[int], int]) -> int:
        lo, hi = self._min, self._max
        while lo < hi:
            mid = (lo + hi) // 2
            unit = self.get(mid)
            if unit is None:
                lo = mid + 1
                continue
            if store_ts_of(unit[0]) < ts_ms:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _first_at_or_above(self, phys: int) -> int:
        """First queue offset in [min, max) whose unit points at or past ``phys`` (units are
        ordered by phys along a queue); max when there is none. Lock held."""
        lo, hi = self._min, self._max
        while lo < hi:
            mid = (lo + hi) // 2
            u = self._units_locked(mid, 1)
            if not len(u) or int(u["phys"][0]) < phys:
                lo = mid + 1
            else:
                hi = mid
        return lo

    # -- writing ---------------------------------------------------------------------------
    def append_batch(
        self, queue_offset: int, phys_offset: int, size: int, index_view: bytes | memoryview
    ) -> None:
        """Units of one batch: ``len(index_view) // 12`` units from ``queue_offset``, all
        (phys_offset, size), tag hashes from the batch's message index. ``queue_offset ==
        max_offset`` appends; a lower one (re-dispatch) first cuts the queue there; a higher
        one is a gap: StoreError."""
        view = memoryview(index_view).cast("B")
        n, rest = divmod(view.nbytes, INDEX_ENTRY_SIZE)
        if n == 0 or rest:
            raise ValueError(
                f"index_view must hold whole {INDEX_ENTRY_SIZE}-byte entries, got {view.nbytes}"
            )
        if n == 1:
            units = UNIT.pack(phys_offset, size, INDEX_ENTRY.unpack_from(view)[0])
        elif n <= _SMALL_BATCH:
            # numpy's fixed cost per call (~3-8 us here) is more than packing a few units:
            # small batches are what spread traffic over many queues brings (issue 17)
            pack = UNIT.pack
            units = b"".join([pack(phys_offset, size, h) for h, _ in _iter_index(view)])
        else:
            arr = np.empty(n, UNIT_DTYPE)
            arr["phys"] = phys_offset
            arr["size"] = size
            arr["tag"] = index_hashes(view)
            units = arr.tobytes()
        with self._log._lock:
            self._append_locked(queue_offset, phys_offset, size, units, n)

    def append_one(self, queue_offset: int, phys_offset: int, size: int, tag: int) -> None:
        """:meth:`append_batch` of a one-message batch."""
        lg = self._log
        with lg._lock:
            if (queue_offset == self._max and phys_offset >= self._max_phys
                    and 0 <= phys_offset < _PHYS_LIMIT and not self._closed
                    and 0 < size <= MAX_BATCH_SIZE):
                if not self._pend:  # the first unit since the last block (at 100,000 queues:
                    self._pend_first = queue_offset  # nearly every one)
                    lg._dirty[self.qid] = self
                self._pend += UNIT.pack(phys_offset, size, tag)
                self._last_phys = phys_offset
                self._max_phys = phys_offset + size
                self._max = queue_offset + 1
                lg._pending_bytes += UNIT_SIZE
                return
            self._append_locked(queue_offset, phys_offset, size,
                                UNIT.pack(phys_offset, size, tag), 1)

    def _append_locked(self, qoff: int, phys: int, size: int, units: bytes, n: int) -> None:
        if self._closed:
            raise StoreClosedError(f"consume queue {self.topic}/{self.queue_id} is closed")
        if not 0 < size <= MAX_BATCH_SIZE or not 0 <= phys < _PHYS_LIMIT:
            raise ValueError(f"bad batch position: phys_offset {phys}, size {size}")
        if qoff < 0:
            raise ValueError(f"queue offset must be >= 0, got {qoff}")
        if qoff > self._max:
            raise StoreError(
                f"consume queue {self.topic}/{self.queue_id}: append at queue offset {qoff} "
                f"would leave a gap after max offset {self._max} (offsets are assigned "
                f"sequentially, so the dispatcher or the queue is out of step)"
            )
        if qoff < self._max:
            self._truncate_locked(qoff)
        elif phys < self._max_phys:
            raise StoreError(
                f"consume queue {self.topic}/{self.queue_id}: batch at CommitLog offset {phys} "
                f"appended after one ending at {self._max_phys}; units must follow CommitLog "
                f"order"
            )
        if not self._pend:
            self._pend_first = qoff
            self._log._dirty[self.qid] = self
        self._pend += units
        self._log._pending_bytes += len(units)
        self._last_phys = phys
        self._max_phys = phys + size
        self._max = qoff + n

    def start_at(self, queue_offset: int) -> None:
        """Make an empty queue begin at ``queue_offset`` (a CommitLog that starts after this
        queue's first batches)."""
        with self._log._lock:
            if self._max or self._rcount or self._pend or queue_offset <= 0:
                return
            if self._closed:
                raise StoreClosedError(f"consume queue {self.topic}/{self.queue_id} is closed")
            self._min = self._max = queue_offset
            self._max_phys = -1
            self._mark_cut()

    def _mark_cut(self) -> None:
        self._cut = True
        self._log._dirty[self.qid] = self

    # -- recovery and retention ------------------------------------------------------------
    def truncate_dirty(self, max_phys: int) -> None:
        """Drop every unit whose phys_offset >= ``max_phys`` (the CommitLog's end)."""
        with self._log._lock:
            if self._last_phys < max_phys and (self._max == self._min or self._last_phys >= 0):
                return  # the last unit points below: nothing to cut (no read)
            cut = self._first_at_or_above(max(max_phys, 0))
            if cut < self._max:
                self._truncate_locked(cut)

    def _truncate_locked(self, cut: int) -> None:
        if cut >= self._max:
            return
        pend = self._pend
        if pend and cut >= self._pend_first:
            dropped = len(pend) - (cut - self._pend_first) * UNIT_SIZE
            del pend[(cut - self._pend_first) * UNIT_SIZE :]
            self._log._pending_bytes -= dropped
        else:
            self._log._pending_bytes -= len(pend)
            pend.clear()
            k = bisect.bisect_left(self._rfirst, cut)  # runs starting at or after the cut go
            if k < len(self._rfirst):
                del self._rfirst[k:]
                del self._rcount[k:]
                del self._rpos[k:]
            if self._rcount:
                last = len(self._rcount) - 1
                self._rcount[last] = min(self._rcount[last], cut - self._rfirst[last])
            if self._cut_to < 0 or cut < self._cut_to:
                self._cut_to = cut
            self._mark_cut()
        self._max = cut
        self._min = min(self._min, cut)
        u = self._units_locked(cut - 1, 1) if cut > self._min else _EMPTY
        if len(u):
            self._last_phys = int(u["phys"][0])
            self._max_phys = self._last_phys + int(u["size"][0])
        else:
            self._last_phys = self._max_phys = -1

    def correct_min_offset(self, min_phys: int) -> None:
        """Move ``min_offset`` to the first unit pointing at or past ``min_phys`` (the
        CommitLog's minimum); drop the runs wholly below it or in deleted log files."""
        lg = self._log
        with lg._lock:
            floor = lg._min_pos
            k = 0
            rpos, rcount = self._rpos, self._rcount
            while k < len(rpos) and rpos[k] < floor:
                k += 1
            if k:
                new_min = self._rfirst[k] if k < len(rpos) else (
                    self._pend_first if self._pend else self._max)
                self._min = max(self._min, new_min)
            first = self._units_locked(self._min, 1)
            if not len(first) or int(first["phys"][0]) < min_phys:
                self._min = self._first_at_or_above(max(min_phys, 0))
            while k < len(rpos) and self._rfirst[k] + rcount[k] <= self._min:
                k += 1
            if k:
                del self._rfirst[:k]
                del self._rcount[:k]
                del self._rpos[:k]

    def delete_expired_files(self, min_phys: int) -> int:
        """Retention: the log deletes its own files (IndexLog.delete_expired); a queue only
        corrects its minimum. Returns 0 (no per-queue files)."""
        self.correct_min_offset(min_phys)
        return 0

    def validate(self, max_phys: int) -> str | None:
        """A problem when the last unit's batch runs past the CommitLog end ``max_phys``
        (units starting at or past it are merely dirty); the log's blocks carry CRCs."""
        lp, mp = self._last_phys, self._max_phys
        if 0 <= lp < max_phys < mp:
            return (f"consume queue {self.topic}/{self.queue_id}: batch [{lp}, {mp}) runs past "
                    f"the CommitLog end {max_phys}")
        return None

    def flush(self) -> None:
        self._log.flush()

    def close(self) -> None:
        self._closed = True

    def destroy(self) -> None:
        self._log.destroy_queue(self.topic, self.queue_id)

    def memory_bytes(self) -> int:
        return (len(self._pend) + 8 * 3 * len(self._rfirst))

    def __repr__(self) -> str:
        return (f"LogQueue({self.topic!r}, {self.queue_id}, min={self._min}, max={self._max}, "
                f"runs={len(self._rfirst)}, pending={len(self._pend) // UNIT_SIZE})")


class _Segment:
    """One log file. Readers copy units out of ``mm``, a read-only mapping of the file's
    first ``len(mm)`` bytes (mapped again, larger, when a read needs bytes written since):
    a pread per read was a syscall per queue, a fifth of the broker's time serving a
    PULL_MULTI_QUEUE of thousands of queues. Units are copied out, never viewed, so no
    reader pins a mapping and a file can be closed at any time."""

    __slots__ = ("start", "path", "fd", "size", "max_phys", "mm")

    def __init__(self, start: int, path: str, fd: int, size: int, max_phys: int) -> None:
        self.start = start
        self.path = path
        self.fd = fd
        self.size = size
        self.max_phys = max_phys
        self.mm: mmap.mmap | None = None

    def read(self, rel: int, n: int) -> bytes:
        """``n`` bytes at ``rel`` (fewer past the written end); lock held."""
        end = min(rel + n, self.size)
        mm = self.mm
        if mm is None or end > len(mm):
            if end <= rel:
                return b""
            mm = self.mm = mmap.mmap(self.fd, self.size, access=mmap.ACCESS_READ)
        return mm[rel:end]

    def close(self) -> None:
        if self.mm is not None:
            self.mm.close()
            self.mm = None
        os.close(self.fd)


class IndexLog:
    """All consume queues of a store over one shared log (the store's ``cqs``): the table
    interface of store/consume_queue.py's ConsumeQueueTable plus :meth:`flush`,
    :meth:`delete_expired` and :attr:`end`."""

    def __init__(self, root: str | os.PathLike[str], segment_bytes: int = 64 << 20) -> None:
        self.root = os.fspath(root)
        self.segment_bytes = segment_bytes
        self._lock = threading.RLock()
        self._flush_lock = threading.Lock()
        self._queues: dict[tuple[str, int], LogQueue] = {}
        self._by_id: dict[int, LogQueue] = {}
        self._next_id = 0
        self._dirty: dict[int, LogQueue] = {}
        self._dropped: list[int] = []
        self._pending_bytes = 0
        self._segments: list[_Segment] = []
        self._min_pos = 0
        self._end = 0
        self._synced = 0
        self.load_problem: str | None = None
        self.blocks_replayed = 0
        self._names_fd = -1
        self._names_size = 0
        self._seen: set[int] = set()

    # -- table interface -----------------------------------------------------------------
    def load(self, trusted_end: int = 0) -> list[tuple[str, int]]:
        """Open the log and replay it, checking every block's CRC. A torn or damaged block
        ends the log: it is cut there, and ``load_problem`` says so when that is below
        ``trusted_end`` (the checkpoint's log position: the store then rebuilds)."""
        os.makedirs(self.root, exist_ok=True)
        self._load_names()
        self._seen = set()
        files = sorted(n for n in os.listdir(self.root)
                       if len(n) == _NAME_DIGITS and n.isdigit())
        stop = False
        for name in files:
            path = os.path.join(self.root, name)
            start = int(name)
            if stop or (self._segments and start != self._end):
                if not stop:
                    self._problem(f"{path}: gap in the index log before position {start}")
                os.unlink(path)
                stop = True
                continue
            if not self._segments:
                self._min_pos = start
                self._end = start
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            size = os.fstat(fd).st_size
            seg = _Segment(start, path, fd, size, -1)
            self._segments.append(seg)
            good = self._replay_segment(seg, trusted_end)
            if good < size:
                if start + good < trusted_end:
                    self._problem(f"{path}: damaged block at byte {good} below the checkpoint")
                if seg.mm is not None:  # never map past the end of a file
                    seg.mm.close()
                    seg.mm = None
                os.ftruncate(fd, good)
                seg.size = good
                stop = True
            self._end = start + seg.size
        self._synced = self._end
        # A queue is what the log mentions; a re-created name's newest id wins.
        for qid in sorted(self._by_id):
            q = self._by_id[qid]
            if qid in self._seen:
                self._queues[(q.topic, q.queue_id)] = q
        self._by_id = {q.qid: q for q in self._queues.values()}
        self._seen = set()
        self._finish_load()
        return list(self._queues)

    def _problem(self, text: str) -> None:
        if self.load_problem is None:
            self.load_problem = text

    def _replay_segment(self, seg: _Segment, trusted_end: int) -> int:
        """Replay the blocks of one file; returns the length of its valid prefix."""
        fd = seg.fd
        pos = 0
        hs = BLOCK_HEADER.size
        while pos + hs <= seg.size:
            head = os.pread(fd, hs, pos)
            magic, crc, body_len, n_entries, max_phys = BLOCK_HEADER.unpack(head)
            if magic != BLOCK_MAGIC or pos + hs + body_len > seg.size or \
                    n_entries * ENTRY.size > body_len:
                return pos
            meta_len = n_entries * ENTRY.size
            # Every block is checked (as the per-queue files were validated unit by unit):
            # a damaged block below the checkpoint makes the store rebuild from the CommitLog.
            body = os.pread(fd, body_len, pos + hs)
            if len(body) != body_len or crc32c(body) != crc:
                return pos
            meta = body[:meta_len]
            try:
                self._apply_block(meta, n_entries, seg.start + pos + hs + meta_len)
            except (ValueError, UnicodeDecodeError, struct.error) as exc:
                self._problem(f"{seg.path}: block at byte {pos} does not apply: {exc}")
                return pos
            seg.max_phys = max(seg.max_phys, max_phys)
            self.blocks_replayed += 1
            pos += hs + body_len
        return pos

    def _load_names(self) -> None:
        """Read the names file: every queue id ever given out (a torn last record, whose
        block was never written, is cut off)."""
        path = os.path.join(self.root, NAMES_FILE)
        fd = self._names_fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        raw = b""
        while True:
            chunk = os.pread(fd, 1 << 20, len(raw))
            if not chunk:
                break
            raw += chunk
        p = 0
        hs = _NAME.size
        while p + hs <= len(raw):
            crc, qid, queue_id, tlen = _NAME.unpack_from(raw, p)
            end = p + hs + tlen
            if end > len(raw) or crc32c(raw[p + 4 : end]) != crc:
                break
            try:
                topic = raw[p + hs : end].decode()
            except UnicodeDecodeError:
                break
            q = LogQueue(self, topic, queue_id, qid)
            q._defined = True
            self._by_id[qid] = q
            self._next_id = max(self._next_id, qid + 1)
            p = end
        if p < len(raw):
            os.ftruncate(fd, p)
        self._names_size = p

    def _check_block(self, rows: list[tuple[int, int, int]]) -> None:
        """Raise ValueError when a block's entries do not apply, before any is applied (a
        block applies whole or not at all: no queue keeps a run of a block the log cuts off).
        Follows :meth:`_apply_block` on each queue's end and first run only."""
        state: dict[int, tuple[int, int] | None] = {}  # qid -> (end, first run or -1)
        for qid, count, first in rows:
            if qid in state:
                st = state[qid]
            else:
                q = self._by_id.get(qid)
                st = None if q is None else (q._max, q._rfirst[0] if q._rcount else -1)
            if st is None:
                raise ValueError(f"entry for an unknown or deleted queue id {qid}")
            if count < DROP:
                raise ValueError(f"entry for queue id {qid} with count {count}")
            if count == DROP:
                state[qid] = None
                continue
            end, r0 = st
            if first > end:
                if count and (r0 >= 0 or end):
                    raise ValueError(f"queue id {qid} jumps from {end} to {first}")
                end, r0 = first, -1
            elif first < end:
                end = first
                if r0 >= first:
                    r0 = -1
            if count > 0:
                end = first + count
                if r0 < 0:
                    r0 = first
            state[qid] = (end, r0)

    def _apply_block(self, meta: bytes, n_entries: int, units_pos: int) -> None:
        rows = np.frombuffer(meta, ENTRY_DTYPE, count=n_entries).tolist()
        self._check_block(rows)
        pos = units_pos
        by_id = self._by_id
        seen = self._seen
        for qid, count, first in rows:
            q = by_id[qid]
            if count == DROP:
                del by_id[qid]
                seen.discard(qid)
                continue
            seen.add(qid)
            if first > q._max:
                # count > 0 here only on an empty queue (_check_block); a count-0 entry above
                # the end is where the queue now starts, its earlier units cut (the writer
                # before the lowest cut was logged wrote "cut to 0, start at N" so)
                q._rfirst, q._rcount, q._rpos = array("q"), array("q"), array("q")
                q._min = q._max = first
                q._last_phys = q._max_phys = -1
            elif first < q._max:
                q._truncate_locked(first)
                q._cut, q._cut_to = False, -1
            if count > 0:
                if q._rcount and q._rfirst[-1] + q._rcount[-1] == first and \
                        q._rpos[-1] + q._rcount[-1] * UNIT_SIZE == pos:
                    q._rcount[-1] += count
                else:
                    q._rfirst.append(first)
                    q._rcount.append(count)
                    q._rpos.append(pos)
                q._max = first + count
                pos += count * UNIT_SIZE

    def _finish_load(self) -> None:
        """After replay: each queue's last batch position (one small read per queue with
        units)."""
        with self._lock:
            self._dirty = {}
            for q in self._queues.values():
                q._cut, q._cut_to = False, -1
                if q._max > q._min:
                    u = q._units_locked(q._max - 1, 1)
                    if len(u):
                        q._last_phys = int(u["phys"][0])
                        q._max_phys = q._last_phys + int(u["size"][0])

    def get_or_create(self, topic: str, queue_id: int) -> LogQueue:
        q = self._queues.get((topic, queue_id))
        if q is not None:
            return q
        _check_topic(topic)
        if queue_id < 0:
            raise ValueError(f"queue id must be >= 0, got {queue_id}")
        with self._lock:
            q = self._queues.get((topic, queue_id))
            if q is None:
                qid = self._next_id
                self._next_id += 1
                q = LogQueue(self, topic, queue_id, qid)
                self._queues[(topic, queue_id)] = q
                self._by_id[qid] = q
            return q

    def find(self, topic: str, queue_id: int) -> LogQueue | None:
        return self._queues.get((topic, queue_id))

    def all(self) -> list[LogQueue]:
        with self._lock:
            return list(self._queues.values())

    def __len__(self) -> int:
        return len(self._queues)

    def validate_all(self, max_phys: int) -> dict[tuple[str, int], str]:
        out: dict[tuple[str, int], str] = {}
        if self.load_problem is not None:
            out[("", -1)] = self.load_problem
        for key, q in list(self._queues.items()):
            problem = q.validate(max_phys)
            if problem is not None:
                out[key] = problem
        return out

    def destroy_queue(self, topic: str, queue_id: int) -> None:
        with self._lock:
            q = self._queues.pop((topic, queue_id), None)
            if q is None:
                return
            self._drop_locked(q)

    def _drop_locked(self, q: LogQueue) -> None:
        q._closed = True
        self._by_id.pop(q.qid, None)
        self._dirty.pop(q.qid, None)
        self._pending_bytes -= len(q._pend)
        if q._defined:
            self._dropped.append(q.qid)
        q._min = q._max = 0
        q._max_phys = q._last_phys = -1
        q._pend = bytearray()
        q._rfirst, q._rcount, q._rpos = array("q"), array("q"), array("q")

    def delete_topic(self, topic: str) -> int:
        with self._lock:
            doomed = [q for k, q in self._queues.items() if k[0] == topic]
            for q in doomed:
                del self._queues[(q.topic, q.queue_id)]
                self._drop_locked(q)
        return len(doomed)

    def flush_all(self) -> None:
        self.flush()

    def close_all(self) -> None:
        self.flush()
        with self._lock:
            for q in self._queues.values():
                q._closed = True
            self._queues.clear()
            self._by_id.clear()
            for seg in self._segments:
                seg.close()
            self._segments = []
            if self._names_fd >= 0:
                os.close(self._names_fd)
                self._names_fd = -1

    # -- the log -------------------------------------------------------------------------
    @property
    def end(self) -> int:
        """Log position after the last block written."""
        return self._end

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def _pread(self, pos: int, n: int) -> bytes:
        segs = self._segments
        seg = segs[-1] if segs else None
        if seg is None or pos < seg.start:
            i = bisect.bisect_right([s.start for s in segs], pos) - 1
            if i < 0:
                return b""
            seg = segs[i]
        return seg.read(pos - seg.start, n)

    def flush(self) -> int:
        """Write every pending unit (and truncation, start, deletion) in blocks of at most
        BLOCK_QUEUES queues and make them durable; returns the log's end.

        The lock is held per block, not for the whole flush: building a block is Python work
        per changed queue, and one block of 100,000 changed queues held every reader and the
        put path for a quarter of a second. Everything pending when the flush starts is
        written when it returns: the queues that changed are taken in the order they became
        dirty (a queue dirty again after its block goes to the back)."""
        with self._flush_lock:
            with self._lock:
                rounds = -(-len(self._dirty) // BLOCK_QUEUES) or 1
            for _ in range(rounds):
                with self._lock:
                    block = self._build_block()
                    if block is not None:
                        self._write_block(*block)
            with self._lock:
                end = self._end
                seg = self._segments[-1] if self._segments else None
            if seg is not None and self._synced < end:
                try:
                    os.fdatasync(seg.fd)
                except OSError as exc:
                    raise StoreWriteError(f"cannot sync {seg.path}: {exc.strerror}") from exc
                self._synced = end
            return end

    def _build_block(
        self,
    ) -> tuple[list[bytes], list[tuple[LogQueue, int, int, int]], int, bytes,
               list[LogQueue], list[LogQueue], int, int] | None:
        """The next block from the first BLOCK_QUEUES queues that changed (lock held);
        changes no state (but forgets dirty queues with nothing to log), so a failed write
        leaves everything pending for the next flush."""
        if not self._dirty and not self._dropped:
            return None
        take = list(itertools.islice(self._dirty.values(), BLOCK_QUEUES))
        names: list[bytes] = []
        entries: list[bytes] = [ENTRY.pack(qid, DROP, 0) for qid in self._dropped]
        units: list[bytes | bytearray] = []
        # queue, first, unit index in block, units: once per changed queue, and at 100,000
        # queues nearly every message is a changed queue (issue 17), so kept to the least
        runs: list[tuple[LogQueue, int, int, int]] = []
        named: list[LogQueue] = []  # queues whose name record goes with this block
        n_units = 0
        max_phys = -1
        pack = ENTRY.pack
        add_entry, add_units, add_run = entries.append, units.append, runs.append
        for q in take:
            pend = q._pend
            if q._defined and not q._cut:  # the common case: units to log, nothing else
                if pend:
                    n = len(pend) // UNIT_SIZE
                    first = q._pend_first
                    add_entry(pack(q.qid, n, first))
                    add_units(pend)  # joined below: the block never aliases it
                    add_run((q, first, n_units, n))
                    n_units += n
                    if q._max_phys > max_phys:
                        max_phys = q._max_phys
                continue
            if not (q._cut or pend):
                continue
            if not q._defined:
                t = q.topic.encode()
                rec = struct.pack("<IIH", q.qid, q.queue_id, len(t)) + t
                names.append(struct.pack("<I", crc32c(rec)) + rec)
                named.append(q)
            if q._cut:
                end = (q._rfirst[-1] + q._rcount[-1]) if q._rcount else (
                    q._pend_first if q._pend else q._max)
                if q._cut_to >= 0:  # the logged units are cut there first
                    entries.append(ENTRY.pack(q.qid, 0, q._cut_to))
                if end != q._cut_to:
                    entries.append(ENTRY.pack(q.qid, 0, end))
            if pend:
                n = len(pend) // UNIT_SIZE
                entries.append(ENTRY.pack(q.qid, n, q._pend_first))
                units.append(pend)
                runs.append((q, q._pend_first, n_units, n))
                n_units += n
                max_phys = max(max_phys, q._max_phys)
        if not entries:
            for q in take:
                del self._dirty[q.qid]
            return None
        meta = b"".join(entries)
        body = meta + b"".join(units)
        head = BLOCK_HEADER.pack(BLOCK_MAGIC, crc32c(body), len(body), len(entries), max_phys)
        return ([head, body], runs, BLOCK_HEADER.size + len(meta), b"".join(names), named, take,
                n_units, max_phys)

    def _write_block(self, parts: list[bytes], runs: list[tuple[LogQueue, int, int, int]],
                     units_at: int, names: bytes, named: list[LogQueue],
                     take: list[LogQueue], n_units: int, max_phys: int) -> None:
        if names:  # durable before any block names these ids
            try:
                if os.pwrite(self._names_fd, names, self._names_size) != len(names):
                    raise OSError(28, "short write (disk full?)")
                os.fdatasync(self._names_fd)
            except OSError as exc:
                raise StoreWriteError(f"cannot write {self.root}/{NAMES_FILE}: "
                                      f"{exc.strerror}") from exc
            self._names_size += len(names)
        size = sum(len(p) for p in parts)
        seg = self._segments[-1] if self._segments else None
        if seg is None or (seg.size and seg.size + size > self.segment_bytes):
            seg = self._new_segment()
        try:
            written = os.pwritev(seg.fd, parts, seg.size)
        except OSError as exc:
            raise StoreWriteError(f"cannot write {seg.path}: {exc.strerror}") from exc
        if written != size:
            raise StoreWriteError(f"short write to {seg.path} (disk full?)")
        # written: now the state moves (what was pending is in the log)
        dirty = self._dirty
        if len(take) == len(dirty):  # the block took every dirty queue
            for q in take:
                q._cut = False
                q._cut_to = -1
            dirty.clear()
        else:
            for q in take:
                q._cut = False
                q._cut_to = -1
                del dirty[q.qid]
        for q in named:  # only these: a dirty queue left without units wrote no name record
            q._defined = True
        self._dropped = []
        base = seg.start + seg.size + units_at
        for q, first, idx, n in runs:
            pos = base + idx * UNIT_SIZE
            rc = q._rcount
            if rc and q._rfirst[-1] + rc[-1] == first and q._rpos[-1] + rc[-1] * UNIT_SIZE == pos:
                rc[-1] += n
            else:
                q._rfirst.append(first)
                rc.append(n)
                q._rpos.append(pos)
            q._pend = bytearray()
        self._pending_bytes -= n_units * UNIT_SIZE
        seg.size += size
        seg.max_phys = max(seg.max_phys, max_phys)
        self._end = seg.start + seg.size

    def _new_segment(self) -> _Segment:
        if self._segments and self._synced < self._end:
            os.fdatasync(self._segments[-1].fd)  # an earlier file is complete before the next
        start = self._end
        path = os.path.join(self.root, f"{start:0{_NAME_DIGITS}d}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise StoreWriteError(f"cannot create {path}: {exc.strerror}") from exc
        seg = _Segment(start, path, fd, 0, -1)
        self._segments.append(seg)
        if len(self._segments) == 1:
            self._min_pos = start
        fsync_dir(self.root)
        return seg

    def delete_expired(self, min_phys: int) -> int:
        """Delete the log files (never the last) whose units all point below ``min_phys``;
        queues left without units there first log where they end. Returns files deleted."""
        with self._lock:
            segs = self._segments
            n = 0
            while n < len(segs) - 1 and segs[n].max_phys < min_phys:
                n += 1
            if not n:
                return 0
            new_min = segs[n].start
            for q in self._queues.values():
                # its last entry may be in a file that goes: log where it ends again
                if not q._rpos or q._rpos[-1] < new_min:
                    q._mark_cut()
        self.flush()
        with self._lock:
            doomed = self._segments[:n]
            self._segments = self._segments[n:]
            self._min_pos = self._segments[0].start
            for seg in doomed:
                seg.close()
                try:
                    os.unlink(seg.path)
                except FileNotFoundError:
                    pass
        fsync_dir(self.root)
        return n

    def files(self) -> list[str]:
        return [s.path for s in self._segments]

    def stats(self) -> dict[str, int]:
        return {"cq_log_bytes": self._end - self._min_pos, "cq_log_files": len(self._segments),
                "cq_pending_bytes": self._pending_bytes, "cq_queues": len(self._queues)}

    def migrate_from(self, queues: Iterable[object]) -> int:
        """Copy the units of old per-queue consume queues (store/consume_queue.py) into the
        log; returns how many queues were copied."""
        n = 0
        for old in queues:
            topic, queue_id = old.topic, old.queue_id  # type: ignore[attr-defined]
            q = self.get_or_create(topic, queue_id)
            mn, mx = old.min_offset, old.max_offset  # type: ignore[attr-defined]
            if mn:
                q.start_at(mn)
            off = mn
            with self._lock:
                while off < mx:
                    u = old.units(off, 65536)  # type: ignore[attr-defined]
                    if not len(u):
                        break
                    last = u[-1]
                    if not q._pend:
                        q._pend_first = off
                        self._dirty[q.qid] = q
                    q._pend += u.tobytes()
                    self._pending_bytes += u.nbytes
                    q._last_phys = int(last["phys"])
                    q._max_phys = q._last_phys + int(last["size"])
                    off += len(u)
                    q._max = off
            n += 1
            if self._pending_bytes > 16 << 20:
                self.flush()
        self.flush()
        return n


def remove_old_layout(root: str) -> None:
    shutil.rmtree(root, ignore_errors=True)
