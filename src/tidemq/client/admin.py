"""The asyncio admin client: topics, routes, offsets, group lag, message lookup (SPEC OP1).

Topic changes go to brokers (UPDATE_AND_CREATE_TOPIC, DELETE_TOPIC); brokers re-register with
the name servers when their topics change, so a route reflects a change a moment later. Unless
told which broker, ``create_topic`` writes to every master broker the name server knows (all
clusters, or the given ``cluster``) and ``delete_topic`` to every broker in the topic's route.

Threading: one event loop. Use ``tidemq.Admin`` from threads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import msgspec

from tidemq.client import offsets
from tidemq.client.codec import decode_batches
from tidemq.client.connection import DEFAULT_TIMEOUT, ConnectionPool
from tidemq.client.errors import NoRouteError
from tidemq.client.message import MessageExt, MessageQueue
from tidemq.client.route import RouteCache
from tidemq.protocol.codes import RequestCode, ResponseCode
from tidemq.protocol.errors import BrokerError
from tidemq.protocol.frame import Frame
from tidemq.protocol.headers import (
    MASTER_ID,
    ClusterInfo,
    ConsumeStats,
    DeleteTopicRequestHeader,
    FoundMessagesHeader,
    GetConsumeStatsRequestHeader,
    GetTopicStatsRequestHeader,
    Perm,
    QueryMessageRequestHeader,
    QueueConsumeStats,
    TopicConfig,
    TopicConfigTable,
    TopicList,
    TopicRouteData,
    TopicStats,
    ViewMessageRequestHeader,
)
from tidemq.protocol.record import BatchView, parse_unique_id

__all__ = ["Admin", "QueueLag", "GroupLag", "QueueStatus"]


class QueueLag(msgspec.Struct, frozen=True):
    """One queue's backlog for a group."""

    queue: MessageQueue
    broker_offset: int
    consumer_offset: int
    lag: int
    last_timestamp: int = 0


class GroupLag(msgspec.Struct, frozen=True):
    group: str
    queues: list[QueueLag]

    @property
    def total_lag(self) -> int:
        return sum(q.lag for q in self.queues)


class QueueStatus(msgspec.Struct, frozen=True):
    """One queue's offsets: it holds [min_offset, max_offset)."""

    queue: MessageQueue
    min_offset: int
    max_offset: int
    last_update_timestamp: int = 0


def _header(frame: Frame, kind: type) -> Any:
    h = frame.header
    if isinstance(h, kind):
        return h
    if h is None or isinstance(h, dict):  # a peer without the typed header: decode the map
        return msgspec.convert(h or {}, kind)
    raise TypeError(f"expected {kind.__name__} in the response, got {type(h).__name__}")


class Admin:
    """Administration of a tidemq cluster through its name servers. An async context manager."""

    def __init__(
        self,
        namesrv: str | Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT,
        pool: ConnectionPool | None = None,
    ) -> None:
        self.timeout = timeout
        self._own_pool = pool is None
        self.pool = pool if pool is not None else ConnectionPool(connect_timeout=timeout)
        self.routes = RouteCache(self.pool, namesrv, timeout=timeout)

    async def start(self) -> Admin:
        return self

    async def close(self) -> None:
        await self.routes.close()
        if self._own_pool:
            self.pool.close()

    async def __aenter__(self) -> Admin:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _broker(self, addr: str, code: int, header: Any = None, **kw: Any) -> Frame:
        return await self.pool.request(addr, code, header, timeout=self.timeout, **kw)

    # -- cluster ---------------------------------------------------------------------------------
    async def cluster_info(self) -> ClusterInfo:
        f = await self.routes.namesrv_request(RequestCode.GET_BROKER_CLUSTER_INFO)
        return _header(f, ClusterInfo)  # type: ignore[no-any-return]

    async def brokers(self, cluster: str | None = None) -> dict[str, str]:
        """Master brokers: name -> address (of one cluster, or all)."""
        info = await self.cluster_info()
        names = set(info.broker_addr_table)
        if cluster is not None:
            if cluster not in info.cluster_addr_table:
                raise NoRouteError(
                    f"cluster {cluster!r} is unknown to the name server (known: "
                    f"{', '.join(sorted(info.cluster_addr_table)) or 'none'})"
                )
            names &= set(info.cluster_addr_table[cluster])
        out = {}
        for name in sorted(names):
            addr = info.broker_addr_table[name].broker_addrs.get(MASTER_ID)
            if addr:
                out[name] = addr
        return out

    async def _resolve_broker(self, broker: str) -> str:
        """A broker name or address -> address."""
        if ":" in broker:
            return broker
        known = await self.brokers()
        if broker not in known:
            raise NoRouteError(f"broker {broker!r} is not registered with the name server "
                               f"(known: {', '.join(known) or 'none'})")
        return known[broker]

    # -- topics ----------------------------------------------------------------------------------
    async def create_topic(
        self,
        topic: str,
        queues: int = 8,
        *,
        read_queues: int | None = None,
        write_queues: int | None = None,
        perm: int = Perm.READ_WRITE,
        order: bool = False,
        broker: str | None = None,
        cluster: str | None = None,
        wait: float = 3.0,
    ) -> list[str]:
        """Create or update ``topic``; returns the broker addresses written to. Waits up to
        ``wait`` seconds for the name server to route the topic to them (0: do not wait)."""
        if not topic or len(topic.encode()) > 255:
            raise ValueError("a topic name is 1..255 bytes")
        if queues < 1:
            raise ValueError("a topic needs at least one queue")
        config = TopicConfig(
            topic_name=topic,
            read_queue_nums=read_queues if read_queues is not None else queues,
            write_queue_nums=write_queues if write_queues is not None else queues,
            perm=perm,
            order=order,
        )
        if broker is not None:
            addrs = [await self._resolve_broker(broker)]
        else:
            addrs = list((await self.brokers(cluster)).values())
            if not addrs:
                raise NoRouteError("no broker is registered with the name server; start one")
        await asyncio.gather(
            *(self._broker(a, RequestCode.UPDATE_AND_CREATE_TOPIC, config) for a in addrs)
        )
        self.routes.forget(topic)
        await self._await_route(topic, set(addrs), wait)
        return addrs

    async def _await_route(self, topic: str, addrs: set[str], wait: float) -> None:
        """Wait (up to ``wait`` s) until the name server routes ``topic`` to ``addrs``: brokers
        re-register right after a topic change, and a consumer subscribing a moment later
        should find it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while loop.time() < deadline:
            try:
                route = await self.routes.get(topic, refresh=True)
                if addrs <= set(route.broker_addrs.values()):
                    return
            except NoRouteError:
                pass
            await asyncio.sleep(0.02)

    async def delete_topic(self, topic: str, *, broker: str | None = None) -> list[str]:
        """Delete ``topic`` from its brokers (or one); returns the addresses written to."""
        if broker is not None:
            addrs = [await self._resolve_broker(broker)]
        else:
            route = await self.routes.get(topic, refresh=True)
            addrs = list(route.broker_addrs.values())
        await asyncio.gather(
            *(self._broker(a, RequestCode.DELETE_TOPIC, DeleteTopicRequestHeader(topic=topic))
              for a in addrs)
        )
        self.routes.forget(topic)
        return addrs

    async def list_topics(self) -> list[str]:
        f = await self.routes.namesrv_request(RequestCode.GET_ALL_TOPIC_LIST_FROM_NAMESERVER)
        return sorted(_header(f, TopicList).topics)

    async def topic_configs(self, broker: str) -> dict[str, TopicConfig]:
        """Every topic config a broker (name or address) holds."""
        addr = await self._resolve_broker(broker)
        f = await self._broker(addr, RequestCode.GET_ALL_TOPIC_CONFIG)
        return dict(_header(f, TopicConfigTable).topics)

    async def topic_route(self, topic: str) -> TopicRouteData:
        return (await self.routes.get(topic, refresh=True)).data

    async def topic_queues(self, topic: str) -> list[MessageQueue]:
        return list((await self.routes.get(topic, refresh=True)).read_queues)

    async def topic_status(self, topic: str) -> list[QueueStatus]:
        """Min/max offset of every queue of ``topic`` (GET_TOPIC_STATS on each broker)."""
        route = await self.routes.get(topic, refresh=True)
        out: list[QueueStatus] = []

        async def one(name: str, addr: str) -> None:
            f = await self._broker(addr, RequestCode.GET_TOPIC_STATS,
                                   GetTopicStatsRequestHeader(topic=topic))
            for q in _header(f, TopicStats).queues:
                out.append(QueueStatus(MessageQueue(topic, name, q.queue_id), q.min_offset,
                                       q.max_offset, q.last_update_timestamp))

        await asyncio.gather(*(one(n, a) for n, a in route.broker_addrs.items()))
        return sorted(out, key=lambda s: s.queue)

    # -- offsets ---------------------------------------------------------------------------------
    async def min_offset(self, mq: MessageQueue) -> int:
        return await offsets.min_offset(self.pool, await self.routes.addr_of(mq), mq,
                                        timeout=self.timeout)

    async def max_offset(self, mq: MessageQueue) -> int:
        return await offsets.max_offset(self.pool, await self.routes.addr_of(mq), mq,
                                        timeout=self.timeout)

    async def search_offset(self, mq: MessageQueue, timestamp_ms: int) -> int:
        return await offsets.search_offset(self.pool, await self.routes.addr_of(mq), mq,
                                           timestamp_ms, timeout=self.timeout)

    async def consumer_offset(self, group: str, mq: MessageQueue) -> int | None:
        return await offsets.query_consumer_offset(self.pool, await self.routes.addr_of(mq),
                                                   group, mq, timeout=self.timeout)

    async def reset_consumer_offset(self, group: str, mq: MessageQueue, offset: int) -> None:
        """Set the group's offset of ``mq`` (takes effect for consumers that start later)."""
        await offsets.update_consumer_offset(self.pool, await self.routes.addr_of(mq), group,
                                             mq, offset, timeout=self.timeout)

    async def group_lag(self, group: str, topic: str | None = None) -> GroupLag:
        """The group's backlog per queue (GET_CONSUME_STATS on the brokers of ``topic``, or
        on every broker)."""
        if topic is not None:
            brokers = (await self.routes.get(topic, refresh=True)).broker_addrs
        else:
            brokers = await self.brokers()
        out: list[QueueLag] = []

        async def one(name: str, addr: str) -> None:
            try:
                f = await self._broker(
                    addr, RequestCode.GET_CONSUME_STATS,
                    GetConsumeStatsRequestHeader(consumer_group=group, topic=topic or ""),
                )
            except BrokerError as exc:
                if exc.response_code in (ResponseCode.QUERY_NOT_FOUND,
                                         ResponseCode.SUBSCRIPTION_GROUP_NOT_EXIST):
                    return
                raise
            stats: ConsumeStats = _header(f, ConsumeStats)
            q: QueueConsumeStats
            for q in stats.queues:
                lag = max(0, q.broker_offset - q.consumer_offset)
                out.append(QueueLag(MessageQueue(q.topic, stats.broker_name or name, q.queue_id),
                                    q.broker_offset, q.consumer_offset, lag, q.last_timestamp))

        await asyncio.gather(*(one(n, a) for n, a in brokers.items()))
        return GroupLag(group, sorted(out, key=lambda x: x.queue))

    # -- messages --------------------------------------------------------------------------------
    async def query_by_key(self, topic: str, key: str, max_num: int = 32) -> list[MessageExt]:
        """Messages of ``topic`` carrying ``key`` (from every broker of the topic)."""
        route = await self.routes.get(topic, refresh=True)
        found: list[MessageExt] = []

        async def one(name: str, addr: str) -> None:
            f = await self._broker(
                addr, RequestCode.QUERY_MESSAGE,
                QueryMessageRequestHeader(topic=topic, key=key, max_num=max_num),
                ok_codes=(ResponseCode.SUCCESS, ResponseCode.QUERY_NOT_FOUND),
            )
            if f.code == ResponseCode.SUCCESS:
                found.extend(_found(f, name))

        await asyncio.gather(*(one(n, a) for n, a in route.broker_addrs.items()))
        found.sort(key=lambda m: (m.store_timestamp, m.queue_id, m.queue_offset))
        return found[:max_num]

    async def view_message(self, msg_id: str, topic: str | None = None) -> MessageExt | None:
        """The message with this unique id: asked of the topic's brokers, or of every one."""
        try:
            parse_unique_id(msg_id)
        except ValueError as exc:
            raise ValueError(f"{exc}; a message id looks like SendResult.msg_id") from None
        if topic is not None:
            brokers = (await self.routes.get(topic, refresh=True)).broker_addrs
        else:
            brokers = await self.brokers()
        for name, addr in brokers.items():
            f = await self._broker(
                addr, RequestCode.VIEW_MESSAGE_BY_ID, ViewMessageRequestHeader(msg_id=msg_id),
                ok_codes=(ResponseCode.SUCCESS, ResponseCode.QUERY_NOT_FOUND),
            )
            if f.code == ResponseCode.SUCCESS:
                for m in _found(f, name):
                    if m.msg_id == msg_id:
                        return m
        return None


def _found(frame: Frame, broker_name: str) -> list[MessageExt]:
    """The messages a FoundMessagesHeader response points at in its body's batches."""
    indexes = _header(frame, FoundMessagesHeader).indexes
    out: list[MessageExt] = []
    mv = memoryview(frame.body) if frame.body else memoryview(b"")
    pos, i = 0, 0
    while pos < len(mv) and i < len(indexes):
        view = BatchView(mv, pos)
        size = view.total_size
        msgs = decode_batches(bytes(mv[pos : pos + size]), from_offset=0,
                              broker_name=broker_name)
        k = indexes[i]
        if 0 <= k < len(msgs):
            out.append(msgs[k])
        pos += size
        i += 1
    return out
