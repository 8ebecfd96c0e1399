"""SimpleConsumer: RocketMQ 5's consumer on server-side dispatch (POP; docs/consumer-groups.md).

::

    async with aio.SimpleConsumer("127.0.0.1:9876", "billing") as c:
        c.subscribe("orders")                        # or sql="region = 'eu'"
        for m in await c.receive(16, invisible_duration=30.0):
            handle(m.body)
            await c.ack(m)

The broker hands each message of the subscribed topics to one member of the group at a time:
``receive`` pops up to ``max_messages`` from any queue (POP_MESSAGE, long polling up to
``await_duration``; with several topics or brokers it waits on all of them at once with
NOTIFICATION, then pops where something is); each received message is invisible to the group for
``invisible_duration`` seconds; ``ack`` removes it for good; what is not acked in time is
delivered again -- to this or another member -- with ``delivery_attempt`` + 1, and after the
group's ``retry_max_times`` (16) deliveries goes to ``%DLQ%<group>``.
``change_invisible_duration`` extends (or shortens) the time a message stays invisible.

Acks are grouped: every ``ack`` joins a per-broker buffer sent as one ACK_MESSAGE frame on the
next turn of the event loop (or at ``ack_batch`` handles), so many concurrent acks cost one
round trip. ``ack`` raises :class:`StaleReceiptError` (response NO_MESSAGE) when the handle is
stale: the message was acked already, or delivered again since because its invisible time
passed -- the work was then done twice, which at-least-once allows.

Members need no rebalance: any number of them share any number of queues. They heartbeat
(``consume_type="POP"``, ``membership.py``) to every broker of their topics at the first
``receive`` after a subscription change and every ``heartbeat_interval``, so ``tidemq group
describe`` lists them and the broker refuses a push or lite pull consumer in the same group
(CONSUME_MODE_CONFLICT, raised by ``receive``); ``close`` unregisters.

``orderly=True`` (RocketMQ 5 FIFO): the broker hands out at most one message per message group
at a time (the ``__SHARDINGKEY`` property; messages without one: per queue), the next only after
it is acked or its invisible time ran out -- so a group's messages are received in order, a
redelivery before the later ones. One group pops either orderly or not.

Event loop only (``tidemq.SimpleConsumer`` is the blocking facade).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from tidemq.client.codec import decode_pull_body
from tidemq.client.connection import DEFAULT_TIMEOUT, ConnectionPool, raise_for_error
from tidemq.client.errors import (
    ClientClosedError,
    ConnectError,
    ConnectionLostError,
    NoRouteError,
)
from tidemq.client.membership import GroupMembership, make_client_id
from tidemq.client.message import MessageExt
from tidemq.client.route import RouteCache
from tidemq.client.selection import Selection
from tidemq.protocol.batch.codec import read_total_size_magic
from tidemq.protocol.batch.fields import queue_offset_at
from tidemq.protocol.codes import RequestCode, ResponseCode
from tidemq.protocol.errors import BrokerError, TidemqError
from tidemq.protocol.names import group_name_problem
from tidemq.protocol.pop import (
    MAX_ACKS_PER_FRAME,
    MAX_POP_MESSAGES,
    AckMessageRequestHeader,
    ChangeInvisibleRequestHeader,
    NotificationRequestHeader,
    PopMessageRequestHeader,
    receipt_strings,
)
from tidemq.protocol.receipt import MAX_INVISIBLE_MS

__all__ = ["SimpleConsumer", "ReceivedMessage", "StaleReceiptError"]

log = logging.getLogger(__name__)

_POP_OK = frozenset({ResponseCode.SUCCESS, ResponseCode.PULL_NOT_FOUND})


class StaleReceiptError(BrokerError):
    """An ack or invisible-time change of a stale receipt handle (NO_MESSAGE): the message was
    acked already, or delivered again since."""

    code = "NO_MESSAGE"


class ReceivedMessage:
    """A received message (``message``: the :class:`MessageExt`; its attributes are readable
    here too) with its ``receipt_handle`` and ``delivery_attempt`` (1 = first delivery)."""

    __slots__ = ("message", "receipt_handle", "delivery_attempt", "broker_addr")

    def __init__(self, message: MessageExt, receipt_handle: str, delivery_attempt: int,
                 broker_addr: str) -> None:
        self.message = message
        self.receipt_handle = receipt_handle
        self.delivery_attempt = delivery_attempt
        self.broker_addr = broker_addr

    def __getattr__(self, name: str) -> Any:
        return getattr(self.message, name)

    def __repr__(self) -> str:
        m = self.message
        return (f"ReceivedMessage({m.topic}, queue {m.queue_id}, offset {m.queue_offset}, "
                f"attempt {self.delivery_attempt})")


def _ms(seconds: float, what: str) -> int:
    ms = int(round(seconds * 1000))
    if not 1 <= ms <= MAX_INVISIBLE_MS:
        raise ValueError(f"{what} must be between 0.001 s and 12 h, not {seconds!r}")
    return ms


def _quiet(f: asyncio.Future[None]) -> None:
    if not f.cancelled():
        f.exception()  # retrieved: a failed ack nobody awaits is not worth a warning


class _AckBuffer:
    """Acks of one broker waiting for the next flush (one ACK_MESSAGE frame)."""

    __slots__ = ("handles", "futures", "scheduled")

    def __init__(self) -> None:
        self.handles: list[str] = []
        self.futures: list[asyncio.Future[None]] = []
        self.scheduled = False


class SimpleConsumer:
    """RocketMQ 5 SimpleConsumer over POP (see the module doc). Event loop only."""

    def __init__(
        self,
        namesrv: str | Sequence[str],
        group: str,
        *,
        await_duration: float = 20.0,
        init_mode: str = "latest",
        orderly: bool = False,
        ack_batch: int = 1024,
        request_timeout: float = DEFAULT_TIMEOUT,
        route_refresh: float = 30.0,
        heartbeat_interval: float = 30.0,
        instance_name: str | None = None,
        pool: ConnectionPool | None = None,
        consumer_name: str = "",
        subscription_type: str = "",
    ) -> None:
        """``consumer_name`` (then the client id) and ``subscription_type``: set by the
        Pulsar-style :class:`~tidemq.client.subscription_consumer.Consumer` popping through
        this one; its pops name the consumer, the broker applies the type's rules."""
        problem = group_name_problem(group)
        if problem:
            raise ValueError(problem)
        if init_mode.lower() not in ("earliest", "latest"):
            raise ValueError("init_mode is 'earliest' or 'latest'")
        if not 1 <= ack_batch <= MAX_ACKS_PER_FRAME:
            raise ValueError(f"ack_batch must be between 1 and {MAX_ACKS_PER_FRAME}")
        self.group = group
        self.await_duration = await_duration
        self.init_mode = init_mode.upper()
        self.orderly = orderly
        self.ack_batch = ack_batch
        self.request_timeout = request_timeout
        self._own_pool = pool is None
        self.pool = pool if pool is not None else ConnectionPool(connect_timeout=request_timeout)
        self.routes = RouteCache(self.pool, namesrv, refresh_interval=route_refresh,
                                 timeout=request_timeout)
        self.client_id = consumer_name or make_client_id(instance_name)
        self.subscription_type = subscription_type
        self.heartbeat_interval = heartbeat_interval
        self.membership = GroupMembership(
            group, self.client_id, self.pool, self.routes, consume_from=self.init_mode.lower(),
            request_timeout=request_timeout, consume_type="POP",
            subscription_type=subscription_type)
        self._beat: dict[str, str] | None = None  # the subscriptions of the last heartbeat
        self._beat_task: asyncio.Task[None] | None = None
        self._subs: dict[str, Selection] = {}
        self._rr = itertools.count()
        self._acks: dict[str, _AckBuffer] = {}
        self._started = False
        self._closed = False
        self.received = 0
        self.acked = 0
        self.stale = 0

    # -- configuration / lifecycle ---------------------------------------------------------------
    def subscribe(self, topic: str, expression: str = "*", *, sql: str | None = None) -> None:
        """Receive ``topic``'s messages: ``expression`` "*" or "TagA || TagB", or
        ``sql="..."`` (SQL92 over properties, filtered on the broker)."""
        self._subs[topic] = Selection(expression, sql=sql)

    def unsubscribe(self, topic: str) -> None:
        self._subs.pop(topic, None)

    def subscription(self) -> dict[str, str]:
        return {t: s.expression for t, s in self._subs.items()}

    async def start(self) -> SimpleConsumer:
        if self._closed:
            raise ClientClosedError("this SimpleConsumer was closed; create a new one")
        if not self._started:
            self._started = True
            self.routes.start()
            self._beat_task = asyncio.get_running_loop().create_task(self._heartbeat_loop())
        return self

    async def _heartbeat(self) -> None:
        """Heartbeat now (a refusal raises: CONSUME_MODE_CONFLICT, a bad subscription)."""
        subs = self.subscription()
        await self.membership.heartbeat(dict(self._subs))
        self._beat = subs

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            if self._subs:
                try:
                    await self._heartbeat()
                except TidemqError as exc:
                    log.warning("heartbeat of group %s failed: %s", self.group, exc)

    async def close(self) -> None:
        """Flush pending acks, then close. Unacked received messages come back to the group
        when their invisible time passes."""
        if self._closed:
            return
        for addr, buf in list(self._acks.items()):
            if buf.handles:
                await self._flush(addr)
        self._closed = True
        if self._beat_task is not None:
            self._beat_task.cancel()
            await asyncio.gather(self._beat_task, return_exceptions=True)
        if self._beat is not None:
            await self.membership.unregister(list(self._beat))
        await self.routes.close()
        if self._own_pool:
            self.pool.close()

    async def __aenter__(self) -> SimpleConsumer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- receive ---------------------------------------------------------------------------------
    async def receive(self, max_messages: int = 16, invisible_duration: float = 30.0
                      ) -> list[ReceivedMessage]:
        """Up to ``max_messages`` messages, each invisible to the group for
        ``invisible_duration`` seconds; waits up to ``await_duration`` when there are none
        (then returns [])."""
        if not self._started:
            await self.start()
        if not self._subs:
            raise ValueError("subscribe to a topic before receive()")
        if not 1 <= max_messages <= MAX_POP_MESSAGES:
            raise ValueError(f"max_messages must be between 1 and {MAX_POP_MESSAGES}")
        inv = _ms(invisible_duration, "invisible_duration")
        if self._beat != self.subscription():  # joined, or subscriptions changed
            await self._heartbeat()
        targets: list[tuple[str, str, Selection]] = []
        for topic, sel in self._subs.items():
            route = await self.routes.get(topic)
            targets += [(topic, addr, sel) for addr in sorted(route.read_addrs.values())]
        if not targets:
            raise NoRouteError(f"no broker serves {sorted(self._subs)}; create the topic")
        n = len(targets)
        first = next(self._rr) % n
        order = [targets[(first + i) % n] for i in range(n)]
        # one quick pass over every (topic, broker), then a long poll on the next one
        for topic, addr, sel in order:
            got = await self._pop(topic, addr, sel, max_messages, inv, 0)
            if got:
                return got
        poll_ms = max(0, min(int(self.await_duration * 1000), 60_000))
        if poll_ms == 0:
            return []
        if n == 1:
            topic, addr, sel = order[0]
            return await self._pop(topic, addr, sel, max_messages, inv, poll_ms)
        if self.subscription_type:
            # a Pulsar-style consumer: NOTIFICATION tells what the group could pop, not what
            # this consumer may (a failover standby, another consumer's keys) -- it would spin.
            # A held pop of one target, in turn, each a share of the wait.
            topic, addr, sel = order[0]
            return await self._pop(topic, addr, sel, max_messages, inv, max(1, poll_ms // n))
        return await self._await_any(order, max_messages, inv, poll_ms)

    async def _await_any(self, targets: list[tuple[str, str, Selection]], max_messages: int,
                         inv: int, poll_ms: int) -> list[ReceivedMessage]:
        """Wait on every (topic, broker) at once with NOTIFICATION (a held pop would take
        messages from one only), then pop where something is; [] after ``poll_ms``."""
        loop = asyncio.get_running_loop()
        end = loop.time() + poll_ms / 1000
        waits = {loop.create_task(self._notified(t, poll_ms)): t for t in targets}
        try:
            while waits:
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for d in done:
                    t = waits.pop(d)
                    if d.exception() is not None:
                        log.debug("notification of %s at %s failed: %s", t[0], t[1],
                                  d.exception())
                        continue
                    left = int((end - loop.time()) * 1000)
                    if d.result():
                        got = await self._pop(t[0], t[1], t[2], max_messages, inv, 0)
                        if got:
                            return got
                    if left > 0:  # taken by another member, or a filtered-out message
                        waits[loop.create_task(self._notified(t, left))] = t
            return []
        finally:
            for w in waits:
                w.cancel()

    async def _notified(self, target: tuple[str, str, Selection], poll_ms: int) -> bool:
        topic, addr, sel = target
        h = NotificationRequestHeader(
            consumer_group=self.group, topic=topic, poll_ms=poll_ms,
            subscription=sel.expression if sel.filters else None,
            expression_type=sel.expression_type, init_mode=self.init_mode, order=self.orderly)
        conn = self.pool.get_nowait(addr) or await self.pool.get(addr)
        frame = raise_for_error(await conn.request(
            RequestCode.NOTIFICATION, h, timeout=poll_ms / 1000 + self.request_timeout))
        return bool(frame.header.has_msg)

    async def _pop(self, topic: str, addr: str, sel: Selection, max_messages: int, inv: int,
                   poll_ms: int) -> list[ReceivedMessage]:
        h = PopMessageRequestHeader(
            consumer_group=self.group, topic=topic, max_msg_nums=max_messages, invisible_ms=inv,
            poll_ms=poll_ms, subscription=sel.expression if sel.filters else None,
            expression_type=sel.expression_type, init_mode=self.init_mode, order=self.orderly,
            consumer=self.client_id if self.subscription_type else "",
            subscription_type=self.subscription_type)
        conn = self.pool.get_nowait(addr) or await self.pool.get(addr)
        frame = raise_for_error(
            await conn.request(RequestCode.POP_MESSAGE, h,
                               timeout=poll_ms / 1000 + self.request_timeout), _POP_OK)
        if frame.code != ResponseCode.SUCCESS:
            return []
        rh = frame.header
        body = frame.body
        mv = body if isinstance(body, memoryview) else memoryview(body)
        wanted: dict[tuple[int, int], tuple[str, int]] = {}
        out: list[ReceivedMessage] = []
        pos = 0
        for j in range(len(rh.batches)):
            total, _magic = read_total_size_magic(mv, pos)
            base = queue_offset_at(mv, pos)
            handles = receipt_strings(rh, topic, j, base)
            for q, off, text, attempt in handles:
                wanted[(q, off)] = (text, attempt)
            if handles:
                # only the members are decoded (a batch shared by several consumers)
                msgs, _end = decode_pull_body(mv[pos:pos + total], from_offset=handles[0][1],
                                              broker_name=rh.broker, topic=topic,
                                              members=[x[1] - base for x in handles])
                for m in msgs:
                    w = wanted.pop((m.queue_id, m.queue_offset), None)
                    if w is not None:
                        out.append(ReceivedMessage(m, w[0], w[1], addr))
            pos += total
        if wanted:
            # a popped message that did not decode: ack it, nobody can consume it
            log.warning("%d popped messages of %s did not decode; acking them", len(wanted),
                        topic)
            for text, _a in wanted.values():
                self._enqueue_ack(addr, text).add_done_callback(_quiet)
        self.received += len(out)
        return out

    # -- ack / change invisible time ---------------------------------------------------------------
    async def ack(self, msg: ReceivedMessage) -> None:
        """Ack ``msg`` (grouped with concurrent acks into one frame); StaleReceiptError when
        its handle is stale."""
        await self._enqueue_ack(msg.broker_addr, msg.receipt_handle)

    def ack_nowait(self, msg: ReceivedMessage) -> asyncio.Future[None]:
        """Queue the ack of ``msg`` and return its future (resolves once the broker answered)."""
        return self._enqueue_ack(msg.broker_addr, msg.receipt_handle)

    async def ack_all(self, msgs: Iterable[ReceivedMessage]) -> list[BaseException | None]:
        """Ack many; per message None or the error (StaleReceiptError, ...)."""
        futs = [self._enqueue_ack(m.broker_addr, m.receipt_handle) for m in msgs]
        return list(await asyncio.gather(*futs, return_exceptions=True))

    def _enqueue_ack(self, addr: str, handle: str) -> asyncio.Future[None]:
        if self._closed:
            raise ClientClosedError("this SimpleConsumer was closed")
        loop = asyncio.get_running_loop()
        buf = self._acks.get(addr)
        if buf is None:
            buf = self._acks[addr] = _AckBuffer()
        fut: asyncio.Future[None] = loop.create_future()
        buf.handles.append(handle)
        buf.futures.append(fut)
        if len(buf.handles) >= self.ack_batch:
            loop.create_task(self._flush(addr))
        elif not buf.scheduled:
            buf.scheduled = True
            loop.call_soon(lambda: loop.create_task(self._flush(addr)))
        return fut

    async def _flush(self, addr: str) -> None:
        buf = self._acks.get(addr)
        if buf is None:
            return
        buf.scheduled = False
        handles, futures = buf.handles, buf.futures
        if not handles:
            return
        buf.handles, buf.futures = [], []
        try:
            conn = self.pool.get_nowait(addr) or await self.pool.get(addr)
            frame = raise_for_error(await conn.request(
                RequestCode.ACK_MESSAGE,
                AckMessageRequestHeader(consumer_group=self.group, handles=handles),
                timeout=self.request_timeout))
            results = frame.header.results
        except (ConnectError, ConnectionLostError) as exc:
            if not await self._reroute(addr, handles, futures, exc):
                for f in futures:
                    if not f.done():
                        f.set_exception(exc)
            return
        except Exception as exc:  # every waiter learns it
            for f in futures:
                if not f.done():
                    f.set_exception(exc)
            return
        for f, code, h in zip(futures, results, handles, strict=False):
            if f.done():
                continue
            if code == ResponseCode.SUCCESS:
                self.acked += 1
                f.set_result(None)
            elif code == ResponseCode.NO_MESSAGE:
                self.stale += 1
                f.set_exception(StaleReceiptError(
                    f"receipt handle {h!r} is stale: acked already, or delivered again since",
                    response_code=code))
            else:
                f.set_exception(BrokerError.from_response(code, f"ack of {h!r} refused"))

    async def _master_of(self, handle: str, addr: str) -> str | None:
        """The address serving the broker group a receipt handle names, when it is not
        ``addr`` (a promoted slave, after the master that delivered it died); else None."""
        try:
            name, topic = handle.split(" ")[1:3]
            new = (await self.routes.get(topic, refresh=True)).broker_addrs.get(name)
        except (TidemqError, ValueError):
            return None
        return new if new is not None and new != addr else None

    async def _reroute(self, addr: str, handles: list[str],
                       futures: list[asyncio.Future[None]], exc: BaseException) -> bool:
        """The broker that delivered these is unreachable: a receipt handle names its broker
        group, and a promoted slave serves the group's POP state (docs/cluster.md), so the acks
        go to the group's master now, if it is another address. True when sent on."""
        new = await self._master_of(handles[0], addr)
        if new is None:
            return False
        log.info("acks for %s are unreachable (%s); sending them to %s", addr, exc, new)
        buf = self._acks.setdefault(new, _AckBuffer())
        buf.handles += handles
        buf.futures += futures
        await self._flush(new)
        return True

    async def _change_request(self, addr: str, handle: str,
                              header: ChangeInvisibleRequestHeader) -> tuple[str, Any]:
        """CHANGE_INVISIBLE_TIME to the broker at ``addr``, or -- unreachable -- to the one
        serving its broker group now (as acks are rerouted); (the address that answered, the
        answer)."""
        try:
            conn = self.pool.get_nowait(addr) or await self.pool.get(addr)
            return addr, await conn.request(RequestCode.CHANGE_INVISIBLE_TIME, header,
                                            timeout=self.request_timeout)
        except (ConnectError, ConnectionLostError) as exc:
            new = await self._master_of(handle, addr)
            if new is None:
                raise
            log.info("invisible-time change for %s: unreachable (%s); sending it to %s", addr,
                     exc, new)
            conn = self.pool.get_nowait(new) or await self.pool.get(new)
            return new, await conn.request(RequestCode.CHANGE_INVISIBLE_TIME, header,
                                           timeout=self.request_timeout)

    async def change_invisible_duration(self, msg: ReceivedMessage, duration: float) -> None:
        """Make ``msg`` invisible for ``duration`` seconds from now; its receipt handle is
        replaced (StaleReceiptError when the old one was stale). When the broker that
        delivered it is gone, the change goes to the one serving its broker group now."""
        inv = _ms(duration, "duration")
        addr, frame = await self._change_request(
            msg.broker_addr, msg.receipt_handle,
            ChangeInvisibleRequestHeader(consumer_group=self.group, handle=msg.receipt_handle,
                                         invisible_ms=inv))
        if frame.code == ResponseCode.NO_MESSAGE:
            self.stale += 1
            raise StaleReceiptError(
                getattr(frame.header, "message", "") or "stale receipt handle",
                response_code=frame.code)
        raise_for_error(frame)
        msg.receipt_handle = frame.header.handle
        msg.broker_addr = addr

    async def change_invisible_all(self, msgs: Sequence[ReceivedMessage],
                                   durations: Sequence[float]) -> list[BaseException | None]:
        """:meth:`change_invisible_duration` of many, one CHANGE_INVISIBLE_TIME frame per
        broker; per message None (its receipt handle replaced) or the error
        (StaleReceiptError, ...)."""
        out: list[BaseException | None] = [None] * len(msgs)
        by_addr: dict[str, list[int]] = {}
        for i, m in enumerate(msgs):
            by_addr.setdefault(m.broker_addr, []).append(i)
        for addr, idx in by_addr.items():
            try:
                served, frame = await self._change_request(
                    addr, msgs[idx[0]].receipt_handle, ChangeInvisibleRequestHeader(
                        consumer_group=self.group,
                        handles=[msgs[i].receipt_handle for i in idx],
                        invisible=[_ms(durations[i], "duration") for i in idx]))
                raise_for_error(frame)
            except TidemqError as exc:
                for i in idx:
                    out[i] = exc
                continue
            for i, code, new in zip(idx, frame.header.results, frame.header.handles,
                                    strict=False):
                if code == ResponseCode.SUCCESS:
                    msgs[i].receipt_handle = new
                    msgs[i].broker_addr = served
                elif code == ResponseCode.NO_MESSAGE:
                    self.stale += 1
                    out[i] = StaleReceiptError(
                        "receipt handle is stale: acked already, or delivered again since",
                        response_code=code)
                else:
                    out[i] = BrokerError.from_response(code, "invisible-time change refused")
        return out

    def stats(self) -> dict[str, int]:
        return {"received": self.received, "acked": self.acked, "stale": self.stale}
