"""The CommitLog (ref ST1): one append-only log of batches for every topic, in segments.

Invariants:
- Segments are contiguous: segment k starts where segment k-1 ends; names are start offsets.
- A batch never spans two segments. When a batch does not fit in what is left of the active
  segment (keeping FILLER_MIN bytes), a filler record (``total_size | FILLER_MAGIC``) closes the
  segment and the batch goes to the next one.
- ``write_pos`` is the physical offset of the next batch; everything below it has been written
  through the mapping; ``flushed_pos`` <= ``write_pos`` is what fdatasync has made durable.

Thread contract: ``reserve`` / ``advance`` / ``truncate`` / ``delete_segments`` are called by
one writer at a time (MessageStore holds its put lock); ``flush`` may run on the flush thread
concurrently with appends; ``view``/``read_batch`` may be called from any thread.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from tidemq.protocol.errors import OffsetOutOfRangeError, StoreError, StoreWriteError
from tidemq.protocol.record import (
    BATCH_MAGIC,
    FILLER_MAGIC,
    FILLER_MIN,
    TOTAL_SIZE_MAGIC,
    BatchView,
)
from tidemq.store.segment import Segment, SegmentAllocator, WarmAhead, segment_name

log = logging.getLogger(__name__)

#: Pages of the mappings more than this far behind the flushed position are dropped from the
#: process (madvise MADV_DONTNEED; the data stays in the page cache and in the file), so the
#: broker's RSS stays bounded however much it writes: a 1 GiB segment would otherwise become
#: 1 GiB of resident memory once written. A reader of old data faults pages back in (minor
#: faults, from the page cache); the next trim drops them again. 32 MiB keeps consumers near
#: the tail fault-free and a broker with a million pending timed messages (500 MB of
#: envelopes) under 100 MB of added RSS (`tidemq bench delay-index`).
RESIDENT_BEHIND = 32 * 1024 * 1024
_PAGE = mmap.PAGESIZE
_NEVER = 1 << 63


class CommitLog:
    def __init__(
        self,
        directory: str | os.PathLike[str],
        segment_size: int,
        *,
        preallocate: bool = True,
        warm_ahead_bytes: int = 64 << 20,
    ):
        if segment_size < 4096:
            raise ValueError("segment_size must be at least 4096 bytes")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.segment_size = segment_size
        self.segments: list[Segment] = []
        self.write_pos = 0
        self.flushed_pos = 0
        self._preallocate = preallocate
        self._warm_window = warm_ahead_bytes
        # Prepared segments get their first window warmed; WarmAhead follows the writer.
        self._allocator = SegmentAllocator(enabled=preallocate, warm_bytes=warm_ahead_bytes)
        self._warmer: WarmAhead | None = None
        #: When the write position reaches this, ``on_flush_wake()`` is called once (the
        #: ASYNC_FLUSH service asks to be woken after flush_dirty_bytes more bytes).
        self.flush_wake_at = _NEVER
        self.on_flush_wake: Callable[[], None] = lambda: None
        self._flush_lock = threading.Lock()
        self._zombies: list[Segment] = []  # deleted segments still pinned by readers' views
        self._trimmed_at = 0  # flushed position of the last trim (flush thread only)

    # -- opening ---------------------------------------------------------------------------
    def open_segments(self) -> list[str]:
        """Map every segment file in order. Returns problems found (non-fatal, reported)."""
        problems = []
        names = sorted(p.name for p in self.dir.iterdir() if p.name.isdigit())
        expected = None
        for name in names:
            start = int(name)
            path = self.dir / name
            if start % self.segment_size:
                problems.append(f"{path}: start offset is not a multiple of segment_size; ignored")
                continue
            if expected is not None and start != expected:
                problems.append(f"{path}: gap before this segment (expected {expected}); ignored")
                break
            size = path.stat().st_size
            if size > self.segment_size:
                problems.append(f"{path}: {size} bytes, larger than segment_size; ignored")
                break
            if size < self.segment_size and name != names[-1]:
                problems.append(f"{path}: only {size} of {self.segment_size} bytes (truncated)")
            self.segments.append(Segment(path, start, self.segment_size))
            expected = start + self.segment_size
        if self.segments:
            self.write_pos = self.flushed_pos = self.segments[0].start
        return problems

    @property
    def min_offset(self) -> int:
        return self.segments[0].start if self.segments else self.write_pos

    def segment_for(self, phys: int) -> Segment:
        segs = self.segments
        if not segs:
            raise OffsetOutOfRangeError(f"CommitLog is empty; no offset {phys}")
        i = (phys - segs[0].start) // self.segment_size
        if i < 0 or i >= len(segs):
            raise OffsetOutOfRangeError(
                f"physical offset {phys} is outside the CommitLog "
                f"[{segs[0].start}, {self.write_pos})"
            )
        return segs[i]

    # -- writing ---------------------------------------------------------------------------
    def _roll(self, start: int) -> Segment:
        seg = self._allocator.take(self.dir / segment_name(start), start, self.segment_size)
        self.segments.append(seg)
        nxt = start + self.segment_size
        self._allocator.prepare(self.dir / segment_name(nxt), nxt, self.segment_size)
        return seg

    def reserve(self, size: int) -> tuple[Segment, int]:
        """Segment and relative position where a batch of ``size`` bytes will be written.

        Writes a filler and rolls when the active segment cannot hold it.
        """
        segs = self.segments
        if segs:  # the common case, once per put: the batch fits in the active segment
            seg = segs[-1]
            rel = self.write_pos - seg.start
            if rel >= 0 and rel + size + FILLER_MIN <= seg.size:
                return seg, rel
        if size + FILLER_MIN > self.segment_size:
            raise StoreWriteError(
                f"a batch of {size} bytes cannot fit in a segment of {self.segment_size} bytes"
            )
        pos = self.write_pos
        if not self.segments:
            seg = self._roll(pos - pos % self.segment_size)
        else:
            seg = self.segments[-1]
        rel = pos - seg.start
        if rel >= seg.size:  # exactly at the end of a closed segment (after a truncate)
            seg, rel = self._roll(seg.end), 0
        if rel + size + FILLER_MIN > seg.size:
            # Roll first: if the new segment cannot be allocated nothing has changed yet.
            nxt = self._roll(seg.end)
            TOTAL_SIZE_MAGIC.pack_into(seg.mm, rel, seg.size - rel, FILLER_MAGIC)
            self.write_pos = seg.end
            seg, rel = nxt, 0
        return seg, rel

    def replica_position(self) -> tuple[Segment, int]:
        """Segment and relative position of the write position, for a slave copying the
        master's bytes verbatim (MessageStore.append_replicated): rolls a new segment when the
        write position is at the end of the last one (or the log is empty). Unlike
        :meth:`reserve` it never writes a filler: the master's fillers arrive as data."""
        pos = self.write_pos
        segs = self.segments
        if segs and segs[-1].start <= pos < segs[-1].end:
            return segs[-1], pos - segs[-1].start
        if pos % self.segment_size:
            raise StoreWriteError(
                f"replicated data at {pos} does not start a segment of {self.segment_size} "
                "bytes (master and slave must use the same store.segment_size)"
            )
        return self._roll(pos), 0

    def pwrite(self, seg: Segment, rel: int, parts: tuple[bytes | bytearray | memoryview, ...],
               size: int) -> None:
        """Write ``parts`` (``size`` bytes in all) at ``rel`` in ``seg`` with one pwritev
        instead of through the mapping (large batches; the mapping sees the same page cache).
        The GIL is released during the copy. StoreWriteError on failure: nothing advanced."""
        try:
            n = os.pwritev(seg.fd, parts, rel)
        except OSError as exc:
            raise StoreWriteError(f"write to {seg.path} at {rel} failed: {exc.strerror}") from exc
        if n != size:
            raise StoreWriteError(f"short write to {seg.path} at {rel}: {n} of {size} bytes")

    def advance(self, size: int) -> None:
        pos = self.write_pos = self.write_pos + size
        w = self._warmer
        if w is not None and pos >= w.wake_at:
            w.kick()
        if pos >= self.flush_wake_at:
            self.flush_wake_at = _NEVER
            self.on_flush_wake()

    # -- reading ---------------------------------------------------------------------------
    def view(self, phys: int, size: int) -> memoryview:
        """Zero-copy view of ``size`` bytes at ``phys`` (within one segment)."""
        seg = self.segment_for(phys)
        rel = phys - seg.start
        if phys + size > self.write_pos or rel + size > seg.size:
            raise OffsetOutOfRangeError(f"{size} bytes at {phys} are beyond written data")
        return memoryview(seg.mm)[rel : rel + size]

    def read_batch(self, phys: int) -> BatchView:
        seg = self.segment_for(phys)
        rel = phys - seg.start
        if phys >= self.write_pos:
            raise OffsetOutOfRangeError(f"no batch at {phys}: CommitLog ends at {self.write_pos}")
        return BatchView(memoryview(seg.mm)[: min(seg.size, self.write_pos - seg.start)], rel)

    def store_ts_at(self, phys: int) -> int:
        return self.read_batch(phys).store_ts

    def iter_positions(self, start: int) -> Iterator[tuple[Segment, int, int, int]]:
        """Walk (segment, rel, total_size, magic) from ``start`` over the written region, without
        validation. Used by recovery; stops at zeros or at the end of the last segment."""
        pos = start
        while True:
            try:
                seg = self.segment_for(pos)
            except OffsetOutOfRangeError:
                return
            rel = pos - seg.start
            if rel + 6 > seg.size:
                return
            total, magic = TOTAL_SIZE_MAGIC.unpack_from(seg.mm, rel)
            yield seg, rel, total, magic
            if magic == FILLER_MAGIC and total == seg.size - rel:
                pos = seg.end
            elif magic == BATCH_MAGIC and 0 < total <= seg.size - rel:
                pos += total
            else:
                return

    # -- durability ------------------------------------------------------------------------
    def flush(self) -> int:
        """fdatasync every segment holding unflushed bytes; returns the new flushed position.

        Safe to call from the flush thread while the writer appends: everything below the
        write position read at entry is durable when this returns.
        """
        with self._flush_lock:
            target = self.write_pos
            start = self.flushed_pos
            if target <= start:
                self._maybe_trim(start)
                return start
            for seg in list(self.segments):
                if seg.end <= start or seg.start >= target:
                    continue
                try:
                    seg.sync()
                except OSError as exc:
                    raise StoreWriteError(
                        f"fdatasync of {seg.path} failed: {exc.strerror}; data after offset "
                        f"{start} is not durable"
                    ) from exc
            self.flushed_pos = target
            self._maybe_trim(target)
            return target

    def _maybe_trim(self, flushed: int) -> None:
        """Drop resident pages far behind ``flushed`` once per RESIDENT_BEHIND / 4 of data
        (flush lock held)."""
        if flushed - self._trimmed_at >= RESIDENT_BEHIND // 4:
            self._trimmed_at = flushed
            self._drop_resident(flushed - RESIDENT_BEHIND)

    def _drop_resident(self, below: int) -> None:
        """Unmap from this process the pages of every segment below ``below`` (flushed
        bytes: nothing is lost; see RESIDENT_BEHIND)."""
        for seg in list(self.segments):
            if seg.start >= below:
                break
            length = min(seg.size, below - seg.start)
            length -= length % _PAGE
            if length <= 0:
                continue
            try:
                seg.mm.madvise(mmap.MADV_DONTNEED, 0, length)
            except (ValueError, OSError):  # closed under us (retention, shutdown)
                continue

    # -- truncation and retention -------------------------------------------------------------
    def truncate(self, end: int, dirty_end: int | None = None) -> list[str]:
        """Make ``end`` the write position: zero bytes after it (up to ``dirty_end`` when the
        caller knows where non-zero bytes stop), delete later segments."""
        removed = []
        keep: list[Segment] = []
        for seg in self.segments:
            if seg.start > end:
                seg.close()
                os.unlink(seg.path)
                removed.append(str(seg.path))
            else:
                keep.append(seg)
        self.segments = keep
        if keep:
            seg = keep[-1]
            rel = end - seg.start
            stop = seg.size if dirty_end is None else min(seg.size, dirty_end - seg.start)
            if rel < stop:
                seg.mm[rel:stop] = bytes(stop - rel)
                seg.sync()
        self.write_pos = end
        self.flushed_pos = min(self.flushed_pos, end)
        return removed

    def truncate_live(self, end: int) -> list[str]:
        """:meth:`truncate` while the store is open (a slave cutting a divergent tail): holds
        the flush lock so the flush thread never syncs a segment being removed. Bytes past
        the write position are zeros already, so only [end, write_pos) is zeroed."""
        with self._flush_lock:
            dirty_end = self.write_pos
            removed = self.truncate(end, max(end, dirty_end))
            self._trimmed_at = min(self._trimmed_at, end)
            return removed

    def reset(self, offset: int) -> None:
        """Drop every segment and continue empty at ``offset`` (a multiple of the segment
        size): a slave whose data the master no longer has, or whose disk was wiped, starts
        over at the master's oldest retained offset. Prepared segments are dropped too."""
        if offset % self.segment_size:
            raise StoreWriteError(
                f"a CommitLog can only restart at a segment boundary, not at {offset}"
            )
        with self._flush_lock:
            self._allocator.close()
            self._allocator = SegmentAllocator(
                enabled=self._preallocate, warm_bytes=self._warm_window
            )
            segs, self.segments = self.segments, []
            for seg in segs:
                try:
                    os.unlink(seg.path)
                except OSError as exc:
                    raise StoreError(f"cannot delete segment {seg.path}: {exc}") from exc
                if not seg.close():
                    self._zombies.append(seg)
            self.write_pos = self.flushed_pos = offset
            self._trimmed_at = offset
        self._allocator.prepare(self.dir / segment_name(offset), offset, self.segment_size)

    def warm_active(self) -> None:
        """After start-up: keep the pages ahead of the writer warm, prepare the next segment."""
        if self._preallocate and self._warmer is None:
            self._warmer = WarmAhead(self._active_position, self._warm_window)
        if self.segments:
            nxt = self.segments[-1].end
            self._allocator.prepare(self.dir / segment_name(nxt), nxt, self.segment_size)

    def stop_warming(self) -> None:
        """No more warm-ahead (a slave copies with pwrite, which allocates its own pages:
        warming them first only costs CPU); :meth:`warm_active` starts it again."""
        if self._warmer is not None:
            self._warmer.close()
            self._warmer = None

    def _active_position(self) -> tuple[Segment, int] | None:
        segs = self.segments
        if not segs:
            return None
        seg = segs[-1]
        return seg, max(0, min(self.write_pos - seg.start, seg.size))

    def ensure_full_size(self) -> None:
        """Grow a short last segment (a truncated file) back to segment_size with zeros."""
        for i, seg in enumerate(self.segments):
            if os.fstat(seg.fd).st_size < self.segment_size:
                path, start = seg.path, seg.start
                seg.close()
                self.segments[i] = Segment(path, start, self.segment_size)

    def delete_segments(self, count: int) -> list[Segment]:
        """Remove the ``count`` oldest segments (never the active one)."""
        count = min(count, len(self.segments) - 1)
        if count <= 0:
            return []
        gone, self.segments = self.segments[:count], self.segments[count:]
        for seg in gone:
            try:
                os.unlink(seg.path)
            except OSError as exc:
                raise StoreError(f"cannot delete expired segment {seg.path}: {exc}") from exc
            if not seg.close():
                self._zombies.append(seg)
        self._zombies = [z for z in self._zombies if not z.close()]
        return gone

    def close(self) -> None:
        if self._warmer is not None:
            self._warmer.close()
            self._warmer = None
        self._allocator.close()
        for seg in self.segments + self._zombies:
            if not seg.close():
                log.warning("segment %s still has readers at close; left mapped", seg.path)
        self.segments = []
