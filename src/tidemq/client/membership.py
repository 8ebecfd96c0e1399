"""A lite pull consumer's membership of its group (ref CO8 with CO4): heartbeats, the member
list, and the share of queues the group's rebalance gives it.

A :class:`~tidemq.client.consumer.PullConsumer` that *subscribes* is a member of its group like
a push consumer (RocketMQ's DefaultLitePullConsumer in subscribe mode): it sends HEART_BEAT
(``consume_type="PULL"``, clustering, its subscriptions) to every broker of its topics every
``heartbeat_interval`` and at once when it subscribes, shows in ``tidemq group describe``,
rebalances with :func:`tidemq.client.rebalance.allocate` over the same sorted views as push
consumers -- all read queues of the topic, the member ids the broker answers -- every
``rebalance_interval`` and at once when a broker says the membership changed
(NOTIFY_CONSUMER_IDS_CHANGED), and unregisters at close so the others take its queues at once.
A consumer that uses ``assign()`` is no member: its queues are its own choice.
A SimpleConsumer heartbeats the same way with ``consume_type="POP"`` (listed, never
rebalanced: the broker dispatches).

Threads: the consumer's event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from typing import TYPE_CHECKING

from tidemq.client.connection import raise_for_error
from tidemq.client.errors import NoRouteError
from tidemq.client.message import MessageQueue
from tidemq.client.rebalance import AllocateStrategy, allocate, find_consumer_ids
from tidemq.protocol.codes import RequestCode, ResponseCode
from tidemq.protocol.errors import BrokerError, TidemqError
from tidemq.protocol.headers import (
    ConsumerData,
    HeartbeatRequestHeader,
    SubscriptionData,
    UnregisterClientRequestHeader,
)

#: a rebalance fetches each topic's route anew unless it was fetched this recently (a
#: consumer's start: its heartbeat has just fetched every route)
ROUTE_FRESH_S = 1.0

if TYPE_CHECKING:
    from tidemq.client.connection import Connection, ConnectionPool
    from tidemq.client.route import RouteCache, TopicRoute
    from tidemq.client.selection import Selection
    from tidemq.protocol.frame import Frame

__all__ = ["GroupMembership", "make_client_id"]

log = logging.getLogger(__name__)


def make_client_id(instance_name: str | None = None) -> str:
    """``ip@pid@instance``, as push consumers name themselves (unique per consumer object)."""
    try:
        ip = socket.gethostbyname(socket.gethostname())
    except OSError:
        ip = "127.0.0.1"
    return f"{ip}@{os.getpid()}@{instance_name or uuid.uuid4().hex[:12]}"


class GroupMembership:
    """Heartbeats and queue allocation of one lite pull consumer in its group."""

    def __init__(
        self,
        group: str,
        client_id: str,
        pool: ConnectionPool,
        routes: RouteCache,
        *,
        consume_from: str,
        strategy: AllocateStrategy = AllocateStrategy.AVG,
        request_timeout: float = 3.0,
        consume_type: str = "PULL",
        subscription_type: str = "",
    ) -> None:
        """``subscription_type``: of a Pulsar-style consumer (``subscription_consumer.py``,
        consume type POP)."""
        self.group = group
        self.client_id = client_id
        self.pool = pool
        self.routes = routes
        self.consume_from = consume_from
        self.strategy = AllocateStrategy(strategy)
        self.request_timeout = request_timeout
        self.consume_type = consume_type  # PULL (lite pull) or POP (SimpleConsumer)
        self.subscription_type = subscription_type
        #: set when a broker says the group's membership changed: rebalance now
        self.changed = asyncio.Event()
        self.heartbeats = 0

    # -- heartbeats ------------------------------------------------------------------------------
    async def _brokers(self, topics: list[str]) -> dict[str, str]:
        """Every broker of the topics' broker groups, slaves included, keyed "name/id". Routes
        not held yet are fetched 64 at a time (a consumer's first heartbeat names every topic:
        12,500 sequential round trips took seconds)."""
        addrs: dict[str, str] = {}
        cached = self.routes.cached
        routes = [r for r in map(cached, topics) if r is not None]
        todo = iter([t for t in topics if cached(t) is None])

        async def fetch() -> None:
            for t in todo:
                try:
                    routes.append(await self.routes.get(t))
                except NoRouteError:
                    continue

        await asyncio.gather(*(fetch() for _ in range(64)))
        for route in routes:
            for name, ids in route.group_addrs.items():
                for bid, addr in ids.items():
                    addrs[f"{name}/{bid}"] = addr
        return addrs

    async def heartbeat(self, subs: dict[str, Selection]) -> None:
        """One HEART_BEAT to every broker of the subscribed topics. A refusal (a subscription
        the broker cannot parse) raises; an unreachable broker is logged and skipped."""
        cd = ConsumerData(
            group=self.group, consume_type=self.consume_type, message_model="CLUSTERING",
            subscription_type=self.subscription_type,
            consume_from=self.consume_from,
            subscriptions=[SubscriptionData(topic=t, expression=s.expression,
                                            expression_type=s.expression_type)
                           for t, s in subs.items()],
        )
        header = HeartbeatRequestHeader(client_id=self.client_id, consumers=[cd])
        for name, addr in (await self._brokers(list(subs))).items():
            try:
                f = await self.pool.request(addr, RequestCode.HEART_BEAT, header,
                                            timeout=self.request_timeout)
            except BrokerError:
                raise  # refused (a subscription, the group's consumption mode): the caller's
            except TidemqError as exc:
                log.warning("heartbeat of %s to broker %s (%s) failed: %s", self.group, name,
                            addr, exc)
                continue
            if f.code != ResponseCode.SUCCESS:
                raise_for_error(f)
        self.heartbeats += 1

    async def unregister(self, topics: list[str]) -> None:
        header = UnregisterClientRequestHeader(client_id=self.client_id,
                                               consumer_group=self.group)
        for addr in (await self._brokers(topics)).values():
            try:
                await self.pool.request(addr, RequestCode.UNREGISTER_CLIENT, header,
                                        timeout=self.request_timeout)
            except TidemqError as exc:
                log.info("unregistering %s from %s failed: %s", self.group, addr, exc)

    def on_request(self, conn: Connection, frame: Frame) -> None:
        """The pool's handler of broker-initiated requests."""
        if frame.code == RequestCode.NOTIFY_CONSUMER_IDS_CHANGED:
            log.info("group %s membership changed (told by %s); rebalancing", self.group,
                     conn.address)
            self.changed.set()

    # -- allocation ------------------------------------------------------------------------------
    async def share(self, topic: str, have: set[MessageQueue],
                    subs: dict[str, Selection]) -> set[MessageQueue]:
        """This member's queues of ``topic``. A broker that does not list this member (the
        topic's brokers were not known at the last heartbeat, or it restarted) gets a heartbeat
        at once; while none lists it, the queues it ``have`` stay."""
        route = await self.routes.get(topic, refresh=True)
        mqs = sorted(route.read_queues)
        cids = await find_consumer_ids(self.pool, self.group, route.read_addrs,
                                       self.request_timeout)
        if self.client_id not in cids:
            await self.heartbeat(subs)
            cids = await find_consumer_ids(self.pool, self.group, route.read_addrs,
                                           self.request_timeout)
        if self.client_id not in cids:
            return {mq for mq in have if mq.topic == topic}
        return set(allocate(self.strategy, self.client_id, mqs, sorted(cids)))

    async def share_all(
        self, topics: list[str], have: dict[str, set[MessageQueue]],
        subs: dict[str, Selection], concurrency: int = 64,
    ) -> tuple[set[MessageQueue], dict[str, NoRouteError]]:
        """:meth:`share` of every topic in one pass: this member's queues, and the topics
        without a route (whose queues in ``have`` -- by topic -- are kept). The routes are
        fetched ``concurrency`` at a time and the member list is asked once per set of
        brokers, not once per topic: a consumer of 12,500 topics otherwise waited 25,000
        sequential round trips (10 s) for its first messages."""
        routes: dict[str, TopicRoute] = {}
        errors: dict[str, NoRouteError] = {}
        todo = iter(topics)

        async def fetch() -> None:
            for t in todo:
                r = self.routes.cached(t)
                if r is not None and time.monotonic() - r.fetched_at < ROUTE_FRESH_S:
                    routes[t] = r  # fetched just now (the first heartbeat's): not again
                    continue
                try:
                    routes[t] = await self.routes.get(t, refresh=True)
                except NoRouteError as exc:
                    errors[t] = exc

        await asyncio.gather(*(fetch() for _ in range(min(concurrency, len(topics)) or 1)))
        by_brokers: dict[frozenset[tuple[str, str]], list[str]] = {}
        for t, route in routes.items():
            by_brokers.setdefault(frozenset(route.read_addrs.items()), []).append(t)
        want: set[MessageQueue] = set()
        beat = False
        for brokers, ts in by_brokers.items():
            addrs = dict(brokers)
            cids = await find_consumer_ids(self.pool, self.group, addrs, self.request_timeout)
            if self.client_id not in cids and not beat:
                beat = True
                await self.heartbeat(subs)
                cids = await find_consumer_ids(self.pool, self.group, addrs,
                                               self.request_timeout)
            if self.client_id not in cids:
                for t in ts:
                    want |= have.get(t, set())
                continue
            members = sorted(cids)
            for t in ts:
                mqs = sorted(routes[t].read_queues)
                want.update(allocate(self.strategy, self.client_id, mqs, members))
        for t in errors:
            want |= have.get(t, set())
        return want, errors
