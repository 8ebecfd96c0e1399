"""A consumer's pulls to one broker gathered into PULL_MULTI_QUEUE requests (issue 17).

A consumer with thousands of assigned queues would otherwise keep a held pull per queue. Each
queue's pull loop still decides *what* to pull (its offset, its filter); the batcher collects
the pulls that the loops issue within one event-loop iteration and sends them, up to
``max_queues`` per request, as PULL_MULTI_QUEUE frames held by the broker as one long poll
(docs/protocol.md 4.0). Each loop gets back its queue's result and its slice of the body,
exactly what a PULL_MESSAGE would have answered.

Cost note: a held request is answered whole when any of its queues receives messages, and the
queues that found nothing pull again; ``max_queues`` bounds that re-pull (the queues of one
request), the price of not keeping per-queue pulls.

Standing pulls (``standing=True``, the push consumer): a queue answered PULL_NOT_FOUND is not
answered to its loop; it stays held on the broker past the answer, and its future here waits
until a later answer on this connection names it in ``woken``. A request then carries only the
queues that moved, and an empty request is kept in flight while queues stand, so a message on
one of 10,000 queues costs one queue's re-pull, not 10,000. A broker that does not hold them
answers ``standing=False``: its PULL_NOT_FOUND results go back to their loops as before.

Threading: one event loop (the consumer's).
"""

from __future__ import annotations

import asyncio
from typing import Any

from tidemq.client.connection import ConnectionPool, raise_for_error
from tidemq.protocol.codes import RequestCode, ResponseCode
from tidemq.protocol.errors import BrokerError
from tidemq.protocol.headers import (
    MultiQueuePull,
    MultiQueuePullResult,
    PullMultiQueueRequestHeader,
    PullMultiQueueResponseHeader,
)

__all__ = ["PullBatcher", "MultiPullUnsupported"]


class MultiPullUnsupported(Exception):
    """The broker does not serve PULL_MULTI_QUEUE: pull queue by queue."""


class PullBatcher:
    def __init__(self, pool: ConnectionPool, addr: str, group: str, *, suspend_ms: int,
                 timeout: float, max_queues: int = 1000, standing: bool = False) -> None:
        self.pool = pool
        self.addr = addr
        self.group = group
        self.suspend_ms = suspend_ms
        self.timeout = timeout
        self.max_queues = max_queues
        self.unsupported = False
        self.requests = 0
        self._waiting: list[tuple[MultiQueuePull, asyncio.Future[Any]]] = []
        self._scheduled = False
        self._tasks: set[asyncio.Future[Any]] = set()
        self.standing = standing
        #: standing queues' futures by (topic, queue id), and the requests in flight
        self._standing: dict[tuple[str, int], asyncio.Future[Any]] = {}
        self._in_flight = 0
        #: the newest pull of each queue: an older one answered later (a queue dropped and
        #: assigned again while its old pull was held) must not stand in its place
        self._latest: dict[tuple[str, int], asyncio.Future[Any]] = {}

    def pull(self, p: MultiQueuePull) -> asyncio.Future[tuple[MultiQueuePullResult, Any]]:
        """The (result, body slice) of one queue's pull."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[tuple[MultiQueuePullResult, Any]] = loop.create_future()
        key = (p.topic, p.queue_id)
        if self.standing:
            self._latest[key] = fut
        old = self._standing.pop(key, None)
        if old is not None and not old.done():
            # pulled anew (the queue was dropped and assigned again): the old pull is void
            old.set_result((MultiQueuePullResult(ResponseCode.PULL_NOT_FOUND, p.queue_offset),
                            b""))
        self._waiting.append((p, fut))
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush)
        return fut

    def _flush(self) -> None:
        self._scheduled = False
        waiting, self._waiting = self._waiting, []
        live = [(p, f) for p, f in waiting if not f.done()]
        loop = asyncio.get_running_loop()
        if not live and self._standing and self._in_flight == 0:
            t = loop.create_task(self._send([]))  # only waits for standing queues
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
            return
        for i in range(0, len(live), self.max_queues):
            t = loop.create_task(self._send(live[i : i + self.max_queues]))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _send(self, items: list[tuple[MultiQueuePull, asyncio.Future[Any]]]) -> None:
        header = PullMultiQueueRequestHeader(
            consumer_group=self.group, pulls=[p for p, _ in items], suspend=True,
            suspend_timeout_millis=self.suspend_ms, standing=self.standing)
        self._in_flight += 1
        try:
            conn = self.pool.get_nowait(self.addr) or await self.pool.get(self.addr)
            self.requests += 1
            frame = await conn.request(RequestCode.PULL_MULTI_QUEUE, header,
                                       timeout=self.timeout)
            if frame.code == ResponseCode.REQUEST_CODE_NOT_SUPPORTED:
                self.unsupported = True
                raise MultiPullUnsupported(self.addr)
            raise_for_error(frame)
            h = frame.header
            if not isinstance(h, PullMultiQueueResponseHeader) or len(h.results) != len(items):
                raise BrokerError("PULL_MULTI_QUEUE answered a different number of results",
                                  response_code=ResponseCode.SYSTEM_ERROR)
        except BaseException as exc:
            self._in_flight -= 1
            lost = [f for _p, f in items]
            if self.standing and isinstance(exc, Exception):
                # the standing queues may be gone with the connection: their loops retry
                lost += self._standing.values()
                self._standing.clear()
            for f in lost:
                if not f.done():
                    f.set_exception(exc if isinstance(exc, Exception) else
                                    asyncio.CancelledError())
            if not isinstance(exc, Exception):
                raise
            return
        self._in_flight -= 1
        body = memoryview(frame.body)
        pos = 0
        stand = self.standing and h.standing
        for (p, f), r in zip(items, h.results, strict=True):
            part = body[pos : pos + r.body_bytes]
            pos += r.body_bytes
            if f.done():
                continue
            key = (p.topic, p.queue_id)
            if stand and r.code == ResponseCode.PULL_NOT_FOUND and self._latest.get(key) is f:
                self._standing[key] = f  # answered when woken
            else:
                f.set_result((r, part))
        for w in h.woken:
            part = body[pos : pos + w.result.body_bytes]
            pos += w.result.body_bytes
            got = self._standing.pop((w.topic, w.queue_id), None)
            if got is not None and not got.done():
                got.set_result((w.result, part))
        if self._standing and self._in_flight == 0 and not self._scheduled:
            # keep a request in flight to carry the next woken queues; the loops answered
            # just now pull again in the next iterations and join it when they are quick
            self._scheduled = True
            loop = asyncio.get_running_loop()
            # three iterations: a loop resumes, starts its next pull task, which calls pull()
            loop.call_soon(loop.call_soon, loop.call_soon, self._flush)

    def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
