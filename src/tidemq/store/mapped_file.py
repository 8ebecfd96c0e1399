"""Fixed-size memory-mapped files: the plumbing shared by ConsumeQueue and IndexFile.

This module owns no on-disk format. A :class:`MappedFile` is exactly ``size`` bytes, created
with its full length allocated (zeros), mapped ``MAP_SHARED`` read-write, and never resized::

    +-----------------------------------------------------------------+
    | size bytes, meaning defined by the owner (ConsumeQueue, IndexFile) |
    +-----------------------------------------------------------------+

Why the full length is allocated up front (``posix_fallocate``, not a sparse ``ftruncate``):
a store through a mapping into a hole of a sparse file on a full disk kills the process with
SIGBUS; allocating at creation turns that into a :class:`DiskFullError` at a safe point.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading

from tidemq.protocol.errors import DiskFullError, StoreError, StoreWriteError

__all__ = ["MappedFile", "fsync_dir"]

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

    __slots__ = ("path", "size", "base", "mm", "dirty", "_fd", "_lock")

    def __init__(self, path: str, size: int, fd: int, mm: mmap.mmap, base: int = 0) -> None:
        self.path = path
        self.size = size
        self.base = base
        self.mm = mm
        self.dirty = False
        self._fd = fd
        self._lock = threading.Lock()

    @classmethod
    def create(cls, path: str, size: int, base: int = 0) -> MappedFile:
        """Create ``path`` (it must not exist) with ``size`` zero bytes allocated and map it."""
        if size <= 0:
            raise ValueError(f"a mapped file needs a positive size, got {size}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            raise StoreError(f"{path}: cannot create, the file already exists")
        except OSError as exc:
            raise _os_error(path, "create", exc)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno not in _NO_FALLOCATE:
                    raise
                os.ftruncate(fd, size)  # filesystem without fallocate: sparse is the best we get
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
        except OSError as exc:
            os.close(fd)
            _unlink_quietly(path)
            raise _os_error(path, "allocate", exc)
        except BaseException:
            os.close(fd)
            _unlink_quietly(path)
            raise
        return cls(path, size, fd, mm, base)

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
            os.close(fd)
            raise _os_error(path, "map", exc)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, size, fd, mm, base)

    def flush(self) -> None:
        """Make written bytes durable if any were written since the last flush.

        ``os.fdatasync`` on the descriptor (not ``mmap.flush``) because it releases the GIL
        while the disk works, so readers keep running."""
        with self._lock:
            if self._fd < 0 or not self.dirty:
                return
            self.dirty = False
            try:
                os.fdatasync(self._fd)
            except OSError as exc:
                self.dirty = True
                raise _os_error(self.path, "fdatasync", exc)

    def close(self) -> None:
        """Release the descriptor and, unless a reader still holds a buffer of it, the mapping."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        try:
            self.mm.close()
        except BufferError:
            pass  # a reader still holds a view (numpy array); unmapped when that view dies

    def delete(self) -> None:
        """Remove the file from disk. The mapping is left to the garbage collector so readers
        holding this object never see it closed under them."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        _unlink_quietly(self.path)

    @property
    def closed(self) -> bool:
        return self._fd < 0


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
