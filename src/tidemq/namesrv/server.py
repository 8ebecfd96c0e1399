"""The name server process: route queries and broker registrations over frames (ref NS1).

+-------------------------------------+-----------------------------+----------------------+
| request                             | request header              | success header       |
+-------------------------------------+-----------------------------+----------------------+
| REGISTER_BROKER                     | RegisterBrokerRequestHeader | RegisterBrokerResp.  |
| UNREGISTER_BROKER                   | UnregisterBrokerRequestH.   | EmptyHeader          |
| GET_ROUTEINFO_BY_TOPIC              | GetRouteInfoRequestHeader   | TopicRouteData       |
|                                     |                             | (TOPIC_NOT_EXIST)    |
| GET_ALL_TOPIC_LIST_FROM_NAMESERVER  | EmptyHeader                 | TopicList            |
| GET_BROKER_CLUSTER_INFO             | EmptyHeader                 | ClusterInfo          |
+-------------------------------------+-----------------------------+----------------------+

Connections are the broker's (``tidemq.base``: framing, back-pressure and the memory limits,
settings of the same names as the broker's): broken framing closes the connection (reason
logged), a bad header or an unknown code gets an error response on a connection that stays
open, and an unexpected failure is answered SYSTEM_ERROR with the traceback in the log. A
client that sends queries and never reads the answers is no longer read from once
``write_buffer_high_water`` bytes of answers wait for it.

Every ``scan_interval_ms`` (10 s) brokers that have not registered within their heartbeat
timeout (120 s, sent by the broker; ``broker_expire_ms`` overrides it) are dropped.

Threads: one event loop (the name server may share it with a broker in ``tidemq dev``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tidemq.base.connection import ServerConnection, decode_request
from tidemq.base.errors import RequestRejected
from tidemq.base.limits import ConnectionLimits, MiB
from tidemq.base.server import FrameServer
from tidemq.namesrv.route_info import RegistrationRefused, RouteInfoManager
from tidemq.protocol.codes import RequestCode, ResponseCode
from tidemq.protocol.frame import DEFAULT_MAX_FRAME_SIZE, FLAG_ONEWAY, FLAG_RESPONSE, Frame
from tidemq.protocol.headers import (
    EmptyHeader,
    ErrorResponseHeader,
    GetRouteInfoRequestHeader,
    RegisterBrokerRequestHeader,
    RegisterBrokerResponseHeader,
    RoutesChangedRequestHeader,
    RoutesChangedResponseHeader,
    TopicList,
    UnregisterBrokerRequestHeader,
)

__all__ = ["NamesrvConfig", "NameServer"]

log = logging.getLogger(__name__)


@dataclass
class NamesrvConfig:
    """Name server settings with RocketMQ's defaults."""

    listen_host: str = "127.0.0.1"
    listen_port: int = 9876
    #: How often expired brokers are looked for (RocketMQ scanNotActiveBroker: 10 s).
    scan_interval_ms: int = 10_000
    #: Expire brokers after this long without a registration; 0 = the broker's own
    #: heartbeat_timeout_millis (120 s by default).
    broker_expire_ms: int = 0
    # -- connections and memory: the broker's settings of the same names (tidemq.base.limits)
    max_connections: int = 10_000
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    socket_send_buffer: int = 256 * 1024
    write_buffer_high_water: int = 64 * 1024
    write_buffer_low_water: int = 16 * 1024
    max_queued_response_bytes: int = 64 * MiB
    max_partial_frame_bytes: int = 128 * MiB
    partial_frame_timeout_ms: int = 30_000
    busy_retry_ms: int = 1000

    def connection_limits(self) -> ConnectionLimits:
        names = {f.name for f in dataclasses.fields(ConnectionLimits)}
        return ConnectionLimits(**{n: getattr(self, n) for n in names})

    def validate(self) -> None:
        """Raise ValueError, naming the field, for settings that cannot work."""
        if self.scan_interval_ms <= 0:
            raise ValueError(f"name server setting scan_interval_ms must be > 0, got "
                             f"{self.scan_interval_ms}")
        if self.broker_expire_ms < 0:
            raise ValueError(f"name server setting broker_expire_ms must be >= 0, got "
                             f"{self.broker_expire_ms}")
        if not 0 <= self.listen_port <= 65535:
            raise ValueError(f"listen_port must be 0..65535, got {self.listen_port}")
        self.connection_limits().validate("name server")


class NameServer:
    """The name server: ``await start()`` / ``await stop()`` and everything else on one loop."""

    def __init__(self, config: NamesrvConfig | None = None) -> None:
        self.config = config or NamesrvConfig()
        self.config.validate()
        expire = self.config.broker_expire_ms / 1000 if self.config.broker_expire_ms else None
        self.routes = RouteInfoManager(expire_override_s=expire)
        self.connections: set[ServerConnection] = set()
        self.port = 0
        self.frames = FrameServer(self, self.config.connection_limits(), what="name server")
        self._scan: asyncio.Task[None] | None = None
        self._handlers: dict[int, Callable[[ServerConnection, Frame], Any]] = {
            RequestCode.REGISTER_BROKER: self._register_broker,
            RequestCode.UNREGISTER_BROKER: self._unregister_broker,
            RequestCode.GET_ROUTEINFO_BY_TOPIC: self._get_route,
            RequestCode.GET_ALL_TOPIC_LIST_FROM_NAMESERVER: self._topic_list,
            RequestCode.GET_BROKER_CLUSTER_INFO: self._cluster_info,
            RequestCode.GET_ROUTES_CHANGED: self._routes_changed,
        }

    @property
    def addr(self) -> str:
        host = self.config.listen_host
        if host in ("", "0.0.0.0", "::"):
            host = "127.0.0.1"
        return f"{host}:{self.port}"

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.port = await self.frames.start(self.config.listen_host, self.config.listen_port)
        self._scan = loop.create_task(self._scan_forever(), name="namesrv-scan")
        log.info("name server serving on %s", self.addr)

    async def stop(self) -> None:
        self.frames.close_listener()
        if self._scan is not None:
            self._scan.cancel()
            await asyncio.gather(self._scan, return_exceptions=True)
        self.frames.close()

    async def _scan_forever(self) -> None:
        interval = self.config.scan_interval_ms / 1000
        while True:
            await asyncio.sleep(interval)
            try:
                self.routes.scan_not_active_brokers()
            except Exception:
                log.exception("scan of inactive brokers failed")

    # -- connections and dispatch (called by the FrameServer) -----------------------------------
    def connection_made(self, conn: ServerConnection) -> None:
        self.connections.add(conn)

    def connection_lost(self, conn: ServerConnection) -> None:
        self.connections.discard(conn)
        self.routes.on_connection_closed(conn)

    def handle(self, conn: ServerConnection, frame: Frame) -> None:
        if frame.flags & FLAG_RESPONSE:
            return
        oneway = frame.flags & FLAG_ONEWAY
        try:
            handler = self._handlers.get(frame.code)
            if handler is None:
                raise RequestRejected(
                    ResponseCode.REQUEST_CODE_NOT_SUPPORTED,
                    f"request code {frame.code} is not served by the name server (it serves "
                    "REGISTER_BROKER, UNREGISTER_BROKER, GET_ROUTEINFO_BY_TOPIC, "
                    "GET_ALL_TOPIC_LIST_FROM_NAMESERVER, GET_BROKER_CLUSTER_INFO, "
                    "GET_ROUTES_CHANGED)",
                )
            header = handler(conn, frame)
            if not oneway:
                conn.respond(frame.opaque, ResponseCode.SUCCESS, header)
        except RequestRejected as exc:
            if not oneway:
                conn.respond_error(frame.opaque, exc.response_code, exc.message)
        except Exception as exc:
            log.error(
                "request %d from %s failed:\n%s", frame.code, conn.peer,
                "".join(traceback.format_exception(exc)).rstrip(),
            )
            if not oneway:
                conn.respond(
                    frame.opaque,
                    ResponseCode.SYSTEM_ERROR,
                    ErrorResponseHeader(
                        f"the name server failed: {type(exc).__name__}: {exc}; see its log"
                    ),
                )

    def _register_broker(self, conn: ServerConnection, frame: Frame) -> Any:
        h: RegisterBrokerRequestHeader = decode_request(frame, RegisterBrokerRequestHeader)
        if not h.broker_name or not h.cluster_name or not h.broker_addr:
            raise RequestRejected(
                ResponseCode.INVALID_ARGUMENT,
                "a registration needs cluster_name, broker_name and broker_addr",
            )
        if h.topics_omitted and not self.routes.has_topics_of(h):
            # a heartbeat for a topic set we do not hold (we restarted): ask for it
            return RegisterBrokerResponseHeader(need_topics=True)
        try:
            master, ha = self.routes.register_broker(h, conn)
        except RegistrationRefused as exc:
            log.warning("registration of %s refused: %s", h.broker_addr, exc)
            raise RequestRejected(ResponseCode.NO_PERMISSION, str(exc)) from None
        return RegisterBrokerResponseHeader(ha_server_addr=ha, master_addr=master)

    def _unregister_broker(self, conn: ServerConnection, frame: Frame) -> Any:
        h: UnregisterBrokerRequestHeader = decode_request(frame, UnregisterBrokerRequestHeader)
        self.routes.unregister_broker(h.cluster_name, h.broker_name, h.broker_id, h.broker_addr)
        return EmptyHeader()

    def _get_route(self, conn: ServerConnection, frame: Frame) -> Any:
        h: GetRouteInfoRequestHeader = decode_request(frame, GetRouteInfoRequestHeader)
        route = self.routes.get_route(h.topic)
        if route is None:
            raise RequestRejected(
                ResponseCode.TOPIC_NOT_EXIST,
                f"no route for topic {h.topic!r}: no live broker has it; create it on a broker "
                "(or send to it with auto-create on)",
            )
        return route

    def _topic_list(self, conn: ServerConnection, frame: Frame) -> Any:
        return TopicList(topics=self.routes.topic_list())

    def _cluster_info(self, conn: ServerConnection, frame: Frame) -> Any:
        return self.routes.cluster_info()

    def _routes_changed(self, conn: ServerConnection, frame: Frame) -> Any:
        h: RoutesChangedRequestHeader = decode_request(frame, RoutesChangedRequestHeader)
        c = self.routes.changes_since(h.instance, h.since)
        return RoutesChangedResponseHeader(instance=c.instance, version=c.version, full=c.full,
                                           topics=c.topics, brokers=c.brokers)
