"""The asyncio admin client: topics, routes, offsets, group lag, message lookup (ref OP1).

Topic changes go to brokers (UPDATE_AND_CREATE_TOPIC, DELETE_TOPIC); brokers re-register with
the name servers when their topics change, so a route reflects a change a moment later. Unless
told which broker, ``create_topic`` writes to every master broker the name server knows (all
clusters, or the given ``cluster``) and ``delete_topic`` to every broker in the topic's route.

Threading: one event loop. Use ``tidemq.Admin`` from threads.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Sequence
from typing import Any

import msgspec

from tidemq.client import offsets
from tidemq.client.codec import decode_pull_body
from tidemq.client.connection import DEFAULT_TIMEOUT, ConnectionPool, raise_for_error
from tidemq.client.errors import NoRouteError
from tidemq.client.message import Message, MessageExt, MessageQueue
from tidemq.client.producer import Producer
from tidemq.client.route import RouteCache
from tidemq.protocol.codes import (
    DLQ_PREFIX,
    TOOLS_CONSUMER_GROUP,
    PullStatus,
    RequestCode,
    ResponseCode,
    pull_status,
)
from tidemq.protocol.corrupt import CorruptRecords
from tidemq.protocol.errors import BrokerError, TidemqError
from tidemq.protocol.frame import Frame
from tidemq.protocol.headers import (
    MASTER_ID,
    BrokerRuntimeInfo,
    ClusterInfo,
    ConsumerGroupRequestHeader,
    ConsumeStats,
    DeleteTopicRequestHeader,
    EmptyHeader,
    FoundMessagesHeader,
    GetConsumeStatsRequestHeader,
    GetTopicStatsRequestHeader,
    GroupInfoResponseHeader,
    Perm,
    PromoteRequestHeader,
    PromoteResponseHeader,
    PullMessageRequestHeader,
    QueryMessageRequestHeader,
    QueueConsumeStats,
    SubscriptionData,
    SubscriptionGroupConfig,
    TopicConfig,
    TopicConfigTable,
    TopicList,
    TopicRouteData,
    TopicStats,
    ViewMessageRequestHeader,
)
from tidemq.protocol.record import BatchView, parse_unique_id

log = logging.getLogger(__name__)

__all__ = ["Admin", "QueueLag", "GroupLag", "QueueStatus", "GroupInfo", "DLQ_PREFIX"]

#: Properties a retry or dead-letter copy carries (broker/send_back.py).
RETRY_TOPIC = "RETRY_TOPIC"
ORIGIN_MESSAGE_ID = "ORIGIN_MESSAGE_ID"
_PULL_CODES = (ResponseCode.SUCCESS, ResponseCode.PULL_NOT_FOUND,
               ResponseCode.PULL_RETRY_IMMEDIATELY, ResponseCode.PULL_OFFSET_MOVED)


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


class GroupInfo(msgspec.Struct, frozen=True):
    """A consumer group as its brokers see it (GET_CONSUMER_CONNECTION_LIST on each)."""

    group: str
    members: list[str]  # client ids, sorted (the union over the brokers)
    message_model: str
    consume_from: str
    subscriptions: list[SubscriptionData]
    config: SubscriptionGroupConfig | None
    brokers: dict[str, list[str]]  # broker name -> the member ids that broker knows
    consume_type: str = ""  # PUSH, PULL (lite pull) or POP (SimpleConsumer); "" = no member


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

    async def runtime_info(self, addr: str) -> dict[str, Any]:
        """GET_BROKER_RUNTIME_INFO of the broker at ``addr``: counters, role, epoch, offsets,
        replication lag (docs/operations.md, docs/cluster.md)."""
        f = await self._broker(addr, RequestCode.GET_BROKER_RUNTIME_INFO, EmptyHeader())
        return dict(_header(f, BrokerRuntimeInfo).table)

    async def cluster_status(self) -> list[dict[str, Any]]:
        """Every broker the name servers know (masters and slaves), with its runtime info
        (``error`` instead when it does not answer), ordered by cluster, name and id."""
        info = await self.cluster_info()
        names = {n: c for c, ns in info.cluster_addr_table.items() for n in ns}
        rows: list[dict[str, Any]] = []

        async def one(name: str, bid: int, addr: str) -> None:
            row: dict[str, Any] = {"cluster": names.get(name, ""), "broker_name": name,
                                   "broker_id": int(bid), "addr": addr}
            try:
                row.update(await self.runtime_info(addr))
            except TidemqError as exc:
                row["error"] = str(exc)
            rows.append(row)

        await asyncio.gather(*(
            one(name, bid, addr)
            for name, bd in info.broker_addr_table.items()
            for bid, addr in bd.broker_addrs.items()
        ))
        rows.sort(key=lambda r: (r["cluster"], r["broker_name"], r["broker_id"]))
        return rows

    async def promote(self, addr: str, *, role: str = "", force: bool = False,
                      timeout: float = 30.0) -> PromoteResponseHeader:
        """Make the slave at ``addr`` the master of its group (``tidemq cluster promote``;
        docs/cluster.md): a new epoch from its CommitLog's end. ``force`` even while it still
        hears from its master (two masters would take writes)."""
        f = await self.pool.request(addr, RequestCode.PROMOTE_TO_MASTER,
                                    PromoteRequestHeader(role=role, force=force), timeout=timeout)
        return _header(f, PromoteResponseHeader)  # type: ignore[no-any-return]

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
                # the broker's count: for a POP group, what is not acked (holes included)
                lag = q.lag
                out.append(QueueLag(MessageQueue(q.topic, stats.broker_name or name, q.queue_id),
                                    q.broker_offset, q.consumer_offset, lag, q.last_timestamp))

        await asyncio.gather(*(one(n, a) for n, a in brokers.items()))
        return GroupLag(group, sorted(out, key=lambda x: x.queue))

    async def group_info(self, group: str) -> GroupInfo:
        """Members, subscriptions and config of ``group`` from every master broker."""
        brokers = await self.brokers()
        seen: dict[str, list[str]] = {}
        heads: list[GroupInfoResponseHeader] = []

        async def one(name: str, addr: str) -> None:
            f = await self._broker(addr, RequestCode.GET_CONSUMER_CONNECTION_LIST,
                                   ConsumerGroupRequestHeader(consumer_group=group))
            h: GroupInfoResponseHeader = _header(f, GroupInfoResponseHeader)
            seen[name] = sorted(h.consumer_ids)
            heads.append(h)

        await asyncio.gather(*(one(n, a) for n, a in brokers.items()))
        members = sorted({m for ids in seen.values() for m in ids})
        live = [h for h in heads if h.consumer_ids] or heads
        first = live[0] if live else GroupInfoResponseHeader()
        config = next((h.config for h in heads if h.config is not None), None)
        return GroupInfo(group, members, first.message_model, first.consume_from,
                         list(first.subscriptions), config, dict(sorted(seen.items())),
                         first.consume_type if members else "")

    async def update_group(self, group: str, **changes: Any) -> SubscriptionGroupConfig:
        """Create or change ``group``'s config on every master broker (e.g.
        ``retry_max_times=3``: messages go to the DLQ after 3 retries); the new config."""
        current = (await self.group_info(group)).config
        base = msgspec.structs.asdict(current) if current is not None else {}
        base.update(changes, group_name=group)
        try:
            cfg = msgspec.convert(base, SubscriptionGroupConfig)
        except msgspec.ValidationError as exc:
            raise ValueError(f"bad group setting: {exc}") from None
        brokers = await self.brokers()
        await asyncio.gather(*(self._broker(a, RequestCode.UPDATE_AND_CREATE_SUBSCRIPTION_GROUP,
                                            cfg) for a in brokers.values()))
        return cfg

    async def reset_group_offsets(
        self, group: str, topic: str, *, offset: int | None = None,
        timestamp_ms: int | None = None,
    ) -> dict[MessageQueue, int]:
        """Set ``group``'s offset of every queue of ``topic`` to ``offset`` (clamped to what the
        queue holds) or to the first message stored at or after ``timestamp_ms``; the new
        offsets. Running members keep their own in-memory offsets: stop the group first."""
        if (offset is None) == (timestamp_ms is None):
            raise ValueError("give exactly one of offset and timestamp_ms")
        out: dict[MessageQueue, int] = {}

        async def one(mq: MessageQueue) -> None:
            if timestamp_ms is not None:
                new = await self.search_offset(mq, timestamp_ms)
            else:
                lo, hi = await asyncio.gather(self.min_offset(mq), self.max_offset(mq))
                new = min(max(int(offset or 0), lo), hi)
            await self.reset_consumer_offset(group, mq, new)
            out[mq] = new

        await asyncio.gather(*(one(mq) for mq in await self.topic_queues(topic)))
        return dict(sorted(out.items()))

    async def dlq_messages(self, group: str, *, max_num: int = 100,
                           from_offset: int = 0) -> list[MessageExt]:
        """Up to ``max_num`` messages of ``%DLQ%<group>`` from ``from_offset`` on (read as the
        tools group, the only one allowed to read a dead-letter topic). Each keeps its origin
        in the properties ``RETRY_TOPIC`` (topic) and ``ORIGIN_MESSAGE_ID``."""
        topic = DLQ_PREFIX + group
        try:
            route = await self.routes.get(topic, refresh=True)
        except NoRouteError:
            return []
        out: list[MessageExt] = []
        for name, addr in sorted(route.broker_addrs.items()):
            mq = MessageQueue(topic, name, 0)
            off = max(from_offset, await self.min_offset(mq))
            end = await self.max_offset(mq)
            while off < end and len(out) < max_num:
                h = PullMessageRequestHeader(
                    consumer_group=TOOLS_CONSUMER_GROUP, topic=topic, queue_id=0,
                    queue_offset=off, max_msg_nums=min(32, max_num - len(out)), sys_flag=0,
                    suspend_timeout_millis=0,
                )
                f = await self.pool.request(addr, RequestCode.PULL_MESSAGE, h,
                                            timeout=self.timeout, ok_codes=_PULL_CODES)
                status = pull_status(f.code)
                if status is None:
                    raise_for_error(f)
                nxt = f.header.next_begin_offset
                if status is PullStatus.FOUND:
                    msgs = decode_pull_body(f.body, from_offset=off, broker_name=name,
                                            on_corrupt=functools.partial(_skipped, mq))[0]
                    out.extend(msgs[: max_num - len(out)])
                if nxt <= off:
                    break
                off = nxt
        return out

    async def resend_dlq(self, group: str, msg_ids: Sequence[str] | None = None, *,
                         max_num: int = 1000) -> list[tuple[str, str, str]]:
        """Send dead-lettered messages of ``group`` (all, or those whose id or origin id is in
        ``msg_ids``) again to their origin topic; (dlq id, origin topic, new id) for each.
        The copies stay in the DLQ (it is an archive)."""
        wanted = set(msg_ids) if msg_ids else None
        todo = []
        for m in await self.dlq_messages(group, max_num=max_num):
            p = m.properties
            if wanted is not None and not ({m.msg_id, p.get(ORIGIN_MESSAGE_ID)} & wanted):
                continue
            origin = p.get(RETRY_TOPIC)
            if not origin:
                raise ValueError(f"DLQ message {m.msg_id} has no RETRY_TOPIC property; its "
                                 "origin topic is unknown")
            props = {k: v for k, v in p.items() if k != RETRY_TOPIC}
            todo.append((m, Message(origin, m.body, tags=m.tags, keys=m.keys or None,
                                    properties=props or None)))
        if wanted is not None:
            found = {x for m, _ in todo for x in (m.msg_id, m.properties.get(ORIGIN_MESSAGE_ID))}
            missing = wanted - found
            if missing:
                raise ValueError(f"not in %DLQ%{group}: {', '.join(sorted(missing))}")
        out = []
        async with Producer(self.routes.namesrv) as producer:
            for m, new in todo:
                r = await producer.send(new)
                out.append((m.msg_id, new.topic, r.msg_id))
        return out

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
        k = indexes[i]
        msgs = decode_pull_body(bytes(mv[pos : pos + size]), from_offset=0,
                                broker_name=broker_name,
                                on_corrupt=functools.partial(_skipped, view.topic_bytes))[0]
        out.extend(m for m in msgs if m._i == k)
        pos += size
        i += 1
    return out


_corrupt = CorruptRecords(log)


def _skipped(where: object, queue_offset: int, count: int, why: str) -> None:
    """A message a query or DLQ listing cannot decode: left out, counted and logged."""
    _corrupt.skipped("admin", f"{where} offset {queue_offset}", why, count)
