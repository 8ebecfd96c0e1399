"""The broker process: store, services, request dispatch and lifecycle (RocketMQ's
BrokerController).

::

    clients --TCP--> BrokerConnection (asyncio.Protocol + FrameDecoder)
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
broker never dies of a request. One-way requests are never answered, errors included.

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
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

from tidemq.broker.admin_processor import AdminProcessor, rss_bytes
from tidemq.broker.config import BrokerConfig
from tidemq.broker.connection import BrokerConnection
from tidemq.broker.consumer_offsets import ConsumerOffsetManager
from tidemq.broker.errors import RequestRejected
from tidemq.broker.long_polling import PullRequestHoldService
from tidemq.broker.pull_processor import PullProcessor
from tidemq.broker.registration import NamesrvRegistration
from tidemq.broker.send_processor import SendProcessor
from tidemq.broker.stats import BrokerStats
from tidemq.broker.topic_config import TopicConfigManager
from tidemq.protocol.codes import RequestCode, ResponseCode
from tidemq.protocol.frame import DEFAULT_MAX_FRAME_SIZE, FLAG_ONEWAY, FLAG_RESPONSE, Frame
from tidemq.protocol.headers import (
    RegisterBrokerRequestHeader,
    TopicConfig,
    UnregisterBrokerRequestHeader,
)
from tidemq.store.message_store import MessageStore

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
        self.loop: asyncio.AbstractEventLoop | None = None
        self.store: MessageStore | None = None
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
        self.registration: NamesrvRegistration | None = None
        self.hold: PullRequestHoldService | None = None
        self._server: asyncio.Server | None = None
        self._tasks: list[asyncio.Task] = []
        self._handlers: dict[int, Callable[[BrokerConnection, Frame], None]] = {}
        self._topics_persist: asyncio.Task | None = None
        self._topics_waiters: list[Callable[[], None]] = []
        self._offsets_persist: asyncio.Future | None = None
        self._stopped = False
        self._loaded = False
        self.started_at = 0.0

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        self.loop = loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: BrokerConnection(self, DEFAULT_MAX_FRAME_SIZE),
            cfg.listen_host,
            cfg.listen_port,
            reuse_address=True,
            start_serving=False,
            backlog=1024,
        )
        sock = self._server.sockets[0]
        self.port = sock.getsockname()[1]
        self.addr = cfg.broker_addr(self.port)
        # Opening the store takes its lock (a second broker on the same directory stops here,
        # before touching the config files) and recovers it; nothing else runs yet.
        self.store = MessageStore(cfg.store_config(self.port))
        os.makedirs(cfg.config_path, exist_ok=True)
        self.topics.load()
        self.offsets.load()
        self._loaded = True
        self.hold = PullRequestHoldService(
            loop,
            self._execute_held,
            self.store.max_offset,
            long_polling=cfg.long_polling_enable,
            check_interval_s=(
                cfg.long_polling_check_ms if cfg.long_polling_enable else cfg.short_polling_time_ms
            )
            / 1000,
        )
        self.store.add_dispatch_listener(self.hold.on_message_arrival)
        self.send_processor = SendProcessor(self)
        self.pull_processor = PullProcessor(self)
        self.admin_processor = AdminProcessor(self)
        self._handlers = {
            RequestCode.SEND_MESSAGE: self.send_processor.handle,
            RequestCode.SEND_BATCH: self.send_processor.handle,
            RequestCode.PULL_MESSAGE: self.pull_processor.handle,
            **self.admin_processor.handlers(),
        }
        self.started_at = time.time()
        await self._server.start_serving()
        self._tasks = [
            loop.create_task(self.hold.run_checks(), name="long-polling-check"),
            loop.create_task(self._persist_offsets_forever(), name="offsets-persist"),
            loop.create_task(self._sample_stats_forever(), name="stats-sample"),
        ]
        if cfg.namesrv_addrs:
            self.registration = NamesrvRegistration(
                cfg.namesrv_addrs,
                self._register_header,
                interval_s=cfg.register_interval_ms / 1000,
                timeout_s=cfg.register_timeout_ms / 1000,
            )
            # The first registration is awaited so routes exist when start() returns.
            await self.registration.register_all()
            self._tasks.append(loop.create_task(self.registration.run(), name="registration"))
        log.info(
            "broker %s (cluster %s) serving on %s, data in %s, flush %s",
            cfg.broker_name, cfg.cluster_name, self.addr, cfg.data_path, cfg.flush_mode,
        )

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._server is not None:
            self._server.close()
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
        if self.hold is not None:
            self.hold.close()
        for conn in list(self.connections):
            conn.close()
        if self._topics_persist is not None:
            await asyncio.gather(self._topics_persist, return_exceptions=True)
        if self._offsets_persist is not None:
            await asyncio.gather(self._offsets_persist, return_exceptions=True)
        if self._loaded:  # never overwrite the files with tables that were not loaded
            try:
                self.offsets.persist()
                self.topics.persist()
            except OSError as exc:
                log.error("persisting offsets/topics at shutdown failed: %s", exc)
        if self.store is not None:
            self.store.close()
            log.info("broker %s stopped", self.config.broker_name)

    # -- connections and dispatch ----------------------------------------------------------------
    def connection_made(self, conn: BrokerConnection) -> None:
        self.connections.add(conn)
        sock = conn.transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def connection_lost(self, conn: BrokerConnection) -> None:
        self.connections.discard(conn)
        if conn.held and self.hold is not None:
            self.hold.drop_connection(conn)

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

    def _execute_held(self, held) -> None:
        self.pull_processor.execute_held(held)

    # -- topics ----------------------------------------------------------------------------------
    def auto_create_topic(self, topic: str) -> TopicConfig:
        tc = self.topics.auto_create(topic)
        self.topics_changed()
        return tc

    def delete_topic(self, topic: str) -> None:
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
            if not self._topics_waiters and data == self.topics.snapshot():
                return

    def _register_header(self) -> RegisterBrokerRequestHeader:
        cfg = self.config
        return RegisterBrokerRequestHeader(
            cluster_name=cfg.cluster_name,
            broker_name=cfg.broker_name,
            broker_id=cfg.broker_id,
            broker_addr=self.addr,
            heartbeat_timeout_millis=cfg.heartbeat_timeout_ms,
            data_version=self.topics.data_version,
            topics=self.topics.all(),
        )

    def _unregister_header(self) -> UnregisterBrokerRequestHeader:
        cfg = self.config
        return UnregisterBrokerRequestHeader(
            cluster_name=cfg.cluster_name,
            broker_name=cfg.broker_name,
            broker_id=cfg.broker_id,
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

    async def _sample_stats_forever(self) -> None:
        interval = self.config.stats_sample_interval_ms / 1000
        while True:
            await asyncio.sleep(interval)
            self.stats.sample()

    # -- runtime info ----------------------------------------------------------------------------
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
            "connections": len(self.connections),
            "held_pulls": self.hold.held_count(),
            "held_woken_by_arrival": self.hold.woken_by_arrival,
            "held_woken_by_check": self.hold.woken_by_check,
            "held_timed_out": self.hold.timed_out,
            "commitlog_min_offset": cl.min_offset,
            "commitlog_max_offset": cl.write_pos,
            "commitlog_flushed_offset": cl.flushed_pos,
            "disk_full": store.disk_full,
            "rss_bytes": rss_bytes(),
            "registrations": self.registration.registrations if self.registration else 0,
        }
        info.update(self.stats.summary())
        return info


def _write(path: str, data: bytes) -> None:
    from tidemq.broker.durable_file import write_atomic

    write_atomic(path, data)


def _code_name(code: int) -> str:
    try:
        return RequestCode(code).name
    except ValueError:
        return f"request code {code}"
