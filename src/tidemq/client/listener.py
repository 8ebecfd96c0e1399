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


class ConsumeContext:
    """Given to every listener call (and to hooks).

    A plain class with slots rather than a dataclass: one is built per listener call (per
    message, by default), and ``props`` is only made when a hook asks for it."""

    __slots__ = ("group", "message_queue", "msgs", "orderly", "ack_index", "suspend_seconds",
                 "status", "_props")

    def __init__(self, group: str, message_queue: MessageQueue,
                 msgs: list[MessageExt] | None = None, orderly: bool = False,
                 ack_index: int = -1, suspend_seconds: float = 1.0, status: str | None = None,
                 props: dict[str, Any] | None = None) -> None:
        self.group = group
        self.message_queue = message_queue
        self.msgs: list[MessageExt] = msgs if msgs is not None else []
        self.orderly = orderly
        #: Concurrent: index of the last consumed message when the status is SUCCESS (default
        #: all).
        self.ack_index = ack_index
        #: Orderly: how long a SUSPEND_CURRENT_QUEUE_A_MOMENT waits.
        self.suspend_seconds = suspend_seconds
        #: Set after the call: the status (for ``ConsumeHook.after``).
        self.status = status
        self._props = props

    @property
    def props(self) -> dict[str, Any]:
        """Free for hooks to pass data from ``before`` to ``after``."""
        p = self._props
        if p is None:
            p = self._props = {}
        return p

    def __repr__(self) -> str:
        return (f"ConsumeContext(group={self.group!r}, message_queue={self.message_queue!r}, "
                f"msgs=<{len(self.msgs)}>, orderly={self.orderly}, ack_index={self.ack_index}, "
                f"status={self.status!r})")


class ConsumeHook(Protocol):
    def before(self, ctx: ConsumeContext) -> None: ...
    def after(self, ctx: ConsumeContext) -> None: ...


Listener = Callable[[list[MessageExt], ConsumeContext], Any | Awaitable[Any]]
