"""Open batches of many topics to one broker as one SEND_MULTI_QUEUE frame (issue 17).

Spread traffic -- ``send_async`` to thousands of queues -- leaves the accumulator as many small
batches at each flush; sent one request per batch, each costs the broker its per-request work.
When the accumulator flushes the open batches of several topics at once, this groups them by
the broker of the queue picked for each (the router's usual choice) and sends each group as one
frame (docs/protocol.md 4.0). The broker answers one result per batch; a batch refused with a
retryable code, and every batch of a frame that failed as a whole, goes again through the
single-batch path (``BatchSender`` with its retries and other brokers). A broker that does not
know the request is remembered and gets single batches.

Not used by deduplicated (named) producers: their resends must reuse the same bytes, which the
single-batch path guarantees.

Threading: one event loop (the producer's).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from tidemq.client.accumulator import split_result
from tidemq.client.batch_sender import STATUS, Encoder
from tidemq.client.connection import ConnectionPool, raise_for_error
from tidemq.client.message import Message, MessageQueue, SendResult
from tidemq.client.retry_policy import CONTENT_CODES, RETRY_CODES
from tidemq.client.send_router import SendRouter
from tidemq.protocol.codes import RequestCode, ResponseCode
from tidemq.protocol.errors import BrokerError
from tidemq.protocol.headers import SendMultiQueueRequestHeader, SendMultiQueueResponseHeader

__all__ = ["MultiQueueSender", "OpenBatch"]

#: batches per SEND_MULTI_QUEUE frame at most, and the body bytes a frame aims to stay under
MAX_FRAME_BATCHES = 1000
MAX_FRAME_BYTES = 4 << 20

# (topic, messages, futures) of one open batch
OpenBatch = tuple[str, list[Message], list[asyncio.Future[SendResult]]]


class MultiQueueSender:
    def __init__(self, *, group: str, pool: ConnectionPool, router: SendRouter,
                 encode: Callable[[], Encoder], producer_id: Callable[[], int],
                 send_timeout: float, single: Callable[[OpenBatch], None],
                 answered: Callable[[int], None], track: Callable[[asyncio.Future[Any]], None]
                 ) -> None:
        self.group = group
        self.pool = pool
        self.router = router
        self._encode = encode
        self._producer_id = producer_id
        self.send_timeout = send_timeout
        self._single = single  # send one open batch through the single-batch path
        self._answered = answered  # n messages answered (the accumulator's pending count)
        self._track = track
        self.no_multi: set[str] = set()  # brokers that answered REQUEST_CODE_NOT_SUPPORTED
        #: encodes a batch of one plain message (BatchSender.encode_one), with
        #: ``packed_host``; None: every batch through ``encode`` (a producer whose encoder
        #: marks batches, or compresses them)
        self.encode_one: Callable[[str, Message, int, bytes, int, int],
                                  tuple[bytearray, int]] | None = None
        #: encodes a batch of 2..32 messages if all are plain (BatchSender.encode_small;
        #: None when it declines), set with ``encode_one``
        self.encode_small: Callable[[str, list[Message], int, bytes, int, int],
                                    tuple[bytearray, int] | None] | None = None
        self.packed_host: Callable[[str], bytes] = lambda host: b""
        self.frames = 0  # SEND_MULTI_QUEUE frames sent (stats, tests)

    def take(self, batches: list[OpenBatch]) -> list[OpenBatch]:
        """Start frames for the batches that share a broker with another; returns the rest
        (for the single-batch path)."""
        rest: list[OpenBatch] = []
        by_broker: dict[str, list[tuple[MessageQueue, OpenBatch]]] = {}
        router = self.router
        # A broker being avoided (latency fault) is handled by the queue choice itself
        # (``select`` picks another broker's queue, or this one when it is the only one left).
        # Handing every batch to the single-batch path instead made one slow frame (a 1,000-
        # batch frame queued behind others, >= 550 ms) turn spread traffic into one request
        # per batch for 30 s: slower still, more timeouts, and the avoidance renewed
        # (100,000 queues: 4.4 k msgs/s and 1,788 send errors of 100,000).
        # once per batch, and at 100,000 queues nearly every batch is one message: locals
        cached, no_multi = router.routes.cached, self.no_multi  # (router.cached: a call more)
        # the router's choice for unpinned batches (round robin, avoiding a slow broker);
        # rr: the everyday case (no broker avoided) inlined
        choose = router.spread_chooser()
        rr = None if router.faults.avoiding else router._rr
        for b in batches:
            route = cached(b[0])
            if route is None or not route.write_queues:
                rest.append(b)
                continue
            queues = route.write_queues
            mq = queues[next(rr) % len(queues)] if rr is not None else choose(queues)
            addr = route.broker_addrs.get(mq.broker_name)
            if addr is None or addr in no_multi:
                rest.append(b)
                continue
            group = by_broker.get(addr)
            if group is None:
                group = by_broker[addr] = []
            group.append((mq, b))
        loop = asyncio.get_running_loop()
        for addr, items in by_broker.items():
            if len(items) == 1:
                rest.append(items[0][1])
                continue
            # frames of at most MAX_FRAME_BATCHES batches and about MAX_FRAME_BYTES of bodies:
            # far below the frame limit (16 MiB), and one frame's work stays bounded
            frame: list[tuple[MessageQueue, OpenBatch]] = []
            size = 0
            for it in items:
                msgs = it[1][1]
                n = (len(msgs[0].body) if len(msgs) == 1 else sum(len(m.body) for m in msgs)
                     ) + 256
                if frame and (len(frame) >= MAX_FRAME_BATCHES or size + n > MAX_FRAME_BYTES):
                    self._track(loop.create_task(self._send(addr, frame)))
                    frame, size = [], 0
                frame.append(it)
                size += n
            if len(frame) == 1:
                rest.append(frame[0][1])
            elif frame:
                self._track(loop.create_task(self._send(addr, frame)))
        return rest

    async def _send(self, addr: str, items: list[tuple[MessageQueue, OpenBatch]]) -> None:
        seqs: list[int] = []
        try:
            conn = self.pool.get_nowait(addr) or await self.pool.get(addr)
            born_ts = int(time.time() * 1000)
            encode = self._encode()
            host, port = conn.local_host, conn.local_port
            parts = []
            one = self.encode_one
            if one is not None:
                packed = self.packed_host(host)
                small = self.encode_small
                for mq, (topic, msgs, _futs) in items:
                    n = len(msgs)
                    if n == 1 and not (msgs[0].delay_level or msgs[0].deliver_at):
                        # a batch of one plain message (at 100,000 queues nearly every one)
                        encoded, seq = one(topic, msgs[0], mq.queue_id, packed, port, born_ts)
                    else:
                        # a few plain messages (at 10,000 queues ~10 a batch), else the
                        # encoder's full dispatch
                        got = (small(topic, msgs, mq.queue_id, packed, port, born_ts)
                               if small is not None and n <= 32 else None)
                        encoded, seq = got if got is not None else encode(
                            topic, msgs, mq.queue_id, host, port, None, born_ts)
                    parts.append(encoded)
                    seqs.append(seq)
            else:
                for mq, (topic, msgs, _futs) in items:
                    encoded, seq = encode(topic, msgs, mq.queue_id, host, port, None, born_ts)
                    parts.append(encoded)
                    seqs.append(seq)
            header = SendMultiQueueRequestHeader(producer_group=self.group, batches=len(parts),
                                                 born_timestamp=born_ts)
            if not conn.writable:
                await conn.drain()
            t0 = time.monotonic()
            self.frames += 1
            frame = await conn.start_request(RequestCode.SEND_MULTI_QUEUE, header,
                                             b"".join(parts), self.send_timeout)
            if frame.code == ResponseCode.REQUEST_CODE_NOT_SUPPORTED:
                self.no_multi.add(addr)
            raise_for_error(frame)
            self.router.record(items[0][0].broker_name, (time.monotonic() - t0) * 1000)
            h = frame.header
            if not isinstance(h, SendMultiQueueResponseHeader) or len(h.results) != len(items):
                raise BrokerError("SEND_MULTI_QUEUE answered a different number of results",
                                  response_code=ResponseCode.SYSTEM_ERROR)
        except Exception:
            for _mq, b in items:  # each batch again on its own, with its retries
                self._single(b)
            return
        pid = self._producer_id()
        prefix = f"{pid:016X}"  # of every message id of the frame
        answered = 0  # messages answered, told to the accumulator once per frame
        try:
            for (mq, b), r, seq in zip(items, h.results, seqs, strict=True):
                topic, msgs, futs = b
                status = STATUS.get(r.code)
                if status is None:
                    if r.code in RETRY_CODES or (r.code in CONTENT_CODES and len(msgs) > 1):
                        # again on its own: with its retries, or to tell the bad message apart
                        # from the callers it shares the batch with
                        self._single(b)
                        continue
                    answered += len(msgs)
                    exc = BrokerError(r.message or f"batch refused (response code {r.code})",
                                      response_code=r.code)
                    for f in futs:
                        if not f.done():
                            f.set_exception(exc)
                    continue
                answered += len(msgs)
                # One SendResult per batch; each message's (offset and sequence + i) is built
                # by split_result, or only when read for a send_async SendFuture.
                split_result(SendResult(status, f"{prefix}{seq:016X}", topic, mq.queue_id,
                                        r.queue_offset, len(msgs), mq.broker_name, pid, seq),
                             futs)
        finally:
            self._answered(answered)
