"""Small files replaced atomically: write a temporary file, fsync it, rename it over the
target, fsync the directory.

A reader (or a restart after kill -9 or a power cut) sees either the old file or the new one,
never a torn mix: the rename is atomic, and the directory's fsync makes the rename itself
durable. Every fsync's result is checked: an OSError propagates and the old file stays in
place. The one implementation for the broker's metadata (topics.json, consumer_offsets.json,
...), the store's checkpoints (store/checkpoint.py, store/timer_log.py) and the client's
offset file (client/offset_store.py).

RocketMQ keeps a ``.bak`` copy for the same reason (ConfigManager.persist); with an atomic
rename the copy is not needed.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

__all__ = ["write_atomic", "read_file"]


def write_atomic(path: str | os.PathLike[str], data: bytes, *, unique_tmp: bool = False) -> None:
    """Durably replace ``path`` with ``data``; its directory is created if missing.

    Blocking: call from a worker thread when the caller is an event loop and the file may be
    large. The temporary file is ``<path>.tmp`` (mode 0644), or with ``unique_tmp`` a fresh
    ``.<name>.*.tmp`` (mode 0600) for callers whose writes of one path may overlap."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    if unique_tmp:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.",
                                   suffix=".tmp")
    else:
        tmp = f"{path}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dfd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def read_file(path: str | os.PathLike[str]) -> bytes | None:
    """The file's bytes, or None when it does not exist (a leftover ``.tmp`` is ignored: it is
    a write that never completed)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None
