"""Topic routes from the name servers (ref NS1): which brokers hold a topic's queues.

A producer or consumer asks a name server GET_ROUTEINFO_BY_TOPIC the first time it uses a
topic, keeps the answer, and refreshes the topics it has used every 30 s (RocketMQ's
``pollNameServerInterval``) so new brokers, new queues and dead brokers are noticed. The
refresh first asks the name server what changed since the previous one (GET_ROUTES_CHANGED:
the topics whose queues changed and the broker groups whose addresses changed) and fetches only
those routes -- work proportional to what changed, not to how many topics the client holds --
and every route when the name server cannot say (it restarted, it is another one, too much
changed, or it is too old to know the request). Several
name server addresses may be given; a request goes to the one that last answered and moves on to
the next when it cannot connect or times out (every name server knows every broker, so any one
will do).

Broker groups (docs/cluster.md): a route lists every address of every group by broker id (0 is
the master). Sends go to masters only (a group without a master has no writable queue here);
reads go to the broker id a pull response suggested, else the master, else a slave
(:meth:`RouteCache.addr_for_read`, RocketMQ's findBrokerAddressInSubscribe); offsets to the
master, else a slave (:meth:`RouteCache.addr_for_admin`). An address a request could not reach
is skipped for a few seconds (:meth:`RouteCache.mark_down`) and the topic's route is fetched
again, so consumers move to a slave within a pull or two of their master's death.

Threading: event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

from tidemq.client.connection import DEFAULT_TIMEOUT, ConnectionPool, parse_address
from tidemq.client.errors import ClientError, NoRouteError
from tidemq.client.message import MessageQueue
from tidemq.protocol.codes import RequestCode, ResponseCode
from tidemq.protocol.errors import BrokerError
from tidemq.protocol.frame import Frame
from tidemq.protocol.headers import (
    MASTER_ID,
    GetRouteInfoRequestHeader,
    Perm,
    RoutesChangedRequestHeader,
    TopicRouteData,
)

__all__ = ["TopicRoute", "RouteCache", "parse_namesrv"]

log = logging.getLogger(__name__)

ROUTE_REFRESH_INTERVAL = 30.0


def parse_namesrv(namesrv: str | Sequence[str]) -> list[str]:
    """``"a:1;b:2"`` / ``"a:1,b:2"`` / ``["a:1", "b:2"]`` -> ["a:1", "b:2"], each checked."""
    if isinstance(namesrv, str):
        items = namesrv.replace(",", ";").split(";")
    else:
        items = list(namesrv)
    addrs = [a.strip() for a in items if a and a.strip()]
    if not addrs:
        raise ValueError("give at least one name server address host:port (e.g. 127.0.0.1:9876)")
    for a in addrs:
        parse_address(a)
    return addrs


class TopicRoute:
    """One topic's route: its master brokers and the queues on each, sorted."""

    __slots__ = ("topic", "data", "broker_addrs", "group_addrs", "write_queues", "read_queues",
                 "fetched_at")

    def __init__(self, topic: str, data: TopicRouteData) -> None:
        self.topic = topic
        self.data = data
        #: broker name -> its master's address (sends)
        self.broker_addrs: dict[str, str] = {}
        #: broker name -> {broker id -> address}, masters and slaves (reads)
        self.group_addrs: dict[str, dict[int, str]] = {}
        for bd in data.broker_datas:
            addrs = {int(k): a for k, a in bd.broker_addrs.items() if a}
            if addrs:
                self.group_addrs[bd.broker_name] = addrs
            addr = addrs.get(MASTER_ID)
            if addr:
                self.broker_addrs[bd.broker_name] = addr
        write: list[MessageQueue] = []
        read: list[MessageQueue] = []
        for qd in sorted(data.queue_datas, key=lambda q: q.broker_name):
            name = qd.broker_name
            if name not in self.group_addrs:
                continue  # nobody of the group is up
            if qd.perm & Perm.WRITE and name in self.broker_addrs:
                # no master: RocketMQ skips such groups for sends ...
                write += [MessageQueue(topic, name, i) for i in range(qd.write_queue_nums)]
            if qd.perm & Perm.READ:
                # ... but their slaves serve pulls
                read += [MessageQueue(topic, name, i) for i in range(qd.read_queue_nums)]
        self.write_queues = write
        self.read_queues = read
        self.fetched_at = time.monotonic()

    @property
    def read_addrs(self) -> dict[str, str]:
        """Broker name -> the address to ask about the group: its master, else a slave."""
        return {name: _pick(addrs, MASTER_ID) for name, addrs in self.group_addrs.items()}

    def __repr__(self) -> str:
        return (
            f"TopicRoute({self.topic!r}, brokers={self.broker_addrs}, "
            f"write={len(self.write_queues)}, read={len(self.read_queues)})"
        )


def _pick(addrs: dict[int, str], broker_id: int) -> str:
    """``addrs[broker_id]``, else the master's, else the lowest id's."""
    addr = addrs.get(broker_id) or addrs.get(MASTER_ID)
    return addr if addr else addrs[min(addrs)]


class RouteCache:
    """Routes of the topics in use, refreshed in the background. Event loop only."""

    def __init__(
        self,
        pool: ConnectionPool,
        namesrv: str | Sequence[str],
        *,
        refresh_interval: float = ROUTE_REFRESH_INTERVAL,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self.pool = pool
        self.namesrv = parse_namesrv(namesrv)
        self.refresh_interval = refresh_interval
        self.timeout = timeout
        self._current = 0  # index of the name server that answered last
        self._routes: dict[str, TopicRoute] = {}
        self._broker_addrs: dict[str, str] = {}  # every broker name seen -> master address
        self._group_addrs: dict[str, dict[int, str]] = {}  # broker name -> id -> address
        self._down: dict[str, float] = {}  # address -> monotonic time until it is skipped
        self._refreshing: set[str] = set()
        self._refreshed_at: dict[str, float] = {}
        self._fetching: dict[str, asyncio.Task[TopicRoute]] = {}
        self._task: asyncio.Task[None] | None = None
        #: the name server's change history and version as of the previous refresh
        self._ns_instance = ""
        self._ns_version = 0
        #: routes fetched from the name servers (any reason; tests and stats read it)
        self.fetches = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._refresh_loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def namesrv_request(self, code: int, header: Any = None) -> Frame:
        """A request to the name servers, failing over; BrokerError for an error response."""
        last: ClientError | None = None
        busy: BrokerError | None = None
        n = len(self.namesrv)
        # A second round only when every name server answered SYSTEM_BUSY with a retry hint,
        # after waiting as asked.
        for round_ in range(2):
            if round_:
                if busy is None or last is not None or busy.retry_after > self.timeout:
                    break
                await asyncio.sleep(busy.retry_after)
                busy = None
            for k in range(n):
                i = (self._current + k) % n
                addr = self.namesrv[i]
                try:
                    frame = await self.pool.request(addr, code, header, timeout=self.timeout)
                except BrokerError as exc:
                    if not exc.retry_after:
                        raise
                    busy = exc
                    log.info("name server %s is busy (%s); trying the next one", addr,
                             exc.message)
                    continue
                except ClientError as exc:
                    last = exc
                    log.info("name server %s failed (%s); trying the next one", addr,
                             exc.message)
                    continue
                self._current = i
                return frame
        if busy is not None:
            raise busy
        assert last is not None
        raise NoRouteError(
            f"no name server answered ({', '.join(self.namesrv)}): {last.message}"
        ) from last

    def cached(self, topic: str) -> TopicRoute | None:
        return self._routes.get(topic)

    async def get(self, topic: str, *, refresh: bool = False) -> TopicRoute:
        """The topic's route (cached unless ``refresh``); NoRouteError when it has none."""
        if not refresh:
            r = self._routes.get(topic)
            if r is not None:
                return r
        task = self._fetching.get(topic)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._fetch(topic))
            self._fetching[topic] = task
            task.add_done_callback(lambda t: self._fetched(topic, t))
        return await asyncio.shield(task)

    def _fetched(self, topic: str, task: asyncio.Task[TopicRoute]) -> None:
        self._fetching.pop(topic, None)
        if not task.cancelled():
            task.exception()  # retrieved: the waiters (if any are left) got it already

    async def _fetch(self, topic: str) -> TopicRoute:
        self.fetches += 1
        try:
            frame = await self.namesrv_request(
                RequestCode.GET_ROUTEINFO_BY_TOPIC, GetRouteInfoRequestHeader(topic=topic)
            )
        except BrokerError as exc:
            if exc.response_code == ResponseCode.TOPIC_NOT_EXIST:
                self._routes.pop(topic, None)
                raise NoRouteError(
                    f"topic {topic!r} does not exist on any broker registered with the name "
                    f"server ({', '.join(self.namesrv)}); create it with `tidemq topic create "
                    f"--topic {topic}` or enable auto-create on the broker"
                ) from exc
            raise
        data = frame.header
        if not isinstance(data, TopicRouteData):
            raise NoRouteError(f"the name server sent no route for topic {topic!r}")
        route = TopicRoute(topic, data)
        self._routes[topic] = route
        self._broker_addrs.update(route.broker_addrs)
        for bd in data.broker_datas:
            name = bd.broker_name
            if name not in route.broker_addrs:
                self._broker_addrs.pop(name, None)  # the group has no master now
            addrs = route.group_addrs.get(name)
            if addrs:
                self._group_addrs[name] = addrs
            else:
                self._group_addrs.pop(name, None)
        return route

    def broker_addr(self, broker_name: str) -> str:
        """The master address of a broker seen in some route; NoRouteError if none."""
        addr = self._broker_addrs.get(broker_name)
        if addr is None:
            raise NoRouteError(
                f"broker {broker_name!r} is not in any known route; refresh the topic's route"
            )
        return addr

    async def addr_of(self, mq: MessageQueue) -> str:
        addr = self._broker_addrs.get(mq.broker_name)
        if addr is None:
            route = await self.get(mq.topic, refresh=True)
            addr = route.broker_addrs.get(mq.broker_name)
            if addr is None:
                raise NoRouteError(
                    f"broker {mq.broker_name!r} of queue {mq} has no master in the route of "
                    f"{mq.topic!r}"
                )
        return addr

    async def addr_for_read(
        self, mq: MessageQueue, broker_id: int = MASTER_ID
    ) -> tuple[str, bool]:
        """(address, is a slave) to pull ``mq`` from: broker ``broker_id`` of its group (a
        pull response's suggestion), else the master, else a slave; an address marked down is
        skipped while another is known. NoRouteError when nobody of the group is known."""
        addrs = self._group_addrs.get(mq.broker_name)
        if not addrs:
            await self.get(mq.topic, refresh=True)
            addrs = self._group_addrs.get(mq.broker_name)
            if not addrs:
                raise NoRouteError(
                    f"no broker of group {mq.broker_name!r} (queue {mq}) is in the route of "
                    f"{mq.topic!r}"
                )
        down = self._down
        if down:
            now = time.monotonic()
            up = {i: a for i, a in addrs.items() if down.get(a, 0.0) <= now}
            if up:
                addrs = up
        addr = _pick(addrs, broker_id)
        return addr, addrs.get(MASTER_ID) != addr

    def addr_for_read_now(self, mq: MessageQueue, broker_id: int = MASTER_ID
                          ) -> tuple[str, bool] | None:
        """:meth:`addr_for_read` without a coroutine when the answer is known now (the group
        is in a route, nobody is marked down); None: call :meth:`addr_for_read`. A consumer
        of thousands of queues asks once per queue and pull."""
        addrs = self._group_addrs.get(mq.broker_name)
        if not addrs or self._down:
            return None
        addr = _pick(addrs, broker_id)
        return addr, addrs.get(MASTER_ID) != addr

    async def addr_for_admin(self, mq: MessageQueue) -> str:
        """Where ``mq``'s offsets are read and committed: the master, else a slave (RocketMQ's
        findBrokerAddressInAdmin; a slave's offsets flow back to the master later)."""
        return (await self.addr_for_read(mq, MASTER_ID))[0]

    def group_size(self, broker_name: str) -> int:
        """Addresses known for a broker group (master and slaves)."""
        return len(self._group_addrs.get(broker_name, ()))

    def mark_down(self, addr: str, topic: str | None = None, seconds: float = 5.0) -> None:
        """A request to ``addr`` failed (connect, timeout): skip it for reads for ``seconds``
        and fetch ``topic``'s route again in the background (at most one fetch at a time)."""
        self._down[addr] = time.monotonic() + seconds
        if len(self._down) > 64:
            now = time.monotonic()
            self._down = {a: t for a, t in self._down.items() if t > now}
        if topic is not None:
            self.refresh_soon(topic)

    def refresh_soon(self, topic: str) -> None:
        """Fetch ``topic``'s route again in the background: at most one fetch at a time and
        one per 0.2 s (a group's master failed or moved: an election names another)."""
        now = time.monotonic()
        if topic in self._refreshing or now - self._refreshed_at.get(topic, 0.0) < 0.2:
            return
        self._refreshing.add(topic)
        self._refreshed_at[topic] = now

        async def refresh() -> None:
            try:
                await self.get(topic, refresh=True)
            except Exception as exc:  # the periodic refresh tries again
                log.debug("refreshing the route of %r failed: %s", topic, exc)
            finally:
                self._refreshing.discard(topic)

        asyncio.get_running_loop().create_task(refresh())

    def forget(self, topic: str) -> None:
        self._routes.pop(topic, None)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_interval)
            # One fetch at a time, on purpose: the same fetches 64 at a time (tried) made a
            # burst of 12,500 requests every 30 s at 100,000 queues that starved the name
            # server's process and timed out the client's sends.
            await self._refresh_some(iter(await self.changed_topics()))

    async def changed_topics(self) -> list[str]:
        """The held topics whose routes changed since the previous call (every held topic the
        first time, and when the name server cannot say)."""
        everything = list(self._routes)
        try:
            frame = await self.namesrv_request(
                RequestCode.GET_ROUTES_CHANGED,
                RoutesChangedRequestHeader(instance=self._ns_instance, since=self._ns_version))
        except ClientError as exc:  # no name server answered: the fetches will say so too
            log.debug("asking the name server what changed failed: %s", exc.message)
            return everything
        except BrokerError as exc:  # e.g. REQUEST_CODE_NOT_SUPPORTED: an older name server
            log.debug("the name server cannot say what changed: %s", exc.message)
            self._ns_instance = ""
            return everything
        h = frame.header
        self._ns_instance, self._ns_version = h.instance, h.version
        if h.full:
            return everything
        routes = self._routes
        out = [t for t in h.topics if t in routes]
        if h.brokers:  # a group's addresses changed: every held topic it serves
            groups = set(h.brokers)
            seen = set(out)
            out += [t for t, r in routes.items() if t not in seen
                    and any(q.broker_name in groups for q in r.data.queue_datas)]
        return out

    async def _refresh_some(self, topics: Any) -> None:
        for topic in topics:
            try:
                await self.get(topic, refresh=True)
            except NoRouteError as exc:
                log.info("route of %r is gone: %s", topic, exc.message)
            except Exception as exc:  # keep refreshing the others; the old route stays
                log.warning("refreshing the route of %r failed: %s", topic, exc)
