"""ConsumeQueue: the per (topic, queue id) index of fixed-size units into the CommitLog (ref ST3).

A queue is a directory ``<root>/<topic>/<queue_id>/`` of files, each ``units_per_file`` units
long, named by the 20-digit zero-padded *byte* offset of its first unit within the queue (unit
``n`` lives at byte ``20 * n``, as in RocketMQ). Files are allocated full size and zero-filled;
a unit whose ``size`` is 0 marks the end of written data, so a queue's units always form a
prefix of its last file. All integers are little-endian. One unit::

    +-----+------+------------------+---------------------------------------------------+
    | off | size | field            | meaning                                           |
    +-----+------+------------------+---------------------------------------------------+
    |   0 |    8 | phys_offset u64  | CommitLog offset of the *batch* holding the message|
    |   8 |    4 | size        u32  | total_size of that batch (0 = no unit here)       |
    |  12 |    8 | tag_hash    u64  | the message's tag hash (0 = no tag)               |
    +-----+------+------------------+---------------------------------------------------+

The logical queue offset of a message is its unit number. Batches are stored whole in the
CommitLog yet every message has its own queue offset (ref ST9): a batch of N messages at
CommitLog offset P of total size S is N consecutive units that all carry (P, S), each with its
own tag hash, taken in order from the batch's message index. So ``phys_offset`` never decreases
along a queue, runs of equal ``phys_offset`` have equal ``size``, and two different batches do
not overlap -- the invariants :meth:`ConsumeQueue.validate` checks.

``min_offset`` is not stored: on load it is the first unit of the first file, and the store
moves it forward with :meth:`ConsumeQueue.correct_min_offset` from the CommitLog's min offset
(RocketMQ's correctMinOffset). ``max_offset`` is found on load by a binary search for the first
empty unit of the last file.
"""

from __future__ import annotations

import mmap
import os
import shutil
import struct
import threading
from collections.abc import Callable

import numpy as np

from tidemq.protocol.batch.layout import index_hashes
from tidemq.protocol.errors import StoreClosedError, StoreError
from tidemq.protocol.record import INDEX_ENTRY, INDEX_ENTRY_SIZE, MAX_BATCH_SIZE
from tidemq.store.mapped_file import ALLOCATE_CHUNK, MappedFile, fsync_dir

__all__ = ["UNIT", "UNIT_SIZE", "UNIT_DTYPE", "ConsumeQueue", "ConsumeQueueTable"]

UNIT = struct.Struct("<QIQ")  # phys_offset, size, tag_hash
UNIT_SIZE = 20
assert UNIT.size == UNIT_SIZE

_SIZE_FIELD = struct.Struct("<I")  # the unit's size alone: 0 = end of written units
_SIZE_FIELD_OFFSET = 8

# The same unit as a numpy record, for building a batch's units and for zero-copy reads.
UNIT_DTYPE = np.dtype([("phys", "<u8"), ("size", "<u4"), ("tag", "<u8")])
assert UNIT_DTYPE.itemsize == UNIT_SIZE

# A batch's message index entry (protocol.record INDEX_ENTRY) as a numpy record.

_NAME_DIGITS = 20
_PHYS_LIMIT = 1 << 63  # CommitLog offsets are i64 in the batch header; anything above is garbage
_EMPTY = np.empty(0, UNIT_DTYPE)
_EMPTY.flags.writeable = False


class ConsumeQueue:
    """The units of one (topic, queue id).

    Threads: one writer -- the store's dispatch thread, under the store's put lock -- calls
    :meth:`append_batch`, :meth:`truncate_dirty`, :meth:`correct_min_offset`,
    :meth:`delete_expired_files`, :meth:`close` and :meth:`destroy`. :meth:`flush` may run on
    one other thread (the store's flush/checkpoint thread) concurrently with that writer. Any
    thread may call :meth:`get`, :meth:`units`, :meth:`offset_for_timestamp` and read
    ``min_offset``, ``max_offset`` and ``max_phys_offset`` concurrently: the writer fills
    units before it publishes the new ``max_offset``, and readers read ``max_offset`` before
    the units below it. :meth:`validate` is for load time, before readers exist.
    """

    UNIT_SIZE = UNIT_SIZE

    def __init__(
        self,
        root: str | os.PathLike[str],
        topic: str,
        queue_id: int,
        units_per_file: int = 300_000,
    ) -> None:
        _check_topic(topic)
        if queue_id < 0:
            raise ValueError(f"queue id must be >= 0, got {queue_id}")
        if units_per_file < 1:
            raise ValueError(f"units_per_file must be >= 1, got {units_per_file}")
        self.topic = topic
        self.queue_id = queue_id
        self.units_per_file = units_per_file
        self.file_size = units_per_file * UNIT_SIZE
        self.dir = os.path.join(os.fspath(root), topic, str(queue_id))
        # Replaced, never mutated, so a reader's snapshot stays consistent (copy-on-write).
        self._files: list[MappedFile] = []
        self._min_offset = 0
        self._max_offset = 0
        self._max_phys = -1
        self._load_problem: str | None = None
        self._dir_dirty = False
        self._closed = False
        # append_one's cache: (the _files list it was taken from, file, first unit, end of the
        # allocated units). Any change of _files replaces the list, which invalidates it.
        self._tail: tuple[list[MappedFile], MappedFile, int, int] | None = None
        self._load()

    # -- loading ---------------------------------------------------------------------------
    def _load(self) -> None:
        try:
            names = sorted(os.listdir(self.dir))
        except FileNotFoundError:
            return
        files: list[MappedFile] = []
        for name in names:
            path = os.path.join(self.dir, name)
            if len(name) != _NAME_DIGITS or not (name.isascii() and name.isdigit()):
                self._problem(f"{path}: unexpected file in consume queue directory")
                continue
            start = int(name)
            if start % self.file_size:
                self._problem(
                    f"{path}: name (byte offset {start}) is not a multiple of the file size "
                    f"{self.file_size} (units_per_file={self.units_per_file} changed?)"
                )
                break
            if files and start != (files[-1].base + self.units_per_file) * UNIT_SIZE:
                self._problem(f"{path}: gap in the file sequence before byte offset {start}")
                break
            try:
                files.append(MappedFile.open(path, self.file_size, base=start // UNIT_SIZE))
            except StoreError as exc:
                self._problem(exc.message)
                break
        # A file that was created but never written (crash right after a roll) carries nothing.
        while len(files) > 1 and not np.frombuffer(files[-1].mm, np.uint8).any():
            files.pop().delete()
            self._dir_dirty = True
        if not files:
            return
        last = files[-1]
        self._files = files
        self._max_offset = last.base + _count_prefix(last.mm, self.units_per_file)
        self._min_offset = files[0].base
        self._max_phys = self._end_phys_before(self._max_offset, files)

    def _problem(self, text: str) -> None:
        if self._load_problem is None:
            self._load_problem = text

    # -- reading ---------------------------------------------------------------------------
    @property
    def min_offset(self) -> int:
        return self._min_offset

    @property
    def max_offset(self) -> int:
        """The next queue offset to write (one past the last unit)."""
        return self._max_offset

    @property
    def max_phys_offset(self) -> int:
        """End (phys_offset + size) of the batch of the last unit; -1 when the files that
        remain hold no unit. Dispatch has reached this CommitLog offset."""
        return self._max_phys

    def get(self, offset: int) -> tuple[int, int, int] | None:
        """(phys_offset, size, tag_hash) of the unit at ``offset``, or None outside
        [min_offset, max_offset)."""
        mx = self._max_offset
        if offset >= mx or offset < self._min_offset:
            return None
        loc = self._locate(offset, self._files)
        if loc is None:
            return None
        mf, pos = loc
        try:
            unit = UNIT.unpack_from(mf.mm, pos)
        except ValueError:  # closed under us by close(): behave as out of range
            return None
        return unit if unit[1] else None

    def units(self, offset: int, max_count: int) -> np.ndarray:
        """Up to ``max_count`` units from ``offset`` as a read-only structured array (fields
        ``phys``, ``size``, ``tag``), never crossing a file end -- the caller loops.

        The array is a zero-copy view of the mapping: it stays valid after the file is
        deleted, and shows the rewrite if recovery truncates or re-dispatches those units.
        Empty if ``offset`` is outside [min_offset, max_offset).
        """
        mx = self._max_offset
        if max_count <= 0 or offset >= mx or offset < self._min_offset:
            return _EMPTY
        loc = self._locate(offset, self._files)
        if loc is None:
            return _EMPTY
        mf, pos = loc
        count = min(max_count, mx - offset, self.units_per_file - pos // UNIT_SIZE)
        try:
            arr = np.frombuffer(mf.mm, UNIT_DTYPE, count=count, offset=pos)
        except ValueError:
            return _EMPTY
        arr.flags.writeable = False
        return arr

    def offset_for_timestamp(self, ts_ms: int, store_ts_of: Callable[[int], int]) -> int:
        """First queue offset whose message has store time >= ``ts_ms`` (``max_offset`` if
        none), by binary search over [min_offset, max_offset); ``store_ts_of(phys_offset)``
        reads a batch's store time from the CommitLog. Store times grow with the CommitLog
        offset, which is what makes the search valid (RocketMQ's getOffsetInQueueByTime)."""
        lo, hi = self._min_offset, self._max_offset
        while lo < hi:
            mid = (lo + hi) // 2
            unit = self.get(mid)
            if unit is None:  # retention moved min_offset past mid meanwhile
                lo = mid + 1
                continue
            if store_ts_of(unit[0]) < ts_ms:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _locate(self, offset: int, files: list[MappedFile]) -> tuple[MappedFile, int] | None:
        if not files:
            return None
        k = (offset - files[0].base) // self.units_per_file
        if k < 0 or k >= len(files):
            return None
        mf = files[k]
        return mf, (offset - mf.base) * UNIT_SIZE

    def _end_phys_before(self, offset: int, files: list[MappedFile]) -> int:
        loc = self._locate(offset - 1, files) if files and offset > files[0].base else None
        if loc is None:
            return -1
        phys: int
        size: int
        phys, size, _tag = UNIT.unpack_from(loc[0].mm, loc[1])
        return phys + size

    # -- writing ---------------------------------------------------------------------------
    def append_batch(
        self, queue_offset: int, phys_offset: int, size: int, index_view: bytes | memoryview
    ) -> None:
        """Write the units of one batch: ``count = len(index_view) // 12`` units from
        ``queue_offset``, all (phys_offset, size), tag hashes from the batch's message index.

        ``queue_offset == max_offset`` appends. A lower ``queue_offset`` is re-dispatch
        during recovery and overwrites those units (idempotent; units in files already
        deleted by retention are skipped). A higher one is a gap: StoreError.
        """
        if self._closed:
            raise StoreClosedError(f"consume queue {self.topic}/{self.queue_id} is closed")
        view = memoryview(index_view).cast("B")
        n, rest = divmod(view.nbytes, INDEX_ENTRY_SIZE)
        if n == 0 or rest:
            raise ValueError(
                f"index_view must hold whole {INDEX_ENTRY_SIZE}-byte entries, got {view.nbytes}"
            )
        if not 0 < size <= MAX_BATCH_SIZE or not 0 <= phys_offset < _PHYS_LIMIT:
            raise ValueError(f"bad batch position: phys_offset {phys_offset}, size {size}")
        mx = self._max_offset
        if queue_offset > mx:
            raise StoreError(
                f"consume queue {self.topic}/{self.queue_id}: append at queue offset "
                f"{queue_offset} would leave a gap after max offset {mx} (offsets are assigned "
                f"sequentially, so the dispatcher or the queue is out of step)"
            )
        if queue_offset < 0:
            raise ValueError(f"queue offset must be >= 0, got {queue_offset}")
        if queue_offset == mx and phys_offset < self._max_phys:
            raise StoreError(
                f"consume queue {self.topic}/{self.queue_id}: batch at CommitLog offset "
                f"{phys_offset} appended after one ending at {self._max_phys}; units must "
                f"follow CommitLog order"
            )
        end = queue_offset + n
        if n == 1:
            # A single message is the common case; struct beats building a numpy array.
            self._write_one(queue_offset, phys_offset, size, INDEX_ENTRY.unpack_from(view)[0])
        else:
            units = np.empty(n, UNIT_DTYPE)
            units["phys"] = phys_offset
            units["size"] = size
            units["tag"] = index_hashes(view)
            self._write_units(queue_offset, units)
        if end >= mx:
            self._max_phys = phys_offset + size
            self._max_offset = end  # publish last: readers trust every unit below it

    def append_one(self, queue_offset: int, phys_offset: int, size: int, tag: int) -> None:
        """:meth:`append_batch` of a one-message batch (the store's put path, once per stored
        single message): a plain append writes its unit into the cached tail file with one
        struct call; anything else -- a re-dispatch, a gap, a closed queue, a file or
        allocation boundary -- takes the general path with all its checks."""
        t = self._tail
        if (
            t is None
            or t[0] is not self._files
            or not t[2] <= queue_offset < t[3]
            or queue_offset != self._max_offset
            or phys_offset < self._max_phys
            or self._closed
        ):
            self.append_batch(queue_offset, phys_offset, size, INDEX_ENTRY.pack(tag, 0))
            self._cache_tail()
            return
        mf = t[1]
        UNIT.pack_into(mf.mm, (queue_offset - t[2]) * UNIT_SIZE, phys_offset, size, tag)
        mf.dirty = True
        self._max_phys = phys_offset + size
        self._max_offset = queue_offset + 1  # publish last, as append_batch does

    def start_at(self, queue_offset: int) -> None:
        """Make an empty queue begin at ``queue_offset``: a store whose CommitLog starts after
        offset 0 (a slave that copied from the master's oldest retained segment, or indexes
        rebuilt after retention) first sees this queue's batches at a queue offset above 0.
        Units before it in its file are written as blanks (RocketMQ's fillPreBlank): phys 0,
        size 1 -- below any real CommitLog start, so readers skip them and the load-time
        ``correct_min_offset`` moves ``min_offset`` past them."""
        if self._max_offset or self._files or queue_offset <= 0:
            return
        if self._closed:
            raise StoreClosedError(f"consume queue {self.topic}/{self.queue_id} is closed")
        base = (queue_offset // self.units_per_file) * self.units_per_file
        mf = self._new_file(base)
        if queue_offset > base:
            n = queue_offset - base
            mf.ensure_allocated(n * UNIT_SIZE)
            blank = np.zeros(n, UNIT_DTYPE)
            blank["size"] = 1
            mf.mm[: n * UNIT_SIZE] = blank.tobytes()
            mf.dirty = True
        self._max_phys = 1 if queue_offset > base else -1
        self._min_offset = queue_offset
        self._max_offset = queue_offset
        self._tail = None

    def make_room(self, queue_offset: int, count: int) -> None:
        """Create the files and reserve the disk blocks that units [queue_offset, queue_offset
        + count) will need, so that appending them cannot fail for want of space. The store
        calls this before it writes a batch: on a full disk the put fails (DiskFullError)
        with nothing written. Cheap when the cached tail already has room."""
        t = self._tail
        if (
            t is not None
            and t[0] is self._files
            and t[2] <= queue_offset
            and queue_offset + count <= t[3]
        ):
            return
        if self._closed:
            raise StoreClosedError(f"consume queue {self.topic}/{self.queue_id} is closed")
        o, end = queue_offset, queue_offset + count
        while o < end:
            mf = self._file_for_write(o)
            if mf is None:  # below the first file (deleted by retention): nothing to write
                o = self._files[0].base
                continue
            upto = min(end, mf.base + self.units_per_file)
            mf.ensure_allocated((upto - mf.base) * UNIT_SIZE)
            o = upto
        self._cache_tail()

    def _cache_tail(self) -> None:
        files = self._files
        if self._closed or not files:
            self._tail = None
            return
        mf = files[-1]
        end = mf.base + min(self.units_per_file, mf.allocated // UNIT_SIZE)
        self._tail = (files, mf, mf.base, end)

    def _write_one(self, offset: int, phys: int, size: int, tag: int) -> None:
        mf = self._file_for_write(offset)
        if mf is None:
            return
        pos = (offset - mf.base) * UNIT_SIZE
        mf.ensure_allocated(pos + UNIT_SIZE)
        UNIT.pack_into(mf.mm, pos, phys, size, tag)
        mf.dirty = True

    def _write_units(self, offset: int, units: np.ndarray) -> None:
        upf = self.units_per_file
        i, n = 0, len(units)
        files = self._files
        if files and offset < files[0].base:  # head already deleted by retention
            i = files[0].base - offset
        while i < n:
            o = offset + i
            mf = self._file_for_write(o)
            assert mf is not None
            first = o - mf.base
            k = min(n - i, upf - first)
            mf.ensure_allocated((first + k) * UNIT_SIZE)
            # an ndarray is a buffer (numpy declares it so only for Python 3.12+)
            mf.mm[first * UNIT_SIZE : (first + k) * UNIT_SIZE] = units[i : i + k]  # type: ignore[call-overload]
            mf.dirty = True
            i += k

    def _file_for_write(self, offset: int) -> MappedFile | None:
        files = self._files
        if not files:
            return self._new_file((offset // self.units_per_file) * self.units_per_file)
        k = (offset - files[0].base) // self.units_per_file
        if k < 0:
            return None
        if k < len(files):
            return files[k]
        # offsets are contiguous, so a write never lands more than one file past the last
        return self._new_file(files[-1].base + self.units_per_file)

    def _new_file(self, base: int) -> MappedFile:
        os.makedirs(self.dir, exist_ok=True)
        path = os.path.join(self.dir, f"{base * UNIT_SIZE:0{_NAME_DIGITS}d}")
        mf = MappedFile.create(path, self.file_size, base=base, allocate=ALLOCATE_CHUNK)
        self._files = [*self._files, mf]
        self._dir_dirty = True
        return mf

    # -- recovery and retention ------------------------------------------------------------
    def truncate_dirty(self, max_phys: int) -> None:
        """Drop every unit whose phys_offset >= ``max_phys`` (the CommitLog's recovered end).

        Units are zeroed and ``max_offset`` moves back; files left wholly empty are deleted,
        except the first, which is kept (zeroed) so the queue remembers where it starts.
        """
        files = self._files
        if not files:
            return
        max_phys = max(max_phys, 0)
        mx = self._max_offset
        upf = self.units_per_file
        doomed: list[MappedFile] = []
        new_max = files[0].base
        cut_file, cut, used = files[0], 0, 0
        for idx in range(len(files) - 1, -1, -1):
            mf = files[idx]
            used = min(max(mx - mf.base, 0), upf)
            phys = np.frombuffer(mf.mm, UNIT_DTYPE, count=used)["phys"]
            cut = int(np.searchsorted(phys, max_phys, side="left")) if used else 0
            if cut == 0 and idx > 0:
                doomed.append(mf)
                continue
            cut_file, new_max = mf, mf.base + cut
            break
        if new_max == mx and not doomed:
            return
        keep = files[: len(files) - len(doomed)]
        self._max_offset = new_max  # publish first: readers stop looking at what goes away
        self._min_offset = min(self._min_offset, new_max)
        self._max_phys = self._end_phys_before(new_max, keep)
        self._files = keep
        if used > cut:
            np.frombuffer(cut_file.mm, np.uint8)[cut * UNIT_SIZE : used * UNIT_SIZE] = 0
            cut_file.dirty = True
        for mf in doomed:
            mf.delete()
            self._dir_dirty = True

    def correct_min_offset(self, min_phys: int) -> None:
        """Move ``min_offset`` to the first unit whose phys_offset >= ``min_phys`` (the
        CommitLog's min offset after retention); ``max_offset`` if there is none."""
        files = self._files
        mx = self._max_offset
        result = mx
        for mf in files:
            used = min(max(mx - mf.base, 0), self.units_per_file)
            if not used:
                break
            phys = np.frombuffer(mf.mm, UNIT_DTYPE, count=used)["phys"]
            if int(phys[-1]) < min_phys:
                continue
            result = mf.base + int(np.searchsorted(phys, max(min_phys, 0), side="left"))
            break
        self._min_offset = max(result, files[0].base) if files else mx

    def delete_expired_files(self, min_phys: int) -> int:
        """Delete leading files all of whose units point below ``min_phys``; never the file
        holding ``max_offset - 1``. Returns how many were deleted, then corrects min_offset."""
        files = self._files
        mx = self._max_offset
        upf = self.units_per_file
        n = 0
        for mf in files[:-1]:
            if mf.base + upf > mx - 1:  # holds the last unit
                break
            last_phys = UNIT.unpack_from(mf.mm, (upf - 1) * UNIT_SIZE)[0]
            if last_phys >= min_phys:
                break
            n += 1
        if n:
            keep = files[n:]
            self._min_offset = max(self._min_offset, keep[0].base)
            self._files = keep
            for mf in files[:n]:
                mf.delete()
            self._dir_dirty = True
        self.correct_min_offset(min_phys)
        return n

    # -- integrity -------------------------------------------------------------------------
    def validate(self, max_phys: int) -> str | None:
        """Check the files against the unit invariants; a human-readable problem naming the
        file and byte position, or None if the queue is sound.

        ``max_phys`` is the CommitLog's end: a unit whose batch starts below it must also end
        at or below it (units starting at or past it are merely dirty; truncate_dirty drops
        them). Reads every unit, so call it at load, after an unclean shutdown. A queue that
        fails should be destroyed and rebuilt by re-dispatch from the CommitLog.
        """
        if self._load_problem is not None:
            return self._load_problem
        files = self._files
        mx = self._max_offset
        upf = self.units_per_file
        prev: np.ndarray | None = None
        for mf in files:
            used = min(max(mx - mf.base, 0), upf)
            u = np.frombuffer(mf.mm, UNIT_DTYPE, count=used)
            problem = _check_units(u, prev, max_phys)
            if problem is not None:
                j, what = problem
                return f"{mf.path}: unit {mf.base + j} at byte {j * UNIT_SIZE}: {what}"
            if used:
                prev = u[-1:]
            if used < upf:
                tail = np.frombuffer(mf.mm, np.uint8)[used * UNIT_SIZE :]
                nz = np.flatnonzero(tail)
                if nz.size:
                    pos = used * UNIT_SIZE + int(nz[0])
                    return (
                        f"{mf.path}: nonzero byte at byte {pos} after the end of written "
                        f"units (byte {used * UNIT_SIZE})"
                    )
        return None

    # -- lifecycle -------------------------------------------------------------------------
    def flush(self) -> None:
        """fdatasync every file written since the last flush (and the directory if files
        were created or deleted)."""
        files = self._files
        for i, mf in enumerate(files):
            if mf.dirty:
                mf.flush()
                if i < len(files) - 1:  # written to its end: leave the process's memory
                    mf.drop_resident(0, mf.size)
        if self._dir_dirty:
            self._dir_dirty = False
            fsync_dir(self.dir)

    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        self._closed = True
        files, self._files = self._files, []
        for mf in files:
            mf.close()

    def destroy(self) -> None:
        """Close and remove the queue's directory (and the topic's, if that leaves it empty)."""
        self._closed = True
        files, self._files = self._files, []
        for mf in files:
            mf.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(self.dir))
        except OSError:
            pass
        self._min_offset = self._max_offset = 0
        self._max_phys = -1

    def __repr__(self) -> str:
        return (
            f"ConsumeQueue({self.topic!r}, {self.queue_id}, min={self._min_offset}, "
            f"max={self._max_offset}, files={len(self._files)})"
        )


def _count_prefix(mm: mmap.mmap | memoryview | bytes, units_per_file: int) -> int:
    """Number of units before the first empty one (binary search: units are a prefix)."""
    lo, hi = 0, units_per_file
    while lo < hi:
        mid = (lo + hi) // 2
        if _SIZE_FIELD.unpack_from(mm, mid * UNIT_SIZE + _SIZE_FIELD_OFFSET)[0]:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _check_units(
    u: np.ndarray, prev: np.ndarray | None, max_phys: int
) -> tuple[int, str] | None:
    """First unit of ``u`` breaking an invariant, as (index in u, what), given the unit
    before it (``prev``, possibly in the previous file)."""
    if not len(u):
        return None
    phys = u["phys"]
    size = u["size"].astype(np.uint64)
    checks: list[tuple[np.ndarray, Callable[[int], str]]] = [
        (size == 0, lambda j: "empty unit (size 0) inside the written range"),
        (size > MAX_BATCH_SIZE, lambda j: f"size {int(size[j])} is over the batch limit"),
        (phys >= _PHYS_LIMIT, lambda j: f"phys_offset {int(phys[j])} is out of range"),
    ]
    bad = np.zeros(len(u), bool)
    for mask, _ in checks:
        bad |= mask
    # Order checks need sane numbers (no u64 overflow), so run them on clamped copies.
    p = np.where(bad, 0, phys)
    s = np.where(bad, 0, size)
    mp = np.uint64(max(max_phys, 0))
    straddle = (p < mp) & (p + s > mp)
    checks.append(
        (straddle, lambda j: f"batch [{int(p[j])}, {int(p[j] + s[j])}) runs past the "
         f"CommitLog end {max_phys}")
    )
    if prev is not None:
        pp = np.concatenate([prev["phys"], p])
        ss = np.concatenate([prev["size"].astype(np.uint64), s])
    else:
        pp, ss = p, s
    shift = len(pp) - len(p) - 1  # pp[j + shift] is the unit before u[j]
    lower = np.zeros(len(u), bool)
    overlap = np.zeros(len(u), bool)
    resized = np.zeros(len(u), bool)
    if len(pp) > 1:
        first = 0 if prev is not None else 1
        same = pp[1:] == pp[:-1]
        lower[first:] = pp[1:] < pp[:-1]
        overlap[first:] = ~same & (pp[1:] >= pp[:-1]) & (pp[1:] < pp[:-1] + ss[:-1])
        resized[first:] = same & (ss[1:] != ss[:-1])
    checks += [
        (lower, lambda j: f"phys_offset {int(p[j])} is below the previous {int(pp[j + shift])}"),
        (
            overlap,
            lambda j: f"batch at {int(p[j])} overlaps the previous batch "
            f"[{int(pp[j + shift])}, {int(pp[j + shift] + ss[j + shift])})",
        ),
        (resized, lambda j: f"size {int(s[j])} differs from the previous unit of its batch"),
    ]
    firsts = [(int(np.argmax(m)), i) for i, (m, _) in enumerate(checks) if m.any()]
    if not firsts:
        return None
    j, i = min(firsts)
    return j, checks[i][1](j)


def _check_topic(topic: str) -> None:
    # The topic becomes a directory name: refuse anything that would escape the root.
    if not topic or topic in (".", "..") or "/" in topic or "\0" in topic or os.sep in topic:
        raise ValueError(f"topic {topic!r} cannot be used as a directory name")


class ConsumeQueueTable:
    """All consume queues under one root, created on first use.

    Threads: :meth:`get_or_create`, :meth:`find` and :meth:`all` may be called from any
    thread (creation and snapshots take a lock; :meth:`find` does not). :meth:`flush_all`
    may run on the flush thread. :meth:`load`, :meth:`validate_all`, :meth:`close_all`,
    :meth:`delete_topic` and :meth:`destroy_queue` belong to the writer side (recovery, or
    admin under the store's put lock). Each queue keeps its own contract (:class:`ConsumeQueue`).
    """

    def __init__(self, root: str | os.PathLike[str], units_per_file: int = 300_000) -> None:
        self.root = os.fspath(root)
        self.units_per_file = units_per_file
        self._queues: dict[tuple[str, int], ConsumeQueue] = {}
        self._lock = threading.Lock()

    def load(self) -> list[tuple[str, int]]:
        """Open every queue found on disk; returns their (topic, queue id) keys. Directories
        that are not ``<topic>/<decimal queue id>`` are left alone."""
        found: list[tuple[str, int]] = []
        try:
            topics = sorted(os.listdir(self.root))
        except FileNotFoundError:
            return found
        with self._lock:
            for topic in topics:
                tdir = os.path.join(self.root, topic)
                if topic.startswith(".") or not os.path.isdir(tdir):
                    continue
                for name in sorted(os.listdir(tdir)):
                    if not (name.isascii() and name.isdigit()):
                        continue
                    if not os.path.isdir(os.path.join(tdir, name)):
                        continue
                    key = (topic, int(name))
                    if key not in self._queues:
                        self._queues[key] = ConsumeQueue(
                            self.root, topic, key[1], self.units_per_file
                        )
                    found.append(key)
        return found

    def get_or_create(self, topic: str, queue_id: int) -> ConsumeQueue:
        cq = self._queues.get((topic, queue_id))
        if cq is not None:
            return cq
        with self._lock:
            cq = self._queues.get((topic, queue_id))
            if cq is None:
                cq = ConsumeQueue(self.root, topic, queue_id, self.units_per_file)
                self._queues[(topic, queue_id)] = cq
            return cq

    def find(self, topic: str, queue_id: int) -> ConsumeQueue | None:
        return self._queues.get((topic, queue_id))

    def all(self) -> list[ConsumeQueue]:
        with self._lock:  # a creation elsewhere must not resize the dict under the copy
            return list(self._queues.values())

    def validate_all(self, max_phys: int) -> dict[tuple[str, int], str]:
        """(topic, queue id) -> problem for every queue failing :meth:`ConsumeQueue.validate`."""
        out = {}
        with self._lock:
            items = list(self._queues.items())
        for key, cq in items:
            problem = cq.validate(max_phys)
            if problem is not None:
                out[key] = problem
        return out

    def destroy_queue(self, topic: str, queue_id: int) -> None:
        """Remove one queue from disk and from the table (a rebuild starts from scratch)."""
        with self._lock:
            cq = self._queues.pop((topic, queue_id), None)
        if cq is not None:
            cq.destroy()
        else:
            shutil.rmtree(os.path.join(self.root, topic, str(queue_id)), ignore_errors=True)

    def flush_all(self) -> None:
        for cq in self.all():
            cq.flush()

    def close_all(self) -> None:
        with self._lock:
            queues = list(self._queues.values())
            self._queues.clear()
        for cq in queues:
            cq.close()

    def delete_topic(self, topic: str) -> int:
        """Destroy every queue of ``topic``; returns how many were removed."""
        _check_topic(topic)
        with self._lock:
            keys = [k for k in self._queues if k[0] == topic]
            queues = [self._queues.pop(k) for k in keys]
        for cq in queues:
            cq.destroy()
        shutil.rmtree(os.path.join(self.root, topic), ignore_errors=True)
        return len(queues)
