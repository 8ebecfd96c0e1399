"""One batch to one queue: encode, send, retry, answer (ref PR1).

The messages of a batch are encoded once (``codec.encode_messages``, or ``Columns.encode``;
the broker stores those bytes as received) and sent as SEND_MESSAGE / SEND_BATCH; the queue
comes from the router, the sequence from the sequencer, what a failure does from the retry
policy. The response becomes one SendResult for the batch.

Threading: one event loop (the producer's).
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from tidemq.client.columns import Columns
from tidemq.client.connection import ConnectionPool, raise_for_error
from tidemq.client.errors import (
    ClientError,
    MessageRejectedError,
    NoRouteError,
    RequestTimeoutError,
)
from tidemq.client.latency_fault import FAILURE_LATENCY_MS
from tidemq.client.message import Message, MessageQueue, SendResult, SendStatus
from tidemq.client.retry_policy import RetryPolicy
from tidemq.client.route import TopicRoute
from tidemq.client.send_router import Selector, SendRouter
from tidemq.client.sequencer import Sequencer
from tidemq.protocol.batch.fast import encode_messages, encode_one, encode_small_plain
from tidemq.protocol.batch.fields import set_queue_id
from tidemq.protocol.codes import RequestCode, ResponseCode
from tidemq.protocol.errors import BrokerError, LocalProtocolError
from tidemq.protocol.frame import Frame
from tidemq.protocol.headers import SendMessageRequestHeader, SendMessageResponseHeader
from tidemq.protocol.record import pack_host, unique_id

__all__ = ["BatchSender", "Encoder", "Started"]

log = logging.getLogger(__name__)

# Keyed by plain ints: a frame's code is an int, and ResponseCode(code) costs more than the
# lookup (IntEnum members hash and compare as their int, so either key finds the entry).
STATUS = {
    int(ResponseCode.SUCCESS): SendStatus.SEND_OK,
    int(ResponseCode.FLUSH_DISK_TIMEOUT): SendStatus.FLUSH_DISK_TIMEOUT,
    int(ResponseCode.FLUSH_SLAVE_TIMEOUT): SendStatus.FLUSH_SLAVE_TIMEOUT,
    int(ResponseCode.SLAVE_NOT_AVAILABLE): SendStatus.SLAVE_NOT_AVAILABLE,
}
_SEND_OK_CODES = frozenset(STATUS)
_SUCCESS = int(ResponseCode.SUCCESS)
_SEND_BATCH = int(RequestCode.SEND_BATCH)
_DUPLICATE = int(ResponseCode.DUPLICATE)

# (topic, msgs, queue_id, host, port, sequence_id, born_ts) -> (batch bytes, base sequence)
Encoder = Callable[..., tuple[bytearray, int]]


class Started(NamedTuple):
    """A send's first attempt, written by :meth:`BatchSender.start`."""

    fut: Any  # the response frame: a future, or start()'s sink
    route: TopicRoute
    mq: MessageQueue
    pinned: bool
    batch: bytearray
    seq: int
    t0: float  # time.monotonic() at the write (the latency table's start)
    deadline: float  # loop time


_new_tuple = tuple.__new__


class BatchSender:
    """Encodes and sends one batch at a time for a producer."""

    def __init__(self, *, group: str, pool: ConnectionPool, router: SendRouter,
                 sequencer: Sequencer, policy: RetryPolicy, send_timeout: float,
                 max_message_size: int, max_properties_size: int, compression: int,
                 compress_min: int) -> None:
        self.group = group
        self.pool = pool
        self.router = router
        self.sequencer = sequencer
        self.policy = policy
        self.send_timeout = send_timeout
        self.max_message_size = max_message_size
        self.max_properties_size = max_properties_size
        self.compression = compression
        self.compress_min = compress_min
        self._hosts: dict[str, bytes] = {}  # local address -> record.pack_host form
        #: the encoder sends use (a TransactionProducer wraps it to mark half messages)
        self.encode: Encoder = self.encode_batch
        #: :meth:`start` may encode a batch of one message with :meth:`encode_one` (the
        #: bytes ``encode`` gives it): set by the producer when ``encode`` is
        #: :meth:`encode_batch` without compression
        self.encode_lone = False

    def header(self, topic: str, queue_id: int, batch: bool,
               born_ts: int | None = None) -> SendMessageRequestHeader:
        return SendMessageRequestHeader(
            producer_group=self.group, topic=topic, queue_id=queue_id,
            born_timestamp=int(time.time() * 1000) if born_ts is None else born_ts, batch=batch,
        )

    def packed_host(self, host: str) -> bytes:
        packed = self._hosts.get(host)
        if packed is None:
            packed = self._hosts[host] = pack_host(host)
        return packed

    def encode_one(self, topic: str, m: Message, queue_id: int, packed_host: bytes, port: int,
                   born_ts: int) -> tuple[bytearray, int]:
        """:meth:`encode_batch` of one message without compression, delay nor deliver_at
        (the caller checked): a frame of 1,000 one-message batches (spread traffic,
        client/multi_sender.py) pays the encoder's per-batch dispatch once per frame."""
        sq = self.sequencer
        seq = sq.next_seq
        try:
            batch = encode_one(topic, queue_id, m, sq.producer_id, seq, born_ts, packed_host,
                               port, self.max_properties_size)
        except (ValueError, struct.error) as exc:
            raise _unencodable(exc) from exc
        if len(batch) > self.max_message_size:
            raise self._oversize(len(batch), 1)
        sq.next_seq = seq + 1
        return batch, seq

    def encode_small(self, topic: str, msgs: Sequence[Message], queue_id: int,
                     packed_host: bytes, port: int, born_ts: int
                     ) -> tuple[bytearray, int] | None:
        """:meth:`encode_batch` of 2..32 plain messages (no tags, keys, properties, delay nor
        deliver_at; the caller checked the producer does not compress), without the encoder's
        per-batch dispatch: the small batches of a frame at 10,000 queues and more
        (client/multi_sender.py). None when a message is not plain (then ``encode_batch``)."""
        for m in msgs:
            if m.tags or m.keys or m.properties or m.delay_level or m.deliver_at:
                return None
        sq = self.sequencer
        seq = sq.next_seq
        try:
            batch = encode_small_plain(topic, queue_id, [m.body for m in msgs],
                                       sq.producer_id, seq, born_ts, packed_host, port)
        except (ValueError, struct.error) as exc:
            raise _unencodable(exc) from exc
        if len(batch) > self.max_message_size:
            raise self._oversize(len(batch), len(msgs))
        sq.next_seq = seq + len(msgs)
        return batch, seq

    def encode_batch(
        self, topic: str, msgs: Sequence[Message], queue_id: int, host: str, port: int,
        sequence_id: int | None = None, born_ts: int | None = None,
    ) -> tuple[bytearray, int]:
        seq = self.sequencer.take(len(msgs), sequence_id)
        if born_ts is None:
            born_ts = int(time.time() * 1000)
        packed = self._hosts.get(host)
        if packed is None:
            packed = self.packed_host(host)
        try:
            if isinstance(msgs, Columns):
                pid = self.sequencer.producer_id if msgs.producer_id is None else msgs.producer_id
                batch = msgs.encode(queue_id, pid, seq, born_ts, packed, port)
            else:
                batch = encode_messages(
                    topic, msgs, queue_id=queue_id, producer_id=self.sequencer.producer_id,
                    base_seq=seq, born_ts=born_ts, born_host=packed, born_port=port,
                    compression=self.compression, compress_min=self.compress_min,
                    max_properties_size=self.max_properties_size,
                )
        except (ValueError, struct.error) as exc:  # struct.error: a field out of its range
            raise _unencodable(exc) from exc
        if len(batch) > self.max_message_size:
            raise self._oversize(len(batch), len(msgs))
        return batch, seq

    def _oversize(self, size: int, n: int) -> MessageRejectedError:
        """The refusal of a batch of ``n`` messages that encodes to ``size`` bytes, over
        ``max_message_size`` (one wording for every encode path)."""
        if n > 1:
            return MessageRejectedError(
                f"the batch encodes to {size} bytes, over the {self.max_message_size}-byte "
                "limit; send fewer or smaller messages per batch")
        return MessageRejectedError(
            f"the message encodes to {size} bytes, over the {self.max_message_size}-byte "
            "limit; send a smaller body, or fewer or shorter keys and properties")

    def check(self, msg: Message) -> Exception | None:
        """Why ``msg`` alone cannot be sent (the encoder's refusal), or None; sends nothing
        and takes no sequence."""
        try:
            batch = encode_messages(
                msg.topic, [msg], queue_id=0, producer_id=self.sequencer.producer_id,
                base_seq=0, born_ts=0, born_host=self.packed_host("127.0.0.1"), born_port=0,
                compression=self.compression, compress_min=self.compress_min,
                max_properties_size=self.max_properties_size,
            )
        except (ValueError, struct.error) as exc:
            return _unencodable(exc)
        if len(batch) > self.max_message_size:
            return self._oversize(len(batch), 1)
        return None

    def start(self, topic: str, msgs: Sequence[Message], queue_id: MessageQueue | None,
              timeout: float | None, code: int, sink: Any = None, now: bool = False
              ) -> Started | None:
        """The first attempt of :meth:`send` without a coroutine: encode and write the request
        now, return what :meth:`finish` needs once its response future completes -- or None
        when this send needs the coroutine from the start (no cached route or open writable
        connection, a deduplicated producer, a message the encoder refuses: :meth:`send` then
        does everything, and raises what it must). The blocking facade's lone sends take this
        path: no task, no coroutine frames, no loop iteration to wake a task. ``sink``:
        where the connection puts the answer (``Connection.start_request``); ``now``: the
        frame is written at once (``Connection.start_request``)."""
        if self.sequencer.producer_name is not None:  # deduplicated (Sequencer.dedup)
            return None
        route = self.router.cached(topic)
        if route is None:
            return None
        router = self.router
        try:
            mq, pinned = router.select(route, msgs[0], queue_id, None, None, None, None)
        except ClientError:
            # No writable queue (say, a group without a master): the coroutine path selects
            # again and raises it to the caller. Raised here it would escape into the loop
            # callback that kicked the batch, and the caller would wait out its timeout.
            return None
        conn = self.pool.writable_nowait(route.broker_addrs[mq.broker_name])
        if conn is None:
            return None
        timeout = self.send_timeout if timeout is None else timeout
        t0 = time.monotonic()
        born_ts = int(time.time() * 1000)
        try:
            m = msgs[0]
            if self.encode_lone and len(msgs) == 1 and not (m.delay_level or m.deliver_at):
                # (encode_batch's own path for it, without its layers: ~1 us a send here)
                host = conn.local_host
                packed = self._hosts.get(host) or self.packed_host(host)
                batch, seq = self.encode_one(topic, m, mq.queue_id, packed, conn.local_port,
                                             born_ts)
            else:
                batch, seq = self.encode(topic, msgs, mq.queue_id, conn.local_host,
                                         conn.local_port, None, born_ts)
            header = SendMessageRequestHeader(
                producer_group=self.group, topic=topic, queue_id=mq.queue_id,
                born_timestamp=born_ts, batch=code == _SEND_BATCH)
            deadline = conn._loop.time() + timeout
            fut = conn.start_request(code, header, batch, timeout, sink, now, deadline)
        except (ClientError, LocalProtocolError):
            return None  # the coroutine path sends it again and reports what it must
        # (tuple.__new__: a NamedTuple's own __new__ is a Python function)
        return _new_tuple(Started, (fut, route, mq, pinned, batch, seq, t0, deadline))

    def finish(self, st: Started, topic: str, frame: Frame) -> SendResult | None:
        """The SendResult of a started send whose answer ``frame`` is a plain SEND_OK, else
        None (the coroutine, :meth:`send` with ``started``, takes it from there: errors,
        retries, statuses that may be sent again elsewhere)."""
        if frame.code != _SUCCESS:
            return None
        mq = st.mq
        self.router.record(mq.broker_name, (time.monotonic() - st.t0) * 1000)
        h = frame.header
        assert isinstance(h, SendMessageResponseHeader)
        return SendResult(SendStatus.SEND_OK, h.msg_id, topic, h.queue_id, h.queue_offset,
                          h.count, mq.broker_name, self.sequencer.producer_id, st.seq,
                          h.commit_log_offset)

    async def send(
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
        started: Started | None = None,
    ) -> SendResult:
        # The hot path of every synchronous send: one coroutine frame (the connection's future
        # is awaited here, not through Connection.request), one clock read for the deadline,
        # one for born_ts, and the monotonic pair the latency table needs.
        router = self.router
        policy = self.policy
        producer_id = self.sequencer.producer_id
        timeout = self.send_timeout if timeout is None else timeout
        loop = asyncio.get_running_loop()
        if started is None:
            deadline = loop.time() + timeout
            route = router.cached(topic) or await router.route(topic)
        else:  # the first attempt was written by start(): its answer is awaited below
            deadline, route = started.deadline, started.route
        batch: bytearray | None = None
        seq = 0
        last_broker: str | None = None
        last_exc: Exception | None = None
        last_result: SendResult | None = None
        attempts = policy.attempts
        dedup = self.sequencer.dedup or (
            isinstance(msgs, Columns) and msgs.producer_id is not None
        )
        mq: MessageQueue | None = None
        pinned = False
        left = timeout
        for attempt in range(attempts):
            if attempt:
                left = deadline - loop.time()
                if left <= 0:
                    break
            if started is not None:
                mq, pinned, batch, seq, t0 = (started.mq, started.pinned, started.batch,
                                              started.seq, started.t0)
                first, started = started.fut, None
            else:
                first = None
                if mq is None or not dedup:
                    mq, pinned = router.select(route, msgs[0], queue_id, selector, arg,
                                               hash_key, last_broker)
                t0 = time.monotonic()
            addr = route.broker_addrs[mq.broker_name]
            try:
                if first is not None:
                    frame = await first
                else:
                    conn = self.pool.get_nowait(addr) or await self.pool.get(addr)
                    if not conn.writable:
                        # Before encoding: a backlog of batches waits here as messages, and
                        # each is encoded just before it is written (cache-hot, and not a
                        # backlog's worth of encoded copies in memory).
                        await conn.drain()
                    born_ts = int(time.time() * 1000)
                    if batch is None:
                        batch, seq = self.encode(topic, msgs, mq.queue_id, conn.local_host,
                                                 conn.local_port, sequence_id, born_ts)
                    elif attempt:
                        # A copy: the transport may still hold the bytes of the failed attempt.
                        batch = bytearray(batch)
                        set_queue_id(batch, mq.queue_id)
                    header = self.header(topic, mq.queue_id, code == _SEND_BATCH, born_ts)
                    frame = await conn.start_request(code, header, batch, left)
                fcode = frame.code
                if fcode not in _SEND_OK_CODES:
                    if fcode == _DUPLICATE:
                        # BR12: the broker has this sequence already; nothing was stored again.
                        return SendResult(SendStatus.DUPLICATE, unique_id(producer_id, seq),
                                          topic, mq.queue_id, -1, len(msgs), mq.broker_name,
                                          producer_id, seq)
                    raise_for_error(frame, _SEND_OK_CODES)
            except (ClientError, BrokerError) as exc:
                if isinstance(exc, MessageRejectedError):
                    raise
                latency = (time.monotonic() - t0) * 1000
                router.record(mq.broker_name, max(latency, FAILURE_LATENCY_MS))
                if policy.route_may_have_moved(exc):
                    router.routes.refresh_soon(topic)
                last_exc, last_broker = exc, mq.broker_name
                wait = policy.wait_before_retry(exc, pinned=pinned, dedup=dedup,
                                                brokers=len(route.broker_addrs),
                                                time_left=deadline - loop.time())
                if wait is None:
                    raise
                if wait:
                    await asyncio.sleep(wait)
                if dedup:
                    await asyncio.sleep(policy.settle(attempt, deadline - loop.time()))
                log.info("send to %s failed (%s), attempt %d of %d", mq, exc, attempt + 1,
                         attempts)
                if policy.refetch_route(exc):
                    assert isinstance(exc, BrokerError)
                    try:
                        route = await router.routes.get(topic, refresh=True)
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
            router.record(mq.broker_name, (time.monotonic() - t0) * 1000)
            h = frame.header
            assert isinstance(h, SendMessageResponseHeader)
            if policy.again_elsewhere(fcode == _SUCCESS, pinned=pinned, dedup=dedup,
                                      attempt=attempt):
                log.info("send to %s answered %s; sending it again to another broker", mq,
                         STATUS[fcode].value)
                last_broker = mq.broker_name
                last_exc = None
                last_result = SendResult(
                    STATUS[fcode], h.msg_id, topic, h.queue_id, h.queue_offset,
                    h.count, mq.broker_name, producer_id, seq, h.commit_log_offset,
                )
                continue
            return SendResult(
                STATUS[fcode], h.msg_id, topic, h.queue_id, h.queue_offset,
                h.count, mq.broker_name, producer_id, seq, h.commit_log_offset,
            )
        if last_result is not None:  # stored, not safe: the caller sees which status
            return last_result
        if last_exc is None:
            raise RequestTimeoutError(f"send to topic {topic!r} timed out after {timeout:g} s")
        raise last_exc


def _unencodable(exc: Exception) -> MessageRejectedError:
    """The refusal of a message the encoder cannot encode (its reason: a field out of range,
    a property that does not fit, ...)."""
    return MessageRejectedError(f"cannot encode the message: {exc}")
