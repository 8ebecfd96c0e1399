"""Client connections: one asyncio.BufferedProtocol per TCP connection, and a pool keyed by
address.

A :class:`Connection` writes request frames and matches responses to their requests by opaque
(a map opaque -> future, RocketMQ's responseTable). Each request has a deadline (3 s by default;
a long-polling pull passes its own); a request whose deadline passes fails with
RequestTimeoutError and a late response is dropped. Deadlines are enforced by one timer per
connection, set for the earliest deadline in flight (a sweep then fails what is due and re-arms
for the next), not by a timer per request: with uvloop each timer is a libuv handle to create,
start, stop and close, and a send is answered long before its deadline. Broken framing from the
peer closes the connection and fails every request in flight with ConnectionLostError.

Memory: what a broker or name server sends is held only up to one frame (``max_frame_size``,
16 MiB by default: a bigger length closes the connection), and a partial frame that stalls is
not held forever: when a request times out and the frame being received started before that
request was even sent, the peer is stuck mid-frame and the connection is closed (its requests
fail with ConnectionLostError; the pool reconnects).

Reads: the transport reads into the connection's own 64 KiB buffer (READ_SIZE), whose bytes
the sans-IO FrameDecoder copies out. A frame larger than that (a pull of 1,000 x 1 KiB is ~1 MiB)
is instead received straight into one buffer of its size, taken over from the decoder once its
prefix is in, and fed to the decoder whole when its last byte is: one copy of the frame, no
list of reads to join and no fresh 256 KiB object per read (what a plain Protocol gets under
uvloop; that churn, and glibc handing the freed memory back and faulting it in again, was a
sixth of a 1 KiB message's client CPU in ``bench consume``). That buffer is kept for the next
large frame when it is at most KEEP_FRAME_BUFFER bytes.

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
import math
import socket
import struct
from collections.abc import Callable, Iterable
from typing import Any

from tidemq.base.gc_tune import tune_gc
from tidemq.base.malloc import tune_malloc
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
    FRAME_MAGIC,
    FRAME_PREFIX,
    FRAME_VERSION,
    INLINE_BODY_MAX,
    MIN_TOTAL_LEN,
    Frame,
    FrameDecoder,
    encode_frame_parts,
    encode_header,
)
from tidemq.protocol.headers import (
    ErrorResponseHeader,
    request_header_type,
    response_header_type,
)

_INF = math.inf
#: Bytes one read takes while no large frame is arriving ...
READ_SIZE = 64 * 1024
#: ... a frame lacking more than READ_SIZE is received into one buffer of its size, kept for
#: the next such frame up to this size (a larger one is received the same way, then released).
KEEP_FRAME_BUFFER = 4 * 1024 * 1024

__all__ = ["Connection", "ConnectionPool", "parse_address", "raise_for_error", "DEFAULT_TIMEOUT"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 3.0
_OPAQUE_MASK = 0xFFFF_FFFF
_SUCCESS_ONLY = (0,)
#: a frame with a body of at least this many bytes is written at once (see _write)
_WRITE_NOW = 64 * 1024


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
    retry_after_ms = 0
    if isinstance(header, ErrorResponseHeader):
        message = header.message
        retry_after_ms = header.retry_after_ms
    elif isinstance(header, dict):
        message = str(header.get("message", ""))
    else:
        message = ""
    raise BrokerError.from_response(frame.code, message or None, retry_after_ms)


# An entry of Connection._pending: (future, request code, deadline in loop time, timeout).
# A tuple: the cheapest record to build once per request.
_Pending = tuple[asyncio.Future[Frame], int, float, float]
#: (request code, response code) -> response header type; response_header_type's answers,
#: kept because the decoder asks for every response frame.
_resp_types: dict[tuple[int, int], type | None] = {}


class Connection(asyncio.BufferedProtocol):
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
        self._sweep_at = _INF  # when the deadline timer fires; inf: not armed
        self._sweep_timer: asyncio.TimerHandle | None = None
        self._transport: asyncio.Transport | None = None
        self._closed_exc: Exception | None = None
        self._drained: asyncio.Future[None] | None = None  # set while writing is paused
        self._wbuf: list[Any] = []  # frames queued in this loop iteration (see _write)
        self._flush_scheduled = False
        self._corked = False  # _flush_scheduled is set by the pool's cork, not a call_soon
        self._partial_since = 0.0  # loop time the partial frame being received started; 0: none
        self.closed: asyncio.Future[None] = self._loop.create_future()
        self._read_view = memoryview(bytearray(READ_SIZE))
        self._frame_buf: memoryview | None = None  # kept for the next large frame
        self._frame_view: memoryview | None = None  # the large frame being received, if any
        self._frame_got = 0  # bytes of it received

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

    def get_buffer(self, sizehint: int) -> memoryview:
        view = self._frame_view
        if view is not None:
            return view[self._frame_got :]
        if self._decoder.missing > READ_SIZE:
            need, held = self._decoder.take_partial()
            view = self._frame_buf
            if view is None or len(view) < need:
                view = memoryview(bytearray(need))
                if need <= KEEP_FRAME_BUFFER:
                    self._frame_buf = view
            view = self._frame_view = view[:need]
            got = self._frame_got = len(held)
            view[:got] = held
            return view[got:]
        return self._read_view

    def buffer_updated(self, nbytes: int) -> None:
        view = self._frame_view
        if view is None:
            self.data_received(self._read_view[:nbytes])  # the decoder copies what it keeps
            return
        self._frame_got += nbytes
        if self._frame_got < len(view):
            return
        self._frame_view = None
        self._frame_got = 0
        self.data_received(bytes(view))  # the whole frame: bodies slice this one object

    def data_received(self, data: bytes | memoryview) -> None:
        try:
            frames = self._decoder.feed(data)
        except RemoteProtocolError as exc:
            log.warning("closing connection to %s: %s", self.address, exc.message)
            self._fail(ConnectionLostError(f"{self.address} sent bytes that break the frame "
                                           f"format ({exc.message}); connection closed"))
            return
        if self._decoder.buffered:
            if frames or not self._partial_since:
                self._partial_since = self._loop.time()
        elif self._partial_since:
            self._partial_since = 0.0
        pending = self._pending
        for frame in frames:
            if frame.flags & FLAG_RESPONSE:
                p = pending.pop(frame.opaque, None)
                if p is None:
                    continue  # its request timed out
                if not p[0].done():  # done: cancelled by its caller
                    p[0].set_result(frame)
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
            if p is None:
                return None
            key = (p[1], code)
            try:
                return _resp_types[key]
            except KeyError:
                t = _resp_types[key] = response_header_type(p[1], code)
                return t
        return request_header_type(code)

    def _opaque(self) -> int:
        o = self._next_opaque
        self._next_opaque = (o + 1) & _OPAQUE_MASK or 1
        return o

    def _write(self, code: int, opaque: int, flags: int, header: Any, body: Any,
               now: bool = False) -> None:
        """Queue a frame; every frame queued in this loop iteration goes out in one write.

        A write system call costs tens of microseconds here (loopback delivery runs in the
        caller's context), far more than framing; coalescing the frames of one iteration
        (many sends in flight, or one pull per queue) into one ``writelines`` is what lets a
        client do more than ~10 k requests per second. The delay is one loop iteration.

        A request with a header and a small body (every send of a few messages) is framed
        here with one ``FRAME_PREFIX.pack`` and one join: the same bytes as
        ``frame.encode_frame_parts`` (a test compares them) at ~0.3 instead of ~0.8 µs, since
        it skips the Frame object and the general checks; anything else goes through it.
        ``now``: written at once with what is queued (see :meth:`start_request`)."""
        if self._closed_exc is not None:
            raise self._closed_exc
        th = type(header)
        if th is not bytearray and th is not memoryview and header is not None and (
            type(body) is not memoryview
        ):
            hb = header if th is bytes else encode_header(header)
            hlen = len(hb)
            blen = len(body)
            total = MIN_TOTAL_LEN + hlen + blen
            if blen <= INLINE_BODY_MAX and total + 4 <= self.max_frame_size:
                try:
                    prefix = FRAME_PREFIX.pack(total, FRAME_MAGIC, FRAME_VERSION, flags, 0, code,
                                               opaque, hlen)
                except struct.error:
                    pass  # encode_frame_parts raises its LocalProtocolError
                else:
                    self._wbuf.append(b"".join((prefix, hb, body)))
                    if now:
                        self._flush()
                    elif not self._flush_scheduled:
                        self._flush_scheduled = True
                        self._loop.call_soon(self._flush)
                    return
        parts = encode_frame_parts(Frame(code, opaque, flags, header, body),
                                   max_frame_size=self.max_frame_size)
        self._wbuf += parts
        if now or len(parts) > 1 and len(parts[-1]) >= _WRITE_NOW:  # [prefix + header, body]
            # A large frame (a batch) is written now, with what is queued before it: the
            # transport then pauses writing at once when its buffer is full, and the next
            # sender of this loop iteration waits in drain() (a send_async backlog would else
            # write all its batches into the transport in one iteration).
            self._flush()
            return
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def flush_now(self) -> None:
        """Write the frames queued in this loop iteration now, not at its end: for a caller
        that knows nothing more will be queued (the blocking facade after handing over what
        its inbox held), it saves the loop iteration between the request and its write."""
        if self._wbuf:
            self._flush()

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
            await self.drain()
        opaque = self._next_opaque  # the one start_request takes
        fut = self.start_request(code, header, body, timeout)
        try:
            return await fut
        except asyncio.CancelledError:
            self._pending.pop(opaque, None)
            raise

    @property
    def writable(self) -> bool:
        """False while the transport's buffer is over its high-water mark (await drain())."""
        return self._drained is None

    def start_request(
        self, code: int, header: Any = None, body: Any = b"", timeout: float = DEFAULT_TIMEOUT,
        sink: Any = None, now: bool = False, deadline: float = 0.0,
    ) -> asyncio.Future[Frame]:
        """Queue a request now and return the future of its response frame: :meth:`request`
        without the coroutine, for a caller on the hot path that awaits the future itself
        (and checks :attr:`writable` first). Cancelling the future abandons the request.

        ``sink``: instead of a new future, any object with ``done()``, ``set_result(frame)``
        and ``set_exception(exc)``, called on the loop as soon as the outcome is known (from
        ``data_received`` itself: no loop iteration between the answer and its use); it is
        returned. The producer's lone sends use it (accumulator.py).

        ``now``: the frame (with whatever was queued before it) is written at once, not at
        the end of the loop iteration: for a caller that knows nothing else will be queued in
        this iteration (the blocking facade's thread sending alone, which then waits for the
        answer: no ``call_soon`` and no extra loop iteration, an ``epoll_wait``, to write).
        ``deadline``: ``timeout`` from now in loop time, when the caller has read the clock
        already (0: read here)."""
        if self._closed_exc is not None:
            raise self._closed_exc
        o = self._next_opaque
        self._next_opaque = (o + 1) & _OPAQUE_MASK or 1
        loop = self._loop
        fut: asyncio.Future[Frame] = loop.create_future() if sink is None else sink
        if not deadline:
            deadline = loop.time() + timeout
        self._pending[o] = (fut, code, deadline, timeout)
        if deadline < self._sweep_at:
            self._arm(deadline)
        try:
            self._write(code, o, 0, header, body, now)
        except BaseException:
            self._pending.pop(o, None)
            raise
        return fut

    def send_oneway(self, code: int, header: Any = None, body: Any = b"") -> None:
        """Write a one-way request (no response comes)."""
        self._write(code, self._opaque(), FLAG_ONEWAY, header, body)

    async def drain(self) -> None:
        """Wait until the transport's write buffer is below its high-water mark.

        Every waiter wakes when the buffer drains, and the first to run writes and may fill it
        again: each waits until it finds the buffer below the mark. (Returning to all of them
        once let a ``send_async`` backlog of 1,600 batches write ~200 MB into the transport at
        once; the last requests' send timeouts ran out before the broker read them, and they
        were sent again.)"""
        while (d := self._drained) is not None:
            if d.done():  # closed: what is written next fails with the connection's error
                return
            await asyncio.shield(d)

    def _arm(self, when: float) -> None:
        """(Re)set the deadline timer to fire at loop time ``when``."""
        if self._sweep_timer is not None:
            self._sweep_timer.cancel()
        self._sweep_at = when
        self._sweep_timer = self._loop.call_at(when, self._sweep)

    def _sweep(self) -> None:
        """Fail the requests whose deadline has passed, forget cancelled ones, and re-arm for
        the earliest deadline left. O(requests in flight), about once per timeout period."""
        self._sweep_timer = None
        self._sweep_at = _INF
        now = self._loop.time()
        due: list[int] = []
        nxt = _INF
        for opaque, (fut, _code, deadline, _t) in self._pending.items():
            if deadline <= now or fut.done():
                due.append(opaque)
            elif deadline < nxt:
                nxt = deadline
        stalled = None
        for opaque in due:
            fut, code, deadline, timeout = self._pending.pop(opaque)
            if self._partial_since and self._partial_since <= deadline - timeout:
                stalled = timeout
            if not fut.done():
                try:
                    name = RequestCode(code).name
                except ValueError:
                    name = str(code)
                fut.set_exception(
                    RequestTimeoutError(
                        f"{name} to {self.address} got no response within {timeout:g} s; the "
                        "broker may be overloaded or unreachable"
                    )
                )
        if stalled is not None and self._closed_exc is None:
            # The frame being received started before the request that just timed out was
            # sent: the peer stopped mid-frame. Release what we hold of it and reconnect.
            d = self._decoder
            size, got = d.partial_size, d.buffered
            if self._frame_view is not None:
                size, got = len(self._frame_view), self._frame_got
            exc = ConnectionLostError(
                f"{self.address} stopped sending in the middle of a {size}-byte frame "
                f"({got} bytes of it received; it started over {stalled:g} s ago); "
                "connection closed"
            )
            d.drop_partial()  # release it now
            self._frame_view = None  # and what was received of a large frame
            self._frame_buf = None
            self._fail(exc)
            return
        if nxt != _INF and self._closed_exc is None:
            # Not sooner than 1 ms: loop time has millisecond steps under uvloop, and a timer
            # due "now" must not spin the loop.
            self._arm(max(nxt, now + 0.001))

    def _fail(self, exc: Exception) -> None:
        if self._closed_exc is None:
            self._closed_exc = exc
        self._wbuf = []
        pending, self._pending = self._pending, {}
        if self._sweep_timer is not None:
            self._sweep_timer.cancel()
            self._sweep_timer = None
        self._sweep_at = _INF
        for p in pending.values():
            if not p[0].done():
                p[0].set_exception(exc)
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
        tune_malloc()  # pull answers and bodies reuse heap pages (tidemq.base.malloc)
        tune_gc()  # batches' small objects die young, uncollected (tidemq.base.gc_tune)
        self.connect_timeout = connect_timeout
        #: Handler of peer -> client requests, given to every connection (see Connection).
        self.on_request = on_request
        self.max_frame_size = max_frame_size
        self._conns: dict[str, Connection] = {}
        self._connecting: dict[str, asyncio.Future[Connection]] = {}
        self._closed = False

    def cork(self) -> None:
        """Until :meth:`flush_now`, the frames written on this pool's connections wait for it
        instead of scheduling their end-of-iteration write (a ``call_soon`` each, and a loop
        iteration -- an ``epoll_wait`` -- to run it after the frame was already written): for
        a caller that writes and then calls :meth:`flush_now` in the same callback (the
        blocking facade's inbox). Call :meth:`flush_now` in a ``finally``."""
        for c in self._conns.values():
            if not c._flush_scheduled:
                c._flush_scheduled = c._corked = True

    def flush_now(self) -> None:
        """:meth:`Connection.flush_now` of every connection of the pool (and the end of a
        :meth:`cork`)."""
        conns = self._conns.values()
        for c in conns:  # all uncorked first: a write that raises leaves none corked
            if c._corked:
                c._corked = c._flush_scheduled = False
        for c in conns:
            if c._wbuf:
                c.flush_now()

    def writable_nowait(self, address: str) -> Connection | None:
        """The open connection to ``address`` when it takes a write now (not over its
        high-water mark), else None: :meth:`get_nowait` and :attr:`Connection.writable` in one
        call (the hot path of a send written at once)."""
        c = self._conns.get(address)
        if c is None or c._closed_exc is not None or c._drained is not None:
            return None
        return c

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
