"""TimerLog: the durable time index of messages held for delivery at a given time (ref BR8).

The messages themselves stay in the CommitLog (the broker wraps each held batch in an envelope
on the timer topic); the TimerLog only says *when* each envelope is due. It is a directory of
time-bucket files, one per ``bucket_ms`` slice of delivery time (60 s by default), each an
append-only array of fixed-size entries::

    <dir>/<20-digit bucket start, ms since the epoch>.tl
    <dir>/checkpoint.json     {"indexed": n, "heartbeat_ms": t}

One entry, 32 bytes, little-endian::

    +-----+------+------------------+------------------------------------------------------+
    | off | size | field            | meaning                                              |
    +-----+------+------------------+------------------------------------------------------+
    |   0 |    8 | deliver_at  i64  | due time, ms since the epoch                         |
    |   8 |    8 | phys        u64  | CommitLog offset of the envelope batch (its handle)  |
    |  16 |    4 | size        u32  | total_size of the envelope batch                     |
    |  20 |    2 | kind        u16  | 1 ADD, 2 CANCEL, 3 DONE (delivered)                  |
    |  22 |    2 | reserved    u16  | 0                                                    |
    |  24 |    4 | crc         u32  | CRC32C of bytes [0, 24)                              |
    |  28 |    4 | pad         u32  | 0                                                    |
    +-----+------+------------------+------------------------------------------------------+

An entry is pending when its bucket holds an ADD for its ``phys`` and no CANCEL or DONE for it.
A bucket file is deleted once every entry in it is done or cancelled (after a checkpoint, so a
recovery never re-indexes an entry whose bucket is gone).

Memory: only the *loaded* bucket (the earliest bucket that still has pending entries) is in
memory, as three sorted numpy arrays (due, phys, size: 20 bytes per entry), plus a small heap of
entries added later whose due time falls at or before the loaded bucket. The rest lives on disk
only, so millions of pending messages cost their files, not the heap.

Recovery (by the owner): ``indexed`` counts the timer topic's consume-queue units already added
here; the owner re-adds units from ``indexed`` to the queue's end after a crash (duplicates of
the same ``phys`` collapse at load). ``heartbeat_ms`` is the wall time of the last checkpoint: a
crash happened before ``heartbeat_ms + checkpoint interval``, which bounds the entries that may
have been delivered without their DONE mark reaching the file.

Corruption: a torn tail (file size not a multiple of 32) is cut; an entry whose CRC does not
match is skipped and reported with file and position (never a crash).

Threads: the owner's thread (the broker's event loop) calls everything except :meth:`sync`
and :meth:`save_checkpoint`, which may run in a worker thread concurrently with appends. The
owner's thread never fsyncs: descriptors it stops using (bucket finished, or evicted from the
open-file LRU) are handed to the next :meth:`sync`, which fsyncs and closes them.
"""

from __future__ import annotations

import bisect
import contextlib
import heapq
import json
import logging
import os
import struct
import sys
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from tidemq.base.atomic_file import write_atomic
from tidemq.protocol.record import crc32c

__all__ = ["TimerLog", "ENTRY", "ENTRY_SIZE", "ADD", "CANCEL", "DONE"]

log = logging.getLogger(__name__)

ENTRY = struct.Struct(
    "<q"  # 0  deliver_at
    "Q"  # 8  phys
    "I"  # 16 size
    "H"  # 20 kind
    "H"  # 22 reserved
)
ENTRY_BODY = 24
assert ENTRY.size == ENTRY_BODY
_CRC_PAD = struct.Struct("<II")
ENTRY_SIZE = 32
_DTYPE = np.dtype(
    [("due", "<i8"), ("phys", "<u8"), ("size", "<u4"), ("kind", "<u2"), ("res", "<u2"),
     ("crc", "<u4"), ("pad", "<u4")]
)
assert _DTYPE.itemsize == ENTRY_SIZE

ADD, CANCEL, DONE = 1, 2, 3
_SUFFIX = ".tl"
_MAX_OPEN = 32


def encode_entry(deliver_at: int, phys: int, size: int, kind: int) -> bytes:
    body = ENTRY.pack(deliver_at, phys, size, kind, 0)
    return body + _CRC_PAD.pack(crc32c(body), 0)


class TimerLog:
    """The time index. See the module docstring for the format and the threading contract."""

    def __init__(self, directory: str | os.PathLike[str], bucket_ms: int = 60_000) -> None:
        if bucket_ms <= 0:
            raise ValueError("bucket_ms must be > 0")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.bucket_ms = bucket_ms
        self.indexed = 0
        self.heartbeat_ms = 0
        #: Entries appended so far (a version: the owner skips an idle checkpoint by it).
        self.changes = 0
        #: ``changes`` and ``indexed`` as of the last checkpoint written.
        self.saved: tuple[int, int] | None = None
        self.problems: list[str] = []
        self._buckets: list[int] = []  # sorted starts of bucket files that exist
        self._fds: OrderedDict[int, int] = OrderedDict()  # bucket start -> append fd (LRU)
        self._dirty: set[int] = set()
        self._fd_lock = threading.Lock()
        # Entries appended since the last sync, per bucket (written out by sync()), and the
        # ones a sync() has taken and is writing right now: readers see both.
        self._buf: dict[int, bytearray] = {}
        self._writing: dict[int, list[bytes]] = {}
        self._retired: list[tuple[int, bool]] = []  # (fd, needs fsync): closed by sync()
        self._syncing: set[int] = set()  # fds a sync() is fsyncing outside the lock
        # Invariant: every pending entry of a bucket at or before ``_loaded`` is in memory
        # (arrays, heap) or handed out; ``_loaded`` only moves forward (until a reload).
        self._loaded: int | None = None
        self._in_arrays: int | None = None  # the bucket whose file the arrays were read from
        self._due = np.empty(0, np.int64)
        self._phys = np.empty(0, np.uint64)
        self._size = np.empty(0, np.uint32)
        self._i = 0
        self._heap: list[tuple[int, int, int]] = []
        self._heap_phys: set[int] = set()
        self._skip: set[int] = set()  # phys done or cancelled among the in-memory entries
        # phys handed out by pop_due and not yet done() -> its bucket start: a bucket with
        # such entries is never deleted (a crash before done() must find them again)
        self._handed: dict[int, int] = {}
        self.added = self.delivered = self.cancelled = 0
        self.pending_deletes: list[int] = []  # finished buckets, unlinked after a checkpoint
        self._load_meta()
        self.next_due()  # load the first bucket before any add (adds compare against it)

    # -- files -----------------------------------------------------------------------------------
    def _load_meta(self) -> None:
        for p in self.dir.iterdir():
            if p.suffix == _SUFFIX and p.stem.isdigit():
                self._buckets.append(int(p.stem))
                torn = p.stat().st_size % ENTRY_SIZE
                if torn:  # a crash in the middle of an append: cut it
                    msg = f"{p}: torn tail of {torn} bytes cut"
                    self.problems.append(msg)
                    log.warning("timer log %s", msg)
                    with open(p, "r+b") as f:
                        f.truncate(p.stat().st_size - torn)
        self._buckets.sort()
        cp = self.dir / "checkpoint.json"
        if cp.exists():
            try:
                data = json.loads(cp.read_text())
                self.indexed = int(data["indexed"])
                self.heartbeat_ms = int(data["heartbeat_ms"])
            except (ValueError, KeyError, TypeError) as exc:
                self.problems.append(f"{cp}: unreadable ({exc}); re-indexing from the start")

    def _path(self, start: int) -> Path:
        return self.dir / f"{start:020d}{_SUFFIX}"

    def bucket_of(self, deliver_at: int) -> int:
        return deliver_at - deliver_at % self.bucket_ms

    def _append(self, start: int, data: bytes) -> None:
        """Buffer an entry for ``start``'s file; :meth:`sync` writes it out. (A write() per
        32-byte entry on the event loop cost 0.2-0.4 ms here under other processes' writeback
        -- dirty-page throttling -- so the owner's thread never writes.)"""
        with self._fd_lock:
            self.changes += 1
            buf = self._buf.get(start)
            if buf is None:
                if start not in self._buckets:
                    bisect.insort(self._buckets, start)
                if start in self.pending_deletes:  # finished, then written again: keep it
                    self.pending_deletes.remove(start)
                buf = self._buf[start] = bytearray()
            buf += data

    def _fd(self, start: int) -> int:
        """The append descriptor of ``start``'s file (lock held), opened if needed."""
        fd = self._fds.get(start)
        if fd is None:
            fd = os.open(self._path(start), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            self._fds[start] = fd
            if len(self._fds) > _MAX_OPEN:
                old, ofd = self._fds.popitem(last=False)
                self._retire(old, ofd)
        else:
            self._fds.move_to_end(start)
        return fd

    def write_now(self, start: int) -> None:
        """Write ``start``'s buffered entries to its file at once, without fsync (they survive
        a kill -9 of the process): for a CANCEL, which nothing else could redo."""
        with self._fd_lock:
            buf = self._buf.pop(start, None)
            if buf:
                os.write(self._fd(start), buf)
                self._dirty.add(start)

    def _retire(self, start: int, fd: int) -> None:
        """Stop appending through ``fd`` (lock held). Its fsync and close are left to the next
        :meth:`sync` -- a worker thread -- so the owner's thread never waits for the disk."""
        self._retired.append((fd, start in self._dirty))
        self._dirty.discard(start)

    def sync(self) -> None:
        """Write out the buffered entries, fsync every bucket written since the last sync, and
        close retired descriptors (any thread). The lock is not held during the writes and
        fsyncs: appends go on meanwhile."""
        with self._fd_lock:
            bufs, self._buf = self._buf, {}
            self._dirty.update(bufs)  # before _fd() may retire one of them (keeps the flag)
            writes: list[tuple[int, int, bytes]] = []
            for start, buf in bufs.items():
                data = bytes(buf)
                self._writing.setdefault(start, []).append(data)
                writes.append((start, self._fd(start), data))
            dirty = [self._fds[s] for s in self._dirty if s in self._fds]
            self._dirty.clear()
            # A descriptor another sync() is using right now is closed by a later sync. Ours,
            # retired just now by _fd(), are closed below, after our writes to them.
            retired = [r for r in self._retired if r[0] not in self._syncing]
            self._retired = [r for r in self._retired if r[0] in self._syncing]
            # an open fd must not be closed (and its number reused) while we use it
            using = set(dirty) | {fd for _s, fd, _d in writes}
            self._syncing.update(using)
        try:
            for _start, fd, data in writes:
                os.write(fd, data)
            for fd in dirty:
                os.fsync(fd)
            for fd, was_dirty in retired:
                try:
                    if was_dirty:
                        os.fsync(fd)
                finally:
                    os.close(fd)
        finally:
            with self._fd_lock:
                self._syncing.difference_update(using)
                for start, _fd, data in writes:
                    pending = self._writing[start]
                    pending.remove(data)
                    if not pending:
                        del self._writing[start]

    def save_checkpoint(self, now_ms: int) -> None:
        """Sync the buckets, then durably record ``indexed`` and the heartbeat (tmp, fsync,
        rename, fsync dir). Blocking; the owner may run it in a worker thread."""
        indexed, changes = self.indexed, self.changes
        self.sync()
        data = json.dumps({"indexed": indexed, "heartbeat_ms": now_ms}).encode()
        self.saved = None
        write_atomic(self.dir / "checkpoint.json", data)
        self.saved = (changes, indexed)

    def unchanged(self) -> bool:
        """Nothing appended and nothing indexed since the last checkpoint written."""
        return self.saved == (self.changes, self.indexed) and not self.pending_deletes

    def _read_bucket(self, start: int) -> np.ndarray:
        """Every entry of the bucket: its file, plus what is buffered or being written (taken
        before the file is read, so an entry is seen twice rather than never; duplicates are
        harmless: the state of a ``phys`` is a set of marks)."""
        path = self._path(start)
        with self._fd_lock:
            extra = b"".join(self._writing.get(start, ())) + bytes(self._buf.get(start, b""))
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raw = b""
        raw = raw[: len(raw) - len(raw) % ENTRY_SIZE] + extra  # a partial append: not yet
        n = len(raw) // ENTRY_SIZE
        arr = np.frombuffer(raw, _DTYPE, count=n)
        mv = memoryview(raw)
        ok = np.fromiter(
            (crc32c(mv[i : i + ENTRY_BODY]) for i in range(0, n * ENTRY_SIZE, ENTRY_SIZE)),
            dtype=np.uint32, count=n,
        ) == arr["crc"]
        if not ok.all():
            for i in np.flatnonzero(~ok)[:10]:
                msg = f"{path}: entry at byte {int(i) * ENTRY_SIZE} fails its CRC; skipped"
                self.problems.append(msg)
                log.error("timer log %s", msg)
            arr = arr[ok]
        return arr

    # -- writing -----------------------------------------------------------------------------------
    def add(self, deliver_at: int, phys: int, size: int) -> None:
        start = self.bucket_of(deliver_at)
        self._append(start, encode_entry(deliver_at, phys, size, ADD))
        self.added += 1
        if self._loaded is None or start <= self._loaded:
            if phys not in self._heap_phys:
                heapq.heappush(self._heap, (deliver_at, phys, size))
                self._heap_phys.add(phys)
            if self._loaded is None:
                self._loaded = start

    def cancel(self, deliver_at: int, phys: int, size: int) -> None:
        """Cancel the pending entry (deliver_at, phys); the caller checked it is pending."""
        start = self.bucket_of(deliver_at)
        self._append(start, encode_entry(deliver_at, phys, size, CANCEL))
        self.write_now(start)
        self._skip.add(phys)
        self.cancelled += 1

    def done(self, deliver_at: int, phys: int, size: int) -> None:
        """Record that (deliver_at, phys) was delivered (call after the delivery's put)."""
        self._append(self.bucket_of(deliver_at), encode_entry(deliver_at, phys, size, DONE))
        self._skip.add(phys)
        self._handed.pop(phys, None)
        self.delivered += 1

    def release(self, entries: list[tuple[int, int, int]]) -> None:
        """Give back entries handed out by :meth:`pop_due` that were not delivered (the
        delivery failed): they are due again at once."""
        for d, p, s in entries:
            if self._handed.pop(p, None) is None:
                continue
            self._skip.discard(p)
            if p not in self._heap_phys:
                heapq.heappush(self._heap, (d, p, s))
                self._heap_phys.add(p)
            # it was in memory before it was handed out, so the heap is its place; the loaded
            # bucket must reach its bucket: adds up to the loaded bucket go to the heap, later
            # ones only to their files. (When every bucket was exhausted, _loaded was reset to
            # None; setting it to the first released entry's bucket only let a later add of an
            # earlier due time, in a bucket between them, wait behind this entry.)
            b = self.bucket_of(d)
            if self._loaded is None or b > self._loaded:
                self._loaded = b

    def is_pending(self, deliver_at: int, phys: int) -> bool:
        """True when the bucket of ``deliver_at`` holds an ADD for ``phys`` and nothing ends it
        (reads the bucket file: for cancels, not the hot path)."""
        if phys in self._skip:
            return False
        arr = self._read_bucket(self.bucket_of(deliver_at))
        sel = arr[arr["phys"] == phys]
        return bool((sel["kind"] == ADD).any()) and not bool((sel["kind"] != ADD).any())

    # -- reading ---------------------------------------------------------------------------------
    def _load_next(self) -> bool:
        """Load the earliest bucket with pending entries; False when there is none."""
        while self._buckets:
            start = self._buckets[0]
            arr = self._read_bucket(start)
            ended = set(arr["phys"][arr["kind"] != ADD].tolist())
            adds = arr[arr["kind"] == ADD]
            if ended:
                adds = adds[~np.isin(adds["phys"], np.fromiter(ended, np.uint64, len(ended)))]
            # already in memory (heap) or handed out and awaiting done()
            held = self._heap_phys | self._handed.keys()
            if held and len(adds):
                adds = adds[~np.isin(adds["phys"], np.fromiter(held, np.uint64, len(held)))]
            if len(adds):
                _u, first = np.unique(adds["phys"], return_index=True)
                adds = adds[first]
                order = np.argsort(adds["due"], kind="stable")
                adds = adds[order]
                self._due = adds["due"].astype(np.int64)
                self._phys = adds["phys"].astype(np.uint64)
                self._size = adds["size"].astype(np.uint32)
                self._i = 0
                self._skip = ended | set(self._handed)
                self._loaded = start if self._loaded is None else max(start, self._loaded)
                self._in_arrays = start
                return True
            if not self._heap:
                self._drop_bucket(start)
                continue
            # nothing pending in the file; the heap still holds earlier entries
            self._loaded = start if self._loaded is None else max(start, self._loaded)
            self._due = np.empty(0, np.int64)
            self._i = 0
            self._in_arrays = start
            return True
        self._loaded = self._in_arrays = None
        return False

    def _drop_bucket(self, start: int) -> None:
        self._buckets.remove(start)
        with self._fd_lock:
            fd = self._fds.pop(start, None)
            if fd is not None:
                self._retire(start, fd)
        if start not in self._handed.values():
            self.pending_deletes.append(start)
        # else: its handed-out entries' DONE appends bring the bucket back; it is dropped
        # (and deleted) once a load finds every entry in it ended

    def delete_finished(self, finished: list[int]) -> None:
        """Unlink the files of buckets that were finished (``pending_deletes`` taken before
        the last :meth:`save_checkpoint`) and have not been written since."""
        for start in finished:
            if start in self._buckets or start in self._fds or start in self._buf:
                continue
            with contextlib.suppress(FileNotFoundError):
                self._path(start).unlink()

    def next_due(self) -> int | None:
        """The earliest pending due time, or None when nothing is pending."""
        while True:
            while self._i < len(self._due) and int(self._phys[self._i]) in self._skip:
                self._i += 1
            while self._heap and self._heap[0][1] in self._skip:
                _d, p, _s = heapq.heappop(self._heap)
                self._heap_phys.discard(p)
            a = int(self._due[self._i]) if self._i < len(self._due) else None
            h = self._heap[0][0] if self._heap else None
            if a is not None or h is not None:
                return min(x for x in (a, h) if x is not None)
            if self._in_arrays is not None and self._in_arrays in self._buckets:
                self._drop_bucket(self._in_arrays)
            if not self._load_next():
                return None

    def pop_due(self, now_ms: int, limit: int = 1024) -> list[tuple[int, int, int]]:
        """Up to ``limit`` pending entries due at or before ``now_ms``, earliest first, as
        (deliver_at, phys, size). They stay pending until :meth:`done`."""
        out: list[tuple[int, int, int]] = []
        while len(out) < limit:
            if out and self._i >= len(self._due) and not self._heap:
                break  # the next bucket loads on the next call, after these are done()
            nd = self.next_due()
            if nd is None or nd > now_ms:
                break
            if self._heap and self._heap[0][0] == nd:
                d, p, s = heapq.heappop(self._heap)
                self._heap_phys.discard(p)
            else:
                i = self._i
                d, p, s = int(self._due[i]), int(self._phys[i]), int(self._size[i])
                self._i = i + 1
            self._skip.add(p)  # handed out: not again (done() writes the durable mark)
            self._handed[p] = self.bucket_of(d)
            out.append((d, p, s))
        return out

    def reload(self) -> None:
        """Forget the in-memory entries and load the earliest bucket again from its file
        (after re-adding entries on recovery: the files, with their DONE marks, decide)."""
        self._loaded = self._in_arrays = None
        self._due = np.empty(0, np.int64)
        self._i = 0
        self._heap, self._heap_phys, self._skip = [], set(), set()
        self._handed.clear()
        self.next_due()

    def memory_bytes(self) -> int:
        """About how much memory the index holds (the loaded bucket's arrays, the heap, the
        skip and handed-out sets): what pending entries cost besides their files."""
        arrays = self._due.nbytes + self._phys.nbytes + self._size.nbytes
        heap = sys.getsizeof(self._heap) + len(self._heap) * 140  # tuple of 3 ints
        sets = sum(sys.getsizeof(x) for x in (self._heap_phys, self._skip, self._handed))
        sets += (len(self._heap_phys) + len(self._skip) + len(self._handed)) * 32  # the ints
        return arrays + heap + sets

    def pending_files(self) -> int:
        return len(self._buckets)

    def close(self) -> None:
        """fsync and close everything (blocking; at shutdown)."""
        with self._fd_lock:
            for start, fd in self._fds.items():
                self._retire(start, fd)
            self._fds.clear()
        self.sync()
