"""What a push consumer's listener returns and receives (RocketMQ's ConsumeConcurrentlyStatus,
ConsumeOrderlyStatus, MessageModel and consume contexts; ref CO1, CO5, CO6).

A concurrent listener ``(msgs, ctx) -> ConsumeStatus`` returns SUCCESS or RECONSUME_LATER (an
exception counts as RECONSUME_LATER). It may also set ``ctx.ack_index``: messages after that
index are retried, those up to it are consumed (RocketMQ's ackIndex).

An orderly listener ``(msgs, ctx) -> ConsumeOrderlyStatus`` returns SUCCESS or
SUSPEND_CURRENT_QUEUE_A_MOMENT (the queue waits ``ctx.suspend_seconds``, 1 s, and the same
messages come again; an exception counts as a suspend).

A listener may be a plain function (run on the consumer's thread pool, 20 threads) or an
``async def`` (run on the consumer's event loop; it must not block).

Hooks (``ConsumeHook``) run around every listener call on the same thread as the listener:
``before(ctx)`` and ``after(ctx)``; ``ctx.status`` is set for ``after``.

All values here are plain data: any thread may use them.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tidemq.client.message import MessageExt, MessageQueue

__all__ = [
    "ConsumeStatus",
    "ConsumeOrderlyStatus",
    "MessageModel",
    "ConsumeContext",
    "ConsumeHook",
    "Listener",
]


class ConsumeStatus(enum.StrEnum):
    SUCCESS = "CONSUME_SUCCESS"
    RECONSUME_LATER = "RECONSUME_LATER"


class ConsumeOrderlyStatus(enum.StrEnum):
    SUCCESS = "SUCCESS"
    SUSPEND_CURRENT_QUEUE_A_MOMENT = "SUSPEND_CURRENT_QUEUE_A_MOMENT"


class MessageModel(enum.StrEnum):
    CLUSTERING = "clustering"  # the group shares the queues; each message to one member
    BROADCASTING = "broadcasting"  # every member gets every message


@dataclass
class ConsumeContext:
    """Given to every listener call (and to hooks)."""

    group: str
    message_queue: MessageQueue
    msgs: list[MessageExt] = field(default_factory=list)
    orderly: bool = False
    #: Concurrent: index of the last consumed message when the status is SUCCESS (default all).
    ack_index: int = -1
    #: Orderly: how long a SUSPEND_CURRENT_QUEUE_A_MOMENT waits.
    suspend_seconds: float = 1.0
    #: Set after the call: the status (for ``ConsumeHook.after``).
    status: str | None = None
    #: Free for hooks to pass data from ``before`` to ``after``.
    props: dict[str, Any] = field(default_factory=dict)


class ConsumeHook(Protocol):
    def before(self, ctx: ConsumeContext) -> None: ...
    def after(self, ctx: ConsumeContext) -> None: ...


Listener = Callable[[list[MessageExt], ConsumeContext], Any | Awaitable[Any]]
