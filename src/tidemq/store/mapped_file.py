"""Fixed-size memory-mapped files: the plumbing shared by ConsumeQueue and IndexFile.

This module owns no on-disk format. A :class:`MappedFile` is exactly ``size`` bytes, created
with its full length allocated (zeros), mapped ``MAP_SHARED`` read-write, and never resized::

    +-----------------------------------------------------------------+
    | size bytes, meaning defined by the owner (ConsumeQueue, IndexFile) |
    +-----------------------------------------------------------------+

Disk blocks are reserved with ``posix_fallocate`` before any byte is written through the
mapping: a store into a hole of a sparse file on a full disk kills the process with SIGBUS,
whereas a failed fallocate is a :class:`DiskFullError` at a safe point. Index files reserve their
whole length at creation; consume-queue files reserve ``ALLOCATE_CHUNK`` bytes at a time ahead of
the write position (``ensure_allocated``), so 10,000 mostly idle queues do not reserve 60 GB.

Only the mapping holds the file open (Python's mmap keeps its own duplicate descriptor); ours is
closed right after mapping and the file is reopened briefly to fdatasync or fallocate, so a store
with 10,000 queues needs 10,000 descriptors, not 20,000.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading

from tidemq.protocol.errors import DiskFullError, StoreError, StoreWriteError

__all__ = ["ALLOCATE_CHUNK", "MappedFile", "fsync_dir"]

ALLOCATE_CHUNK = 64 * 1024

_NO_FALLOCATE = {errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS}


class MappedFile:
    """One fixed-size file mapped read-write.

    ``mm`` is the mapping; owners read and write it directly and set ``dirty = True`` *after*
    writing (so a concurrent :meth:`flush` that clears the flag never loses a write).
    ``base`` is a number the owner uses to place the file in its sequence (unused here).

    Threads: any thread may read ``mm``. :meth:`flush`, :meth:`close` and :meth:`delete` may
    race each other (they share a lock, so a file descriptor is never synced after it was
    closed and its number reused). After :meth:`delete` the mapping stays valid for threads
    that still hold this object; it is unmapped when the last reference goes.
    """

    __slots__ = ("path", "size", "base", "mm", "dirty", "allocated", "_open", "_lock")

    def __init__(
        self, path: str, size: int, mm: mmap.mmap, base: int = 0, allocated: int = 0
    ) -> None:
        self.path = path
        self.size = size
        self.base = base
        self.mm = mm
        self.dirty = False
        self.allocated = allocated  # bytes [0, allocated) have disk blocks reserved
        self._open = True
        self._lock = threading.Lock()

    @classmethod
    def create(
        cls, path: str, size: int, base: int = 0, allocate: int | None = None
    ) -> MappedFile:
        """Create ``path`` (it must not exist) with ``size`` zero bytes and map it; reserve
        disk blocks for the first ``allocate`` bytes (all of them when None)."""
        if size <= 0:
            raise ValueError(f"a mapped file needs a positive size, got {size}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            raise StoreError(f"{path}: cannot create, the file already exists")
        except OSError as exc:
            raise _os_error(path, "create", exc)
        want = size if allocate is None else min(size, allocate)
        try:
            os.ftruncate(fd, size)
            _fallocate(fd, 0, want)
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
        except OSError as exc:
            _unlink_quietly(path)
            raise _os_error(path, "allocate", exc)
        except BaseException:
            _unlink_quietly(path)
            raise
        finally:
            os.close(fd)
        return cls(path, size, mm, base, want)

    @classmethod
    def open(cls, path: str, size: int, base: int = 0) -> MappedFile:
        """Map an existing file; raises StoreError (naming the file) if its length is not
        ``size``."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise _os_error(path, "open", exc)
        try:
            actual = os.fstat(fd).st_size
            if actual != size:
                raise StoreError(
                    f"{path}: file is {actual} bytes, expected {size} (truncated or not ours); "
                    f"valid data would end before byte {min(actual, size)}",
                    code="CORRUPT_FILE",
                )
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
        except OSError as exc:
            raise _os_error(path, "map", exc)
        finally:
            os.close(fd)
        # What is reserved on disk is not recorded; ensure_allocated re-reserves from 0, which
        # costs nothing for blocks already allocated.
        return cls(path, size, mm, base, 0)

    def ensure_allocated(self, end: int) -> None:
        """Reserve disk blocks up to ``end`` (rounded up to ALLOCATE_CHUNK) before writing
        there. Writer thread only. DiskFullError if the disk is full: nothing was written."""
        if end <= self.allocated:
            return
        new = min(self.size, -(-end // ALLOCATE_CHUNK) * ALLOCATE_CHUNK)
        with self._lock:
            if not self._open:
                return
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
                try:
                    _fallocate(fd, self.allocated, new - self.allocated)
                finally:
                    os.close(fd)
            except OSError as exc:
                raise _os_error(self.path, "allocate", exc)
        self.allocated = new

    def flush(self) -> None:
        """Make written bytes durable if any were written since the last flush.

        ``os.fdatasync`` on a descriptor (not ``mmap.flush``) because it releases the GIL
        while the disk works, so readers keep running; fsync is per file, so a fresh
        descriptor covers every page written through the mapping."""
        with self._lock:
            if not self._open or not self.dirty:
                return
            self.dirty = False
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
                try:
                    os.fdatasync(fd)
                finally:
                    os.close(fd)
            except OSError as exc:
                self.dirty = True
                raise _os_error(self.path, "fdatasync", exc)

    def drop_resident(self, start: int, end: int) -> None:
        """Drop the pages of bytes [start, end) from this process (madvise MADV_DONTNEED):
        the data stays in the page cache and the file, a later access faults it back in.
        Keeps the RSS of a broker with large mapped files bounded (call on flushed bytes)."""
        start = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
        end = min(end, self.size) // mmap.PAGESIZE * mmap.PAGESIZE
        if end <= start:
            return
        with self._lock:
            if self._open:
                with contextlib.suppress(ValueError, OSError):
                    self.mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        """Release the mapping unless a reader still holds a buffer of it."""
        with self._lock:
            self._open = False
        try:
            self.mm.close()
        except BufferError:
            pass  # a reader still holds a view (numpy array); unmapped when that view dies

    def delete(self) -> None:
        """Remove the file from disk. The mapping is left to the garbage collector so readers
        holding this object never see it closed under them."""
        with self._lock:
            self._open = False
        _unlink_quietly(self.path)

    @property
    def closed(self) -> bool:
        return not self._open


def _fallocate(fd: int, offset: int, length: int) -> None:
    if length <= 0:
        return
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        if exc.errno not in _NO_FALLOCATE:
            raise
        # a filesystem without fallocate: the file stays sparse, the best we can get


def fsync_dir(path: str) -> None:
    """fsync a directory so that files created or removed in it survive a crash."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _os_error(path: str, what: str, exc: OSError) -> StoreError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(f"{path}: cannot {what}: {exc.strerror}")
    return StoreWriteError(f"{path}: cannot {what}: {exc.strerror or exc}")
