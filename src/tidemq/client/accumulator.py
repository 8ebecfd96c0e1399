"""The producer's batch accumulator (SPEC PR3; Pulsar's batch container, Kafka's
RecordAccumulator).

``send_async`` messages without routing options are collected per topic and sent as one batch
when ``batch_max_messages`` (1000) or ``batch_max_bytes`` (128 KiB) is reached or
``batch_max_delay`` (1 ms) has passed. Each message gets its own future and SendResult; the
messages of a batch share a queue. At most ``max_pending_messages`` messages may be unanswered
(queued here or in flight), so a caller that never awaits cannot grow memory without limit
(Pulsar's maxPendingMessages).

Threading: one event loop (the producer's).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from tidemq.client.errors import ProducerQueueFullError
from tidemq.client.message import Message, SendResult

__all__ = ["Accumulator"]

_Future = asyncio.Future

# Sends one batch of a topic; the result of the whole batch.
BatchSend = Callable[[str, list[Message]], Awaitable[SendResult]]


class Accumulator:
    def __init__(self, send: BatchSend, *, batch_max_messages: int, batch_max_bytes: int,
                 batch_max_delay: float, max_pending_messages: int) -> None:
        if max_pending_messages < 1:
            raise ValueError("max_pending_messages must be >= 1")
        self._send = send
        self.batch_max_messages = batch_max_messages
        self.batch_max_bytes = batch_max_bytes
        self.batch_max_delay = batch_max_delay
        self.max_pending_messages = max_pending_messages
        # The open batch of each topic: [messages, futures, body bytes, loop].
        self._open: dict[str, list[Any]] = {}
        self._flush_scheduled = False
        #: messages handed over and not answered yet (in an open batch or in flight)
        self.npending = 0
        #: the tasks of batches in flight (and other tracked sends)
        self.tasks: set[asyncio.Future[Any]] = set()
        #: when several topics' batches flush together: takes those it sends in frames of many
        #: batches per broker (SEND_MULTI_QUEUE, client/multi_sender.py), returns the rest
        self.send_many: Callable[[list[Any]], list[Any]] | None = None

    def check_room(self, n: int = 1) -> None:
        if self.npending + n > self.max_pending_messages:
            raise ProducerQueueFullError(
                f"{self.npending} messages sent with send_async are not answered yet "
                f"(max_pending_messages={self.max_pending_messages}); await some of their "
                "futures or `await producer.flush()` before sending more"
            )

    def add(self, msg: Message) -> asyncio.Future[SendResult]:
        """Queue ``msg`` into its topic's open batch (the caller checked room and counted it
        in ``npending``); its future."""
        pending = self._open.get(msg.topic)
        if pending is None:
            return self._start(msg)
        # The hot path, kept to the least work per message (no per-future callbacks: close()
        # waits for the batch's task instead).
        fut: asyncio.Future[SendResult] = _Future(loop=pending[3])
        msgs = pending[0]
        msgs.append(msg)
        pending[1].append(fut)
        size = pending[2] + len(msg.body)
        pending[2] = size
        if len(msgs) >= self.batch_max_messages or size >= self.batch_max_bytes:
            self._dispatch(msg.topic)
        return fut

    def _start(self, msg: Message) -> asyncio.Future[SendResult]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[SendResult] = loop.create_future()
        # [messages, futures, body bytes, loop]
        pending = self._open[msg.topic] = [[msg], [fut], len(msg.body), loop]
        if self.batch_max_messages <= 1 or pending[2] >= self.batch_max_bytes:
            self._dispatch(msg.topic)
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            if self.batch_max_delay > 0:
                loop.call_later(self.batch_max_delay, self.flush_open)
            else:
                loop.call_soon(self.flush_open)
        return fut

    @property
    def has_open(self) -> bool:
        return bool(self._open)

    def flush_open(self) -> None:
        """Send every open batch now."""
        self._flush_scheduled = False
        pending, self._open = self._open, {}
        loop = asyncio.get_running_loop()
        if self.send_many is not None and len(pending) > 1:
            rest = self.send_many([(t, p[0], p[1]) for t, p in pending.items()])
            for topic, msgs, futs in rest:
                self.track(loop.create_task(self._send_batch(topic, msgs, futs)))
            return
        for topic, (msgs, futs, _size, _loop) in pending.items():
            self.track(loop.create_task(self._send_batch(topic, msgs, futs)))

    def send_single(self, batch: tuple[str, list[Message], list[Any]]) -> None:
        """Send one open batch (topic, messages, futures) through the single-batch path."""
        topic, msgs, futs = batch
        self.track(asyncio.get_running_loop().create_task(self._send_batch(topic, msgs, futs)))

    def answered(self, n: int) -> None:
        self.npending -= n

    def _dispatch(self, topic: str) -> None:
        """Send the full batch of ``topic`` now."""
        msgs, futs, _size, loop = self._open.pop(topic)
        self.track(loop.create_task(self._send_batch(topic, msgs, futs)))

    def track(self, task: asyncio.Future[Any]) -> None:
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def wait_all(self) -> None:
        """Until every tracked send is answered (failures stay in their futures)."""
        while self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)

    async def _send_batch(self, topic: str, msgs: list[Message],
                          futs: list[asyncio.Future[SendResult]]) -> None:
        try:
            r = await self._send(topic, msgs)
        except BaseException as exc:
            self.npending -= len(msgs)
            for f in futs:
                if not f.done():
                    f.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        self.npending -= len(msgs)
        split_result(r, futs)


def split_result(r: SendResult, futs: list[asyncio.Future[SendResult]]) -> None:
    """Give each message of a batch its own SendResult (message i: offset and sequence + i)."""
    pid = r.producer_id
    prefix = f"{pid:016X}"  # unique_id(pid, seq), formatted once per batch
    status, topic, qid, qoff, bname, base = (r.status, r.topic, r.queue_id, r.queue_offset,
                                             r.broker_name, r.base_seq)
    step = 1 if qoff >= 0 else 0  # a DUPLICATE batch has no offsets: -1 for each
    for i, f in enumerate(futs):
        if not f.done():
            seq = base + i
            f.set_result(SendResult(status, f"{prefix}{seq:016X}", topic, qid,
                                    qoff + i * step, 1, bname, pid, seq))
