"""What a read from a queue comes back as, and the one rule that decides its status.

RocketMQ's GetMessageStatus (``GetStatus``) and the result of a read (``GetResult``: status, the
queue offset to read next, the queue's bounds, the batches found). Both readers -- the
CommitLog store (``message_store.py``) and the in-memory window of non-persistent topics
(``broker/non_persistent.py``) -- decide the status with :func:`position_outcome` before they
read and :func:`read_outcome` after, so a client sees the same statuses and next offsets from
either.

Threads: plain values and pure functions.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tidemq.protocol.record import BatchView, StoredMessage

__all__ = ["GetStatus", "GetResult", "ReadBatch", "position_outcome", "read_outcome"]


class GetStatus(enum.StrEnum):
    """RocketMQ's GetMessageStatus."""

    FOUND = "FOUND"
    NO_MATCHED_MESSAGE = "NO_MATCHED_MESSAGE"
    MESSAGE_WAS_REMOVING = "MESSAGE_WAS_REMOVING"
    OFFSET_FOUND_NULL = "OFFSET_FOUND_NULL"
    OFFSET_OVERFLOW_BADLY = "OFFSET_OVERFLOW_BADLY"
    OFFSET_OVERFLOW_ONE = "OFFSET_OVERFLOW_ONE"
    OFFSET_TOO_SMALL = "OFFSET_TOO_SMALL"
    NO_MATCHED_LOGIC_QUEUE = "NO_MATCHED_LOGIC_QUEUE"
    NO_MESSAGE_IN_QUEUE = "NO_MESSAGE_IN_QUEUE"


@dataclass(slots=True)
class ReadBatch:
    """A whole stored batch (zero-copy view of the mapping) and the first message wanted."""

    data: memoryview
    first_index: int
    queue_offset: int  # queue offset of message ``first_index``
    count: int  # messages from first_index to the batch's end

    def messages(self) -> list[StoredMessage]:
        return list(BatchView(self.data).messages(self.first_index))


@dataclass(slots=True)
class GetResult:
    status: GetStatus
    next_begin_offset: int
    min_offset: int
    max_offset: int
    batches: list[ReadBatch] = field(default_factory=list)

    @property
    def message_count(self) -> int:
        return sum(b.count for b in self.batches)

    def messages(self) -> list[StoredMessage]:
        out: list[StoredMessage] = []
        for b in self.batches:
            out.extend(b.messages())
        return out


def position_outcome(exists: bool, offset: int, mn: int, mx: int) -> GetResult | None:
    """The result of a read at queue offset ``offset`` of a queue holding [mn, mx) that ends
    before anything is read, or None when ``offset`` is inside [mn, mx) and the reader must look.

    RocketMQ's DefaultMessageStore.getMessage: no such queue -> NO_MATCHED_LOGIC_QUEUE; an
    empty queue -> NO_MESSAGE_IN_QUEUE (next 0); below mn -> OFFSET_TOO_SMALL (next mn); at mx
    -> OFFSET_OVERFLOW_ONE (next mx); past mx -> OFFSET_OVERFLOW_BADLY (next mn when mn is 0,
    else mx)."""
    if not exists:
        return GetResult(GetStatus.NO_MATCHED_LOGIC_QUEUE, 0, 0, 0)
    if mx == 0:
        return GetResult(GetStatus.NO_MESSAGE_IN_QUEUE, 0, mn, mx)
    if offset < mn:
        return GetResult(GetStatus.OFFSET_TOO_SMALL, mn, mn, mx)
    if offset == mx:
        return GetResult(GetStatus.OFFSET_OVERFLOW_ONE, offset, mn, mx)
    if offset > mx:
        return GetResult(GetStatus.OFFSET_OVERFLOW_BADLY, mn if mn == 0 else mx, mn, mx)
    return None


def read_outcome(
    next_offset: int, mn: int, mx: int, batches: list[ReadBatch], removed: bool = False
) -> GetResult:
    """The result of a read inside [mn, mx) that stopped before ``next_offset``: FOUND with
    batches; else MESSAGE_WAS_REMOVING when what it passed had been deleted by retention; else
    NO_MATCHED_MESSAGE (nothing matched the filter)."""
    if batches:
        status = GetStatus.FOUND
    elif removed:
        status = GetStatus.MESSAGE_WAS_REMOVING
    else:
        status = GetStatus.NO_MATCHED_MESSAGE
    return GetResult(status, next_offset, mn, mx, batches)
