"""NOTIFICATION: held like a pull until something is poppable (docs/pop-dispatch.md).

RocketMQ 5's NotificationProcessor: a client with many (topic, broker) pairs to watch asks each
broker "tell me when this group has something to pop here" instead of holding a pop on each
(a held pop would take messages it may not want yet). The answer is SUCCESS with ``has_msg``:
True as soon as a queue of the topic (or the one named) has a message the group could pop --
a new one, or an in-flight one whose invisible time ran out (orderly: a message of a free
message group) -- else, after ``poll_ms``, False. Nothing is popped; the subscription's filter
is not applied (a hint: the pop that follows may still find nothing). Held and woken exactly as
a held pop (``pop_hold.py``: arrival, revive timer, ack).

Threads: the broker's event loop only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tidemq.broker.connection import decode_request
from tidemq.broker.errors import RequestRejected
from tidemq.broker.pop_hold import HeldPop
from tidemq.protocol.codes import ResponseCode
from tidemq.protocol.pop import ANY_QUEUE, NotificationRequestHeader, NotificationResponseHeader

if TYPE_CHECKING:
    from tidemq.broker.connection import BrokerConnection
    from tidemq.broker.pop_processor import PopProcessor
    from tidemq.protocol.frame import Frame

__all__ = ["NotificationHandler"]


class NotificationHandler:
    """NOTIFICATION requests of one broker, over its :class:`PopProcessor`."""

    def __init__(self, proc: PopProcessor) -> None:
        self.proc = proc
        self.answered = 0

    def handle(self, conn: BrokerConnection, frame: Frame) -> None:
        h: NotificationRequestHeader = decode_request(frame, NotificationRequestHeader)
        if frame.is_oneway:
            raise RequestRejected(ResponseCode.INVALID_ARGUMENT,
                                  "a notification cannot be one-way")
        self.proc._admit(h)  # the door of a pop: group, topic, queue, subscription, mode
        if self._attempt_at(conn, frame.opaque, h):
            return
        if h.poll_ms > 0:
            self.proc.hold.hold(HeldPop(conn, frame.opaque, h, self._attempt, self._expire,
                                        h.poll_ms / 1000.0, self.proc.broker.loop.time()))
        else:
            self._respond(conn, frame.opaque, False)

    def has_msg(self, h: NotificationRequestHeader) -> bool:
        proc = self.proc
        tc = proc.broker.topics.get(h.topic)
        if tc is None:
            return False
        qids = range(tc.read_queue_nums) if h.queue_id == ANY_QUEUE else (h.queue_id,)
        return any(proc.poppable(h.consumer_group, h.topic, q, h.init_mode, h.order)
                   for q in qids)

    def _attempt_at(self, conn: BrokerConnection, opaque: int,
                    h: NotificationRequestHeader) -> bool:
        if not self.has_msg(h):
            return False
        self._respond(conn, opaque, True)
        return True

    def _attempt(self, held: HeldPop) -> bool:
        return self._attempt_at(held.conn, held.opaque, held.header)

    def _expire(self, held: HeldPop) -> None:
        self._respond(held.conn, held.opaque, False)

    def _respond(self, conn: BrokerConnection, opaque: int, has_msg: bool) -> None:
        self.answered += 1
        conn.respond(opaque, ResponseCode.SUCCESS, NotificationResponseHeader(has_msg=has_msg))
