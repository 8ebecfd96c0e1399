"""The server side of one client connection: an ``asyncio.BufferedProtocol`` around the sans-IO
FrameDecoder, shared by the broker and the name server.

Bytes in: the transport reads into the server's one shared read buffer (READ_SIZE, 64 KiB, or
up to LARGE_READ_SIZE, 1 MiB, while a frame that still lacks more than 64 KiB is arriving),
:meth:`ServerConnection.buffer_updated` copies what arrived out of it and
:meth:`ServerConnection.data_received` feeds the decoder and hands every complete request frame
to the server's handler (``handle(conn, frame)``), in order. (A plain ``Protocol`` would get up
to 256 KiB per read under uvloop: more than a paused connection should hold.) Headers are
decoded in two steps: the decoder keeps each header as ``msgspec.Raw`` (valid MessagePack, nothing
more), and the request handler decodes it into its Struct with :func:`decode_request`. So a
header that is valid MessagePack but has a missing or mistyped field is a client mistake
answered with INVALID_ARGUMENT on a connection that stays open, while bytes that break the frame
layout (bad magic, bad length, header not MessagePack) are broken framing: the reason is logged
and the connection closed, since the stream cannot be resynchronised.

Bytes out: responses produced while a chunk of input is handled are collected and written with
one system call at the end of the chunk (pipelined requests cost one); responses produced later
(a held pull woken, a SYNC_FLUSH send made durable) are collected for the rest of the loop
iteration and written together. A response's body parts (stored batches: memoryviews of the
mapped CommitLog) go to the transport untouched, never joined (``writelines``); output without
such parts is joined into one bytes object first, so a transport that cannot send it at once
holds one object, not one per response.

Memory (the limits are :class:`~tidemq.base.limits.ConnectionLimits`):

- Back-pressure. Once more than ``write_buffer_high_water`` bytes of responses are unsent, the
  connection stops handling requests -- also in the middle of a chunk: the output collected so
  far is written, and if the transport could not take it the chunk's remaining frames wait,
  as bytes -- and stops reading until the buffer is below ``write_buffer_low_water``. So a peer
  that sends requests and never reads its responses costs at most the high-water mark, one
  response and one read, however much it sends. Work that produces output without a request
  being read (a woken held pull) waits in :meth:`when_writable` while the connection is
  paused.
- ``max_queued_response_bytes``: a connection whose unsent output passes it anyway (responses
  produced while paused: notifications, answers to earlier work) is closed, dropping it.
- Partial frames count against the server's budget (``FrameServer``): past the per-process cap
  the oldest partial frame is dropped and its sender answered SYSTEM_BUSY once the frame's last
  byte is in; a frame incomplete for ``partial_frame_timeout_ms`` closes its connection.
- A connection over ``max_connections`` is refused: each request it sends is answered
  SYSTEM_BUSY, and it is closed.

SYSTEM_BUSY carries a retry hint (``ErrorResponseHeader.retry_after_ms``, ``busy_retry_ms``)
that the client honours before it sends again.

Threads: the server's event loop only (``respond`` too: other threads reach it through the
loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from tidemq.base.errors import RequestRejected
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
    encode_frame_parts,
)
from tidemq.protocol.headers import ErrorResponseHeader

if TYPE_CHECKING:
    from tidemq.base.server import FrameServer

__all__ = ["ServerConnection", "decode_request", "raw_headers", "encode_response"]

log = logging.getLogger(__name__)

_pack_prefix = FRAME_PREFIX.pack
_encode = msgspec.msgpack.Encoder().encode
_decoders: dict[type, msgspec.msgpack.Decoder[Any]] = {}
_SYSTEM_BUSY = int(ResponseCode.SYSTEM_BUSY)
#: Requests of one connection handled in one turn of the event loop (see _handle_frames).
FRAMES_PER_TURN = 256
#: Bytes one read takes from a connection (the transport may read less) ...
READ_SIZE = 64 * 1024
#: ... or, while a frame larger than that is arriving, up to what it lacks, at most this.
LARGE_READ_SIZE = 1024 * 1024


def raw_headers(flags: int, code: int, opaque: int) -> type:
    """FrameDecoder header resolver: keep every header as msgspec.Raw (see module docstring)."""
    return msgspec.Raw


def decode_request(frame: Frame, header_type: type[Any]) -> Any:
    """The frame's header as ``header_type``; RequestRejected(INVALID_ARGUMENT) if it does not
    fit (the message names the field)."""
    dec = _decoders.get(header_type)
    if dec is None:
        dec = _decoders[header_type] = msgspec.msgpack.Decoder(header_type)
    try:
        return dec.decode(frame.header)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        try:
            what = RequestCode(frame.code).name
        except ValueError:
            what = f"request code {frame.code}"
        raise RequestRejected(
            ResponseCode.INVALID_ARGUMENT, f"{what} header is invalid: {exc}"
        ) from None


def encode_response(opaque: int, code: int, header: Any, body_len: int = 0) -> bytes:
    """Prefix + header of a response frame whose body (``body_len`` bytes) follows separately."""
    hb = b"" if header is None else _encode(header)
    hlen = len(hb)
    return _pack_prefix(
        MIN_TOTAL_LEN + hlen + body_len, FRAME_MAGIC, FRAME_VERSION, FLAG_RESPONSE, 0, code,
        opaque, hlen,
    ) + hb


def _size(parts: list[Any]) -> int:
    n = 0
    for p in parts:
        n += p.nbytes if type(p) is memoryview else len(p)
    return n


def _frames_bytes(frames: list[Frame]) -> bytes:
    """The wire bytes of received request frames (headers as received): what a paused
    connection keeps of the requests it has not handled yet -- a few bytes each, where the
    decoded Frame objects would cost ~300."""
    parts: list[Any] = []
    for f in frames:
        hb = b"" if f.header is None else bytes(f.header)
        body = f.body
        parts.append(_pack_prefix(MIN_TOTAL_LEN + len(hb) + len(body), FRAME_MAGIC,
                                  FRAME_VERSION, f.flags, 0, f.code, f.opaque, len(hb)))
        parts.append(hb)
        parts.append(body)
    return b"".join(parts)


class ServerConnection(asyncio.BufferedProtocol):
    """One client connection of a :class:`~tidemq.base.server.FrameServer`; the server's
    handler sees it in ``handle`` / ``connection_made`` / ``connection_lost``.

    Event loop only."""

    __slots__ = (
        "server", "decoder", "transport", "peer", "closed", "refused", "partial",
        "_handle", "_loop", "_high_water", "_out", "_out_bytes", "_later", "_later_bytes",
        "_paused", "_backlog", "_waiting", "_views", "_read_view", "_small_read",
        "oneway_opaque",
    )

    def __init__(self, server: FrameServer) -> None:
        self.server = server
        limits = server.limits
        self.decoder = FrameDecoder(max_frame_size=limits.max_frame_size, header_types=raw_headers)
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.closed = False
        #: Over max_connections: every request is answered SYSTEM_BUSY, then the connection
        #: closes. Set by the server when the connection is made.
        self.refused = False
        #: Bytes of a partial frame counted against the server's budget.
        self.partial = 0
        #: Opaque of the one-way request being handled: ``respond`` drops answers to it, so
        #: no handler can answer a one-way request by mistake (the server's handle sets it).
        self.oneway_opaque: int | None = None
        self._handle: Callable[[ServerConnection, Frame], None] = server.handler.handle
        self._loop = server.loop
        self._read_view = server.read_view
        self._small_read = server.read_view[:READ_SIZE]
        self._high_water = limits.write_buffer_high_water
        self._out: list[Any] | None = None  # output of the chunk being handled
        self._out_bytes = 0
        # Writes made outside data_received (a group commit's answers, a woken held pull),
        # sent together at the end of the loop iteration; None when nothing waits.
        self._later: list[Any] | None = None
        self._later_bytes = 0
        self._views = False  # some part queued in _out or _later is not bytes (a body view)
        self._paused = False  # the transport's buffer is over the high-water mark
        # Requests received and not handled yet: Frames until the next turn, bytes while the
        # peer does not read. Reading is paused while there are any.
        self._backlog: list[Frame] | bytes | None = None
        self._waiting: deque[Callable[[], None]] = deque()  # when_writable callbacks

    # -- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        peer = transport.get_extra_info("peername")
        if peer:
            self.peer = f"{peer[0]}:{peer[1]}"
        limits = self.server.limits
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if limits.socket_send_buffer:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF,
                                    limits.socket_send_buffer)
        transport.set_write_buffer_limits(  # type: ignore[attr-defined]
            high=limits.write_buffer_high_water, low=limits.write_buffer_low_water
        )
        self.server.accept(self)
        if self.refused:
            self._handle = _refuse

    def get_buffer(self, sizehint: int) -> memoryview:
        # The server's shared buffer: READ_SIZE bytes, or up to LARGE_READ_SIZE while a frame
        # with more than READ_SIZE bytes still to come is arriving (fewer wake-ups for a large
        # send; its size is known and counted against max_partial_frame_bytes).
        missing = self.decoder.missing
        if missing > READ_SIZE:
            return self._read_view[: min(missing, LARGE_READ_SIZE)]
        return self._small_read

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(bytes(self._read_view[:nbytes]))

    def data_received(self, data: bytes) -> None:
        dec = self.decoder
        before = self.partial
        try:
            frames = dec.feed(data)
        except RemoteProtocolError as exc:
            log.warning("closing connection from %s: %s", self.peer, exc.message)
            self.close()
            return
        if before or dec.buffered:
            self.server.partial_changed(self, bool(frames))
        if dec.dropped:  # the rest of a dropped frame is in: answer it, stop its clock
            self._answer_dropped()
            self.server.partial_changed(self, True)
        if self._backlog is not None:  # requests are waiting: keep the order
            if isinstance(self._backlog, bytes):
                self._backlog += _frames_bytes(frames)
            else:
                self._backlog += frames
            return
        if frames:
            self._handle_frames(frames)

    def _handle_frames(self, frames: list[Frame]) -> None:
        later: list[Frame] | None = None
        if len(frames) > FRAMES_PER_TURN:
            # A read of many small requests: handle a turn's worth now and the rest on the next
            # loop iteration, so other connections' requests are not stuck behind them.
            later = frames[FRAMES_PER_TURN:]
            frames = frames[:FRAMES_PER_TURN]
        out = self._out = []
        self._out_bytes = 0
        handle = self._handle
        hw = self._high_water
        done = 0
        try:
            for frame in frames:
                done += 1
                handle(self, frame)
                if self._out_bytes > hw:
                    # One chunk of pipelined requests must not queue unbounded output: write
                    # what is collected, and if the transport could not take it, stop here.
                    self._flush(out)
                    out = self._out = []
                    self._out_bytes = 0
                    if self._paused or self.closed:
                        if done < len(frames):
                            later = frames[done:] + later if later else frames[done:]
                        break
            after = self.server.after_read
            if after is not None:
                after()  # what it answers on this connection joins this read's write
        finally:
            self._out = None
            self._flush(out)
        if later and not self.closed:
            if self._paused:  # kept until the peer reads: as bytes, not Frame objects
                self._backlog = _frames_bytes(later)
            else:
                self._backlog = later
                self.transport.pause_reading()  # type: ignore[union-attr]
                self._loop.call_soon(self._resume)

    def _flush(self, out: list[Any]) -> None:
        if self._later is not None:  # keep the order: earlier writes first
            out[:0] = self._later
            self._later = None
        if out and not self.closed:
            self._send(out)

    def _send(self, parts: list[Any]) -> None:
        if len(parts) == 1:  # one response (the common case): no list for the transport
            self._views = False
            self.transport.write(parts[0])  # type: ignore[union-attr]
        elif self._views:
            self._views = False
            self.transport.writelines(parts)  # type: ignore[union-attr]
        else:
            self.transport.write(b"".join(parts))  # type: ignore[union-attr]

    def eof_received(self) -> bool:
        try:
            self.decoder.eof()
        except RemoteProtocolError as exc:
            log.info("connection from %s: %s", self.peer, exc.message)
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._backlog = None
        self._waiting.clear()
        self.server.lost(self)

    def pause_writing(self) -> None:
        # The peer does not read its responses: stop reading its requests until it does.
        self._paused = True
        if not self.closed:
            self.transport.pause_reading()  # type: ignore[union-attr]

    def resume_writing(self) -> None:
        self._paused = False
        if self.closed:
            return
        if self._backlog is not None or self._waiting:
            # Not from inside the transport's write callback: on the next loop iteration.
            self._loop.call_soon(self._resume)
        else:
            self.transport.resume_reading()  # type: ignore[union-attr]

    def _resume(self) -> None:
        if self.closed or self._paused:
            return
        backlog, self._backlog = self._backlog, None
        if isinstance(backlog, bytes):
            # Valid frames, as received: a fresh decoder (the connection's own may hold the
            # start of the frame that follows them).
            limits = self.server.limits
            again = FrameDecoder(max_frame_size=limits.max_frame_size, header_types=raw_headers)
            backlog = again.feed(backlog)
        if backlog:
            self._handle_frames(backlog)
            if self._backlog is not None:  # the next turn is scheduled, or the peer stalls
                return
        waiting = self._waiting
        if waiting and not self._paused and not self.closed:
            out = self._out = []
            self._out_bytes = 0
            hw = self._high_water
            try:
                while waiting and not self.closed:
                    fn = waiting.popleft()
                    try:
                        fn()
                    except Exception:
                        log.exception("deferred work for %s failed", self.peer)
                    if self._out_bytes > hw:
                        self._flush(out)
                        out = self._out = []
                        self._out_bytes = 0
                        if self._paused:
                            break
            finally:
                self._out = None
                self._flush(out)
        if not self._paused and not self.closed and self._backlog is None:
            self.transport.resume_reading()  # type: ignore[union-attr]

    # -- writing -------------------------------------------------------------------------------
    @property
    def write_paused(self) -> bool:
        """True while the peer is not reading (the transport's buffer is over high water)."""
        return self._paused

    def when_writable(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (which writes a response) now, or once the peer reads again if it does
        not read now; dropped if the connection closes first."""
        if not self._paused:
            fn()
        elif not self.closed:
            self._waiting.append(fn)

    def write(self, parts: list[Any], nbytes: int = -1) -> None:
        """Queue ``parts`` (bytes-like) for the transport; ``nbytes`` is their total size
        (computed when -1)."""
        if nbytes < 0:
            nbytes = _size(parts)
            if not self._views:
                for p in parts:
                    if type(p) is not bytes:
                        self._views = True
                        break
        if self._out is not None:
            self._out.extend(parts)
            self._out_bytes += nbytes
        elif not self.closed:
            # Outside data_received: coalesce this loop iteration's writes into one system call
            # (a SYNC_FLUSH group commit answers up to a round's worth of sends at once; a
            # writelines each cost ~7 us of system time per send).
            later = self._later
            if later is None:
                self._later = list(parts)
                self._later_bytes = nbytes
                self._loop.call_soon(self._write_later)
            else:
                later.extend(parts)
                self._later_bytes += nbytes
                if self._later_bytes > self._high_water:
                    # A burst (many held pulls woken at once): write it now so pause_writing
                    # and when_writable see the transport's state.
                    self._write_later()

    def flush_writes(self) -> None:
        """Write now what was queued outside a read for the end of the loop iteration: for a
        caller that knows it queued its last answer (the broker's woken held pulls)."""
        if self._later is not None:
            self._write_later()

    def _write_later(self) -> None:
        later, self._later = self._later, None
        if later and not self.closed:
            transport = self.transport
            self._send(later)
            if self._paused:
                queued = transport.get_write_buffer_size()  # type: ignore[union-attr]
                if queued > self.server.limits.max_queued_response_bytes:
                    self.server.overflowed(self, queued)

    def respond(
        self, opaque: int, code: int, header: Any, bodies: list[Any] | None = None
    ) -> None:
        """Send a response; ``bodies`` are written after the header, each untouched."""
        if opaque == self.oneway_opaque:
            return  # a one-way request is never answered
        if bodies:
            n = 0
            for b in bodies:
                n += len(b)
            head = encode_response(opaque, code, header, n)
            self._views = True  # bodies go to the transport as they are
            self.write([head, *bodies], len(head) + n)
        else:
            head = encode_response(opaque, code, header)
            out = self._out
            if out is not None:  # answered while its read is handled (most are): write() inlined
                out.append(head)
                self._out_bytes += len(head)
            else:
                self.write([head], len(head))

    def send_oneway_request(self, code: int, header: Any) -> None:
        """A server -> client one-way request (NOTIFY_CONSUMER_IDS_CHANGED); never answered."""
        if not self.closed:
            self.write(encode_frame_parts(Frame(code, 0, FLAG_ONEWAY, header)))

    def respond_error(self, opaque: int, code: int, message: str) -> None:
        """An error response; SYSTEM_BUSY carries the server's retry hint."""
        if code == _SYSTEM_BUSY:
            header = ErrorResponseHeader(
                message=message, retry_after_ms=self.server.limits.busy_retry_ms
            )
        else:
            header = ErrorResponseHeader(message=message)
        self.respond(opaque, code, header)

    def _answer_dropped(self) -> None:
        dropped = self.decoder.dropped
        for code, opaque, flags in dropped:
            if not flags & (FLAG_ONEWAY | FLAG_RESPONSE):
                self.respond_error(opaque, _SYSTEM_BUSY, self.server.partial_busy_message(code))
        dropped.clear()

    def close(self) -> None:
        """Write what is queued, then close."""
        if not self.closed:
            later, self._later = self._later, None
            if later and self.transport is not None:
                self._send(later)  # written before the close, as before
            self.closed = True
            self.server.forget_partial(self)
            if self.transport is not None:
                self.transport.close()

    def abort(self) -> None:
        """Close at once, dropping unsent output (a peer that does not read, or stalls)."""
        if not self.closed:
            self._later = None
            self.closed = True
            self.server.forget_partial(self)
            if self.transport is not None:
                self.transport.abort()


def _refuse(conn: ServerConnection, frame: Frame) -> None:
    """The handler of a refused connection: SYSTEM_BUSY to every request, then close."""
    if not frame.flags & (FLAG_ONEWAY | FLAG_RESPONSE):
        conn.respond_error(frame.opaque, _SYSTEM_BUSY, conn.server.refused_message())
    conn._loop.call_soon(conn.close)
