"""One client connection to the broker: an ``asyncio.Protocol`` around the sans-IO FrameDecoder.

Bytes in: :meth:`BrokerConnection.data_received` feeds the decoder and hands every complete
request frame to the broker's dispatcher, in order. Headers are decoded in two steps: the
decoder keeps each header as ``msgspec.Raw`` (valid MessagePack, nothing more), and the request
handler decodes it into its Struct with :func:`decode_request`. So a header that is valid
MessagePack but has a missing or mistyped field (a missing group, a negative queue id) is a
client mistake answered with INVALID_ARGUMENT on a connection that stays open, while bytes that
break the frame layout (bad magic, bad length, header not MessagePack) are broken framing: the
reason is logged and the connection closed, since the stream cannot be resynchronised.

Bytes out: responses produced while a chunk of input is being handled are collected and written
with one ``transport.writelines`` at the end of the chunk (pipelined requests cost one syscall);
responses produced later (a held pull woken, a SYNC_FLUSH send made durable) are written at
once. A pull response's stored batches go to the transport as memoryviews of the mapped
CommitLog, never joined (uvloop's writelines hands them to the kernel as an iovec).

Back-pressure: when the transport's write buffer passes its high-water mark (a consumer that
does not read), the connection stops reading requests until the buffer drains.

Threads: the broker's event loop only.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec

from tidemq.broker.errors import RequestRejected
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

__all__ = ["BrokerConnection", "decode_request", "raw_headers", "encode_response"]

log = logging.getLogger(__name__)

_pack_prefix = FRAME_PREFIX.pack
_encode = msgspec.msgpack.Encoder().encode
_decoders: dict[type, msgspec.msgpack.Decoder] = {}


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


class BrokerConnection(asyncio.Protocol):
    """One client connection; ``broker`` provides handle / connection_made / connection_lost.

    Event loop only (``respond`` too: the store's threads reach it through the loop)."""

    __slots__ = (
        "broker", "decoder", "transport", "peer", "closed", "held", "_out", "_later", "_paused",
        "oneway_opaque",
    )

    def __init__(self, broker: Any, max_frame_size: int) -> None:
        self.broker = broker
        self.decoder = FrameDecoder(max_frame_size=max_frame_size, header_types=raw_headers)
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.closed = False
        #: Held (long-polling) pulls of this connection, dropped when it closes.
        self.held: set[Any] = set()
        self._out: list | None = None
        # Writes made outside data_received (a group commit's answers, a woken held pull),
        # sent together at the end of the loop iteration; None when nothing waits.
        self._later: list | None = None
        self._paused = False
        #: Opaque of the one-way request being handled: ``respond`` drops answers to it, so
        #: no handler can answer a one-way request by mistake (Broker.handle sets it).
        self.oneway_opaque: int | None = None

    # -- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        if peer:
            self.peer = f"{peer[0]}:{peer[1]}"
        self.broker.connection_made(self)

    def data_received(self, data: bytes) -> None:
        try:
            frames = self.decoder.feed(data)
        except RemoteProtocolError as exc:
            log.warning("closing connection from %s: %s", self.peer, exc.message)
            self.close()
            return
        out = self._out = []
        handle = self.broker.handle
        try:
            for frame in frames:
                handle(self, frame)
        finally:
            self._out = None
            if self._later is not None:  # keep the order: earlier writes first
                out[:0] = self._later
                self._later = None
            if out and not self.closed:
                self.transport.writelines(out)

    def eof_received(self) -> bool:
        try:
            self.decoder.eof()
        except RemoteProtocolError as exc:
            log.info("connection from %s: %s", self.peer, exc.message)
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.broker.connection_lost(self)

    def pause_writing(self) -> None:
        # The peer does not read its responses: stop reading its requests until it does.
        self._paused = True
        if not self.closed:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._paused = False
        if not self.closed:
            self.transport.resume_reading()

    # -- writing -------------------------------------------------------------------------------
    def write(self, parts: list) -> None:
        if self._out is not None:
            self._out.extend(parts)
        elif not self.closed:
            # Outside data_received: coalesce this loop iteration's writes into one system call
            # (a SYNC_FLUSH group commit answers up to a round's worth of sends at once; a
            # writelines each cost ~7 µs of system time per send).
            later = self._later
            if later is None:
                self._later = list(parts)
                self.broker.loop.call_soon(self._write_later)
            else:
                later.extend(parts)

    def _write_later(self) -> None:
        later, self._later = self._later, None
        if later and not self.closed:
            self.transport.writelines(later)

    def respond(self, opaque: int, code: int, header: Any, bodies: list | None = None) -> None:
        """Send a response; ``bodies`` are written after the header, each untouched."""
        if opaque == self.oneway_opaque:
            return  # a one-way request is never answered
        if bodies:
            n = 0
            for b in bodies:
                n += len(b)
            self.write([encode_response(opaque, code, header, n), *bodies])
        else:
            self.write([encode_response(opaque, code, header)])

    def send_oneway_request(self, code: int, header: Any) -> None:
        """A broker -> client one-way request (NOTIFY_CONSUMER_IDS_CHANGED); never answered."""
        if not self.closed:
            self.write(encode_frame_parts(Frame(code, 0, FLAG_ONEWAY, header)))

    def respond_error(self, opaque: int, code: int, message: str) -> None:
        self.respond(opaque, code, ErrorResponseHeader(message=message))

    def close(self) -> None:
        if not self.closed:
            later, self._later = self._later, None
            if later and self.transport is not None:
                self.transport.writelines(later)  # written before the close, as before
            self.closed = True
            if self.transport is not None:
                self.transport.close()
