"""IndexFile: RocketMQ's persistent hash index from a key to CommitLog offsets (ref ST4).

Files live in ``<root>/`` and are named by their creation time ``yyyyMMddHHmmssSSS`` (UTC, so
names sort in time order; it is the first entry's store time, bumped by 1 ms when needed so
that every name is unique and later than the one before). A file is a header, a hash table of
slots and an append-only array of entries, allocated full size up front. All integers are
little-endian::

    +-----------------------------------------------------------------------------------+
    | HEADER (40 bytes)                                                                 |
    +------+------+------------------------+--------------------------------------------+
    |  off | size | field                  | meaning                                    |
    +------+------+------------------------+--------------------------------------------+
    |    0 |    8 | begin_ts         i64   | store time (ms) of the first entry         |
    |    8 |    8 | end_ts           i64   | largest store time (ms) of any entry       |
    |   16 |    8 | begin_phys       i64   | CommitLog offset of the first entry        |
    |   24 |    8 | end_phys         i64   | CommitLog offset of the last entry         |
    |   32 |    4 | hash_slot_count  i32   | slots that are not empty                   |
    |   36 |    4 | index_count      i32   | entries written (entry numbers 1..count)   |
    +------+------+------------------------+--------------------------------------------+
    | SLOTS: ``slots`` x 4 bytes from byte 40                                           |
    |   head u32 -- entry number of the newest entry whose key_hash % slots is this    |
    |               slot's number; 0 = empty                                           |
    +-----------------------------------------------------------------------------------+
    | ENTRIES: ``max_entries`` x 20 bytes from byte E = 40 + 4 * slots                  |
    |   entry number i (1-based; 0 is reserved for "none") is at E + 20 * (i - 1)       |
    +------+------+------------------------+--------------------------------------------+
    |  +0  |    4 | key_hash         u32   | crc32c(key.encode())                       |
    |  +4  |    8 | phys_offset      u64   | CommitLog offset of the batch with the key |
    |  +12 |    4 | time_diff        i32   | store time - begin_ts, in ms (>= 0)        |
    |  +16 |    4 | prev_index       u32   | next older entry of the same slot, 0 = end |
    +------+------+------------------------+--------------------------------------------+

``time_diff`` is in milliseconds (RocketMQ keeps seconds): a file rolls over to a new one when
it is full *or* when an entry's store time is more than 2**31 - 1 ms (24.8 days) after
``begin_ts``, so the difference always fits. A store time before ``begin_ts`` (clock stepped
back) is recorded as ``time_diff`` 0, as RocketMQ does.

The geometry (``slots``, ``max_entries``) is configuration, not stored -- with one twist, so
that preallocation never dominates a small disk: a new file takes at most
``max_free_ratio`` (5 %) of the disk's free space at its creation. RocketMQ's geometry (5,000,000
slots, 20,000,000 entries: ~420 MB, reserved at once) is kept when ~8.4 GB or more are free;
below that both numbers are halved (k times, the smallest k that fits, never below
``MIN_SCALED_ENTRIES`` entries). The file's length says which k it was made with
(:func:`geometry_of_length`); a file whose length matches neither the configured geometry nor a
halving of it is reported and dropped (rebuilt from the CommitLog).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import struct
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta

import crc32c as _crc32c_mod
import numpy as np

from tidemq.protocol.errors import StoreError
from tidemq.store.mapped_file import MappedFile, fsync_dir

__all__ = ["HEADER", "SLOT", "ENTRY", "IndexFile", "IndexService", "key_hash"]

HEADER = struct.Struct("<qqqqii")  # begin_ts, end_ts, begin_phys, end_phys, slots used, count
HEADER_SIZE = 40
assert HEADER.size == HEADER_SIZE

SLOT = struct.Struct("<I")  # head entry number
SLOT_SIZE = 4
assert SLOT.size == SLOT_SIZE

ENTRY = struct.Struct("<IQiI")  # key_hash, phys_offset, time_diff, prev_index
ENTRY_SIZE = 20
assert ENTRY.size == ENTRY_SIZE

_ENTRY_DTYPE = np.dtype([("hash", "<u4"), ("phys", "<u8"), ("diff", "<i4"), ("prev", "<u4")])
assert _ENTRY_DTYPE.itemsize == ENTRY_SIZE

_I32_MAX = 2**31 - 1
_NAME_RE = re.compile(r"^\d{17}$")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_NAME_MS_MAX = 253_402_300_799_999  # 9999-12-31 23:59:59.999 UTC, the last 17-digit name

_crc32c = _crc32c_mod.crc32c
log = logging.getLogger(__name__)


#: Disk-size scaling never makes an index file hold fewer entries than this.
MIN_SCALED_ENTRIES = 4096


def scaled_geometry(slots: int, max_entries: int, k: int) -> tuple[int, int]:
    """The configured geometry halved ``k`` times."""
    return max(1, slots >> k), max(1, max_entries >> k)


def geometry_for_space(
    slots: int, max_entries: int, free_bytes: int, max_free_ratio: float
) -> tuple[int, int]:
    """The geometry of a new index file: the configured one halved the fewest times so that
    the file is at most ``max_free_ratio * free_bytes`` bytes (or holds MIN_SCALED_ENTRIES
    entries, if even that is more)."""
    budget = max_free_ratio * free_bytes
    k = 0
    while True:
        s, e = scaled_geometry(slots, max_entries, k)
        if (IndexFile.file_size(s, e) <= budget or (max_entries >> (k + 1)) < MIN_SCALED_ENTRIES
                or (s, e) == (1, 1)):
            return s, e
        k += 1


def geometry_of_length(length: int, slots: int, max_entries: int) -> tuple[int, int] | None:
    """The geometry (the configured one halved k >= 0 times) of an index file ``length`` bytes
    long; None when no halving matches."""
    for k in range(64):
        s, e = scaled_geometry(slots, max_entries, k)
        size = IndexFile.file_size(s, e)
        if size == length:
            return s, e
        if size < length or (s, e) == (1, 1):
            return None
    return None


def key_hash(key: str) -> int:
    """The 32-bit hash an index entry keeps for ``key``."""
    return _crc32c(key.encode())


def _name_for(ms: int) -> str:
    ms = min(max(ms, 0), _NAME_MS_MAX)
    dt = _EPOCH + timedelta(milliseconds=ms)
    return dt.strftime("%Y%m%d%H%M%S") + f"{ms % 1000:03d}"


def _ms_of(name: str) -> int:
    dt = datetime.strptime(name[:14], "%Y%m%d%H%M%S").replace(tzinfo=UTC)
    return (dt - _EPOCH) // timedelta(milliseconds=1) + int(name[14:])


#: Newest entries of an index file kept mapped in after a flush (8 MiB of them).
_RESIDENT_ENTRIES = (8 << 20) // ENTRY_SIZE


class IndexFile:
    """One index file. Only :class:`IndexService` uses it and it follows that class's thread
    contract: one writer; readers walk chains concurrently. A put writes the entry before the
    slot head that points at it, so a reader following a head always finds a whole entry."""

    __slots__ = (
        "mf", "name", "name_ms", "slots", "max_entries", "entries_start", "begin_ts", "end_ts",
        "begin_phys", "end_phys", "hash_slot_count", "index_count",
    )
    begin_ts: int
    end_ts: int
    begin_phys: int
    end_phys: int
    hash_slot_count: int
    index_count: int

    def __init__(self, mf: MappedFile, slots: int, max_entries: int) -> None:
        self.mf = mf
        self.name = os.path.basename(mf.path)
        self.name_ms = _ms_of(self.name)
        self.slots = slots
        self.max_entries = max_entries
        self.entries_start = HEADER_SIZE + slots * SLOT_SIZE
        (
            self.begin_ts, self.end_ts, self.begin_phys, self.end_phys, self.hash_slot_count,
            self.index_count,
        ) = HEADER.unpack_from(mf.mm, 0)

    @staticmethod
    def file_size(slots: int, max_entries: int) -> int:
        return HEADER_SIZE + slots * SLOT_SIZE + max_entries * ENTRY_SIZE

    @classmethod
    def create(cls, path: str, slots: int, max_entries: int) -> IndexFile:
        return cls(MappedFile.create(path, cls.file_size(slots, max_entries)), slots, max_entries)

    @classmethod
    def load(cls, path: str, slots: int, max_entries: int) -> IndexFile:
        """Open a file and check its length and header; StoreError naming the file and byte
        position if they are not sound. :meth:`check_body` checks the rest."""
        f = cls(MappedFile.open(path, cls.file_size(slots, max_entries)), slots, max_entries)
        problem = f._check_header()
        if problem is not None:
            f.mf.close()
            raise StoreError(f"{path}: {problem}", code="CORRUPT_FILE")
        return f

    def _check_header(self) -> str | None:
        n = self.index_count
        if not 0 <= n <= self.max_entries:
            return f"index_count {n} at byte 36 is outside 0..{self.max_entries}"
        if not 0 <= self.hash_slot_count <= min(n, self.slots):
            return f"hash_slot_count {self.hash_slot_count} at byte 32 is outside 0..{n}"
        if n and not 0 <= self.begin_phys <= self.end_phys:
            return f"begin_phys {self.begin_phys} / end_phys {self.end_phys} at byte 16 disagree"
        if n and not 0 <= self.end_ts - self.begin_ts <= _I32_MAX:
            return f"begin_ts {self.begin_ts} / end_ts {self.end_ts} at byte 0 disagree"
        return None

    def check_body(self) -> str | None:
        """Every slot and entry against the header and the chain rules; a problem naming the
        byte position, or None. Reads the whole file."""
        n, mm = self.index_count, self.mf.mm
        heads = np.frombuffer(mm, "<u4", count=self.slots, offset=HEADER_SIZE)
        e = np.frombuffer(mm, _ENTRY_DTYPE, count=n, offset=self.entries_start)
        h_slot = (e["hash"] % self.slots).astype(np.int64)
        nonzero = np.flatnonzero(heads)
        if nonzero.size != self.hash_slot_count:
            return (
                f"hash_slot_count {self.hash_slot_count} at byte 32, but {nonzero.size} slots "
                f"are in use"
            )
        over = np.flatnonzero(heads > n)
        if over.size:
            s = int(over[0])
            return f"slot {s} at byte {HEADER_SIZE + 4 * s} points at entry {heads[s]} > {n}"
        wrong = nonzero[h_slot[heads[nonzero].astype(np.int64) - 1] != nonzero]
        if wrong.size:
            s = int(wrong[0])
            return f"slot {s} at byte {HEADER_SIZE + 4 * s} heads an entry of another slot"
        if not n:
            return None
        nums = np.arange(1, n + 1, dtype=np.int64)
        prev = e["prev"].astype(np.int64)
        phys = e["phys"]
        has_prev = prev > 0
        checks = [
            (prev >= nums, "prev_index does not point at an older entry"),
            (
                has_prev & (h_slot[np.clip(prev, 1, n) - 1] != h_slot),
                "prev_index leaves the slot",
            ),
            (e["diff"] < 0, "negative time_diff"),
            (e["diff"].astype(np.int64) > self.end_ts - self.begin_ts, "time_diff past end_ts"),
            ((phys < self.begin_phys) | (phys > self.end_phys), "phys_offset outside the header's"),
            (np.r_[False, phys[1:] < phys[:-1]], "phys_offset lower than the entry before"),
        ]
        if int(phys[0]) != self.begin_phys or int(phys[-1]) != self.end_phys:
            return "first/last entry phys_offset disagree with begin_phys/end_phys at byte 16"
        firsts = [(int(np.argmax(m)), what) for m, what in checks if m.any()]
        if not firsts:
            return None
        j, what = min(firsts)
        return f"entry {j + 1} at byte {self.entries_start + ENTRY_SIZE * j}: {what}"

    # -- writing (writer thread) -----------------------------------------------------------
    def fits(self, ts: int) -> bool:
        return self.index_count < self.max_entries and (
            self.index_count == 0 or ts - self.begin_ts <= _I32_MAX
        )

    @property
    def room(self) -> int:
        return self.max_entries - self.index_count

    def add(self, hashes: list[int], phys: int, ts: int) -> None:
        """Append one entry per hash (at least one), all pointing at ``phys``; the caller
        checked room."""
        self.add_run(hashes, [phys] * len(hashes), ts)

    def add_run(self, hashes: list[int], physs: list[int], ts: int) -> None:
        """:meth:`add_one` of each (hash, phys) in turn (``physs`` ascending, at least one),
        the header written once at the end: a SEND_MULTI_QUEUE frame's id-index entries, one
        per batch (issue 17), and a batch's keys (:meth:`add`). The caller checked room for
        all of them."""
        mm = self.mf.mm
        n = self.index_count
        if n == 0:
            self.begin_ts = self.end_ts = ts
            self.begin_phys = physs[0]
        diff = max(ts - self.begin_ts, 0)
        slots, used = self.slots, self.hash_slot_count
        es = self.entries_start - ENTRY_SIZE  # entry numbers are 1-based
        unpack_slot, pack_slot, pack_entry = SLOT.unpack_from, SLOT.pack_into, ENTRY.pack_into
        for h, phys in zip(hashes, physs, strict=True):
            spos = HEADER_SIZE + (h % slots) * SLOT_SIZE
            head = unpack_slot(mm, spos)[0]
            n += 1
            pack_entry(mm, es + n * ENTRY_SIZE, h, phys, diff, head)
            pack_slot(mm, spos, n)
            if not head:
                used += 1
        self.end_ts = max(self.end_ts, ts)
        self.end_phys = physs[-1]
        self.hash_slot_count = used
        self._write_header(n)
        self.index_count = n
        self.mf.dirty = True

    def add_one(self, h: int, phys: int, ts: int) -> None:
        """:meth:`add` for a single hash: the hot path (one id-index entry per batch). The
        caller checked :meth:`fits`."""
        mm = self.mf.mm
        n = self.index_count + 1
        if n == 1:
            self.begin_ts = self.end_ts = ts
            self.begin_phys = phys
        diff = ts - self.begin_ts
        spos = HEADER_SIZE + (h % self.slots) * SLOT_SIZE
        head = SLOT.unpack_from(mm, spos)[0]
        ENTRY.pack_into(
            mm, self.entries_start + (n - 1) * ENTRY_SIZE, h, phys, diff if diff > 0 else 0, head
        )
        SLOT.pack_into(mm, spos, n)
        if not head:
            self.hash_slot_count += 1
        end_ts = self.end_ts
        if ts > end_ts:
            self.end_ts = end_ts = ts
        self.end_phys = phys
        HEADER.pack_into(
            mm, 0, self.begin_ts, end_ts, self.begin_phys, phys, self.hash_slot_count, n
        )
        self.index_count = n
        self.mf.dirty = True

    def _write_header(self, count: int) -> None:
        HEADER.pack_into(
            self.mf.mm, 0, self.begin_ts, self.end_ts, self.begin_phys, self.end_phys,
            self.hash_slot_count, count,
        )

    def truncate(self, max_phys: int) -> None:
        """Remove entries with phys_offset >= max_phys from the tail, unlinking each from its
        slot (it is that slot's head: entries leave in the reverse order they came)."""
        mm, n = self.mf.mm, self.index_count
        es = self.entries_start - ENTRY_SIZE
        zero = bytes(ENTRY_SIZE)
        removed = False
        while n:
            pos = es + n * ENTRY_SIZE
            h, phys, _diff, prev = ENTRY.unpack_from(mm, pos)
            if phys < max_phys:
                break
            spos = HEADER_SIZE + (h % self.slots) * SLOT_SIZE
            if SLOT.unpack_from(mm, spos)[0] == n:
                SLOT.pack_into(mm, spos, prev)
                if not prev:
                    self.hash_slot_count -= 1
            mm[pos : pos + ENTRY_SIZE] = zero
            n -= 1
            removed = True
        if not removed:
            return
        if n:
            self.end_phys = ENTRY.unpack_from(mm, es + n * ENTRY_SIZE)[1]
            diffs = np.frombuffer(mm, _ENTRY_DTYPE, count=n, offset=self.entries_start)["diff"]
            self.end_ts = self.begin_ts + int(diffs.max())
        else:
            self.begin_ts = self.end_ts = self.begin_phys = self.end_phys = 0
            self.hash_slot_count = 0
        self.index_count = n
        self._write_header(n)
        self.mf.dirty = True

    # -- reading (any thread) ----------------------------------------------------------------
    def collect(
        self, h: int, begin_ts: int, end_ts: int, max_num: int, out: list[int], seen: set[int]
    ) -> None:
        """Walk the chain of ``h``'s slot, newest first, appending matching phys offsets."""
        mm = self.mf.mm
        es = self.entries_start - ENTRY_SIZE
        base = self.begin_ts
        limit = self.max_entries
        unpack = ENTRY.unpack_from
        try:
            i = SLOT.unpack_from(mm, HEADER_SIZE + (h % self.slots) * SLOT_SIZE)[0]
            while 0 < i <= limit:
                eh, phys, diff, prev = unpack(mm, es + i * ENTRY_SIZE)
                if eh == h and begin_ts <= base + diff <= end_ts and phys not in seen:
                    seen.add(phys)
                    out.append(phys)
                    if len(out) >= max_num:
                        return
                if prev >= i:  # a damaged chain must not loop
                    return
                i = prev
        except ValueError:  # mapping closed by close() under a late reader
            return


class IndexService:
    """All index files under ``root``: puts go to the newest, queries walk newest to oldest.

    Threads: one writer -- the store's dispatch thread -- calls :meth:`put`,
    :meth:`put_many`, :meth:`truncate_dirty`, :meth:`delete_expired` and :meth:`close`.
    :meth:`flush` may run on one other thread (the flush/checkpoint thread) concurrently.
    Any thread may call :meth:`query` and read :attr:`max_phys_offset` concurrently (the file
    list is replaced, never mutated, and an entry is complete before a slot head points at
    it).

    Damaged files do not stop the service (no exception from the constructor): loading checks
    every file's length and header, and every slot and entry of the newest file (the only
    one that can hold writes made after its last flush -- a file is fdatasync'ed when the
    next one is created). A file that fails *and every newer file* are deleted and described
    in :attr:`load_errors` (file and byte position), so :attr:`max_phys_offset` falls back
    to the last good file and re-dispatch from there rebuilds what was lost.
    """

    def __init__(
        self, root: str | os.PathLike[str], slots: int = 5_000_000, max_entries: int = 20_000_000,
        max_free_ratio: float = 1.0,
    ) -> None:
        if not 1 <= slots <= _I32_MAX or not 1 <= max_entries <= _I32_MAX:
            raise ValueError(f"slots and max_entries must be 1..{_I32_MAX}")
        if not 0 < max_free_ratio <= 1:
            raise ValueError(f"max_free_ratio must be in (0, 1], got {max_free_ratio}")
        self.root = os.fspath(root)
        self.slots = slots
        self.max_entries = max_entries
        self.max_free_ratio = max_free_ratio
        self.load_errors: list[str] = []
        self._files: list[IndexFile] = []  # oldest first; replaced, never mutated
        self._dir_dirty = False
        self._load()

    def _load(self) -> None:
        try:
            names = sorted(n for n in os.listdir(self.root) if _NAME_RE.match(n))
        except FileNotFoundError:
            return
        files: list[IndexFile] = []
        for k, name in enumerate(names):
            path = os.path.join(self.root, name)
            try:
                _ms_of(name)  # a 17-digit name that is no date is as bad as a bad header
                geometry = geometry_of_length(os.path.getsize(path), self.slots,
                                              self.max_entries)
                # no match: load with the configured geometry, which words the length error
                f = IndexFile.load(path, *(geometry or (self.slots, self.max_entries)))
                if files and f.index_count and f.begin_phys < files[-1].end_phys:
                    f.mf.close()
                    raise StoreError(
                        f"{path}: begin_phys {f.begin_phys} at byte 16 is below end_phys "
                        f"{files[-1].end_phys} of the file before",
                        code="CORRUPT_FILE",
                    )
            except (StoreError, ValueError) as exc:
                self.load_errors.append(
                    exc.message if isinstance(exc, StoreError) else f"{path}: {exc}"
                )
                for newer in names[k + 1 :]:
                    self.load_errors.append(
                        f"{os.path.join(self.root, newer)}: dropped, newer than a damaged file"
                    )
                for doomed in names[k:]:
                    try:
                        os.unlink(os.path.join(self.root, doomed))
                    except FileNotFoundError:
                        pass
                self._dir_dirty = True
                break
            if f.index_count:
                files.append(f)
            else:  # created but never written: carries nothing
                f.mf.delete()
                self._dir_dirty = True
        # The newest file is the one that may hold writes made after its last flush (and
        # after a drop, the survivor that became newest decides max_phys_offset): check it
        # entry by entry.
        while files:
            problem = files[-1].check_body()
            if problem is None:
                break
            f = files.pop()
            self.load_errors.append(f"{f.mf.path}: {problem}")
            f.mf.delete()
            self._dir_dirty = True
        self._files = files

    # -- writing ---------------------------------------------------------------------------
    def put(self, key: str, phys_offset: int, store_ts: int) -> None:
        self.put_many((key,), phys_offset, store_ts)

    def put_one(self, key: str, phys_offset: int, store_ts: int) -> None:
        """:meth:`put` without the generality of :meth:`put_many`."""
        self.put_hash(_crc32c(key.encode()), phys_offset, store_ts)

    def put_hash(self, h: int, phys_offset: int, store_ts: int) -> None:
        """:meth:`put_one` of a key whose :func:`key_hash` the caller knows (the per-batch hot
        path: the store caches the hash of each producer's current id block)."""
        files = self._files
        if not files:
            f = self._roll(store_ts)
        else:
            f = files[-1]
            if phys_offset < f.end_phys:
                return
            # IndexFile.fits, inlined: this runs once per stored batch
            n = f.index_count
            if n >= f.max_entries or (n and store_ts - f.begin_ts > _I32_MAX):
                f = self._roll(store_ts)
        f.add_one(h, phys_offset, store_ts)

    def put_hash_run(self, hashes: list[int], physs: list[int], store_ts: int) -> None:
        """:meth:`put_hash` of each (hash, phys) in turn, ``physs`` ascending (the id-index
        entries of a frame's batches): one call and one header write per index file instead of
        one per batch. Entries below the newest file's last phys are already indexed and
        skipped, as :meth:`put_hash` skips them."""
        k = len(hashes)
        i = 0
        if self._files:
            end = self._files[-1].end_phys
            while i < k and physs[i] < end:
                i += 1
        while i < k:
            files = self._files
            f = files[-1] if files else None
            if f is None or not f.fits(store_ts):
                f = self._roll(store_ts)
            take = min(k - i, f.room)
            f.add_run(hashes[i : i + take], physs[i : i + take], store_ts)
            i += take

    def put_many(self, keys: Iterable[str], phys_offset: int, store_ts: int) -> None:
        """Index every non-empty key of ``keys`` to the batch at ``phys_offset``.

        A batch below :attr:`max_phys_offset` is already indexed and ignored, so re-dispatch
        from there is idempotent (the batch *at* it may be indexed twice; query
        de-duplicates).
        """
        self.put_hashes([_crc32c(k.encode()) for k in keys if k], phys_offset, store_ts)

    def put_hashes(self, hashes: list[int], phys_offset: int, store_ts: int) -> None:
        """:meth:`put_many` of keys whose :func:`key_hash` the caller computed. The common
        case -- the newest file has room for all of them (a batch's few keys: a keyed
        message's key and its id block) -- is one check and one :meth:`IndexFile.add` (one
        header write); the loop below rolls files as they fill."""
        files = self._files
        if files:
            f = files[-1]
            if phys_offset < f.end_phys:  # already indexed (max_phys_offset)
                return
            n = f.index_count  # IndexFile.fits for all of them, inlined: once per stored batch
            if hashes and n + len(hashes) <= f.max_entries and (
                    not n or store_ts - f.begin_ts <= _I32_MAX):
                f.add(hashes, phys_offset, store_ts)
                return
        i = 0
        while i < len(hashes):
            last = self._files[-1] if self._files else None
            g = last if last is not None and last.fits(store_ts) else self._roll(store_ts)
            take = min(len(hashes) - i, g.room)
            g.add(hashes[i : i + take], phys_offset, store_ts)
            i += take

    def make_room(self, store_ts: int, entries: int) -> None:
        """Roll to a new file now if the newest cannot take ``entries`` more entries stored at
        ``store_ts``, so that the puts of one batch that follow do not need to create a file
        (the store calls this before it writes the batch: a full disk then fails the put with
        nothing written). Raises StoreError (DiskFullError) when the file cannot be created."""
        files = self._files
        if files:
            f = files[-1]
            n = f.index_count
            if not n or (n + entries <= f.max_entries and store_ts - f.begin_ts <= _I32_MAX):
                return  # an empty file takes what it can; the rest rolls as before
        self._roll(store_ts)

    def _roll(self, store_ts: int) -> IndexFile:
        files = self._files
        ms = store_ts
        if files:
            # A full file is final: make it durable now so load only deep-checks the newest.
            files[-1].mf.flush()
            ms = max(ms, files[-1].name_ms + 1)
        os.makedirs(self.root, exist_ok=True)
        name = _name_for(ms)
        while os.path.exists(os.path.join(self.root, name)):
            ms += 1
            name = _name_for(ms)
        slots, entries = self.slots, self.max_entries
        free = shutil.disk_usage(self.root).free
        if self.max_free_ratio < 1 or IndexFile.file_size(slots, entries) > free:
            slots, entries = geometry_for_space(slots, entries, free, self.max_free_ratio)
            if entries != self.max_entries:
                log.info("index file %s: %d slots, %d entries (%d bytes; %d bytes free on the "
                         "disk)", name, slots, entries, IndexFile.file_size(slots, entries), free)
        f = IndexFile.create(os.path.join(self.root, name), slots, entries)
        self._files = [*files, f]
        self._dir_dirty = True
        return f

    # -- reading ---------------------------------------------------------------------------
    def query(self, key: str, begin_ts: int, end_ts: int, max_num: int = 64) -> list[int]:
        """CommitLog offsets of batches indexed under a key whose hash equals ``key``'s, with
        store time in [begin_ts, end_ts], newest first, without repeats, at most
        ``max_num``. The caller re-checks the key on the message (hashes collide)."""
        out: list[int] = []
        if max_num <= 0 or begin_ts > end_ts:
            return out
        h = _crc32c(key.encode())
        seen: set[int] = set()
        for f in reversed(self._files):
            if f.index_count == 0 or f.end_ts < begin_ts or f.begin_ts > end_ts:
                continue
            f.collect(h, begin_ts, end_ts, max_num, out, seen)
            if len(out) >= max_num:
                break
        return out

    @property
    def max_phys_offset(self) -> int:
        """CommitLog offset of the last batch indexed (end_phys of the newest file), -1 when
        there is none. This is a batch *start*: re-dispatch the index from here."""
        files = self._files
        return files[-1].end_phys if files else -1

    @property
    def files(self) -> list[str]:
        """Paths of the index files, oldest first (for tools and tests)."""
        return [f.mf.path for f in self._files]

    # -- recovery and retention --------------------------------------------------------------
    def truncate_dirty(self, max_phys: int) -> None:
        """Remove every entry with phys_offset >= ``max_phys``; files left empty are deleted."""
        files = list(self._files)
        doomed: list[IndexFile] = []
        while files:
            f = files[-1]
            if f.index_count and f.begin_phys < max_phys:
                f.truncate(max_phys)
                break
            doomed.append(files.pop())
        if doomed:
            self._files = files
            for f in doomed:
                f.mf.delete()
            self._dir_dirty = True

    def delete_expired(self, min_phys: int) -> int:
        """Delete the oldest files whose end_phys < ``min_phys`` (never the newest)."""
        files = self._files
        n = 0
        for f in files[:-1]:
            if f.end_phys >= min_phys:
                break
            n += 1
        if n:
            self._files = files[n:]
            for f in files[:n]:
                f.mf.delete()
            self._dir_dirty = True
        return n

    # -- lifecycle -------------------------------------------------------------------------
    def flush(self) -> None:
        for f in self._files:
            if f.mf.dirty:
                f.mf.flush()
                # entries are appended in order: all but the newest leave the process's
                # memory (lookups fault them back from the page cache); the slot table stays
                f.mf.drop_resident(
                    f.entries_start,
                    f.entries_start + (f.index_count - _RESIDENT_ENTRIES) * ENTRY_SIZE,
                )
        if self._dir_dirty:
            self._dir_dirty = False
            fsync_dir(self.root)

    def close(self) -> None:
        self.flush()
        files, self._files = self._files, []
        for f in files:
            f.mf.close()
