"""The asyncio producer (SPEC PR1, PR2, PR6 sequence ids, PR9).

Sending one message or a batch is the same path: pick a queue, encode the messages into one
batch (``codec.encode_messages``; the broker stores those bytes as received), send it as
SEND_MESSAGE / SEND_BATCH and turn the response into a SendResult.

Queue choice (PR2): round robin over the topic's writable queues; ``queue_id=`` (an index into
the sorted writable queues, equal to the queue id on a single broker, or a MessageQueue),
``selector=`` (``selector(queues, message, arg) -> MessageQueue``, RocketMQ's
MessageQueueSelector) or ``hash_key=`` (CRC32C of the key modulo the queue count) pin the queue
for ordered sends.

Failures (PR1): a synchronous send is tried up to ``1 + retries`` times within its overall
timeout, each retry on a queue of another broker when there is one. A broker that failed, or
answered slowly, is avoided for a while (RocketMQ's MQFaultStrategy: latency 550 ms -> 30 s,
1 s -> 60 s, ..., a failure counts as 30 s of latency and isolates the broker for 10 min) unless
every broker is avoided. Retries re-send the same bytes with the same producer id and sequence,
so a broker that deduplicates (BR12) stores the batch once. Pinned sends (queue_id, selector,
hash_key) are never moved to another queue: that would break their order.

Ids (PR6, PR9): each Producer instance has a random 63-bit ``producer_id``; every batch gets the
next ``base_seq`` (message i: ``base_seq + i``); the unique message id is
``record.unique_id(producer_id, seq)``. A producer with a ``producer_name`` is deduplicated by the
brokers (BR12): its id is ``dedup_producer_id(name)`` (bit 63 set), its sequence continues after
the highest one the brokers persisted for that name (asked at start), ``sequence_id=`` sends a
batch with an explicit base sequence, a DUPLICATE answer is a success with
``SendStatus.DUPLICATE``, and its retries stay on the same queue (docs/producer-path.md).

Automatic batching (PR3): ``send_async`` messages without routing options are collected per
topic and sent as one batch when ``batch_max_messages`` (1000) or ``batch_max_bytes`` (128 KiB)
is reached or ``batch_max_delay`` (1 ms) has passed. Compression (PR4) applies to a batch whose
records are at least ``compress_min`` (1 KiB). Messages above ``max_message_size`` are sent in
chunks (PR5, ``chunking.py``).

Threading: one event loop. Use ``tidemq.Producer`` from threads.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

from tidemq.client import chunking
from tidemq.client.codec import encode_messages, set_queue_id
from tidemq.client.columns import Columns
from tidemq.client.connection import DEFAULT_TIMEOUT, ConnectionPool, raise_for_error
from tidemq.client.errors import (
    ClientClosedError,
    ClientError,
    MessageRejectedError,
    NoRouteError,
    ProducerQueueFullError,
    RequestTimeoutError,
)
from tidemq.client.latency_fault import FAILURE_LATENCY_MS, LatencyFaultTable
from tidemq.client.message import Message, MessageQueue, SendResult, SendStatus
from tidemq.client.route import RouteCache, TopicRoute
from tidemq.protocol.codes import RequestCode, ResponseCode
from tidemq.protocol.errors import BrokerError, LocalProtocolError
from tidemq.protocol.headers import (
    CancelTimerMessageRequestHeader,
    ClusterInfo,
    LastSequenceRequestHeader,
    LastSequenceResponseHeader,
    QueueData,
    SendMessageRequestHeader,
    SendMessageResponseHeader,
    TopicRouteData,
    dedup_producer_id,
)
from tidemq.protocol.names import group_name_problem, topic_name_problem
from tidemq.protocol.record import (
    DEFAULT_MAX_PROPERTIES_SIZE,
    Compression,
    crc32c,
    pack_host,
    unique_id,
)

__all__ = ["Producer", "Selector", "SendCallback"]

log = logging.getLogger(__name__)

_Future = asyncio.Future

Selector = Callable[[list[MessageQueue], Message, Any], MessageQueue]
SendCallback = Callable[[SendResult | None, BaseException | None], None]

DEFAULT_GROUP = "DEFAULT_PRODUCER"
MAX_MESSAGE_SIZE = 4 * 1024 * 1024  # the broker's default batch limit (SPEC BR1)

# Keyed by plain ints: a frame's code is an int, and ResponseCode(code) costs more than the
# lookup (IntEnum members hash and compare as their int, so either key finds the entry).
_STATUS = {
    int(ResponseCode.SUCCESS): SendStatus.SEND_OK,
    int(ResponseCode.FLUSH_DISK_TIMEOUT): SendStatus.FLUSH_DISK_TIMEOUT,
    int(ResponseCode.FLUSH_SLAVE_TIMEOUT): SendStatus.FLUSH_SLAVE_TIMEOUT,
    int(ResponseCode.SLAVE_NOT_AVAILABLE): SendStatus.SLAVE_NOT_AVAILABLE,
}
_SEND_OK_CODES = frozenset(_STATUS)
_SUCCESS = int(ResponseCode.SUCCESS)
_SEND_MESSAGE = int(RequestCode.SEND_MESSAGE)
_SEND_BATCH = int(RequestCode.SEND_BATCH)
_DUPLICATE = int(ResponseCode.DUPLICATE)
# Error responses worth another broker (RocketMQ's retryResponseCodes plus the retryable ones).
_RETRY_CODES = frozenset(
    {
        ResponseCode.TOPIC_NOT_EXIST,
        ResponseCode.SERVICE_NOT_AVAILABLE,
        ResponseCode.SYSTEM_ERROR,
        ResponseCode.SYSTEM_BUSY,
        ResponseCode.NO_PERMISSION,
        ResponseCode.RETRY_LATER,
        ResponseCode.DISK_FULL,
    }
)

class Producer:
    """Sends messages to a topic's brokers. One event loop; an async context manager.

    Options: ``send_timeout`` (3 s, covers all retries), ``retries`` (2), ``max_message_size``
    (4 MiB per batch, checked before sending), ``compression`` ("none", "lz4", "zstd", "zlib")
    with ``compress_min`` bytes, ``latency_fault`` (True: avoid slow/failed brokers),
    ``route_refresh`` (30 s), ``pool`` (share a ConnectionPool between clients),
    ``max_pending_messages`` (100 000 unanswered ``send_async`` messages at most),
    ``retry_another_broker_when_not_store_ok`` (False: see below), ``max_properties_size``
    (32 KiB of encoded properties per message, the broker's default ``max_properties_size``;
    raise both together).

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
        batch_max_bytes: int = 128 * 1024,
        batch_max_delay: float = 0.001,
        producer_name: str | None = None,
        default_topic_queues: int = 8,
        route_refresh: float = 30.0,
        pool: ConnectionPool | None = None,
        max_pending_messages: int = 100_000,
        retry_another_broker_when_not_store_ok: bool = False,
        max_properties_size: int = DEFAULT_MAX_PROPERTIES_SIZE,
    ) -> None:
        problem = group_name_problem(group, "producer group") if group is not None else None
        if problem:
            raise ValueError(problem)
        if retries < 0:
            raise ValueError("retries must be >= 0")
        if max_pending_messages < 1:
            raise ValueError("max_pending_messages must be >= 1")
        if compression not in Compression.NAMES:
            raise ValueError(f"compression must be one of {sorted(Compression.NAMES)}")
        self.group = group or DEFAULT_GROUP
        self.send_timeout = send_timeout
        self.retries = retries
        self.max_message_size = max_message_size
        self.max_properties_size = max_properties_size
        self.compression = Compression.NAMES[compression]
        self.compress_min = compress_min
        self.latency_fault = latency_fault
        self.retry_another_broker_when_not_store_ok = retry_another_broker_when_not_store_ok
        self.auto_create_route = auto_create_route
        self.auto_batch = auto_batch
        self.batch_max_messages = batch_max_messages
        self.batch_max_bytes = batch_max_bytes
        self.default_topic_queues = default_topic_queues
        self.batch_max_delay = batch_max_delay
        self.producer_name = producer_name
        # Named producers are deduplicated by the broker (bit 63 set); random ids keep it clear.
        self.producer_id = (
            dedup_producer_id(producer_name) if producer_name else secrets.randbits(63)
        )
        self.last_sequence_id = -1  # named producers: the brokers' highest persisted, at start
        self._seq = 0
        self._own_pool = pool is None
        self.pool = pool if pool is not None else ConnectionPool(connect_timeout=send_timeout)
        self.routes = RouteCache(self.pool, namesrv, refresh_interval=route_refresh,
                                 timeout=send_timeout)
        self._rr = itertools.count(secrets.randbelow(1 << 16))
        self._faults = LatencyFaultTable()
        self._started = False
        self._closed = False
        self._async: set[asyncio.Future[Any]] = set()
        self._hosts: dict[str, bytes] = {}  # local address -> record.pack_host form
        # The open auto-batch of each topic: [messages, futures, body bytes, loop].
        self._pending: dict[str, list[Any]] = {}
        self._pending_flush = False
        # Messages of send_async calls not answered yet (queued in an open batch or in flight):
        # bounded by max_pending_messages so a caller that never awaits cannot grow memory
        # without limit (Pulsar's maxPendingMessages).
        self.max_pending_messages = max_pending_messages
        self._npending = 0

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> Producer:
        if self._closed:
            raise ClientClosedError("this producer was closed; create a new one")
        if not self._started:
            self._started = True
            self.routes.start()
            if self.producer_name:
                try:
                    await self._fetch_last_sequence()
                except BaseException:
                    self._started = False
                    raise
        return self

    async def _fetch_last_sequence(self) -> None:
        """Pulsar's getLastSequenceId: continue after the highest sequence any broker of the
        cluster persisted for this name."""
        frame = await self.routes.namesrv_request(RequestCode.GET_BROKER_CLUSTER_INFO)
        info = frame.header
        addrs = []
        if isinstance(info, ClusterInfo):
            for bd in info.broker_addr_table.values():
                addrs.extend(bd.broker_addrs.values())
        last = -1
        for addr in addrs:
            conn = await self.pool.get(addr)
            resp = await conn.request(
                RequestCode.GET_LAST_SEQUENCE,
                LastSequenceRequestHeader(producer_name=self.producer_name or ""),
                timeout=self.send_timeout,
            )
            raise_for_error(resp)
            h = resp.header
            assert isinstance(h, LastSequenceResponseHeader)
            last = max(last, h.last_sequence_id)
        self.last_sequence_id = last
        self._seq = max(self._seq, last + 1)

    async def close(self) -> None:
        """Wait for async sends still in flight, then close connections. Idempotent."""
        if self._closed:
            return
        if self._pending:
            self._flush_pending()
        if self._async:
            await asyncio.gather(*self._async, return_exceptions=True)
        self._closed = True
        await self.routes.close()
        if self._own_pool:
            self.pool.close()

    async def __aenter__(self) -> Producer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

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
        batch is sent in chunks (PR5); ``sequence_id`` sets its sequence explicitly."""
        if len(msg.body) > self.max_message_size - chunking.CHUNK_HEADROOM // 2:
            return await self._send_chunked(msg, queue_id, selector, arg, hash_key, timeout,
                                            sequence_id)
        return await self._send(msg.topic, (msg,), queue_id, selector, arg, hash_key, timeout,
                                RequestCode.SEND_MESSAGE, sequence_id)

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
        """PR5: one batch per chunk, in order, to one queue; the result of the last chunk
        (count 1: the consumer sees one message)."""
        await self._ensure_started()
        route = self.routes.cached(msg.topic) or await self._route(msg.topic)
        mq, _pinned = self._select(route, msg, queue_id, selector, arg, hash_key, None)
        seq = self._seq if sequence_id is None else sequence_id
        name = self.producer_name or f"{self.producer_id:016X}"
        parts = chunking.split(msg, f"{name}-{seq}",
                               chunking.chunk_body_size(self.max_message_size))
        result: SendResult | None = None
        for i, part in enumerate(parts):
            result = await self._send(msg.topic, (part,), mq, None, None, None, timeout,
                                      RequestCode.SEND_MESSAGE, seq + i)
        assert result is not None
        return result

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
        fut: asyncio.Future[SendResult]
        if self._npending >= self.max_pending_messages:
            raise ProducerQueueFullError(
                f"{self._npending} messages sent with send_async are not answered yet "
                f"(max_pending_messages={self.max_pending_messages}); await some of their "
                "futures or `await producer.flush()` before sending more"
            )
        if (
            callback is None and not options and type(msg) is Message and self.auto_batch
            and len(msg.body) < self.batch_max_bytes
            and not msg.delay_level and not msg.deliver_at
        ):
            # The hot path, kept to the least work per message (no per-future callbacks:
            # close() waits for the batch's task instead).
            self._npending += 1  # given back per batch by _send_pending
            pending = self._pending.get(msg.topic)
            if pending is None:
                return self._enqueue(msg)
            fut = _Future(loop=pending[3])
            msgs = pending[0]
            msgs.append(msg)
            pending[1].append(fut)
            size = pending[2] + len(msg.body)
            pending[2] = size
            if len(msgs) >= self.batch_max_messages or size >= self.batch_max_bytes:
                self._dispatch(msg.topic)
            return fut
        if (
            self.auto_batch and not options and isinstance(msg, Message)
            and len(msg.body) < self.batch_max_bytes
            # delay and delivery time are per batch: a delayed message travels alone
            and not msg.delay_level and not msg.deliver_at
        ):
            self._npending += 1  # given back per batch by _send_pending
            fut = self._enqueue(msg)
            if callback is None:
                # The hot path: close() waits for the batch's task, not for each future.
                return fut
        else:
            coro = self.send_batch(msg, **options) if isinstance(msg, list | tuple) else (
                self.send(msg, **options)  # type: ignore[arg-type]
            )
            n = len(msg) if isinstance(msg, list | tuple) else 1
            self._npending += n
            fut = asyncio.ensure_future(self._counted(coro, n))
        self._async.add(fut)
        fut.add_done_callback(self._async.discard)
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
        msgs: Sequence[Message] = msg if isinstance(msg, list | tuple) else (msg,)  # type: ignore[assignment]
        if not msgs:
            raise ValueError("send_oneway needs at least one message")
        topic = msgs[0].topic
        await self._ensure_started()
        route = await self._route(topic)
        mq, _pinned = self._select(route, msgs[0], queue_id, selector, arg, hash_key, None)
        conn = await self.pool.get(route.broker_addrs[mq.broker_name])
        batch, _seq = self._encode(topic, msgs, mq.queue_id, conn.local_host, conn.local_port)
        code = RequestCode.SEND_BATCH if len(msgs) > 1 else RequestCode.SEND_MESSAGE
        await conn.drain()
        conn.send_oneway(code, self._header(topic, mq.queue_id, len(msgs) > 1), batch)

    # -- automatic batching of send_async --------------------------------------------------------
    def _enqueue(self, msg: Message) -> asyncio.Future[SendResult]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[SendResult] = loop.create_future()
        pending = self._pending.get(msg.topic)
        if pending is None:
            # [messages, futures, body bytes, loop]
            pending = self._pending[msg.topic] = [[], [], 0, loop]
        msgs, futs = pending[0], pending[1]
        msgs.append(msg)
        futs.append(fut)
        pending[2] += len(msg.body)
        if len(msgs) >= self.batch_max_messages or pending[2] >= self.batch_max_bytes:
            self._dispatch(msg.topic)
        elif not self._pending_flush:
            self._pending_flush = True
            if self.batch_max_delay > 0:
                loop.call_later(self.batch_max_delay, self._flush_pending)
            else:
                loop.call_soon(self._flush_pending)
        return fut

    def _flush_pending(self) -> None:
        self._pending_flush = False
        pending, self._pending = self._pending, {}
        loop = asyncio.get_running_loop()
        for topic, (msgs, futs, _size, _loop) in pending.items():
            self._track(loop.create_task(self._send_pending(topic, msgs, futs)))

    def _dispatch(self, topic: str) -> None:
        """Send the full batch of ``topic`` now."""
        msgs, futs, _size, loop = self._pending.pop(topic)
        self._track(loop.create_task(self._send_pending(topic, msgs, futs)))

    def _track(self, task: asyncio.Future[Any]) -> None:
        self._async.add(task)
        task.add_done_callback(self._async.discard)

    async def _counted(self, coro: Any, n: int) -> SendResult:
        """Run a send_async send; its ``n`` messages stop counting as pending before its
        future completes (so whoever sees it done may send ``n`` more at once)."""
        try:
            return await coro
        finally:
            self._npending -= n

    async def flush(self) -> None:
        """Send the open automatic batches now and wait until every ``send_async`` so far is
        answered (failures stay in their futures)."""
        if self._pending:
            self._flush_pending()
        while self._async:
            await asyncio.gather(*list(self._async), return_exceptions=True)

    async def _send_pending(
        self, topic: str, msgs: list[Message], futs: list[asyncio.Future[SendResult]]
    ) -> None:
        code = RequestCode.SEND_BATCH if len(msgs) > 1 else RequestCode.SEND_MESSAGE
        try:
            r = await self._send(topic, msgs, None, None, None, None, None, code)
        except BaseException as exc:
            self._npending -= len(msgs)
            for f in futs:
                if not f.done():
                    f.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        self._npending -= len(msgs)
        pid = self.producer_id
        prefix = f"{pid:016X}"  # unique_id(pid, seq), formatted once per batch
        status, qid, qoff, bname, base = (r.status, r.queue_id, r.queue_offset,
                                          r.broker_name, r.base_seq)
        step = 1 if qoff >= 0 else 0  # a DUPLICATE batch has no offsets: -1 for each
        for i, f in enumerate(futs):
            if not f.done():
                seq = base + i
                f.set_result(SendResult(status, f"{prefix}{seq:016X}", topic, qid,
                                        qoff + i * step, 1, bname, pid, seq))

    # -- internals ---------------------------------------------------------------------------
    async def _route(self, topic: str) -> TopicRoute:
        """The topic's route; for a topic no broker has yet, a route over every master broker
        (RocketMQ's TBW102 default route): a broker with auto-create on creates the topic on
        the first send, one with it off answers TOPIC_NOT_EXIST."""
        try:
            return await self.routes.get(topic)
        except NoRouteError as exc:
            problem = topic_name_problem(topic)
            if problem:  # no broker would create it (the rule of protocol/names.py)
                raise MessageRejectedError(problem) from None
            if not self.auto_create_route:
                raise
            try:
                frame = await self.routes.namesrv_request(RequestCode.GET_BROKER_CLUSTER_INFO)
            except (ClientError, BrokerError):
                raise exc from None
            info = frame.header
            if not isinstance(info, ClusterInfo) or not info.broker_addr_table:
                raise
            data = TopicRouteData(
                queue_datas=[
                    QueueData(broker_name=name, read_queue_nums=self.default_topic_queues,
                              write_queue_nums=self.default_topic_queues)
                    for name in sorted(info.broker_addr_table)
                ],
                broker_datas=list(info.broker_addr_table.values()),
            )
            route = TopicRoute(topic, data)
            if not route.write_queues:
                raise
            # Not cached: the next send asks the name server again and finds the real route
            # once the broker has created the topic and re-registered.
            return route

    async def _ensure_started(self) -> None:
        if not self._started or self._closed:
            await self.start()

    def _header(self, topic: str, queue_id: int, batch: bool,
                born_ts: int | None = None) -> SendMessageRequestHeader:
        return SendMessageRequestHeader(
            producer_group=self.group, topic=topic, queue_id=queue_id,
            born_timestamp=int(time.time() * 1000) if born_ts is None else born_ts, batch=batch,
        )

    def _encode(
        self, topic: str, msgs: Sequence[Message], queue_id: int, host: str, port: int,
        sequence_id: int | None = None, born_ts: int | None = None,
    ) -> tuple[bytearray, int]:
        if sequence_id is None:
            seq = self._seq
            self._seq = seq + len(msgs)
        else:
            if sequence_id < 0:
                raise MessageRejectedError(f"sequence_id must be >= 0, got {sequence_id}")
            seq = sequence_id
            self._seq = max(self._seq, seq + len(msgs))
        if born_ts is None:
            born_ts = int(time.time() * 1000)
        packed = self._hosts.get(host)
        if packed is None:
            packed = self._packed_host(host)
        try:
            if isinstance(msgs, Columns):
                pid = self.producer_id if msgs.producer_id is None else msgs.producer_id
                batch = msgs.encode(queue_id, pid, seq, born_ts, packed, port)
            else:
                batch = encode_messages(
                    topic, msgs, queue_id=queue_id, producer_id=self.producer_id, base_seq=seq,
                    born_ts=born_ts, born_host=packed, born_port=port,
                    compression=self.compression, compress_min=self.compress_min,
                    max_properties_size=self.max_properties_size,
                )
        except (ValueError, struct.error) as exc:  # struct.error: a field out of its range
            raise MessageRejectedError(f"cannot encode the message: {exc}") from exc
        if len(batch) > self.max_message_size:
            raise MessageRejectedError(
                f"the {'batch' if len(msgs) > 1 else 'message'} encodes to {len(batch)} bytes, "
                f"over the {self.max_message_size}-byte limit; send fewer or smaller messages "
                "per batch"
            )
        return batch, seq

    def _packed_host(self, host: str) -> bytes:
        packed = self._hosts.get(host)
        if packed is None:
            packed = self._hosts[host] = pack_host(host)
        return packed

    def _select(
        self,
        route: TopicRoute,
        msg: Message,
        queue_id: int | MessageQueue | None,
        selector: Selector | None,
        arg: Any,
        hash_key: str | bytes | None,
        avoid: str | None,
    ) -> tuple[MessageQueue, bool]:
        """(queue, pinned): pinned queues are never moved by a retry."""
        queues = route.write_queues
        if (
            queue_id is None and selector is None and hash_key is None and avoid is None
            and queues and not self._faults.avoiding
        ):
            # The common choice: plain round robin (no broker to avoid).
            return queues[next(self._rr) % len(queues)], False
        if not queues:
            self.routes.refresh_soon(route.topic)  # its groups may have a master again soon
            raise NoRouteError(
                f"topic {route.topic!r} has no writable queue (check its perm and write queue "
                "count, and that its brokers are registered)"
            )
        if queue_id is not None:
            if isinstance(queue_id, MessageQueue):
                if queue_id not in queues:
                    if queue_id.broker_name in route.group_addrs:
                        self.routes.refresh_soon(route.topic)  # an election may name one
                        raise NoRouteError(
                            f"queue {queue_id} belongs to broker group "
                            f"{queue_id.broker_name!r}, which has no master now (only slaves, "
                            "which take no writes); a send pinned to it is not moved to another "
                            "queue -- retry once a master is back (`tidemq cluster promote`)"
                        )
                    raise MessageRejectedError(f"queue {queue_id} is not a writable queue of "
                                               f"topic {route.topic!r}")
                return queue_id, True
            if not 0 <= queue_id < len(queues):
                raise MessageRejectedError(
                    f"queue_id {queue_id} is out of range: topic {route.topic!r} has "
                    f"{len(queues)} writable queues (0..{len(queues) - 1})"
                )
            return queues[queue_id], True
        if selector is not None:
            mq = selector(list(queues), msg, arg)
            if mq not in queues:
                raise MessageRejectedError(
                    f"the selector returned {mq!r}, which is not one of the queues it was given"
                )
            return mq, True
        if hash_key is not None:
            kb = hash_key.encode() if isinstance(hash_key, str) else hash_key
            return queues[crc32c(kb) % len(queues)], True
        n = len(queues)
        start = next(self._rr)
        if self.latency_fault or avoid is not None:
            for k in range(n):
                mq = queues[(start + k) % n]
                if mq.broker_name != avoid and (
                    not self.latency_fault or self._faults.available(mq.broker_name)
                ):
                    return mq, False
            if avoid is not None:
                for k in range(n):  # every other broker is avoided: any other broker at all
                    mq = queues[(start + k) % n]
                    if mq.broker_name != avoid:
                        return mq, False
        return queues[start % n], False

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
        # The hot path of every synchronous send: one coroutine frame (the connection's future
        # is awaited here, not through Connection.request), one clock read for the deadline,
        # one for born_ts, and the monotonic pair the latency table needs.
        if not self._started or self._closed:
            await self._ensure_started()
        timeout = self.send_timeout if timeout is None else timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        route = self.routes.cached(topic) or await self._route(topic)
        batch: bytearray | None = None
        seq = 0
        last_broker: str | None = None
        last_exc: Exception | None = None
        last_result: SendResult | None = None
        attempts = 1 + self.retries
        dedup = self.producer_name is not None or (
            type(msgs) is Columns and msgs.producer_id is not None
        )
        mq: MessageQueue | None = None
        left = timeout
        for attempt in range(attempts):
            if attempt:
                left = deadline - loop.time()
                if left <= 0:
                    break
            if mq is None or not dedup:
                mq, pinned = self._select(route, msgs[0], queue_id, selector, arg, hash_key,
                                          last_broker)
            addr = route.broker_addrs[mq.broker_name]
            t0 = time.monotonic()
            try:
                conn = self.pool.get_nowait(addr) or await self.pool.get(addr)
                born_ts = int(time.time() * 1000)
                if batch is None:
                    batch, seq = self._encode(topic, msgs, mq.queue_id, conn.local_host,
                                              conn.local_port, sequence_id, born_ts)
                elif attempt:
                    # A copy: the transport may still hold the bytes of the failed attempt.
                    batch = bytearray(batch)
                    set_queue_id(batch, mq.queue_id)
                header = self._header(topic, mq.queue_id, code == _SEND_BATCH, born_ts)
                if not conn.writable:
                    await conn.drain()
                frame = await conn.start_request(code, header, batch, left)
                fcode = frame.code
                if fcode not in _SEND_OK_CODES:
                    if fcode == _DUPLICATE:
                        # BR12: the broker has this sequence already; nothing was stored again.
                        return SendResult(SendStatus.DUPLICATE, unique_id(self.producer_id, seq),
                                          topic, mq.queue_id, -1, len(msgs), mq.broker_name,
                                          self.producer_id, seq)
                    raise_for_error(frame, _SEND_OK_CODES)
            except (ClientError, BrokerError) as exc:
                if isinstance(exc, MessageRejectedError):
                    raise
                latency = (time.monotonic() - t0) * 1000
                if self.latency_fault:
                    self._faults.update(mq.broker_name, max(latency, FAILURE_LATENCY_MS))
                if not isinstance(exc, BrokerError) or \
                        exc.response_code == ResponseCode.SERVICE_NOT_AVAILABLE:
                    # unreachable, or not the master any more: the name servers may name
                    # another by now (an election), so ask them again in the background
                    self.routes.refresh_soon(topic)
                last_exc, last_broker = exc, mq.broker_name
                retry = not isinstance(exc, BrokerError) or exc.response_code in _RETRY_CODES
                # SYSTEM_BUSY with a retry hint: refused before anything was done, so even a
                # send pinned to its queue may go again -- after the wait asked for.
                wait = exc.retry_after if isinstance(exc, BrokerError) else 0.0
                if (pinned and not dedup and not wait) or not retry:
                    raise
                if wait and (dedup or pinned or len(route.broker_addrs) < 2):
                    # The retry goes to the same broker: wait as asked, or give up now if the
                    # wait outlasts the send's deadline.
                    if wait >= deadline - loop.time():
                        raise
                    await asyncio.sleep(wait)
                if dedup:
                    # A deduplicated resend must reach the broker that may hold the first copy
                    # (same queue, same bytes); give an uncertain first copy time to settle.
                    left = deadline - loop.time()
                    await asyncio.sleep(min(0.05 * (attempt + 1), max(0.0, left / 2)))
                log.info("send to %s failed (%s), attempt %d of %d", mq, exc, attempt + 1,
                         attempts)
                if isinstance(exc, BrokerError) and exc.response_code in (
                    ResponseCode.TOPIC_NOT_EXIST, ResponseCode.NO_PERMISSION
                ):
                    try:
                        route = await self.routes.get(topic, refresh=True)
                    except NoRouteError:
                        raise BrokerError(
                            f"topic {topic!r} does not exist and the broker does not create "
                            f"topics on first send; create it first (`tidemq topic create "
                            f"--topic {topic}`) ({exc.message})",
                            response_code=exc.response_code, code=exc.code,
                        ) from None
                continue
            except LocalProtocolError as exc:
                raise MessageRejectedError(exc.message) from exc
            if self.latency_fault:
                self._faults.update(mq.broker_name, (time.monotonic() - t0) * 1000)
            h = frame.header
            assert isinstance(h, SendMessageResponseHeader)
            if (fcode != _SUCCESS and self.retry_another_broker_when_not_store_ok
                    and not pinned and not dedup and attempt + 1 < attempts):
                log.info("send to %s answered %s; sending it again to another broker", mq,
                         _STATUS[fcode].value)
                last_broker = mq.broker_name
                last_exc = None
                last_result = SendResult(
                    _STATUS[fcode], h.msg_id, topic, h.queue_id, h.queue_offset,
                    h.count, mq.broker_name, self.producer_id, seq, h.commit_log_offset,
                )
                continue
            return SendResult(
                _STATUS[fcode], h.msg_id, topic, h.queue_id, h.queue_offset,
                h.count, mq.broker_name, self.producer_id, seq, h.commit_log_offset,
            )
        if last_result is not None:  # stored, not safe: the caller sees which status
            return last_result
        if last_exc is None:
            raise RequestTimeoutError(f"send to topic {topic!r} timed out after {timeout:g} s")
        raise last_exc
