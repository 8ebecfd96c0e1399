"""Small metadata files replaced atomically: topics.json, consumer_offsets.json.

A reader (or a restart after kill -9 or a power cut) sees either the old file or the new one,
never a torn mix, because a write goes: write ``<name>.tmp`` -> fsync it -> rename over
``<name>`` -> fsync the directory (so the rename itself is durable). Every fsync's result is
checked: an OSError propagates and the old file stays in place.

RocketMQ keeps a ``.bak`` copy for the same reason (ConfigManager.persist); with an atomic
rename the copy is not needed.
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["write_atomic", "read_file"]


def write_atomic(path: str, data: bytes) -> None:
    """Durably replace ``path`` with ``data`` (blocking: call from a worker thread when the
    caller is an event loop and the file may be large)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def read_file(path: str) -> bytes | None:
    """The file's bytes, or None when it does not exist (a leftover ``.tmp`` is ignored: it is
    a write that never completed)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None
