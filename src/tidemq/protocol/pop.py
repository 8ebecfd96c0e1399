"""Headers of server-side dispatch (POP; docs/pop-dispatch.md, docs/protocol.md).

Three requests, each a msgspec map like every header (``headers.py``)::

    POP_MESSAGE            PopMessageRequestHeader      -> PopMessageResponseHeader
                                                           body: whole stored batches
    ACK_MESSAGE            AckMessageRequestHeader      -> AckMessageResponseHeader
    CHANGE_INVISIBLE_TIME  ChangeInvisibleRequestHeader -> ChangeInvisibleResponseHeader
    NOTIFICATION           NotificationRequestHeader    -> NotificationResponseHeader

A pop answer's body holds whole stored batches, exactly as stored (never re-encoded), from one
topic and possibly several queues; ``batches[j]`` says which messages of body batch ``j`` are
this consumer's (a member bitmap, ``protocol/members.py``) and their delivery attempts. With
the answer-wide ``broker``, ``pop_time`` and ``invisible_ms`` that is everything a receipt
handle holds (:func:`receipt_handles`), so handles cost no bytes per message on the wire.

An empty pop (nothing poppable before ``poll_ms`` passed) is answered PULL_NOT_FOUND with
this header and no batches. ACK_MESSAGE answers one code per handle, in request order:
SUCCESS, NO_MESSAGE (stale: acked already, or delivered again since) or INVALID_ARGUMENT
(the handle does not decode, or is of another topic/broker).

Sans-IO; any thread.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from tidemq.protocol.members import members as member_indices
from tidemq.protocol.receipt import MAX_INVISIBLE_MS, ReceiptHandle

__all__ = [
    "INIT_EARLIEST",
    "INIT_LATEST",
    "ANY_QUEUE",
    "PopMessageRequestHeader",
    "PoppedBatch",
    "PopMessageResponseHeader",
    "AckMessageRequestHeader",
    "AckMessageResponseHeader",
    "ChangeInvisibleRequestHeader",
    "ChangeInvisibleResponseHeader",
    "SeekRequestHeader",
    "SeekResponseHeader",
    "NotificationRequestHeader",
    "NotificationResponseHeader",
    "receipt_handles",
    "receipt_strings",
    "MAX_POP_MESSAGES",
    "MAX_ACKS_PER_FRAME",
]

INIT_EARLIEST = "EARLIEST"
INIT_LATEST = "LATEST"
ANY_QUEUE = -1
MAX_POP_MESSAGES = 1024
MAX_ACKS_PER_FRAME = 4096



class Header(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """As ``headers.Header`` (a map, defaults omitted); own copy so that headers.py can
    register these types without an import cycle."""


_Invisible = Annotated[int, msgspec.Meta(ge=1, le=MAX_INVISIBLE_MS)]
_QueueId = Annotated[int, msgspec.Meta(ge=-1, le=2**31 - 1)]
_Max = Annotated[int, msgspec.Meta(ge=1, le=MAX_POP_MESSAGES)]
_Poll = Annotated[int, msgspec.Meta(ge=0, le=60_000)]


class PopMessageRequestHeader(Header):
    """POP_MESSAGE: up to ``max_msg_nums`` messages of ``topic`` (queue ``queue_id``, or any:
    -1) for ``consumer_group``, each invisible to the group for ``invisible_ms``; held up to
    ``poll_ms`` when nothing is poppable (long polling). ``init_mode``: where a queue the
    group never consumed starts (EARLIEST or LATEST)."""

    consumer_group: str
    topic: str
    queue_id: _QueueId = ANY_QUEUE
    max_msg_nums: _Max = 32
    invisible_ms: _Invisible = 30_000
    poll_ms: _Poll = 0
    subscription: str | None = None  # "*", "TagA || TagB" or an SQL92 expression
    expression_type: str = "TAG"  # TAG or SQL92
    init_mode: str = INIT_LATEST
    #: a Pulsar-style consumer (``client/subscription_consumer.py``): its name (its client
    #: id in the group's heartbeats) and subscription type; "" for a SimpleConsumer
    consumer: str = ""
    subscription_type: str = ""
    #: orderly POP (RocketMQ 5 FIFO): one message per message group (the ``__SHARDINGKEY``
    #: property, else the queue) in flight at a time, in queue order
    order: bool = False


class PoppedBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Body batch ``j`` of a pop answer: its queue, which of its messages were popped
    (``members``, bit i = message i of the batch) and, when not all first deliveries, the
    delivery attempt of each member in member order."""

    queue_id: int
    members: bytes
    attempts: list[int] = []


class PopMessageResponseHeader(Header):
    broker: str
    pop_time: int  # ms since the epoch: every handle of this answer has it
    invisible_ms: int
    revive_queue_id: int = 0
    batches: list[PoppedBatch] = []


class AckMessageRequestHeader(Header):
    """ACK_MESSAGE: the receipt handles of ``consumer_group`` (one frame per flush of the
    client's ack buffer)."""

    consumer_group: str
    handles: list[str]


class AckMessageResponseHeader(Header):
    """One response code per handle, in request order (SUCCESS, NO_MESSAGE, INVALID_ARGUMENT)."""

    results: list[int] = []


class ChangeInvisibleRequestHeader(Header):
    """CHANGE_INVISIBLE_TIME of one receipt handle (``handle``, ``invisible_ms``), or of many in
    one frame (``handles`` with ``invisible``, one time each: a client's negative acks of one
    loop turn, as acks are grouped) -- exactly one of the two forms."""

    consumer_group: str
    handle: str = ""
    invisible_ms: _Invisible = 30_000
    handles: list[str] = []
    invisible: list[_Invisible] = []


class ChangeInvisibleResponseHeader(Header):
    """The new receipt handle; the old one is stale from now on. For ``handles``: per handle in
    request order, its code in ``results`` (SUCCESS, NO_MESSAGE: stale, INVALID_ARGUMENT) and
    its new handle in ``handles`` ("" unless SUCCESS)."""

    handle: str = ""
    handles: list[str] = []
    results: list[int] = []


class NotificationRequestHeader(Header):
    """NOTIFICATION: answer ``has_msg`` as soon as something of ``topic`` (queue ``queue_id``,
    or any: -1) is poppable for ``consumer_group`` -- held up to ``poll_ms`` like a pop, but
    nothing is popped. A hint: the subscription's filter is not applied, so a pop after
    ``has_msg`` may still find nothing."""

    consumer_group: str
    topic: str
    queue_id: _QueueId = ANY_QUEUE
    poll_ms: _Poll = 0
    subscription: str | None = None  # checked at the door as a pop's
    expression_type: str = "TAG"
    init_mode: str = INIT_LATEST
    order: bool = False


class NotificationResponseHeader(Header):
    has_msg: bool = False


class SeekRequestHeader(Header):
    """SEEK_SUBSCRIPTION: move ``consumer_group``'s POP state of ``topic`` (queue
    ``queue_id``, or every queue: -1) to ``offset``, or to the first message stored at or
    after ``timestamp`` (ms) when ``offset`` is -1. Deliveries in flight become stale."""

    consumer_group: str
    topic: str
    queue_id: _QueueId = ANY_QUEUE
    offset: Annotated[int, msgspec.Meta(ge=-1)] = -1
    timestamp: Annotated[int, msgspec.Meta(ge=-1)] = -1


class SeekResponseHeader(Header):
    """The queues moved and the offset each starts from now."""

    offsets: dict[int, int] = {}


def receipt_handles(h: PopMessageResponseHeader, topic: str, j: int, base_offset: int
                    ) -> list[ReceiptHandle]:
    """The receipt handles of the members of body batch ``j`` (whose first message has queue
    offset ``base_offset``), in member order."""
    b = h.batches[j]
    idx = member_indices(b.members)
    attempts = b.attempts or [1] * len(idx)
    if len(attempts) != len(idx):
        raise ValueError(f"pop answer batch {j}: {len(idx)} members but {len(attempts)} attempts")
    return [ReceiptHandle(h.broker, topic, b.queue_id, base_offset + i, h.pop_time,
                          h.invisible_ms, h.revive_queue_id, a)
            for i, a in zip(idx, attempts, strict=True)]


def receipt_strings(h: PopMessageResponseHeader, topic: str, j: int, base_offset: int
                    ) -> list[tuple[int, int, str, int]]:
    """``(queue id, offset, receipt handle string, attempt)`` of the members of body batch
    ``j``: :func:`receipt_handles` encoded, without building and re-checking each handle (the
    client's hot path; the broker checks every handle it is given back)."""
    b = h.batches[j]
    idx = member_indices(b.members)
    attempts = b.attempts or [1] * len(idx)
    if len(attempts) != len(idx):
        raise ValueError(f"pop answer batch {j}: {len(idx)} members but {len(attempts)} attempts")
    q = b.queue_id
    head = f"v1 {h.broker} {topic} {q} "
    tail = f" {h.pop_time} {h.invisible_ms} {h.revive_queue_id} "
    return [(q, base_offset + i, f"{head}{base_offset + i}{tail}{a}", a)
            for i, a in zip(idx, attempts, strict=True)]
