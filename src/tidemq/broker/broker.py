"""The broker process: store, services, request dispatch and lifecycle (RocketMQ's
BrokerController).

::

    clients --TCP--> FrameServer / BrokerConnection (tidemq.base: framing, back-pressure, limits)
                        |  Broker.handle(conn, frame): code -> processor
                        v
       SendProcessor   PullProcessor --held--> PullRequestHoldService (long_polling)
            |               |                        ^ woken by the store's dispatch listener
            v               v                        |
                     MessageStore (CommitLog, ConsumeQueue, index; its own flush threads)
       TopicConfigManager, ConsumerOffsetManager (JSON files under <data_dir>/config/)
       BrokerStats; NamesrvRegistration (REGISTER_BROKER every 30 s and on change)

Every request is handled on the event loop; a handler raises
:class:`~tidemq.broker.errors.RequestRejected` for a client mistake (error response, connection
kept) and anything else it raises is answered SYSTEM_ERROR with the traceback in the log -- the
broker never dies of a request. One-way requests are never answered, errors included: while a
handler runs for one, its connection drops any response to that request's opaque (answers to
other requests of the connection, such as a held pull the handler wakes, still go out).

Lifecycle: ``await Broker(config).start()`` binds the port (0 = any), opens the store, loads
topics and offsets, starts serving and registers with the name servers; ``await stop()``
unregisters, closes connections, persists topics and offsets and closes the store.

Threads: the event loop that called :meth:`start`; the store runs its own flush and housekeeping
threads and calls back through the loop (see send_processor and long_polling).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

from tidemq.base.gc_tune import freeze_long_lived, tune_gc
from tidemq.base.server import FrameServer
from tidemq.broker.admin_processor import AdminProcessor, rss_bytes
from tidemq.broker.config import BrokerConfig
from tidemq.broker.connection import BrokerConnection
from tidemq.broker.consumer_manager import DLQ_PREFIX, RETRY_PREFIX, ConsumerManager
from tidemq.broker.consumer_offsets import ConsumerOffsetManager
from tidemq.broker.dedup import MessageDeduplication
from tidemq.broker.errors import RequestRejected
from tidemq.broker.ha.service import HAService
from tidemq.broker.long_polling import HeldPull, PullRequestHoldService
from tidemq.broker.metrics import MetricsServer
from tidemq.broker.multi_pull import MultiPullProcessor
from tidemq.broker.non_persistent import NonPersistentTopics
from tidemq.broker.pop_processor import PopProcessor
from tidemq.broker.pull_processor import PullProcessor
from tidemq.broker.queue_lock import QueueLockManager
from tidemq.broker.queue_shrink import QueueShrinker
from tidemq.broker.registration import NamesrvRegistration
from tidemq.broker.schedule_service import (
    SCHEDULE_TOPIC,
    ScheduleMessageService,
    parse_delay_levels,
)
from tidemq.broker.send_back import SendBackProcessor
from tidemq.broker.send_processor import SendProcessor
from tidemq.broker.stats import BrokerStats
from tidemq.broker.subscription_group import SubscriptionGroupManager
from tidemq.broker.timer_service import TimerMessageService
from tidemq.broker.topic_config import TopicConfigManager
from tidemq.broker.transaction_service import HALF_TOPIC, OP_TOPIC, TransactionService
from tidemq.protocol.codes import RequestCode, ResponseCode
from tidemq.protocol.errors import CorruptBatchError
from tidemq.protocol.frame import FLAG_ONEWAY, FLAG_RESPONSE, Frame
from tidemq.protocol.headers import (
    Perm,
    RegisterBrokerRequestHeader,
    SubscriptionGroupConfig,
    TopicConfig,
    UnregisterBrokerRequestHeader,
)
from tidemq.protocol.names import is_system_topic
from tidemq.protocol.record import BatchView
from tidemq.store.flush import handoff_to
from tidemq.store.message_store import MessageStore, PutResult

__all__ = ["Broker"]

log = logging.getLogger(__name__)

try:
    from importlib.metadata import version as _version

    VERSION = _version("tidemq")
except Exception:  # not installed (running from a source tree)
    VERSION = "0"


class Broker:
    """One broker. Call :meth:`start`, :meth:`stop` and everything else from the event loop
    that ran :meth:`start`; only the store's callbacks arrive from other threads (and hop)."""

    def __init__(self, config: BrokerConfig) -> None:
        config.validate()
        self.config = config
        # Set by start(); read through the properties below, which say so when it has not run.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._store: MessageStore | None = None
        self.port = 0
        self.addr = ""
        self.connections: set[BrokerConnection] = set()
        self.topics = TopicConfigManager(
            os.path.join(config.config_path, "topics.json"),
            default_queue_nums=config.default_topic_queue_nums,
        )
        self.offsets = ConsumerOffsetManager(
            os.path.join(config.config_path, "consumer_offsets.json")
        )
        self.stats = BrokerStats(config.stats_sample_interval_ms / 1000)
        # Consumer groups (docs/consumer-groups.md): members, queue locks, group configs.
        self.subscription_groups = SubscriptionGroupManager(
            os.path.join(config.config_path, "subscription_groups.json"),
            auto_create=config.auto_create_subscription_group,
        )
        self.subscription_groups.on_update = self._resize_retry_topic
        self.consumers = ConsumerManager(self)
        self.queue_locks = QueueLockManager(config.queue_lock_max_live_ms)
        # Pulsar's producer path (docs/producer-path.md): deduplication, non-persistent topics.
        self.dedup = MessageDeduplication(
            os.path.join(config.config_path, "dedup.json"),
            enabled=config.dedup_enabled,
            snapshot_interval_s=config.dedup_snapshot_interval_ms / 1000,
            inactivity_s=config.dedup_producer_inactivity_ms / 1000,
        )
        self.non_persistent = NonPersistentTopics(
            max_pending_messages=config.non_persistent_max_pending_messages,
            max_pending_bytes=config.non_persistent_max_pending_bytes,
        )
        self.registration: NamesrvRegistration | None = None
        #: Replication: this broker's role in its group (docs/cluster.md).
        self.ha = HAService(self)
        self.shrinker = QueueShrinker(self)
        #: called (event loop) when an elected master finds itself replaced: the ``tidemq
        #: broker`` process restarts in place as a slave; None (embedded) = stay fenced
        self.restart_hook: Callable[[str], None] | None = None
        #: The delay, timer and transaction services run (a master's; a slave starts them
        #: when it is promoted).
        self.services_started = False
        self.metrics: MetricsServer | None = None
        self._hold: PullRequestHoldService | None = None
        self.frames = FrameServer(
            self, config.connection_limits(), what="broker", connection_factory=BrokerConnection
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._handlers: dict[int, Callable[[BrokerConnection, Frame], None]] = {}
        self._topics_persist: asyncio.Task[None] | None = None
        self._topics_waiters: list[Callable[[], None]] = []
        self._offsets_persist: asyncio.Future[None] | None = None
        self._stopped = False
        self._loaded = False
        self.started_at = 0.0
        #: collections frozen by _freeze_gc_forever (runtime info)
        self.gc_freezes = 0
        self.pop: PopProcessor | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop :meth:`start` ran on."""
        if self._loop is None:
            raise RuntimeError("the broker has not started")
        return self._loop

    @property
    def store(self) -> MessageStore:
        """The message store :meth:`start` opened."""
        if self._store is None:
            raise RuntimeError("the broker has not started")
        return self._store

    @property
    def hold(self) -> PullRequestHoldService:
        """Long polling's held pulls (created by :meth:`start`)."""
        if self._hold is None:
            raise RuntimeError("the broker has not started")
        return self._hold

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        tune_gc()  # a frame's thousands of small objects die young (tidemq.base.gc_tune)
        self._loop = loop = asyncio.get_running_loop()
        self.port = await self.frames.start(cfg.listen_host, cfg.listen_port, start_serving=False)
        self.addr = cfg.broker_addr(self.port)
        # Opening the store takes its lock (a second broker on the same directory stops here,
        # before touching the config files) and recovers it; nothing else runs yet.
        self._store = MessageStore(cfg.store_config(self.port))
        # SYNC_FLUSH: a group commit's callbacks reach the loop in one wake-up (store/flush.py)
        self.store.flush_service.complete_on(handoff_to(loop.call_soon_threadsafe))
        os.makedirs(cfg.config_path, exist_ok=True)
        self.ha.load()
        await self.ha.join_election()  # election on etcd: the role comes from there
        self.topics.load()
        self.offsets.load()
        self.subscription_groups.load()
        # Disk pressure never deletes what a reader has not consumed (store/retention.py).
        self.store.retention.consumed = self._consumed_positions
        self._loaded = True
        self._hold = PullRequestHoldService(
            loop,
            self._execute_held,
            self._max_offset,
            long_polling=cfg.long_polling_enable,
            check_interval_s=(
                cfg.long_polling_check_ms if cfg.long_polling_enable else cfg.short_polling_time_ms
            )
            / 1000,
        )
        self.store.add_dispatch_listener(self.hold.on_message_arrival)
        self.non_persistent.on_arrival = self.hold.on_message_arrival
        # the pulls a read's sends woke are answered with that read's answers (if few)
        self.frames.after_read = self.hold.run_woken_in_read
        self.dedup.recover(self.store)
        # Delayed, timed and transactional messages (docs/delayed-and-transactional.md).
        self.schedule = ScheduleMessageService(
            self.store, parse_delay_levels(cfg.message_delay_level),
            os.path.join(cfg.config_path, "delay_offset.json"),
        )
        self.timers = TimerMessageService(
            self.store, os.path.join(cfg.data_path, "timerlog"),
            bucket_ms=cfg.timer_bucket_ms, checkpoint_ms=cfg.timer_checkpoint_ms,
        )
        self.transactions = TransactionService(
            self, os.path.join(cfg.config_path, "transaction_progress.json")
        )
        if self.ha.is_master:
            self.start_services()
        self.send_processor = SendProcessor(self)
        self.pull_processor = PullProcessor(self)
        self.multi_pull = MultiPullProcessor(self)
        self.admin_processor = AdminProcessor(self)
        self.send_back = SendBackProcessor(self)
        self.pop = PopProcessor(self)
        self.pop.recover()  # POP windows from rmq_sys_POP_LOG, before serving
        self.store.add_dispatch_listener(self.pop.hold.on_message_arrival)  # held pops wake
        self._handlers = {
            RequestCode.SEND_MESSAGE: self.send_processor.handle,
            RequestCode.SEND_BATCH: self.send_processor.handle,
            RequestCode.SEND_MULTI_QUEUE: self.send_processor.handle_multi,
            RequestCode.PULL_MESSAGE: self.pull_processor.handle,
            RequestCode.PULL_MULTI_QUEUE: self.multi_pull.handle,
            RequestCode.GET_LAST_SEQUENCE: self.dedup.handle_last_sequence,
            **self.admin_processor.handlers(),
            **self.consumers.handlers(),
            **self.queue_locks.handlers(),
            **self.send_back.handlers(),
            **self.pop.handlers(),
            **self.subscription_groups.handlers(),
            RequestCode.END_TRANSACTION: self.transactions.handle_end,
            RequestCode.CANCEL_TIMER_MESSAGE: self._cancel_timer_message,
        }
        # Producers of a transaction group are found through their heartbeats too.
        self._handlers[RequestCode.HEART_BEAT] = self.transactions.wrap_heartbeat(
            self._handlers.get(RequestCode.HEART_BEAT)
        )
        self._handlers.update(self.ha.handlers())
        self.ha.guard(self._handlers)  # a slave refuses writes
        await self.ha.start()
        self.started_at = time.time()
        await self.frames.start_serving()
        self._tasks = [
            loop.create_task(self.hold.run_checks(), name="long-polling-check"),
            loop.create_task(self._persist_offsets_forever(), name="offsets-persist"),
            loop.create_task(self._sample_stats_forever(), name="stats-sample"),
            loop.create_task(self._freeze_gc_forever(), name="gc-freeze"),
            loop.create_task(self.dedup.run_snapshots(self.store), name="dedup-snapshot"),
            loop.create_task(self.pop.run_snapshots(), name="pop-snapshot"),
            loop.create_task(self._scan_clients_forever(), name="client-scan"),
            loop.create_task(self.shrinker.run_forever(), name="queue-shrink"),
        ]
        if cfg.metrics_port >= 0:
            self.metrics = MetricsServer(self)
            await self.metrics.start(cfg.listen_host, cfg.metrics_port)
        if cfg.namesrv_addrs:
            self.registration = NamesrvRegistration(
                cfg.namesrv_addrs,
                self._register_header,
                interval_s=cfg.register_interval_ms / 1000,
                timeout_s=cfg.register_timeout_ms / 1000,
                on_response=self.ha.on_register_response,
            )
            # The first registration is awaited so routes exist when start() returns.
            await self.registration.register_all()
            self._tasks.append(loop.create_task(self.registration.run(), name="registration"))
        log.info(
            "broker %s id %d (%s, cluster %s) serving on %s, data in %s, flush %s",
            cfg.broker_name, self.ha.broker_id, self.ha.role, cfg.cluster_name, self.addr,
            cfg.data_path, cfg.flush_mode,
        )

    def start_services(self, *, timer_done_before: int | None = None) -> None:
        """The delay, timer and transaction services: a master's only (on a slave they would
        deliver what its master delivers). A promoted slave starts them with the timer
        progress its master last sent (TimerMessageService.start)."""
        if self.services_started:
            return
        self.services_started = True
        loop = self.loop
        self.schedule.start(loop)
        self.timers.start(loop, done_before=timer_done_before)
        self.transactions.start(loop)

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.frames.close_listener()
        if self.metrics is not None:
            await self.metrics.close()
        if self.registration is not None:
            try:
                await asyncio.wait_for(
                    self.registration.unregister_all(self._unregister_header()), 2
                )
            except TimeoutError:
                pass
            self.registration.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.ha.stop()
        if self._hold is not None:
            self._hold.close()
        if self.pop is not None:
            self.pop.hold.close()
        self.frames.close()
        if self._topics_persist is not None:
            await asyncio.gather(self._topics_persist, return_exceptions=True)
        if self._offsets_persist is not None:
            await asyncio.gather(self._offsets_persist, return_exceptions=True)
        if self._loaded:  # never overwrite the files with tables that were not loaded
            try:
                self.offsets.persist()
                self.topics.persist()
                self.subscription_groups.persist()
            except OSError as exc:
                log.error("persisting offsets/topics at shutdown failed: %s", exc)
        if self._store is not None and self._loaded:
            try:
                if self.services_started:
                    await self.transactions.stop()
                    self.schedule.close()
                    await self.timers.stop()
            except OSError as exc:
                log.error("persisting delay/timer/transaction progress failed: %s", exc)
        if self._store is not None:
            try:
                self.dedup.save_now(self.store)
            except OSError as exc:
                log.error("persisting the dedup snapshot at shutdown failed: %s", exc)
            self.store.close()
            log.info("broker %s stopped", self.config.broker_name)

    # -- connections and dispatch ----------------------------------------------------------------
    def connection_made(self, conn: BrokerConnection) -> None:
        self.connections.add(conn)

    def connection_lost(self, conn: BrokerConnection) -> None:
        self.connections.discard(conn)
        if conn.held and self._hold is not None:
            self._hold.drop_connection(conn)
        if self.pop is not None:
            self.pop.drop_connection(conn)
        if self.multi_pull.standing:
            self.multi_pull.drop_connection(conn)
        if not self._stopped:
            self.consumers.connection_closed(conn)

    def handle(self, conn: BrokerConnection, frame: Frame) -> None:
        """Dispatch one request frame; never raises."""
        flags = frame.flags
        if flags & FLAG_RESPONSE:
            log.debug("ignoring a response frame (opaque %d) from %s", frame.opaque, conn.peer)
            return
        handler = self._handlers.get(frame.code)
        try:
            if handler is None:
                raise RequestRejected(
                    ResponseCode.REQUEST_CODE_NOT_SUPPORTED,
                    f"request code {frame.code} is not supported by this broker (tidemq "
                    f"{VERSION}); see docs/protocol.md for the codes it serves",
                )
            if flags & FLAG_ONEWAY:
                conn.oneway_opaque = frame.opaque
                try:
                    handler(conn, frame)
                finally:
                    conn.oneway_opaque = None
            else:
                handler(conn, frame)
        except RequestRejected as exc:
            if flags & FLAG_ONEWAY:
                log.debug("one-way request %d from %s rejected: %s", frame.code, conn.peer, exc)
            else:
                conn.respond_error(frame.opaque, exc.response_code, exc.message)
        except Exception as exc:
            self.answer_failure(conn, frame.opaque if not flags & FLAG_ONEWAY else None,
                                _code_name(frame.code), exc)

    def answer_failure(
        self, conn: BrokerConnection, opaque: int | None, what: str, exc: BaseException
    ) -> None:
        """A handler failed unexpectedly: log the traceback, answer SYSTEM_ERROR."""
        if isinstance(exc, RequestRejected):
            if opaque is not None:
                conn.respond_error(opaque, exc.response_code, exc.message)
            return
        log.error(
            "%s from %s failed:\n%s", what, conn.peer,
            "".join(traceback.format_exception(exc)).rstrip(),
        )
        if opaque is not None and not conn.closed:
            conn.respond_error(
                opaque,
                ResponseCode.SYSTEM_ERROR,
                f"the broker failed handling {what}: {type(exc).__name__}: {exc}; the broker log "
                "has the traceback",
            )

    def _execute_held(self, held: HeldPull) -> None:
        self.pull_processor.execute_held(held)

    # -- topics ----------------------------------------------------------------------------------
    def auto_create_topic(self, topic: str) -> TopicConfig:
        tc = self.topics.auto_create(topic)
        self.topics_changed()
        return tc

    def ensure_retry_topic(self, group: str) -> None:
        """Create ``%RETRY%<group>`` (read + write, the group's retry queue count) if missing."""
        topic = RETRY_PREFIX + group
        if self.topics.get(topic) is None:
            n = self.subscription_groups.ensure(group).retry_queue_nums
            self.topics.update(TopicConfig(topic_name=topic, read_queue_nums=n,
                                           write_queue_nums=n, perm=Perm.READ_WRITE))
            self.topics_changed()

    def _resize_retry_topic(self, cfg: SubscriptionGroupConfig) -> None:
        """A group's retry_queue_nums changed: its existing retry topic follows (write queues
        as configured; read queues never shrink, so no retry message is stranded)."""
        topic = RETRY_PREFIX + cfg.group_name
        tc = self.topics.get(topic)
        n = cfg.retry_queue_nums
        if tc is not None and tc.write_queue_nums != n:
            self.topics.update(TopicConfig(
                topic_name=topic, read_queue_nums=max(tc.read_queue_nums, n),
                write_queue_nums=n, perm=tc.perm,
            ))
            self.topics_changed()

    def ensure_dlq_topic(self, group: str) -> None:
        """Create ``%DLQ%<group>`` (1 queue, write-only, as RocketMQ) if missing."""
        topic = DLQ_PREFIX + group
        if self.topics.get(topic) is None:
            self.topics.update(TopicConfig(topic_name=topic, read_queue_nums=1,
                                           write_queue_nums=1, perm=Perm.WRITE))
            self.topics_changed()

    def max_delay_level(self) -> int:
        """Highest delay level of the schedule (18 with RocketMQ's default)."""
        return max(1, len(parse_delay_levels(self.config.message_delay_level)))

    def put_for_consumer(self, batch: bytearray, queue_id: int) -> None:
        """Store a broker-made batch (a retry or dead-letter copy); its delay level is held by
        the schedule service (``put_internal``)."""
        self.put_internal(batch, queue_id, on_durable=_ignore_durable)

    def put_internal(
        self,
        batch: bytes | bytearray | memoryview,
        queue_id: int,
        *,
        on_durable: Callable[[object], None] | None = None,
        view: BatchView | None = None,
    ) -> PutResult:
        """Store one batch, holding it first when its attributes say it is not due yet.

        The one entry point for every batch the broker stores on someone's behalf: client sends
        (SendProcessor), consumer send-back into ``%RETRY%<group>`` and dead-letter copies, and
        transaction commits. Event loop only.

        - ``batch``: one whole batch (``record.encode_batch`` layout) whose store header names
          the real topic; ``queue_id`` is the real queue (it overrides the header's).
        - delay level ``L > 0`` in the attributes (bits 5-9): the batch is wrapped in an
          envelope on ``SCHEDULE_TOPIC_XXXX`` queue ``min(L, max level) - 1`` (properties
          REAL_TOPIC / REAL_QID) and delivered to (real topic, ``queue_id``) once
          ``message_delay_level[L - 1]`` has passed since it was stored here.
        - else ``deliver_at`` later than now (ms since the epoch): wrapped on
          ``rmq_sys_wheel_timer`` and indexed in the durable time index; delivered at
          ``deliver_at`` (never before). More than ``timer_max_delay_ms`` ahead raises
          CorruptBatchError (answered MESSAGE_ILLEGAL). A ``deliver_at`` in the past or 0 means
          now.
        - else stored at once, exactly as ``MessageStore.put``.

        The attributes are the producer's and are never rewritten, so a copy of a consumed
        batch carries its producer's delay: re-encode it with the delay you want
        (``record.encode_batch(..., delay_level=3 + reconsume_times)``) rather than passing
        the consumed bytes. Delivery stores the inner batch directly (it is not held again).

        Returns the ``PutResult`` of what was stored now: for a held batch that is the
        envelope (topic SCHEDULE_TOPIC_XXXX / rmq_sys_wheel_timer, its queue and offset), not
        the real queue's offset, which is known only at delivery. ``on_durable`` is passed to
        that put (SYNC_FLUSH: called on the flush thread once it is on disk). Raises what
        ``MessageStore.put`` raises (a StoreError subclass / CorruptBatchError).
        """
        v = BatchView(batch) if view is None else view
        # A batch already on a system topic is never held again.
        if v.delay_level and not is_system_topic(v.topic):
            return self.schedule.hold(batch, v, queue_id, on_durable)
        at = v.deliver_at
        if at:
            now = time.time_ns() // 1_000_000
            if at > now:
                if at - now > self.config.timer_max_delay_ms:
                    raise CorruptBatchError(
                        f"deliver_at is {(at - now) / 86_400_000:.1f} days ahead, beyond the "
                        f"broker's limit of {self.config.timer_max_delay_ms / 86_400_000:g} "
                        "days (timer_max_delay_ms)"
                    )
                return self.timers.hold(batch, v, queue_id, on_durable)
        return self.store.put(batch, queue_id=queue_id, view=v, on_durable=on_durable)

    def _cancel_timer_message(self, conn: BrokerConnection, frame: Frame) -> None:
        """CANCEL_TIMER_MESSAGE: cancel a message held for a deliver_at, by its message id."""
        from tidemq.broker.connection import decode_request
        from tidemq.protocol.headers import CancelTimerMessageRequestHeader

        h = decode_request(frame, CancelTimerMessageRequestHeader)
        try:
            ok = self.timers.cancel(h.msg_id)
        except ValueError as exc:
            raise RequestRejected(ResponseCode.INVALID_ARGUMENT, str(exc)) from None
        if not ok:
            raise RequestRejected(
                ResponseCode.QUERY_NOT_FOUND,
                f"no pending timed message with id {h.msg_id} (unknown, delivered or cancelled "
                "already; only deliver_at / deliver_after messages can be cancelled)",
            )
        if not frame.flags & FLAG_ONEWAY:
            conn.respond(frame.opaque, ResponseCode.SUCCESS, None)

    def _max_offset(self, topic: str, queue_id: int) -> int:
        """Max offset of a queue, in the store or in memory (non-persistent topics)."""
        if self.non_persistent.owns(topic):
            return self.non_persistent.max_offset(topic, queue_id)
        return self.store.max_offset(topic, queue_id)

    def delete_topic(self, topic: str) -> None:
        self.non_persistent.delete_topic(topic)
        self.topics.delete(topic)
        self.store.delete_topic(topic)
        self.offsets.delete_topic(topic)

    def topics_changed(self, then: Callable[[], None] | None = None) -> None:
        """Persist the topic table (coalesced, in a worker thread), tell the name servers, then
        call ``then`` (e.g. answer the admin request once the change is durable)."""
        if then is not None:
            self._topics_waiters.append(then)
        if self._topics_persist is None or self._topics_persist.done():
            self._topics_persist = self.loop.create_task(self._persist_topics())
        if self.registration is not None:
            self.registration.changed()

    async def _persist_topics(self) -> None:
        await asyncio.sleep(0)  # let changes made in the same loop iteration join this write
        while True:
            waiters, self._topics_waiters = self._topics_waiters, []
            changes = self.topics.changes
            data = self.topics.snapshot()
            try:
                await asyncio.to_thread(_write, self.topics.path, data)
            except OSError as exc:
                log.error("persisting topics to %s failed: %s", self.topics.path, exc)
            for cb in waiters:
                try:
                    cb()
                except Exception:
                    log.exception("topic change callback failed")
            if not self._topics_waiters and changes == self.topics.changes:
                return

    def _register_header(self, with_topics: bool = True) -> RegisterBrokerRequestHeader:
        """The registration; ``with_topics=False``: the heartbeat form (``topics_omitted``)
        when the broker has topics, built without copying the topic table."""
        cfg = self.config
        omit = not with_topics and len(self.topics) > 0
        return RegisterBrokerRequestHeader(
            cluster_name=cfg.cluster_name,
            broker_name=cfg.broker_name,
            broker_id=self.ha.broker_id,
            broker_addr=self.addr,
            ha_server_addr=self.ha.ha_addr,
            heartbeat_timeout_millis=cfg.heartbeat_timeout_ms,
            data_version=self.topics.data_version,
            topics={} if omit else self.topics.all(),
            topics_omitted=omit,
            epoch=self.ha.epoch if self.ha.is_master else 0,
        )

    def _unregister_header(self) -> UnregisterBrokerRequestHeader:
        cfg = self.config
        return UnregisterBrokerRequestHeader(
            cluster_name=cfg.cluster_name,
            broker_name=cfg.broker_name,
            broker_id=self.ha.broker_id,
            broker_addr=self.addr,
        )

    # -- periodic work ---------------------------------------------------------------------------
    async def _persist_offsets_forever(self) -> None:
        interval = self.config.offset_persist_interval_ms / 1000
        while True:
            await asyncio.sleep(interval)
            if not self.offsets.dirty:
                continue
            data = self.offsets.snapshot()
            self._offsets_persist = asyncio.ensure_future(
                asyncio.to_thread(_write, self.offsets.path, data)
            )
            try:
                await self._offsets_persist
            except OSError as exc:
                self.offsets.dirty = True
                log.error("persisting consumer offsets to %s failed: %s", self.offsets.path, exc)

    async def _scan_clients_forever(self) -> None:
        interval = self.config.client_scan_interval_ms / 1000
        path = self.subscription_groups.path
        while True:
            await asyncio.sleep(interval)
            try:
                self.consumers.scan_expired()
                if self.subscription_groups.dirty:
                    await asyncio.to_thread(_write, path, self.subscription_groups.snapshot())
            except Exception:  # keep scanning
                log.exception("client housekeeping failed")

    async def _freeze_gc_forever(self) -> None:
        """``freeze_long_lived`` once the store has ``gc_freeze_min_queues`` more queues than
        at the last freeze and their number held still for a second (a burst of topic
        creations or first messages is over): their state lives as long as they do, and the
        collector's full collections walked it -- 68-95 ms of the loop's CPU at 10,000 queues,
        in the push phase of ``bench scale`` (issue 17). Counted in ``gc_freezes``."""
        step = self.config.gc_freeze_min_queues
        if step <= 0:
            return
        frozen_at = 0
        last = -1
        while True:
            await asyncio.sleep(1.0)
            n = len(self.store.cqs)
            if n - frozen_at >= step and n == last:
                frozen_at = n
                if freeze_long_lived():
                    self.gc_freezes += 1
            last = n

    async def _sample_stats_forever(self) -> None:
        interval = self.config.stats_sample_interval_ms / 1000
        while True:
            await asyncio.sleep(interval)
            self.stats.sample()

    # -- runtime info ----------------------------------------------------------------------------
    def _consumed_positions(self) -> dict[tuple[str, int], tuple[int, str]]:
        """Per queue, the lowest offset a reader still needs and who that is, for retention
        (store/retention.py): the lowest committed offset of the consumer groups with
        offsets on the topic (a group without one for a queue needs all of it), and the
        progress of the services reading the internal topics. Queues nobody reads are left
        out (kept until they expire).

        Called on the store's housekeeping thread: every table is copied first with C-level
        dict copies (atomic under the GIL) of what the event loop owns, and the result only
        decides what may be *kept* (a stale answer keeps more, never less, except right after
        an offset reset)."""
        out: dict[tuple[str, int], tuple[int, str]] = {}
        by_topic = self.offsets.by_topic()
        for cq in self.store.cqs.all():
            groups = by_topic.get(cq.topic)
            if not groups:
                continue
            off, who = min(((q.get(cq.queue_id, -1), g) for g, q in groups),
                           key=lambda e: e[0])
            out[(cq.topic, cq.queue_id)] = (max(off, 0), f"consumer group {who} at offset {off}")
        schedule = getattr(self, "schedule", None)
        if schedule is not None:
            durable = dict(schedule.durable_offsets)
            for level in range(1, schedule.max_level + 1):
                off = durable.get(level, 0)
                out[(SCHEDULE_TOPIC, level - 1)] = (off, f"delay level {level} at offset {off}")
        txn = getattr(self, "transactions", None)
        if txn is not None:
            out[(HALF_TOPIC, 0)] = (txn.half_progress, "the transaction check")
            out[(OP_TOPIC, 0)] = (txn.op_progress, "the transaction check")
        return out

    def runtime_info(self) -> dict[str, Any]:
        cfg = self.config
        store = self.store
        cl = store.commitlog
        info: dict[str, Any] = {
            "version": VERSION,
            "broker_name": cfg.broker_name,
            "cluster_name": cfg.cluster_name,
            "broker_addr": self.addr,
            "boot_timestamp": int(self.started_at * 1000),
            "uptime_ms": int((time.time() - self.started_at) * 1000),
            "flush_mode": cfg.flush_mode,
            "long_polling_enable": cfg.long_polling_enable,
            "topics": len(self.topics),
            "queues": len(store.queues()),
            "consumer_groups": len(self.offsets.groups()),
            "online_groups": len(self.consumers.groups),
            "consumer_notifications": self.consumers.notifications,
            "sent_back_retry": self.send_back.retried,
            "sent_back_dlq": self.send_back.dead,
            "connections": len(self.connections),
            **self.frames.stats(),
            "gc_freezes": self.gc_freezes,
            "held_pulls": (held := self.hold.held_count()),
            # requests, not queues: a held PULL_MULTI_QUEUE is one, whatever its queues
            "held_multi_pulls": (multi := self.multi_pull.held_counts())[0],
            "held_pull_requests": held - multi[1] + multi[0],
            "held_woken_by_arrival": self.hold.woken_by_arrival,
            "held_woken_by_check": self.hold.woken_by_check,
            "held_timed_out": self.hold.timed_out,
            "commitlog_min_offset": cl.min_offset,
            "commitlog_max_offset": cl.write_pos,
            "commitlog_flushed_offset": cl.flushed_pos,
            "disk_full": store.disk_full,
            "rss_bytes": rss_bytes(),
            # utime + stime of the whole process (every thread), for CPU-per-message figures
            "process_cpu_s": round(time.process_time(), 6),
            "registrations": self.registration.registrations if self.registration else 0,
        }
        info.update(self.stats.summary())
        info.update(self.dedup.stats())
        info.update({
            "delay_pending": self.schedule.pending(),
            "delay_delivered": self.schedule.delivered,
            "timer_delivered": self.timers.delivered,
            "timer_bucket_files": self.timers.pending_buckets(),
            **self.timers.stats(),
            "txn_half_pending": self.transactions.pending(),
            **{f"txn_{k}": n for k, n in self.transactions.stats.items()},
        })
        info.update(self.non_persistent.stats())
        if self.pop is not None:
            info.update(self.pop.stats())
        # "Tolerate on the way out": records readers skipped as undecodable, per reader, and
        # batches the store quarantined (CRC or framing damage found by recovery or a read).
        corrupt = store.corrupt.counts
        info["corrupt_skipped"] = sum(corrupt.values())
        info.update({f"corrupt_skipped_{r.replace('-', '_')}": n for r, n in corrupt.items()})
        info["quarantined_batches"] = len(store.quarantine)
        info.update(self.ha.runtime_info())
        return info




def _ignore_durable(err: object) -> None:
    """on_durable of a broker-made put: the client was answered at the put (never block the
    loop waiting for a SYNC_FLUSH fsync)."""


def _write(path: str, data: bytes) -> None:
    from tidemq.base.atomic_file import write_atomic

    write_atomic(path, data)


def _code_name(code: int) -> str:
    try:
        return RequestCode(code).name
    except ValueError:
        return f"request code {code}"
