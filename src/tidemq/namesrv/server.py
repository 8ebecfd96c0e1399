"""The name server process: route queries and broker registrations over frames (SPEC NS1).

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

Connections follow the broker's rules: broken framing closes the connection (reason logged), a
bad header or an unknown code gets an error response on a connection that stays open, and an
unexpected failure is answered SYSTEM_ERROR with the traceback in the log.

Every ``scan_interval_ms`` (10 s) brokers that have not registered within their heartbeat
timeout (120 s, sent by the broker; ``broker_expire_ms`` overrides it) are dropped.

Threads: one event loop (the name server may share it with a broker in ``tidemq dev``).
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from dataclasses import dataclass
from typing import Any

import msgspec

from tidemq.namesrv.route_info import RegistrationRefused, RouteInfoManager
from tidemq.protocol.codes import RequestCode, ResponseCode
from tidemq.protocol.errors import RemoteProtocolError
from tidemq.protocol.frame import (
    FLAG_ONEWAY,
    FLAG_RESPONSE,
    FRAME_MAGIC,
    FRAME_PREFIX,
    FRAME_VERSION,
    MIN_TOTAL_LEN,
    Frame,
    FrameDecoder,
)
from tidemq.protocol.headers import (
    EmptyHeader,
    ErrorResponseHeader,
    GetRouteInfoRequestHeader,
    RegisterBrokerRequestHeader,
    RegisterBrokerResponseHeader,
    TopicList,
    UnregisterBrokerRequestHeader,
)

__all__ = ["NamesrvConfig", "NameServer"]

log = logging.getLogger(__name__)

_encode = msgspec.msgpack.Encoder().encode


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


class _Rejected(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.response_code = code
        self.message = message


def _raw(flags: int, code: int, opaque: int) -> type:
    return msgspec.Raw


_decoders: dict[type, msgspec.msgpack.Decoder] = {}


def _decode(frame: Frame, header_type: type) -> Any:
    dec = _decoders.get(header_type)
    if dec is None:
        dec = _decoders[header_type] = msgspec.msgpack.Decoder(header_type)
    try:
        return dec.decode(frame.header)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _Rejected(
            ResponseCode.INVALID_ARGUMENT, f"{header_type.__name__} is invalid: {exc}"
        ) from None


class _NamesrvConnection(asyncio.Protocol):
    """One connection to the name server (its event loop only)."""

    def __init__(self, server: NameServer) -> None:
        self.server = server
        self.decoder = FrameDecoder(header_types=_raw)
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.closed = False

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        if peer:
            self.peer = f"{peer[0]}:{peer[1]}"
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        try:
            frames = self.decoder.feed(data)
        except RemoteProtocolError as exc:
            log.warning("closing connection from %s: %s", self.peer, exc.message)
            self.transport.close()
            return
        for frame in frames:
            self.server.handle(self, frame)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        self.server.routes.on_connection_closed(self)

    def respond(self, opaque: int, code: int, header: Any) -> None:
        if self.closed:
            return
        hb = _encode(header)
        self.transport.write(
            FRAME_PREFIX.pack(
                MIN_TOTAL_LEN + len(hb), FRAME_MAGIC, FRAME_VERSION, FLAG_RESPONSE, 0, code,
                opaque, len(hb),
            )
            + hb
        )


class NameServer:
    """The name server: ``await start()`` / ``await stop()`` and everything else on one loop."""

    def __init__(self, config: NamesrvConfig | None = None) -> None:
        self.config = config or NamesrvConfig()
        expire = self.config.broker_expire_ms / 1000 if self.config.broker_expire_ms else None
        self.routes = RouteInfoManager(expire_override_s=expire)
        self.connections: set[_NamesrvConnection] = set()
        self.port = 0
        self._server: asyncio.Server | None = None
        self._scan: asyncio.Task | None = None
        self._handlers = {
            RequestCode.REGISTER_BROKER: self._register_broker,
            RequestCode.UNREGISTER_BROKER: self._unregister_broker,
            RequestCode.GET_ROUTEINFO_BY_TOPIC: self._get_route,
            RequestCode.GET_ALL_TOPIC_LIST_FROM_NAMESERVER: self._topic_list,
            RequestCode.GET_BROKER_CLUSTER_INFO: self._cluster_info,
        }

    @property
    def addr(self) -> str:
        host = self.config.listen_host
        if host in ("", "0.0.0.0", "::"):
            host = "127.0.0.1"
        return f"{host}:{self.port}"

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _NamesrvConnection(self),
            self.config.listen_host,
            self.config.listen_port,
            reuse_address=True,
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._scan = loop.create_task(self._scan_forever(), name="namesrv-scan")
        log.info("name server serving on %s", self.addr)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._scan is not None:
            self._scan.cancel()
            await asyncio.gather(self._scan, return_exceptions=True)
        for conn in list(self.connections):
            conn.transport.close()

    async def _scan_forever(self) -> None:
        interval = self.config.scan_interval_ms / 1000
        while True:
            await asyncio.sleep(interval)
            try:
                self.routes.scan_not_active_brokers()
            except Exception:
                log.exception("scan of inactive brokers failed")

    # -- dispatch --------------------------------------------------------------------------------
    def handle(self, conn: _NamesrvConnection, frame: Frame) -> None:
        if frame.flags & FLAG_RESPONSE:
            return
        oneway = frame.flags & FLAG_ONEWAY
        try:
            handler = self._handlers.get(frame.code)
            if handler is None:
                raise _Rejected(
                    ResponseCode.REQUEST_CODE_NOT_SUPPORTED,
                    f"request code {frame.code} is not served by the name server (it serves "
                    "REGISTER_BROKER, UNREGISTER_BROKER, GET_ROUTEINFO_BY_TOPIC, "
                    "GET_ALL_TOPIC_LIST_FROM_NAMESERVER, GET_BROKER_CLUSTER_INFO)",
                )
            header = handler(conn, frame)
            if not oneway:
                conn.respond(frame.opaque, ResponseCode.SUCCESS, header)
        except _Rejected as exc:
            if not oneway:
                conn.respond(frame.opaque, exc.response_code, ErrorResponseHeader(exc.message))
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

    def _register_broker(self, conn: _NamesrvConnection, frame: Frame) -> Any:
        h: RegisterBrokerRequestHeader = _decode(frame, RegisterBrokerRequestHeader)
        if not h.broker_name or not h.cluster_name or not h.broker_addr:
            raise _Rejected(
                ResponseCode.INVALID_ARGUMENT,
                "a registration needs cluster_name, broker_name and broker_addr",
            )
        try:
            master, ha = self.routes.register_broker(h, conn)
        except RegistrationRefused as exc:
            log.warning("registration of %s refused: %s", h.broker_addr, exc)
            raise _Rejected(ResponseCode.NO_PERMISSION, str(exc)) from None
        return RegisterBrokerResponseHeader(ha_server_addr=ha, master_addr=master)

    def _unregister_broker(self, conn: _NamesrvConnection, frame: Frame) -> Any:
        h: UnregisterBrokerRequestHeader = _decode(frame, UnregisterBrokerRequestHeader)
        self.routes.unregister_broker(h.cluster_name, h.broker_name, h.broker_id, h.broker_addr)
        return EmptyHeader()

    def _get_route(self, conn: _NamesrvConnection, frame: Frame) -> Any:
        h: GetRouteInfoRequestHeader = _decode(frame, GetRouteInfoRequestHeader)
        route = self.routes.get_route(h.topic)
        if route is None:
            raise _Rejected(
                ResponseCode.TOPIC_NOT_EXIST,
                f"no route for topic {h.topic!r}: no live broker has it; create it on a broker "
                "(or send to it with auto-create on)",
            )
        return route

    def _topic_list(self, conn: _NamesrvConnection, frame: Frame) -> Any:
        return TopicList(topics=self.routes.topic_list())

    def _cluster_info(self, conn: _NamesrvConnection, frame: Frame) -> Any:
        return self.routes.cluster_info()
