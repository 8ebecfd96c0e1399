"""The store checkpoint: what is durable, written atomically (ref ST6).

File ``<data>/checkpoint`` is JSON (msgspec), replaced by write-tmp, fsync, rename, fsync-dir:

    {"version": 2,
     "commitlog_flushed": <phys offset below which the CommitLog is durable>,
     "dispatched": <phys offset below which every consume queue and the index are durable>,
     "index_log_end": <position of the consume queue log (store/index_log.py) durable with it>,
     "queues": {},
     "index_phys": <CommitLog offset of the last batch in the durable index, -1 if none>,
     "written_at": <ms since epoch>}

Version 1 (per-queue consume queue files) listed every queue's durable max offset in
``queues`` -- a walk of all queues every second; version 2 records one log position instead
(its size does not grow with the number of queues). A version 1 checkpoint is still read: the
old layout is then copied into the log and ``queues`` checked against it.

``dispatched`` is always a batch boundary and never above ``commitlog_flushed``. Recovery scans
the CommitLog from ``dispatched`` and rebuilds what lies beyond it; ``queues`` and
``index_phys`` let it notice a consume queue or index that was deleted or damaged (then
everything is rebuilt from the CommitLog).
A second file, ``<data>/abort``, exists while the store is open: found at start-up it means the
last run did not close cleanly.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from tidemq.base import atomic_file
from tidemq.protocol.errors import StoreWriteError


class Checkpoint(msgspec.Struct):
    version: int = 1
    commitlog_flushed: int = 0
    dispatched: int = 0
    queues: dict[str, int] = {}
    index_log_end: int = 0
    index_phys: int = -1
    written_at: int = 0


def queue_key(topic: str, queue_id: int) -> str:
    return f"{topic}\x00{queue_id}"


def split_queue_key(key: str) -> tuple[str, int]:
    topic, _, qid = key.rpartition("\x00")
    return topic, int(qid)


def write_atomic(path: Path, data: bytes) -> None:
    """Durably replace ``path`` with ``data`` (tmp + fsync + rename + fsync of the directory)."""
    try:
        atomic_file.write_atomic(path, data)
    except OSError as exc:
        raise StoreWriteError(f"cannot write {path}: {exc.strerror}") from exc


def load_checkpoint(path: Path) -> tuple[Checkpoint | None, str | None]:
    """(checkpoint, problem). A missing file is (None, None); a garbled one (None, reason)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None, None
    try:
        cp = msgspec.json.decode(raw, type=Checkpoint)
    except msgspec.DecodeError as exc:
        return None, f"{path} is unreadable ({exc}); rebuilding indexes from the CommitLog"
    if cp.dispatched > cp.commitlog_flushed or cp.dispatched < 0:
        return None, f"{path} is inconsistent (dispatched > flushed); rebuilding from the CommitLog"
    return cp, None


def save_checkpoint(path: Path, cp: Checkpoint) -> None:
    write_atomic(path, msgspec.json.encode(cp))
