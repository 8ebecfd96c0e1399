"""The asyncio producer (ref PR1-PR6, PR9): a short front over its parts.

Sending one message or a batch is the same path: pick a queue, encode the messages into one
batch, send it as SEND_MESSAGE / SEND_BATCH and turn the response into a SendResult. The parts,
one job each:

- ``send_router.py`` -- routes (auto-created ones too) and the queue of each batch: round robin,
  or pinned by ``queue_id=`` / ``selector=`` / ``hash_key=``; slow or failed brokers avoided.
- ``accumulator.py`` -- the batch container of ``send_async`` (PR3): messages without routing
  options travel together, each with its own SendResult; the pending bound.
- ``sequencer.py`` -- the producer id and sequences (PR6, PR9), and a named producer's
  deduplication (BR12: continue after the brokers' last sequence).
- ``chunking.py`` -- messages above ``max_message_size`` as chunks (PR5).
- ``retry_policy.py`` -- what a failure does next (PR1): another broker, a wait, or give up.
- ``batch_sender.py`` -- one batch: encode (compression PR4), send, retry, answer.

Statuses, deduplication and the options are described on :class:`Producer` and in
docs/producer-path.md.

Threading: one event loop. Use ``tidemq.Producer`` from threads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, cast

from tidemq.client import chunking
from tidemq.client.accumulator import Accumulator
from tidemq.client.batch_sender import BatchSender, Started
from tidemq.client.columns import Columns
from tidemq.client.connection import DEFAULT_TIMEOUT, ConnectionPool
from tidemq.client.errors import ClientClosedError, NoRouteError
from tidemq.client.message import Message, MessageQueue, SendResult
from tidemq.client.multi_sender import MultiQueueSender
from tidemq.client.retry_policy import RetryPolicy
from tidemq.client.route import RouteCache, TopicRoute
from tidemq.client.send_router import Selector, SendRouter
from tidemq.client.sequencer import Sequencer
from tidemq.protocol.codes import RequestCode
from tidemq.protocol.headers import CancelTimerMessageRequestHeader
from tidemq.protocol.names import group_name_problem
from tidemq.protocol.record import DEFAULT_MAX_PROPERTIES_SIZE, Compression

__all__ = ["Producer", "Selector", "SendCallback"]

SendCallback = Callable[[SendResult | None, BaseException | None], None]

DEFAULT_GROUP = "DEFAULT_PRODUCER"
_ROUTING_OPTIONS = frozenset({"timeout", "queue_id", "selector", "arg", "hash_key"})
MAX_MESSAGE_SIZE = 4 * 1024 * 1024  # the broker's default batch limit (ref BR1)
#: An automatic batch leaves at this many bytes of bodies (or ``batch_max_messages``). 512 KiB,
#: not 128: a batch costs ~150 µs of client CPU beyond its messages (its request, the frame's
#: write, the answer, the encoder's per-batch calls), so ~125 varied 1 KiB messages a batch
#: paid ~1.2 µs each for it; at ~500 a batch `bench app`'s send_async used 3.9-4.1 instead of
#: 4.6-5.9 µs of client CPU and 3.2-3.6 instead of 4.4-4.9 µs of broker CPU per message
#: (docs/benchmarks.md, fifth session). 1 MiB measured no better.
BATCH_MAX_BYTES = 512 * 1024


def _pins(options: dict[str, Any]) -> bool:
    return (options.get("queue_id") is not None or options.get("selector") is not None
            or options.get("hash_key") is not None)


class Producer:
    """Sends messages to a topic's brokers. One event loop; an async context manager.

    Options: ``send_timeout`` (3 s, covers all retries), ``retries`` (2), ``max_message_size``
    (4 MiB per batch, checked before sending), ``compression`` ("none", "lz4", "zstd", "zlib")
    with ``compress_min`` bytes, ``latency_fault`` (True: avoid slow/failed brokers),
    ``route_refresh`` (30 s), ``pool`` (share a ConnectionPool between clients),
    ``max_pending_messages`` (100 000 unanswered messages at most) and
    ``block_if_queue_full`` (True: a ``send`` waits for room; False: it raises),
    ``retry_another_broker_when_not_store_ok`` (False: see below), ``max_properties_size``
    (32 KiB of encoded properties per message, the broker's default ``max_properties_size``;
    raise both together).
    ``multi_queue`` (True): when the batching timer sends the open batches of several topics,
    those bound for one broker leave as one SEND_MULTI_QUEUE frame (client/multi_sender.py;
    named producers always send one batch per request).

    Statuses (docs/cluster.md): only ``SendStatus.SEND_OK`` means the message is where the
    broker promises (on disk under SYNC_FLUSH, on the in-sync slaves under SYNC_MASTER).
    FLUSH_DISK_TIMEOUT, FLUSH_SLAVE_TIMEOUT and SLAVE_NOT_AVAILABLE mean "stored on the master,
    not yet safe": the result says so and the send is not repeated, since a resend would store
    it twice -- unless ``retry_another_broker_when_not_store_ok`` (RocketMQ's
    retryAnotherBrokerWhenNotStoreOK), which sends it again to another broker's queue (at most
    ``retries`` times; pinned sends and deduplicated producers are never moved) and returns the
    last result: a duplicate rather than a message at risk.

    A message the broker's door would refuse (protocol/batch_rules.py) is refused before it is
    sent, with MessageRejectedError: a topic name outside RocketMQ's rule (protocol/names.py),
    properties over the limit, a negative delay level, a deliver_at out of range. A group name
    outside the rule is a ValueError here.
    """

    def __init__(
        self,
        namesrv: str | Sequence[str],
        group: str | None = None,
        *,
        send_timeout: float = DEFAULT_TIMEOUT,
        retries: int = 2,
        max_message_size: int = MAX_MESSAGE_SIZE,
        compression: str = "none",
        compress_min: int = 1024,
        latency_fault: bool = True,
        auto_create_route: bool = True,
        auto_batch: bool = True,
        batch_max_messages: int = 1000,
        batch_max_bytes: int = BATCH_MAX_BYTES,
        batch_max_delay: float = 0.001,
        producer_name: str | None = None,
        default_topic_queues: int = 8,
        route_refresh: float = 30.0,
        pool: ConnectionPool | None = None,
        max_pending_messages: int = 100_000,
        block_if_queue_full: bool = True,
        retry_another_broker_when_not_store_ok: bool = False,
        max_properties_size: int = DEFAULT_MAX_PROPERTIES_SIZE,
        multi_queue: bool = True,
    ) -> None:
        problem = group_name_problem(group, "producer group") if group is not None else None
        if problem:
            raise ValueError(problem)
        if compression not in Compression.NAMES:
            raise ValueError(f"compression must be one of {sorted(Compression.NAMES)}")
        self.group = group or DEFAULT_GROUP
        self.send_timeout = send_timeout
        self.max_message_size = max_message_size
        self.auto_batch = auto_batch
        self.block_if_queue_full = block_if_queue_full
        self.producer_name = producer_name
        policy = RetryPolicy(retries, retry_another_broker_when_not_store_ok)
        self.sequencer = Sequencer(producer_name)
        self.producer_id = self.sequencer.producer_id
        self._own_pool = pool is None
        self.pool = pool if pool is not None else ConnectionPool(connect_timeout=send_timeout)
        self.routes = RouteCache(self.pool, namesrv, refresh_interval=route_refresh,
                                 timeout=send_timeout)
        self.router = SendRouter(self.routes, latency_fault=latency_fault,
                                 auto_create_route=auto_create_route,
                                 default_topic_queues=default_topic_queues)
        self.sender = BatchSender(
            group=self.group, pool=self.pool, router=self.router, sequencer=self.sequencer,
            policy=policy, send_timeout=send_timeout, max_message_size=max_message_size,
            max_properties_size=max_properties_size, compression=Compression.NAMES[compression],
            compress_min=compress_min,
        )
        self.sender.encode = self._encode
        self.accumulator = Accumulator(
            self._send_auto, batch_max_messages=batch_max_messages,
            batch_max_bytes=batch_max_bytes, batch_max_delay=batch_max_delay,
            max_pending_messages=max_pending_messages, check=self.sender.check,
        )
        acc = self.accumulator
        #: SEND_MULTI_QUEUE: the open batches of many topics leave as one frame per broker
        self.multi = MultiQueueSender(
            group=self.group, pool=self.pool, router=self.router,
            encode=lambda: self.sender.encode, producer_id=lambda: self.producer_id,
            send_timeout=send_timeout, single=acc.send_single, answered=acc.answered,
            track=acc.track,
        )
        if multi_queue and producer_name is None:
            acc.send_many = self.multi.take
        if type(self)._encode is Producer._encode and not self.sender.compression:
            # batches of one message written at once encoded as encode_batch would
            self.sender.encode_lone = True
            if multi_queue and producer_name is None:
                # batches encoded as encode_batch would (no subclass marks them)
                self.multi.encode_one = self.sender.encode_one
                self.multi.encode_small = self.sender.encode_small
                self.multi.packed_host = self.sender.packed_host
        acc.start_one = self._start_one
        acc.flush_now = self.pool.flush_now
        acc.finish_one = self.sender.finish
        acc.resume_one = self._resume_one
        self._started = False
        self._closed = False
        #: the loop the producer was started on (asyncio.get_running_loop() costs a getpid
        #: system call on Python 3.11: not once per send)
        self._loop: Any = None

    @property
    def last_sequence_id(self) -> int:
        """Named producers: the highest sequence the brokers had persisted, asked at start."""
        return self.sequencer.last_sequence_id

    @property
    def _npending(self) -> int:
        return self.accumulator.npending

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> Producer:
        if self._closed:
            raise ClientClosedError("this producer was closed; create a new one")
        if not self._started:
            self._started = True
            self._loop = asyncio.get_running_loop()
            self.routes.start()
            if self.producer_name:
                try:
                    await self.sequencer.fetch_last(self.routes, self.pool, self.send_timeout)
                except BaseException:
                    self._started = False
                    raise
        return self

    async def close(self) -> None:
        """Wait for async sends still in flight, then close connections. Idempotent."""
        if self._closed:
            return
        if self.accumulator.has_open:
            self.accumulator.flush_open()
        if self.accumulator.tasks:
            await asyncio.gather(*self.accumulator.tasks, return_exceptions=True)
        self._closed = True
        await self.routes.close()
        if self._own_pool:
            self.pool.close()

    async def __aenter__(self) -> Producer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _ensure_started(self) -> None:
        if not self._started or self._closed:
            await self.start()

    # -- public sends ------------------------------------------------------------------------
    async def send(
        self,
        msg: Message,
        *,
        queue_id: int | MessageQueue | None = None,
        selector: Selector | None = None,
        arg: Any = None,
        hash_key: str | bytes | None = None,
        timeout: float | None = None,
        sequence_id: int | None = None,
    ) -> SendResult:
        """Send one message and wait for the broker's answer. A message too large for one
        batch is sent in chunks (PR5); ``sequence_id`` sets its sequence explicitly.

        With ``auto_batch`` (the default) the message goes through the batch container
        (``accumulator.py``): it leaves at once when nothing of its topic (or, for a pinned
        send, its queue) is in flight, else it gathers with the sends arriving meanwhile and
        they leave together as one batch. Its result and its error are its own; ``timeout``
        covers the wait in the container; with ``max_pending_messages`` unanswered the send
        waits for room (``block_if_queue_full``, the default) or raises
        ProducerQueueFullError."""
        acc = self.accumulator
        if (
            sequence_id is not None or not self.auto_batch or not acc.may_join(msg)
        ):
            if len(msg.body) > self.max_message_size - chunking.CHUNK_HEADROOM // 2:
                return await self._send_chunked(msg, queue_id, selector, arg, hash_key, timeout,
                                                sequence_id)
            return await self._send(msg.topic, (msg,), queue_id, selector, arg, hash_key,
                                    timeout, RequestCode.SEND_MESSAGE, sequence_id)
        if not self._started or self._closed:
            await self._ensure_started()
        deadline = self._loop.time() + (self.send_timeout if timeout is None else timeout)
        key: Any = None
        mq: MessageQueue | None = None
        if queue_id is not None or selector is not None or hash_key is not None:
            route = self.routes.cached(msg.topic) or await self._route(msg.topic)
            mq, _pinned = self.router.select(route, msg, queue_id, selector, arg, hash_key,
                                             None)
            key = (msg.topic, mq)
        if acc.npending >= acc.max_pending_messages:
            if not self.block_if_queue_full:
                acc.check_room()
            await acc.room(deadline)
        acc.npending += 1
        return await acc.send(msg, key, mq, deadline)

    async def send_batch(
        self,
        msgs: Sequence[Message],
        *,
        queue_id: int | MessageQueue | None = None,
        selector: Selector | None = None,
        arg: Any = None,
        hash_key: str | bytes | None = None,
        timeout: float | None = None,
        sequence_id: int | None = None,
    ) -> SendResult:
        """Send messages of one topic as one batch (one queue, consecutive offsets).

        ``sequence_id``: the batch's base sequence (message i: ``sequence_id + i``) instead of
        the producer's next one -- for a deduplicated producer re-sending a batch with the ids
        it had (docs/producer-path.md)."""
        if not msgs:
            raise ValueError("send_batch needs at least one message")
        topic = msgs[0].topic
        for m in msgs:
            if m.topic != topic:
                raise ValueError(
                    f"a batch holds one topic; got {topic!r} and {m.topic!r}: send them apart"
                )
        return await self._send(topic, msgs, queue_id, selector, arg, hash_key, timeout,
                                RequestCode.SEND_BATCH, sequence_id)

    async def send_columns(self, cols: Columns, *, queue_id: int | MessageQueue,
                           sequence_id: int, timeout: float | None = None) -> SendResult:
        """Send rows given as columns (``client/columns.py``: no Message per row) as one
        batch to ``queue_id`` with base sequence ``sequence_id``; ``cols.producer_id`` (if set)
        makes the broker deduplicate it under that id instead of this producer's."""
        return await self._send(cols.topic, cols, queue_id, None, None, None,  # type: ignore[arg-type]
                                timeout, RequestCode.SEND_BATCH, sequence_id)

    async def _send_chunked(
        self, msg: Message, queue_id: int | MessageQueue | None, selector: Selector | None,
        arg: Any, hash_key: str | bytes | None, timeout: float | None, sequence_id: int | None,
    ) -> SendResult:
        """PR5: one batch per chunk, in order, to one queue (chunking.send_chunks)."""
        await self._ensure_started()
        route = self.routes.cached(msg.topic) or await self._route(msg.topic)
        mq, _pinned = self.router.select(route, msg, queue_id, selector, arg, hash_key, None)
        seq = self.sequencer.next_seq if sequence_id is None else sequence_id
        name = self.producer_name or f"{self.producer_id:016X}"

        async def one(part: Message, part_seq: int) -> SendResult:
            return await self._send(msg.topic, (part,), mq, None, None, None, timeout,
                                    RequestCode.SEND_MESSAGE, part_seq)

        return await chunking.send_chunks(msg, f"{name}-{seq}",
                                          chunking.chunk_body_size(self.max_message_size),
                                          seq, one)

    def send_async(
        self,
        msg: Message | Sequence[Message],
        callback: SendCallback | None = None,
        **options: Any,
    ) -> asyncio.Future[SendResult]:
        """Start sending now; return a future (awaitable). ``callback(result, error)`` runs on
        the loop when it completes. A list sends as one batch.

        With ``auto_batch`` (the default) single messages without routing options travel
        together as one batch (Pulsar's batch container, PR3): a batch leaves when it holds
        ``batch_max_messages`` or ``batch_max_bytes``, or ``batch_max_delay`` after its first
        message. Each message still gets its own SendResult, and they share a queue.

        At most ``max_pending_messages`` messages (100 000) may be unanswered; one more raises
        ProducerQueueFullError -- await earlier futures (or :meth:`flush`) first."""
        acc = self.accumulator
        if callback is None and not options and type(msg) is Message and self.auto_batch:
            # The hot path, kept to the least work per message (close() waits for the batch's
            # task, not for each future): a SendFuture (client/send_future.py), resolved per
            # batch, its SendResult built when read; None for a message that travels alone.
            sf = acc.add_async(msg)
            if sf is not None:
                return sf  # type: ignore[return-value]
        if acc.npending >= acc.max_pending_messages:
            acc.check_room()  # raises
        fut: asyncio.Future[SendResult]
        if (
            self.auto_batch and not options and isinstance(msg, Message)
            # Accumulator.may_join, inlined (one call less per message)
            and len(msg.body) < acc.batch_max_bytes
            and not msg.delay_level and not msg.deliver_at
        ):
            acc.npending += 1
            fut = acc.add(msg)
        elif isinstance(msg, list | tuple):
            acc.npending += len(msg)
            fut = asyncio.ensure_future(self._counted(self.send_batch(msg, **options),
                                                      len(msg)))
            acc.track(fut)
        else:
            fut = self._pinned_async(cast(Message, msg), options)
        if callback is not None:

            def done(f: asyncio.Future[SendResult]) -> None:
                if f.cancelled():
                    callback(None, asyncio.CancelledError())
                elif f.exception() is not None:
                    callback(None, f.exception())
                else:
                    callback(f.result(), None)

            fut.add_done_callback(done)
        return fut

    def _hand_over(self, msg: Message, options: dict[str, Any], sink: Any, wait: bool) -> None:
        """On the loop: a message of the blocking facade (``send`` when ``wait``, else
        ``send_async``) into the batch container, its answer to ``sink`` (anything with
        ``done()``, ``set_result()``, ``set_exception()``; completed on the loop). The
        facade calls :meth:`Accumulator.kick` after handing over what it had."""
        acc = self.accumulator
        try:
            if (
                self._started and not self._closed and self.auto_batch
                and type(msg) is Message and acc.may_join(msg)
                and (not options or options.keys() <= _ROUTING_OPTIONS)
            ):
                key: Any = None
                mq: MessageQueue | None = None
                full = acc.npending >= acc.max_pending_messages
                if full and (not wait or not self.block_if_queue_full):
                    acc.check_room()  # raises
                route = self.routes.cached(msg.topic)
                if not full and (route is not None or not _pins(options)):
                    if route is not None and _pins(options):
                        mq, _pinned = self.router.select(
                            route, msg, options.get("queue_id"), options.get("selector"),
                            options.get("arg"), options.get("hash_key"), None)
                        key = (msg.topic, mq)
                    deadline = 0.0
                    if wait:
                        timeout = options.get("timeout")
                        deadline = self._loop.time() + (
                            self.send_timeout if timeout is None else timeout)
                    acc.npending += 1
                    acc.add(msg, key, mq, deadline, sink)
                    return
        except Exception as exc:  # refused before it was queued: this sender's error
            sink.set_exception(exc)
            return
        # Everything else (a route not known yet, a full container, chunks, delays, ...):
        # the coroutine path.
        try:
            task = asyncio.ensure_future(self.send(msg, **options) if wait
                                         else self.send_async(msg, **options))
        except Exception as exc:
            sink.set_exception(exc)
            return
        self.accumulator.track(task)

        def done(t: asyncio.Future[SendResult]) -> None:
            if sink.done():
                return
            if t.cancelled():
                sink.set_exception(asyncio.CancelledError())
            elif t.exception() is not None:
                sink.set_exception(t.exception())
            else:
                sink.set_result(t.result())

        task.add_done_callback(done)

    def _pinned_async(self, msg: Message, options: dict[str, Any]) -> asyncio.Future[SendResult]:
        """``send_async`` with routing options: straight into the queue's bucket when the
        route is known (so sends keep the order of the calls), else through ``send``."""
        route = self.routes.cached(msg.topic)
        if (
            route is not None and self.auto_batch and self._started and not self._closed
            and set(options) <= {"queue_id", "selector", "arg", "hash_key"}
            and self.accumulator.may_join(msg)
        ):
            mq, _pinned = self.router.select(
                route, msg, options.get("queue_id"), options.get("selector"), options.get("arg"),
                options.get("hash_key"), None)
            self.accumulator.npending += 1
            return self.accumulator.add(msg, (msg.topic, mq), mq)
        fut = asyncio.ensure_future(self.send(msg, **options))
        self.accumulator.track(fut)
        return fut

    async def write_queues(self, topic: str) -> list[MessageQueue]:
        """The writable queues a send to ``topic`` chooses from, sorted (``queue_id=`` indexes
        this list). For a topic no broker has yet, the queues of the default route a send
        would use (the broker creates the topic on the first send, ``auto_create_route``)."""
        await self._ensure_started()
        route = self.routes.cached(topic) or await self._route(topic)
        return list(route.write_queues)

    async def cancel(self, result: SendResult, *, timeout: float | None = None) -> None:
        """Cancel a pending timed message (sent with ``deliver_at`` / ``deliver_after``) by
        the SendResult of its send. Raises BrokerError (QUERY_NOT_FOUND) when it is not
        pending any more: delivered, cancelled, or not a timed message."""
        await self._ensure_started()
        route = self.routes.cached(result.topic) or await self._route(result.topic)
        addr = route.broker_addrs.get(result.broker_name)
        if addr is None:
            route = await self.routes.get(result.topic, refresh=True)
            addr = route.broker_addrs.get(result.broker_name)
        if addr is None:
            raise NoRouteError(
                f"cannot cancel: broker group {result.broker_name!r}, which holds the timed "
                f"message {result.msg_id}, has no master now (it is not in the route of "
                f"{result.topic!r}, or only its slaves are, and they take no cancellations); "
                "retry once the group has a master again"
            )
        await self.pool.request(
            addr, RequestCode.CANCEL_TIMER_MESSAGE,
            CancelTimerMessageRequestHeader(msg_id=result.msg_id),
            timeout=self.send_timeout if timeout is None else timeout,
        )

    async def send_oneway(
        self,
        msg: Message | Sequence[Message],
        *,
        queue_id: int | MessageQueue | None = None,
        selector: Selector | None = None,
        arg: Any = None,
        hash_key: str | bytes | None = None,
    ) -> None:
        """Write the message (or a list, as one batch) and return without any answer: no
        result, no retry, possible silent loss (RocketMQ's oneway)."""
        msgs: Sequence[Message] = msg if isinstance(msg, list | tuple) else (msg,)
        if not msgs:
            raise ValueError("send_oneway needs at least one message")
        topic = msgs[0].topic
        await self._ensure_started()
        route = await self._route(topic)
        mq, _pinned = self.router.select(route, msgs[0], queue_id, selector, arg, hash_key,
                                         None)
        conn = await self.pool.get(route.broker_addrs[mq.broker_name])
        batch, _seq = self._encode(topic, msgs, mq.queue_id, conn.local_host, conn.local_port)
        code = _send_code(msgs)
        await conn.drain()
        conn.send_oneway(code, self.sender.header(topic, mq.queue_id, len(msgs) > 1), batch)

    # -- internals ---------------------------------------------------------------------------
    async def _route(self, topic: str) -> TopicRoute:
        return await self.router.route(topic)

    def _encode(
        self, topic: str, msgs: Sequence[Message], queue_id: int, host: str, port: int,
        sequence_id: int | None = None, born_ts: int | None = None,
    ) -> tuple[bytearray, int]:
        """The batch bytes and base sequence (a subclass may mark them: transactions)."""
        return self.sender.encode_batch(topic, msgs, queue_id, host, port, sequence_id, born_ts)

    async def _send(
        self,
        topic: str,
        msgs: Sequence[Message],
        queue_id: int | MessageQueue | None,
        selector: Selector | None,
        arg: Any,
        hash_key: str | bytes | None,
        timeout: float | None,
        code: int,
        sequence_id: int | None = None,
    ) -> SendResult:
        if not self._started or self._closed:
            await self._ensure_started()
        return await self.sender.send(topic, msgs, queue_id, selector, arg, hash_key, timeout,
                                      code, sequence_id)

    async def _send_auto(self, topic: str, mq: MessageQueue | None, msgs: list[Message],
                         timeout: float | None) -> SendResult:
        """One batch of the accumulator (``mq``: the queue of a pinned bucket)."""
        code = _send_code(msgs)
        return await self._send(topic, msgs, mq, None, None, None, timeout, code)

    def _start_one(self, topic: str, mq: MessageQueue | None, msgs: list[Message],
                   timeout: float | None, sink: Any, now: bool) -> Started | None:
        """A batch of the accumulator written without a task (None: it needs one); ``now``:
        its frame is written at once."""
        if not self._started or self._closed:
            return None
        code = _SEND_BATCH if len(msgs) > 1 else _SEND_MESSAGE
        return self.sender.start(topic, msgs, mq, timeout, code, sink, now)

    def _lone_driven(self, msg: Message, timeout: float | None, sink: Any) -> bool:
        """(On the loop, by the thread that runs it: the blocking facade's borrower.) A
        blocking ``send`` of ``msg`` without routing options, written now as a batch of its
        own when its topic's bucket is idle (Accumulator.start_lone): what ``_hand_over``
        and the accumulator's dispatch do for a lone message, without the hand-over. False:
        nothing was done (the ordinary hand-over then)."""
        acc = self.accumulator
        if not (
            self._started and not self._closed and self.auto_batch and acc.may_join(msg)
        ):
            return False
        t = self.send_timeout if timeout is None else timeout
        return acc.start_lone(msg, self._loop.time() + t, t, sink)

    async def _resume_one(self, topic: str, mq: MessageQueue | None, msgs: list[Message],
                          st: Started) -> SendResult:
        code = _send_code(msgs)
        return await self.sender.send(topic, msgs, mq, None, None, None, None, code,
                                      started=st)

    async def _counted(self, coro: Any, n: int) -> SendResult:
        """Run a send_async send; its ``n`` messages stop counting as pending before its
        future completes (so whoever sees it done may send ``n`` more at once)."""
        try:
            result: SendResult = await coro
            return result
        finally:
            self.accumulator.npending -= n

    async def flush(self) -> None:
        """Send the open automatic batches now and wait until every ``send_async`` so far is
        answered (failures stay in their futures)."""
        if self.accumulator.has_open:
            self.accumulator.flush_open()
        await self.accumulator.wait_all()


_SEND_BATCH = int(RequestCode.SEND_BATCH)
_SEND_MESSAGE = int(RequestCode.SEND_MESSAGE)


def _send_code(msgs: Sequence[Message]) -> int:
    """SEND_BATCH for a batch of several messages, SEND_MESSAGE for one."""
    return RequestCode.SEND_BATCH if len(msgs) > 1 else RequestCode.SEND_MESSAGE
