"""The broker's side of the name servers (RocketMQ's BrokerOuterAPI; ref NS1).

Every ``register_interval_ms`` (30 s), and at once whenever the topic set changes, the broker
sends REGISTER_BROKER to every name server, in parallel: with *all* its topic configs when the
topic set's data version changed since that name server last accepted one (or after a
reconnect), else without them (``topics_omitted``: a heartbeat whose size does not grow with
the number of topics; a name server that does not hold that version answers ``need_topics``
and gets the full registration at once). Each name
server keeps the broker for ``heartbeat_timeout_ms`` (120 s) after its last registration, and
drops it at once when this connection closes (RocketMQ's BrokerHousekeepingService), so a
broker killed with kill -9 leaves the routes within a scan interval. On a clean shutdown the
broker sends UNREGISTER_BROKER.

One long-lived connection per name server, one request at a time on it. This is a cold path
(a few requests a minute), so it uses asyncio streams rather than a hand-written Protocol.

Threads: the broker's event loop only.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable

from tidemq.protocol.codes import RequestCode, ResponseCode, describe
from tidemq.protocol.frame import Frame, FrameDecoder, encode_frame
from tidemq.protocol.headers import (
    ErrorResponseHeader,
    RegisterBrokerRequestHeader,
    RegisterBrokerResponseHeader,
    UnregisterBrokerRequestHeader,
    response_header_type,
)

__all__ = ["NamesrvLink", "NamesrvRegistration", "parse_addr"]

log = logging.getLogger(__name__)


def parse_addr(addr: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port); ValueError with the offending text otherwise."""
    host, sep, port = addr.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address {addr!r} must look like host:port")
    return host.strip("[]"), int(port)


class NamesrvLink:
    """A request/response connection to one name server (reconnects on the next request).
    Event loop only; one request at a time (a lock serialises callers)."""

    def __init__(self, addr: str, timeout_s: float) -> None:
        self.addr = addr
        self.host, self.port = parse_addr(addr)
        self.timeout_s = timeout_s
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._decoder: FrameDecoder | None = None
        self._lock = asyncio.Lock()
        self._opaque = itertools.count(1)
        self._pending_code = 0
        self.failures = 0
        #: the data version whose topics this name server accepted (None: send them)
        self.accepted_version: int | None = None

    def _resolve(self, flags: int, code: int, opaque: int) -> type | None:
        return response_header_type(self._pending_code, code)

    async def _connect(self) -> None:
        self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        self._decoder = FrameDecoder(header_types=self._resolve)

    async def request(self, code: int, header: object) -> Frame:
        """Send one request and wait for its response (TimeoutError / OSError on failure)."""
        async with self._lock:
            try:
                return await asyncio.wait_for(self._request(code, header), self.timeout_s)
            except BaseException:
                self.close()
                raise

    async def _request(self, code: int, header: object) -> Frame:
        if self._writer is None or self._writer.is_closing():
            await self._connect()
        assert self._writer is not None and self._reader is not None and self._decoder
        opaque = next(self._opaque) & 0xFFFF_FFFF
        self._pending_code = code
        self._writer.write(encode_frame(Frame.request(code, opaque, header)))
        await self._writer.drain()
        while True:
            data = await self._reader.read(1 << 16)
            if not data:
                raise ConnectionError(f"name server {self.addr} closed the connection")
            for frame in self._decoder.feed(data):
                if frame.opaque == opaque:
                    return frame

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._writer = self._reader = None
        self._decoder = None
        self.accepted_version = None


class NamesrvRegistration:
    """Keeps this broker registered with every configured name server (event loop only)."""

    def __init__(
        self,
        addrs: list[str],
        make_header: Callable[[bool], RegisterBrokerRequestHeader],
        *,
        interval_s: float,
        timeout_s: float,
        on_response: Callable[[str, Frame], None] | None = None,
    ) -> None:
        self.links = [NamesrvLink(a, timeout_s) for a in addrs]
        #: sees every answer (a slave learns its master from it; a refused master fences)
        self.on_response = on_response
        self.make_header = make_header
        self.interval_s = interval_s
        self._changed = asyncio.Event()
        self.registrations = 0

    def changed(self) -> None:
        """The topic set changed: register again now (coalesced with other changes)."""
        self._changed.set()

    async def register_all(self) -> int:
        """One round of REGISTER_BROKER to every name server; returns how many accepted."""
        if not self.links:
            return 0
        # The heartbeat form first: the topic table is copied only when a name server needs
        # it (a changed data version, a reconnect, need_topics), not every interval.
        light = self.make_header(False)
        full: list[RegisterBrokerRequestHeader] = []

        def whole() -> RegisterBrokerRequestHeader:
            if not full:
                full.append(self.make_header(True) if light.topics_omitted else light)
            return full[0]

        results = await asyncio.gather(
            *(self._register(link, light, whole) for link in self.links),
            return_exceptions=True,
        )
        return sum(1 for r in results if r is True)

    async def _register(self, link: NamesrvLink, light: RegisterBrokerRequestHeader,
                        whole: Callable[[], RegisterBrokerRequestHeader]) -> bool:
        header = light
        if not (light.topics_omitted and link.accepted_version == light.data_version):
            header = whole()
        try:
            resp = await link.request(RequestCode.REGISTER_BROKER, header)
            h = resp.header
            if isinstance(h, RegisterBrokerResponseHeader) and h.need_topics:
                link.accepted_version = None
                header = whole()
                resp = await link.request(RequestCode.REGISTER_BROKER, header)
        except Exception as exc:  # OSError, TimeoutError, a peer that breaks the framing...
            level = logging.WARNING if link.failures == 0 else logging.DEBUG
            link.failures += 1
            log.log(
                level, "register with name server %s failed: %s", link.addr,
                str(exc) or type(exc).__name__,
            )
            return False
        if self.on_response is not None:
            try:
                self.on_response(link.addr, resp)
            except Exception:
                log.exception("handling the answer of name server %s failed", link.addr)
        if resp.code != ResponseCode.SUCCESS:
            msg = resp.header.message if isinstance(resp.header, ErrorResponseHeader) else ""
            log.warning(
                "name server %s refused the registration: %s", link.addr, msg or describe(resp.code)
            )
            return False
        if link.failures:
            log.info("registered with name server %s again", link.addr)
        link.failures = 0
        link.accepted_version = header.data_version
        self.registrations += 1
        return True

    async def run(self) -> None:
        """Register every interval and on every change, until cancelled."""
        while True:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancel that
            # arrives as the event is set, and stop() would wait for this loop forever.
            try:
                async with asyncio.timeout(self.interval_s):
                    await self._changed.wait()
            except TimeoutError:
                pass
            self._changed.clear()
            await self.register_all()

    async def unregister_all(self, header: UnregisterBrokerRequestHeader) -> None:
        async def one(link: NamesrvLink) -> None:
            try:
                await link.request(RequestCode.UNREGISTER_BROKER, header)
            except Exception as exc:
                log.info("unregister from name server %s failed: %s", link.addr, exc)

        await asyncio.gather(*(one(link) for link in self.links))

    def close(self) -> None:
        for link in self.links:
            link.close()
