"""Client connections: one asyncio.Protocol per TCP connection, and a pool keyed by address.

A :class:`Connection` writes request frames and matches responses to their requests by opaque
(a map opaque -> future, RocketMQ's responseTable). Each request has a deadline (3 s by default;
a long-polling pull passes its own); a request whose deadline passes fails with
RequestTimeoutError and a late response is dropped. Broken framing from the peer closes the
connection and fails every request in flight with ConnectionLostError.

Writes never block: frames go to the transport at once (``writelines`` of the prefix and the
body, the body never copied when large). When the transport's buffer passes its high-water mark,
:meth:`Connection.request` waits for it to drain first, so a fast producer cannot grow the
buffer without bound.

Threading: everything here runs on one event loop; call it from coroutines on that loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Iterable
from typing import Any

from tidemq.client.errors import (
    ClientClosedError,
    ConnectError,
    ConnectionLostError,
    RequestTimeoutError,
)
from tidemq.protocol.codes import RequestCode
from tidemq.protocol.errors import BrokerError, RemoteProtocolError
from tidemq.protocol.frame import (
    DEFAULT_MAX_FRAME_SIZE,
    FLAG_ONEWAY,
    FLAG_RESPONSE,
    Frame,
    FrameDecoder,
    encode_frame_parts,
)
from tidemq.protocol.headers import (
    ErrorResponseHeader,
    request_header_type,
    response_header_type,
)

__all__ = ["Connection", "ConnectionPool", "parse_address", "raise_for_error", "DEFAULT_TIMEOUT"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 3.0
_OPAQUE_MASK = 0xFFFF_FFFF
_SUCCESS_ONLY = (0,)


def parse_address(addr: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port); a clear ValueError otherwise."""
    host, sep, port = addr.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address {addr!r} is not host:port (e.g. 127.0.0.1:9876)")
    return host.strip("[]"), int(port)


def raise_for_error(frame: Frame, ok_codes: Iterable[int] = _SUCCESS_ONLY) -> Frame:
    """Return ``frame`` if its code is one of ``ok_codes``, else raise its BrokerError."""
    if frame.code in ok_codes:
        return frame
    header = frame.header
    if isinstance(header, ErrorResponseHeader):
        message = header.message
    elif isinstance(header, dict):
        message = str(header.get("message", ""))
    else:
        message = ""
    raise BrokerError.from_response(frame.code, message or None)


class _Pending:
    __slots__ = ("future", "code", "timer")

    def __init__(self, future: asyncio.Future[Frame], code: int, timer: asyncio.TimerHandle):
        self.future = future
        self.code = code
        self.timer = timer


class Connection(asyncio.Protocol):
    """One connection to a broker or name server. Event loop only."""

    def __init__(
        self,
        address: str,
        *,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        on_request: Callable[[Connection, Frame], None] | None = None,
    ) -> None:
        self.address = address
        #: Called (on the loop) with every request the peer sends us, e.g. the broker's
        #: NOTIFY_CONSUMER_IDS_CHANGED; None ignores them.
        self.on_request = on_request
        self.max_frame_size = max_frame_size
        self.local_host = ""
        self.local_port = 0
        self._loop = asyncio.get_running_loop()
        self._decoder = FrameDecoder(max_frame_size=max_frame_size, header_types=self._header_type)
        self._pending: dict[int, _Pending] = {}
        self._next_opaque = 1
        self._transport: asyncio.Transport | None = None
        self._closed_exc: Exception | None = None
        self._drained: asyncio.Future[None] | None = None  # set while writing is paused
        self._wbuf: list[Any] = []  # frames queued in this loop iteration (see _write)
        self._flush_scheduled = False
        self.closed: asyncio.Future[None] = self._loop.create_future()

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        name = transport.get_extra_info("sockname")
        if name:
            self.local_host, self.local_port = name[0], name[1]

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._decoder.feed(data)
        except RemoteProtocolError as exc:
            log.warning("closing connection to %s: %s", self.address, exc.message)
            self._fail(ConnectionLostError(f"{self.address} sent bytes that break the frame "
                                           f"format ({exc.message}); connection closed"))
            return
        pending = self._pending
        for frame in frames:
            if frame.flags & FLAG_RESPONSE:
                p = pending.pop(frame.opaque, None)
                if p is None:
                    continue  # its request timed out or was cancelled
                p.timer.cancel()
                if not p.future.done():
                    p.future.set_result(frame)
            elif self.on_request is not None:
                try:
                    self.on_request(self, frame)
                except Exception:  # a handler bug must not break the connection
                    log.exception("handling request code %d from %s failed", frame.code,
                                  self.address)
            else:
                log.debug("ignoring request code %d from %s", frame.code, self.address)

    def connection_lost(self, exc: Exception | None) -> None:
        reason = f": {exc}" if exc else ""
        self._fail(ConnectionLostError(f"connection to {self.address} closed{reason}"))

    def pause_writing(self) -> None:
        if self._drained is None:
            self._drained = self._loop.create_future()

    def resume_writing(self) -> None:
        d, self._drained = self._drained, None
        if d is not None and not d.done():
            d.set_result(None)

    # -- requests ----------------------------------------------------------------------------
    @property
    def is_closed(self) -> bool:
        return self._closed_exc is not None

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def _header_type(self, flags: int, code: int, opaque: int) -> type | None:
        if flags & FLAG_RESPONSE:
            p = self._pending.get(opaque)
            return response_header_type(p.code, code) if p is not None else None
        return request_header_type(code)

    def _opaque(self) -> int:
        o = self._next_opaque
        self._next_opaque = (o + 1) & _OPAQUE_MASK or 1
        return o

    def _write(self, frame: Frame) -> None:
        """Queue the frame; every frame queued in this loop iteration goes out in one write.

        A write system call costs tens of microseconds here (loopback delivery runs in the
        caller's context), far more than framing; coalescing the frames of one iteration
        (many sends in flight, or one pull per queue) into one ``writelines`` is what lets a
        client do more than ~10 k requests per second. The delay is one loop iteration."""
        if self._closed_exc is not None:
            raise self._closed_exc
        parts = encode_frame_parts(frame, max_frame_size=self.max_frame_size)
        self._wbuf += parts
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        buf, self._wbuf = self._wbuf, []
        if self._closed_exc is not None or self._transport is None or not buf:
            return
        if len(buf) == 1:
            self._transport.write(buf[0])
        else:
            self._transport.writelines(buf)

    async def request(
        self,
        code: int,
        header: Any = None,
        body: Any = b"",
        *,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> Frame:
        """Send a request and wait for its response frame (any code; see raise_for_error)."""
        if self._drained is not None:
            await asyncio.shield(self._drained)
        if self._closed_exc is not None:
            raise self._closed_exc
        opaque = self._opaque()
        fut: asyncio.Future[Frame] = self._loop.create_future()
        timer = self._loop.call_later(timeout, self._timeout, opaque, code, timeout)
        self._pending[opaque] = _Pending(fut, code, timer)
        try:
            self._write(Frame(code, opaque, 0, header, body))
        except BaseException:
            timer.cancel()
            self._pending.pop(opaque, None)
            raise
        try:
            return await fut
        except asyncio.CancelledError:
            p = self._pending.pop(opaque, None)
            if p is not None:
                p.timer.cancel()
            raise

    def send_oneway(self, code: int, header: Any = None, body: Any = b"") -> None:
        """Write a one-way request (no response comes)."""
        self._write(Frame(code, self._opaque(), FLAG_ONEWAY, header, body))

    async def drain(self) -> None:
        """Wait until the transport's write buffer is below its high-water mark."""
        if self._drained is not None:
            await asyncio.shield(self._drained)

    def _timeout(self, opaque: int, code: int, timeout: float) -> None:
        p = self._pending.pop(opaque, None)
        if p is not None and not p.future.done():
            try:
                name = RequestCode(code).name
            except ValueError:
                name = str(code)
            p.future.set_exception(
                RequestTimeoutError(
                    f"{name} to {self.address} got no response within {timeout:g} s; the broker "
                    "may be overloaded or unreachable"
                )
            )

    def _fail(self, exc: Exception) -> None:
        if self._closed_exc is None:
            self._closed_exc = exc
        self._wbuf = []
        pending, self._pending = self._pending, {}
        for p in pending.values():
            p.timer.cancel()
            if not p.future.done():
                p.future.set_exception(exc)
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        if self._transport is not None:
            self._transport.close()
        if not self.closed.done():
            self.closed.set_result(None)

    def close(self) -> None:
        """Write what is queued (one-way sends), then close; requests in flight fail."""
        if self._wbuf and self._closed_exc is None:
            self._flush()
        self._fail(ConnectionLostError(f"connection to {self.address} was closed by the client"))


class ConnectionPool:
    """Connections by address (one each, reconnected when broken). Event loop only."""

    def __init__(
        self,
        *,
        connect_timeout: float = DEFAULT_TIMEOUT,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        on_request: Callable[[Connection, Frame], None] | None = None,
    ) -> None:
        self.connect_timeout = connect_timeout
        #: Handler of peer -> client requests, given to every connection (see Connection).
        self.on_request = on_request
        self.max_frame_size = max_frame_size
        self._conns: dict[str, Connection] = {}
        self._connecting: dict[str, asyncio.Future[Connection]] = {}
        self._closed = False

    def get_nowait(self, address: str) -> Connection | None:
        """The open connection to ``address``, or None (no await: the hot path's fast check)."""
        c = self._conns.get(address)
        return c if c is not None and not c.is_closed else None

    async def get(self, address: str) -> Connection:
        c = self._conns.get(address)
        if c is not None and not c.is_closed:
            return c
        if self._closed:
            raise ClientClosedError("the client was closed; create a new one")
        fut = self._connecting.get(address)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._connecting[address] = fut
            try:
                conn = await self._connect(address)
            except BaseException as exc:
                del self._connecting[address]
                if not fut.done():
                    fut.set_exception(exc)
                    fut.exception()  # retrieved: no "never retrieved" warning
                raise
            del self._connecting[address]
            self._conns[address] = conn
            fut.set_result(conn)
            return conn
        return await asyncio.shield(fut)

    async def _connect(self, address: str) -> Connection:
        host, port = parse_address(address)
        loop = asyncio.get_running_loop()
        try:
            _t, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: Connection(address, max_frame_size=self.max_frame_size,
                                       on_request=self.on_request),
                    host, port,
                ),
                self.connect_timeout,
            )
        except (TimeoutError, OSError) as exc:
            raise ConnectError(
                f"cannot connect to {address} ({exc or type(exc).__name__}); check that the "
                "broker / name server is running and the address is right"
            ) from exc
        return conn

    async def request(
        self, address: str, code: int, header: Any = None, body: Any = b"", *,
        timeout: float = DEFAULT_TIMEOUT, ok_codes: Iterable[int] = _SUCCESS_ONLY,
    ) -> Frame:
        """Connect if needed, send, wait, and raise BrokerError unless the code is in ok_codes."""
        conn = await self.get(address)
        return raise_for_error(await conn.request(code, header, body, timeout=timeout), ok_codes)

    def close(self) -> None:
        self._closed = True
        for c in self._conns.values():
            c.close()
        self._conns.clear()
