"""The asyncio push consumer (RocketMQ's DefaultMQPushConsumer; ref CO1-CO7).

::

    async def handle(msgs, ctx):
        return tidemq.ConsumeStatus.SUCCESS

    async with PushConsumer("127.0.0.1:9876", group="billing", listener=handle) as c:
        c.subscribe("orders", "created || paid")
        await asyncio.sleep(60)

How it fits together (one instance = RocketMQ's MQClientInstance + the consumer)::

    heartbeat (30 s) --> brokers: ConsumerManager tracks the group's members
    broker --NOTIFY_CONSUMER_IDS_CHANGED--> wake --> Rebalance (also every 20 s)
    Rebalance: allocate sorted queues over sorted member ids --> add/drop ProcessQueues
    PullService: one async pull in flight per queue (many queues: one standing multi-queue
        pull per broker, PullDriver) --> ProcessQueue --> consume service
    ConsumeConcurrentlyService / ConsumeOrderlyService --> listener --> offset store
    offset store --> broker every 5 s (clustering) / local file (broadcasting)

In clustering the consumer also subscribes to its group's retry topic ``%RETRY%<group>``,
where failed messages come back (with their original topic restored) after the delay of their
retry level. Settings are RocketMQ's defaults (ref CO1); see the constructor.

``close()`` stops pulling, waits for nothing more than the listener calls in flight, persists
offsets, releases queue locks and unregisters from the brokers, which tell the remaining members
to rebalance at once.

Threads: one event loop (``tidemq.PushConsumer`` runs it for ordinary threads). Sync listeners
run on the consumer's thread pool; ``async def`` listeners on the loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import Sequence
from typing import Any

from tidemq.client.connection import Connection, ConnectionPool
from tidemq.client.consume_concurrently import ConsumeConcurrentlyService
from tidemq.client.consume_orderly import ConsumeOrderlyService
from tidemq.client.consumer_options import PushConsumerOptions
from tidemq.client.errors import ClientClosedError, NoRouteError
from tidemq.client.listener import Listener, MessageModel
from tidemq.client.loop_share import Slicer
from tidemq.client.message import MessageQueue
from tidemq.client.offset_store import (
    LocalFileOffsetStore,
    RemoteOffsetStore,
    default_offset_dir,
)
from tidemq.client.pull_service import PullService
from tidemq.client.rebalance import RETRY_PREFIX, Rebalance
from tidemq.client.route import RouteCache
from tidemq.client.selection import EVERYTHING, Selection
from tidemq.protocol.codes import RequestCode
from tidemq.protocol.corrupt import CorruptRecords
from tidemq.protocol.errors import TidemqError
from tidemq.protocol.frame import Frame
from tidemq.protocol.headers import (
    ConsumerData,
    HeartbeatRequestHeader,
    SubscriptionData,
    UnregisterClientRequestHeader,
)
from tidemq.protocol.names import group_name_problem

__all__ = ["PushConsumer"]

log = logging.getLogger(__name__)

MiB = 1 << 20


def _local_ip() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class PushConsumer:
    """A push consumer: subscribe, and the listener is called with the messages.

    Options: a :class:`~tidemq.client.consumer_options.PushConsumerOptions` (every field
    documented there, RocketMQ's defaults), or its fields as keywords; keywords given with
    ``options`` override its fields.

    What cannot be decoded (a CRC mismatch, records that do not decompress or would
    decompress past ``max_uncompressed_bytes``, a tag, key or property that is not UTF-8) is
    skipped, counted (``stats()["corrupt_skipped"]``) and logged with its queue and offset; the
    queue moves on past it.
    """

    def __init__(
        self,
        namesrv: str | Sequence[str],
        group: str,
        listener: Listener,
        options: PushConsumerOptions | None = None,
        **keywords: Any,
    ) -> None:
        problem = group_name_problem(group)
        if problem:
            raise ValueError(problem)
        if not callable(listener):
            raise ValueError("listener must be a function (msgs, ctx) -> status")
        o = self.options = PushConsumerOptions.of(options, keywords)
        self.group = group
        self.listener = listener
        self.orderly = o.orderly
        self.message_model = o.message_model
        self.broadcasting = self.message_model is MessageModel.BROADCASTING
        self.consume_from = o.consume_from
        self.consume_timestamp = o.consume_timestamp or 0
        self.allocate_strategy = o.allocate_strategy
        self.allocate_config = list(o.allocate_config)
        self.consumer_rooms = list(o.consumer_rooms)
        self.consume_thread_max = o.consume_thread_max
        self.consume_message_batch_max_size = o.consume_message_batch_max_size
        self.pull_batch_size = o.pull_batch_size
        self.pull_threshold_for_queue = o.pull_threshold_for_queue
        self.pull_threshold_size_for_queue = o.pull_threshold_size_for_queue
        self.consume_concurrently_max_span = o.consume_concurrently_max_span
        self.pull_interval = o.pull_interval
        self.max_reconsume_times = o.max_reconsume_times
        self.suspend_current_queue_time = o.suspend_current_queue_time
        self.consume_timeout = o.consume_timeout
        self.heartbeat_interval = o.heartbeat_interval
        self.rebalance_interval = o.rebalance_interval
        self.persist_interval = o.persist_interval
        self.lock_interval = o.lock_interval
        self.suspend_ms = int(o.suspend_timeout * 1000)
        self.instance_name = o.instance_name or uuid.uuid4().hex[:12]
        self.client_id = f"{_local_ip()}@{os.getpid()}@{self.instance_name}"
        self.offset_dir = o.offset_dir or default_offset_dir()
        self.hooks = list(o.hooks)
        self.check_crc = o.check_crc
        self.max_uncompressed_bytes = o.max_uncompressed_bytes
        self.chunk_expire = o.chunk_expire
        self.multi_queue_min = o.multi_queue_min
        #: records skipped because they do not decode ("tolerate on the way out")
        self.corrupt = CorruptRecords(log)
        self.request_timeout = o.request_timeout
        self.paused = False
        self._namesrv = namesrv
        self._route_refresh = o.route_refresh
        #: topic -> what is subscribed there (tags or SQL92)
        self.subscriptions: dict[str, Selection] = {}
        self._started = False
        self._closed = False
        self._tasks: list[asyncio.Task[None]] = []
        self._wake: asyncio.Event | None = None
        self.pool: ConnectionPool = None  # type: ignore[assignment]  # set by start()
        self.routes: RouteCache = None  # type: ignore[assignment]

    # -- configuration -------------------------------------------------------------------------
    def subscribe(self, topic: str, expression: str = "*", *, sql: str | None = None) -> None:
        """Consume ``topic``: ``expression`` is "*" or "TagA || TagB"; or
        ``sql="region = 'eu' AND amount > 100"`` selects by properties (SQL92,
        docs/consumer-groups.md). A bad SQL92 expression raises SqlFilterError here."""
        self.subscriptions[topic] = Selection(expression, sql=sql)
        if self._started:
            self._kick(heartbeat=True)

    def unsubscribe(self, topic: str) -> None:
        self.subscriptions.pop(topic, None)
        if self._started:
            self._kick(heartbeat=True)

    def assignment(self) -> set[MessageQueue]:
        """The queues this member consumes now (retry topic included)."""
        return set(self.rebalance.table) if self._started else set()

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        if self._started and not self._closed:
            self.pull_service.resume()

    def stats(self) -> dict[str, Any]:
        cs = self.consume_service
        return {
            "client_id": self.client_id,
            "queues": len(self.rebalance.table),
            "consumed": cs.consumed,
            "failed": getattr(cs, "failed", 0),
            # listener jobs (pool jobs, or tasks of an async listener) started
            "consume_jobs": getattr(cs, "jobs", 0),
            "pulls": self.pull_service.pulls,
            "multi_pull_requests": self.pull_service.multi_requests,
            "flow_controlled": self.pull_service.flow_controlled,
            "flow_resumed_early": self.pull_service.unparked,
            "rebalances": self.rebalance.rebalances,
            "gc_freezes": self.rebalance.gc_freezes,
            "in_flight": sum(pq.msg_count for pq in self.rebalance.table.values()),
            "corrupt_skipped": self.corrupt.total,
            "chunks_assembled": sum(pq.assembler.assembled for pq in self.rebalance.table.values()
                                    if pq.assembler is not None),
            "chunks_expired": sum(pq.assembler.expired for pq in self.rebalance.table.values()
                                  if pq.assembler is not None),
        }

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> PushConsumer:
        if self._closed:
            raise ClientClosedError("this consumer was closed; create a new one")
        if self._started:
            return self
        loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self.pool = ConnectionPool(connect_timeout=self.request_timeout,
                                   on_request=self._on_request)
        self.routes = RouteCache(self.pool, self._namesrv, refresh_interval=self._route_refresh,
                                 timeout=self.request_timeout)
        self.routes.start()
        if not self.broadcasting:
            self.subscriptions.setdefault(RETRY_PREFIX + self.group, EVERYTHING)
            self.offset_store: Any = RemoteOffsetStore(self.pool, self.routes, self.group,
                                                       self.request_timeout)
        else:
            self.offset_store = LocalFileOffsetStore(self.offset_dir, self.instance_name,
                                                     self.group)
        await self.offset_store.load()
        self.pull_service = PullService(self)
        self.consume_service: Any = (
            ConsumeOrderlyService(self) if self.orderly else ConsumeConcurrentlyService(self)
        )
        self.rebalance = Rebalance(self)
        self._started = True
        await self.send_heartbeat()
        await self.rebalance.do_rebalance()
        self._tasks = [
            loop.create_task(self._heartbeat_loop(), name="tidemq-heartbeat"),
            loop.create_task(self._rebalance_loop(), name="tidemq-rebalance"),
            loop.create_task(self._persist_loop(), name="tidemq-persist-offsets"),
            loop.create_task(self._clean_loop(), name="tidemq-clean-expired"),
        ]
        if self.orderly and not self.broadcasting:
            self._tasks.append(loop.create_task(self._lock_loop(), name="tidemq-lock"))
        return self

    async def close(self) -> None:
        """Stop, persist offsets, release locks, leave the group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self._started:
            return
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.pull_service.close()
        ordered = self.orderly and not self.broadcasting
        pqs = list(self.rebalance.table.values())
        # Orderly: let listener calls in progress end and commit (up to 1 s) before the
        # offsets are persisted and the locks released to the next owner.
        held = await asyncio.gather(*(self.rebalance.quiesce(pq) for pq in pqs)) if ordered \
            else [False] * len(pqs)
        for pq, h in zip(pqs, held, strict=True):
            pq.dropped = True
            if h:
                pq.consume_lock.release()
        try:
            await self.offset_store.persist_all(set(self.rebalance.table))
        except TidemqError as exc:
            log.warning("persisting offsets of group %s at close failed: %s", self.group, exc)
        if self.orderly and not self.broadcasting and self.rebalance.table:
            try:
                await self.rebalance.unlock(list(self.rebalance.table))
            except TidemqError as exc:
                log.info("unlocking queues at close failed: %s", exc)
        await self._unregister()
        await self.consume_service.close()
        await self.routes.close()
        self.pool.close()

    async def __aenter__(self) -> PushConsumer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- heartbeats and membership ---------------------------------------------------------------
    def _heartbeat_header(self) -> HeartbeatRequestHeader:
        subs = [SubscriptionData(topic=t, expression=s.expression,
                                 expression_type=s.expression_type)
                for t, s in self.subscriptions.items()]
        cd = ConsumerData(
            group=self.group, message_model=self.message_model.value.upper(),
            consume_from=self.consume_from.value, subscriptions=subs,
        )
        return HeartbeatRequestHeader(client_id=self.client_id, consumers=[cd])

    async def _brokers(self) -> dict[str, str]:
        """Every broker of the subscribed topics' groups, slaves included (RocketMQ sends a
        consumer's heartbeats to all of them: a slave serves the group when its master is
        down), keyed by "name/id"."""
        addrs: dict[str, str] = {}
        for topic in list(self.subscriptions):
            try:
                route = await self.routes.get(topic)
            except NoRouteError:
                continue
            for name, ids in route.group_addrs.items():
                for bid, addr in ids.items():
                    addrs[f"{name}/{bid}"] = addr
        return addrs

    async def send_heartbeat(self) -> None:
        header = self._heartbeat_header()
        for name, addr in (await self._brokers()).items():
            try:
                await self.pool.request(addr, RequestCode.HEART_BEAT, header,
                                        timeout=self.request_timeout)
            except TidemqError as exc:
                log.warning("heartbeat to broker %s (%s) failed: %s", name, addr, exc)

    async def _unregister(self) -> None:
        header = UnregisterClientRequestHeader(client_id=self.client_id,
                                               consumer_group=self.group)
        for addr in (await self._brokers()).values():
            try:
                await self.pool.request(addr, RequestCode.UNREGISTER_CLIENT, header,
                                        timeout=self.request_timeout)
            except TidemqError as exc:
                log.info("unregistering from %s failed: %s", addr, exc)

    def _on_request(self, conn: Connection, frame: Frame) -> None:
        if frame.code == RequestCode.NOTIFY_CONSUMER_IDS_CHANGED:
            log.info("group %s membership changed (told by %s); rebalancing", self.group,
                     conn.address)
            if self._wake is not None:
                self._wake.set()

    def _kick(self, *, heartbeat: bool = False) -> None:
        async def go() -> None:
            if heartbeat:
                await self.send_heartbeat()
            if self._wake is not None:
                self._wake.set()

        asyncio.get_running_loop().create_task(go())

    # -- periodic work ---------------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            try:
                await self.send_heartbeat()
            except Exception:
                log.exception("heartbeat failed")

    async def _rebalance_loop(self) -> None:
        assert self._wake is not None
        while True:
            timeout = 0.5 if self.rebalance.retry_soon else self.rebalance_interval
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel that
            # arrives as the event is set (a notification during close), and close() would
            # then wait for the next 20 s round.
            try:
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.rebalance.do_rebalance()
            except Exception:
                log.exception("rebalance of group %s failed", self.group)

    async def _persist_loop(self) -> None:
        while True:
            await asyncio.sleep(self.persist_interval)
            try:
                await self.offset_store.persist_all(set(self.rebalance.table))
            except Exception:
                log.exception("persisting offsets of group %s failed", self.group)

    async def _lock_loop(self) -> None:
        while True:
            await asyncio.sleep(self.lock_interval)
            try:
                await self.rebalance.lock_all()
            except Exception:
                log.exception("renewing queue locks of group %s failed", self.group)

    async def _clean_loop(self) -> None:
        while True:
            await asyncio.sleep(min(self.consume_timeout, 60.0))
            sl = Slicer()
            for mq, pq in list(self.rebalance.table.items()):
                if sl.due():  # 10,000 queues are not one stretch of the loop (loop_share)
                    await asyncio.sleep(0)
                try:
                    await self.consume_service.clean_expired(pq, mq)
                except Exception:
                    log.exception("cleaning expired messages of %s failed", mq)
