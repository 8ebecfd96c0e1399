"""The listening socket of a server and what it keeps across its connections: the connection
cap and the budget of bytes held in partial frames.

A server (the broker, the name server) gives a :class:`FrameServer` its handler -- an object
with ``handle(conn, frame)``, ``connection_made(conn)`` and ``connection_lost(conn)`` -- and its
:class:`~tidemq.base.limits.ConnectionLimits`; the connections (:class:`ServerConnection` or a
subclass) report to it:

- ``accept``: over ``max_connections`` a new connection is *refused*: it is not handed to the
  handler, every request it sends is answered SYSTEM_BUSY, and it is closed after the first
  chunk of requests or ``busy_retry_ms`` (at least 1 s), whichever comes first. Refused
  connections waiting for their request are capped too; past that they are closed at once.
- ``partial_changed``: the bytes each connection holds for a frame that has not fully arrived
  are summed; past ``max_partial_frame_bytes`` the *oldest* partial frames larger than one read
  (64 KiB) are dropped
  (``FrameDecoder.drop_partial``: released now, the rest discarded as it arrives, SYSTEM_BUSY
  once it is in). Dropping the oldest first spares frames that arrive at network speed and
  hits the senders that stall.
- a sweep every second while partial frames exist closes connections whose frame has been
  incomplete for ``partial_frame_timeout_ms`` -- a dropped frame still being discarded
  included; a connection the server itself stopped reading (back-pressure: its peer does not
  read) is not timed while it is paused, since its frame cannot complete then.

The counters (:meth:`stats`) feed the broker's runtime info and metrics.

Threads: the event loop that called :meth:`start`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from tidemq.base.connection import LARGE_READ_SIZE, READ_SIZE, ServerConnection
from tidemq.base.limits import ConnectionLimits
from tidemq.protocol.codes import RequestCode
from tidemq.protocol.frame import Frame

__all__ = ["FrameServer", "Handler"]

log = logging.getLogger(__name__)

#: Refused connections kept open (to answer SYSTEM_BUSY) at once; more are closed unanswered.
MAX_REFUSED_PENDING = 256
#: Connections the partial-frame sweep closes at most per turn of the event loop.
_SWEEP_BATCH = 32
#: Warnings about refusals, drops and timeouts: at most one line per kind this often.
_LOG_EVERY_S = 10.0


class Handler(Protocol):
    """What a server gives its FrameServer (the broker, the name server)."""

    def handle(self, conn: Any, frame: Frame) -> None: ...

    def connection_made(self, conn: Any) -> None: ...

    def connection_lost(self, conn: Any) -> None: ...


class FrameServer:
    """One listening socket and its connections. ``what`` names the server in messages
    ("broker", "name server"). Event loop only."""

    def __init__(
        self,
        handler: Handler,
        limits: ConnectionLimits,
        *,
        what: str = "server",
        connection_factory: Callable[[FrameServer], ServerConnection] = ServerConnection,
    ) -> None:
        limits.validate(what)
        self.handler = handler
        self.limits = limits
        self.what = what
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # start()
        self.connections: set[ServerConnection] = set()
        self.port = 0
        #: Bytes held in partial frames, all connections together.
        self.partial_bytes = 0
        self.refused_total = 0
        self.dropped_frames = 0
        self.partial_timeouts = 0
        self.overflow_closed = 0
        self._factory = connection_factory
        #: Called at the end of each read's handling, before its answers are written (what
        #: it answers on that connection joins them, in one write); the broker answers there
        #: the held pulls the read's sends woke (long_polling.py), so those answers do not
        #: wait for the loop's next turns. None: nothing to do.
        self.after_read: Callable[[], None] | None = None
        self._server: asyncio.AbstractServer | None = None
        self._refused: set[ServerConnection] = set()
        # Connections receiving a frame -> when it started (its clock; a dropped frame still
        # being discarded included); insertion order is age order (a restarted frame is
        # re-inserted), so the oldest come first.
        self._partial: dict[ServerConnection, float] = {}
        # Those of them holding bytes of a frame larger than one read, oldest first: whom to
        # drop (a smaller frame costs no more than the read every connection may hold anyway,
        # counted per connection in the bound; dropping it would only turn a request into
        # SYSTEM_BUSY).
        self._holding: dict[ServerConnection, None] = {}
        self._sweep: asyncio.TimerHandle | None = None
        self._logged: dict[str, float] = {}
        # The one read buffer of all connections: a transport reads into it and the connection
        # copies the bytes out at once (buffer_updated), before the loop reads anything else.
        self.read_view = memoryview(bytearray(LARGE_READ_SIZE))

    async def start(
        self, host: str, port: int, *, start_serving: bool = True, backlog: int = 1024
    ) -> int:
        """Bind ``host:port`` (0 = any free port); returns the port bound."""
        self.loop = loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: self._factory(self),
            host,
            port,
            reuse_address=True,
            start_serving=start_serving,
            backlog=backlog,
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def start_serving(self) -> None:
        assert self._server is not None
        await self._server.start_serving()

    def close_listener(self) -> None:
        """Stop accepting connections; those open stay open."""
        if self._server is not None:
            self._server.close()

    def close(self) -> None:
        """Stop listening and close every connection (queued output is written first)."""
        self.close_listener()
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conn in [*self.connections, *self._refused]:
            conn.close()

    def stats(self) -> dict[str, int]:
        return {
            "connections_paused": sum(1 for c in self.connections if c.write_paused),
            "partial_frame_bytes": self.partial_bytes,
            "connections_refused": self.refused_total,
            "frames_dropped_busy": self.dropped_frames,
            "partial_frame_timeouts": self.partial_timeouts,
            "connections_overflowed": self.overflow_closed,
        }

    # -- connections ---------------------------------------------------------------------------
    def accept(self, conn: ServerConnection) -> None:
        if len(self.connections) < self.limits.max_connections:
            self.connections.add(conn)
            self.handler.connection_made(conn)
            return
        conn.refused = True
        self.refused_total += 1
        self._warn("refused", "%s at max_connections=%d: refusing connections (SYSTEM_BUSY); "
                   "%d refused so far", self.what, self.limits.max_connections,
                   self.refused_total)
        if len(self._refused) >= MAX_REFUSED_PENDING:
            conn.abort()
            return
        self._refused.add(conn)
        self.loop.call_later(max(1.0, self.limits.busy_retry_ms / 1000), conn.abort)

    def lost(self, conn: ServerConnection) -> None:
        self.forget_partial(conn)
        if conn.refused:
            self._refused.discard(conn)
            return
        if conn in self.connections:
            self.connections.discard(conn)
            self.handler.connection_lost(conn)

    def refused_message(self) -> str:
        return (
            f"the {self.what} serves at most {self.limits.max_connections} connections "
            f"(max_connections) and has no room for this one; retry in "
            f"{self.limits.busy_retry_ms} ms, or raise max_connections"
        )

    def partial_busy_message(self, code: int) -> str:
        try:
            what = RequestCode(code).name
        except ValueError:
            what = f"request code {code}"
        return (
            f"the {self.what} dropped this {what} frame: it holds "
            f"max_partial_frame_bytes={self.limits.max_partial_frame_bytes} bytes of frames "
            f"that have not fully arrived; retry in {self.limits.busy_retry_ms} ms"
        )

    def overflowed(self, conn: ServerConnection, queued: int) -> None:
        self.overflow_closed += 1
        self._warn("overflow", "closing connection from %s: %d bytes of responses unsent, over "
                   "max_queued_response_bytes=%d (the client does not read)", conn.peer, queued,
                   self.limits.max_queued_response_bytes)
        conn.abort()

    # -- partial frames ------------------------------------------------------------------------
    def partial_changed(self, conn: ServerConnection, restarted: bool) -> None:
        """``conn``'s decoder holds a different number of bytes than ``conn.partial`` says;
        ``restarted``: frames completed in the same chunk, so what it holds is a new frame."""
        new = conn.decoder.buffered
        self.partial_bytes += new - conn.partial
        conn.partial = new
        table = self._partial
        if not new:
            table.pop(conn, None)
            self._holding.pop(conn, None)
            return
        if restarted or conn not in table:
            table.pop(conn, None)
            table[conn] = self.loop.time()
            self._holding.pop(conn, None)
            if self._sweep is None:
                self._arm()
        if conn not in self._holding and conn.decoder.partial_size > READ_SIZE:
            self._holding[conn] = None
        if self.partial_bytes > self.limits.max_partial_frame_bytes:
            self._drop_oldest()

    def forget_partial(self, conn: ServerConnection) -> None:
        if conn.partial:
            self.partial_bytes -= conn.partial
            conn.partial = 0
        self._partial.pop(conn, None)
        self._holding.pop(conn, None)

    def _drop_oldest(self) -> None:
        excess = self.partial_bytes - self.limits.max_partial_frame_bytes
        victims: list[ServerConnection] = []
        for c in self._holding:
            victims.append(c)
            excess -= c.partial
            if excess <= 0:
                break
        for c in victims:
            size = c.decoder.partial_size
            if c.decoder.drop_partial():
                self.dropped_frames += 1
                self._warn("drop", "%s holds over max_partial_frame_bytes=%d bytes of partial "
                           "frames: dropped a %d-byte frame from %s (SYSTEM_BUSY); %d dropped "
                           "so far", self.what, self.limits.max_partial_frame_bytes, size,
                           c.peer, self.dropped_frames)
                # Its bytes are released; its clock keeps running while the rest of the frame
                # is discarded (partial_changed forgets it once the frame is over).
                self.partial_bytes -= c.partial
                c.partial = 0
                del self._holding[c]

    def _arm(self, period: float | None = None) -> None:
        if period is None:
            period = min(1.0, self.limits.partial_frame_timeout_ms / 4000)
        self._sweep = self.loop.call_later(period, self._sweep_partial)

    def _sweep_partial(self) -> None:
        self._sweep = None
        now = self.loop.time()
        oldest = now - self.limits.partial_frame_timeout_ms / 1000
        expired: list[ServerConnection] = []
        more = False
        for c, since in self._partial.items():
            if since > oldest:
                break
            if len(expired) == _SWEEP_BATCH:
                # Connections opened together time out together: close a batch per turn of
                # the loop, not hundreds at once, so other clients are served in between.
                more = True
                break
            expired.append(c)
        for c in expired:
            if c.write_paused:
                # We stopped reading it (its peer does not read): its frame cannot complete
                # until it does. Not timed meanwhile; restart its clock.
                del self._partial[c]
                self._partial[c] = now
                continue
            self.partial_timeouts += 1
            self._warn("timeout", "closing connection from %s: a frame incomplete for over "
                       "partial_frame_timeout_ms=%d (%d bytes of it held); %d closed so far",
                       c.peer, self.limits.partial_frame_timeout_ms, c.partial,
                       self.partial_timeouts)
            c.abort()
        if more:
            self._arm(0.01)
        elif self._partial:
            self._arm()

    def _warn(self, kind: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._logged.get(kind, -_LOG_EVERY_S) >= _LOG_EVERY_S:
            self._logged[kind] = now
            log.warning(msg, *args)
