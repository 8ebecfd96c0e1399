"""A slave's side of CommitLog replication, without the network: bytes in, records stored.

The master streams ranges of its CommitLog (``feed(phys, data)``: the bytes it holds at
``phys``), cut wherever its reads ended -- in the middle of a batch, inside a filler's zeros.
:class:`ReplicaAppender` keeps the bytes of the record that is not complete yet and hands the
store whole records only (``MessageStore.append_replicated``), so the store's write position is
always a record boundary, as it is on a master: a crash of the slave leaves no torn record the
master did not write, and the offset it reports back is always one the master can resume from.

Positions, not counts, drive it: data below what the store already has (a filler's zeros, which
the store skips by jumping to the next segment) is dropped; data beyond it is a gap in the
stream and refused (StoreError), which makes the caller reconnect and resume.

Threads: one caller at a time (the broker's HA client thread).
"""

from __future__ import annotations

from collections.abc import Callable

from tidemq.protocol.errors import StoreError
from tidemq.store.message_store import MessageStore

__all__ = ["ReplicaAppender"]


class ReplicaAppender:
    def __init__(self, store: MessageStore) -> None:
        self.store = store
        self._pending = bytearray()

    @property
    def position(self) -> int:
        """CommitLog offset of the next byte wanted from the master."""
        return self.store.max_phys_offset + len(self._pending)

    def reset(self) -> None:
        """Forget a partial record (a new connection resends from ``store.max_phys_offset``)."""
        self._pending.clear()

    def feed(self, phys: int, data: bytes | bytearray | memoryview,
             on_written: Callable[[int], None] | None = None) -> int:
        """Take ``data``, the master's bytes at ``phys``; store every record it completes.
        ``on_written(position)`` runs once the CommitLog has them, before they are dispatched
        (``MessageStore.append_replicated``). Returns the store's write position afterwards."""
        store = self.store
        want = self.position
        mv = memoryview(data).cast("B")
        if phys > want:
            raise StoreError(
                f"replication stream skipped bytes: got data at {phys}, expected {want}"
            )
        if phys + len(mv) <= want:
            return store.max_phys_offset
        mv = mv[want - phys :]
        pending = self._pending
        if pending:
            pending += mv
            buf: bytes | bytearray | memoryview = pending
        else:
            buf = mv
        start = store.max_phys_offset
        used = 0
        n = len(buf)
        while used < n:
            new = store.append_replicated(memoryview(buf)[used:], on_written)
            step = new - start - used
            if step <= 0:
                break
            used += step
        if used >= n:
            # Everything was taken, or a filler moved the store past the end of what arrived
            # (its zeros): later bytes below the store's position are dropped by position.
            pending.clear()
        elif buf is pending:
            del pending[:used]
        else:
            pending[:] = buf[used:]
        return store.max_phys_offset
