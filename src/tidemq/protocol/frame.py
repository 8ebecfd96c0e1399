"""The tidemq wire frame: one request, response or one-way message on a connection (sans-IO).

A connection carries a stream of frames, each prefixed by its length. All integers are
little-endian, like the batch format in ``batch/layout.py``. The layout, field by field::

    +------+------+------------------+------------------------------------------------------+
    |  off | size | field            | meaning                                              |
    +------+------+------------------+------------------------------------------------------+
    |    0 |    4 | total_len   u32  | bytes of the frame after this field (14 + H + B)     |
    |    4 |    1 | magic       u8   | 0xD7 (FRAME_MAGIC)                                   |
    |    5 |    1 | version     u8   | 1 (FRAME_VERSION)                                    |
    |    6 |    1 | flags       u8   | bit 0 RESPONSE, bit 1 ONEWAY (never both); the other |
    |      |      |                  | bits are 0                                           |
    |    7 |    1 | reserved    u8   | 0                                                    |
    |    8 |    2 | code        u16  | request code (codes.RequestCode), or, in a response, |
    |      |      |                  | the response code (codes.ResponseCode)               |
    |   10 |    4 | opaque      u32  | correlation id: a response repeats its request's     |
    |   14 |    4 | header_len  u32  | H, bytes of the header that follows                  |
    +------+------+------------------+------------------------------------------------------+
    |   18 |    H | header           | one MessagePack map (a ``headers.py`` Struct or a    |
    |      |      |                  | dict with str keys); H = 0 means "no header"         |
    | 18+H |    B | body             | opaque bytes: B = total_len - 14 - H; for sends and  |
    |      |      |                  | pulls, one or more batches (``batch/``), as is       |
    +------+------+------------------+------------------------------------------------------+

The body is never re-encoded: :func:`encode_frame_parts` hands it to the transport untouched
(a stored batch, a memoryview of a mapped segment) and :class:`FrameDecoder` returns it as a
zero-copy memoryview of the bytes received.

Errors: :class:`LocalProtocolError` when our caller asks for a frame that cannot be sent (a value
out of range, a header that does not encode, a frame over the size limit);
:class:`RemoteProtocolError` when the peer's bytes break the layout. After a
RemoteProtocolError the stream cannot be resynchronised and the connection must be closed.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import msgspec

from tidemq.protocol.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "FRAME_MAGIC",
    "FRAME_VERSION",
    "FRAME_PREFIX",
    "PREFIX_SIZE",
    "MIN_TOTAL_LEN",
    "FLAG_RESPONSE",
    "FLAG_ONEWAY",
    "DEFAULT_MAX_FRAME_SIZE",
    "INLINE_BODY_MAX",
    "Frame",
    "HeaderResolver",
    "FrameDecoder",
    "encode_frame",
    "encode_frame_parts",
    "encode_frame_head",
    "encode_frame_vectored",
    "encode_header",
    "decode_header",
]

FRAME_MAGIC = 0xD7
FRAME_VERSION = 1

FRAME_PREFIX = struct.Struct(
    "<I"  # 0  total_len (bytes after this field)
    "B"  # 4  magic
    "B"  # 5  version
    "B"  # 6  flags
    "B"  # 7  reserved
    "H"  # 8  code
    "I"  # 10 opaque
    "I"  # 14 header_len
)
PREFIX_SIZE = 18
assert FRAME_PREFIX.size == PREFIX_SIZE
MIN_TOTAL_LEN = PREFIX_SIZE - 4  # a frame with neither header nor body

FLAG_RESPONSE = 0x01
FLAG_ONEWAY = 0x02

#: Largest frame (length field included) accepted by default: a 16 MiB batch plus room for the
#: frame prefix and header.
DEFAULT_MAX_FRAME_SIZE = 16 * 1024 * 1024 + 64 * 1024
#: encode_frame_parts copies a body up to this size into the prefix buffer (one write beats two).
INLINE_BODY_MAX = 16 * 1024

# What msgspec raises on hostile input: DecodeError (a ValueError), UnicodeDecodeError (likewise)
# for a string that is not UTF-8, RecursionError for absurd nesting.
_DECODE_ERRORS = (ValueError, RecursionError, OverflowError)

_EMPTY_MAP = b"\x80"  # MessagePack {} -- what a typed header decodes from when H = 0

Buffer = bytes | bytearray | memoryview

#: ``(flags, code, opaque) -> header type or None``; None decodes the header as ``dict[str, Any]``.
HeaderResolver = Callable[[int, int, int], "type | None"]


class Frame(msgspec.Struct):
    """One frame. ``header`` is a msgspec Struct, a dict, None (no header) or, when sending only,
    already-encoded MessagePack bytes; ``body`` is bytes-like and never copied by this module."""

    code: int
    opaque: int
    flags: int = 0
    header: Any = None
    body: Buffer = b""

    @property
    def is_response(self) -> bool:
        return bool(self.flags & FLAG_RESPONSE)

    @property
    def is_oneway(self) -> bool:
        return bool(self.flags & FLAG_ONEWAY)

    @classmethod
    def request(
        cls, code: int, opaque: int, header: Any = None, body: Buffer = b"", *, oneway: bool = False
    ) -> Frame:
        return cls(code, opaque, FLAG_ONEWAY if oneway else 0, header, body)

    def response(self, code: int = 0, header: Any = None, body: Buffer = b"") -> Frame:
        """The response to this request frame (same opaque); code 0 is SUCCESS."""
        if self.flags & (FLAG_RESPONSE | FLAG_ONEWAY):
            kind = "a response" if self.flags & FLAG_RESPONSE else "a one-way request"
            raise LocalProtocolError(
                f"frame (code {self.code}, opaque {self.opaque}) is {kind}; it gets no response"
            )
        return Frame(code, self.opaque, FLAG_RESPONSE, header, body)


# -- header codec -----------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
_generic_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(dict[str, Any])
_decoders: dict[type, msgspec.msgpack.Decoder[Any]] = {}


def _decoder_for(header_type: type | None) -> msgspec.msgpack.Decoder[Any]:
    if header_type is None:
        return _generic_decoder
    dec = _decoders.get(header_type)
    if dec is None:
        dec = _decoders[header_type] = msgspec.msgpack.Decoder(header_type)
    return dec


def encode_header(header: Any) -> bytes:
    """MessagePack bytes of a header Struct or dict; LocalProtocolError if it does not encode."""
    try:
        return _encoder.encode(header)
    except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:
        raise LocalProtocolError(
            f"header {type(header).__name__} does not encode as MessagePack: {exc}"
        ) from exc


def decode_header(raw: Buffer, header_type: type | None = None) -> Any:
    """Decode header bytes into ``header_type`` (a Struct), or into a dict when None.

    Empty ``raw`` is "no header": None for a dict, else the Struct built from an empty map
    (which fails if the Struct has required fields). Bad input raises RemoteProtocolError.
    """
    if not raw:
        if header_type is None:
            return None
        raw = _EMPTY_MAP
    try:
        return _decoder_for(header_type).decode(raw)
    except _DECODE_ERRORS as exc:
        name = "a map" if header_type is None else header_type.__name__
        raise RemoteProtocolError(f"frame header does not decode as {name}: {exc}") from exc


# -- encoding ---------------------------------------------------------------------------------


def _encode_parts(frame: Frame, max_frame_size: int) -> tuple[bytes, Buffer, Buffer, int]:
    """(prefix, header bytes, body, body length) of ``frame``, every rule checked."""
    header, body, flags = frame.header, frame.body, frame.flags
    if header is None:
        hb: Buffer = b""
    elif type(header) is bytes:
        hb = header
    elif isinstance(header, bytearray | memoryview):
        hb = bytes(header)
    else:
        hb = encode_header(header)
    hlen = len(hb)
    blen = body.nbytes if type(body) is memoryview else len(body)
    total = MIN_TOTAL_LEN + hlen + blen
    if total + 4 > max_frame_size:
        raise LocalProtocolError(
            f"frame of {total + 4} bytes (header {hlen}, body {blen}) exceeds the limit of "
            f"{max_frame_size} bytes; send smaller batches"
        )
    if not 0 <= flags <= FLAG_ONEWAY:  # 0, RESPONSE or ONEWAY; never both
        raise LocalProtocolError(
            f"frame flags {flags!r} are invalid: 0, RESPONSE (0x01) or ONEWAY (0x02)"
        )
    try:
        prefix = FRAME_PREFIX.pack(
            total, FRAME_MAGIC, FRAME_VERSION, flags, 0, frame.code, frame.opaque, hlen
        )
    except struct.error as exc:
        raise LocalProtocolError(
            f"frame code {frame.code!r} must be 0..65535 and opaque {frame.opaque!r} "
            f"0..4294967295 ({exc})"
        ) from exc
    return prefix, hb, body, blen


def encode_frame(frame: Frame, *, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> bytes:
    """The whole frame as one bytes object (copies the body once; see encode_frame_parts)."""
    prefix, hb, body, _ = _encode_parts(frame, max_frame_size)
    return b"".join((prefix, hb, body))


def encode_frame_parts(
    frame: Frame,
    *,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    inline_body_max: int = INLINE_BODY_MAX,
) -> list[Buffer]:
    """The frame as buffers for ``transport.writelines``: ``[prefix + header, body]``.

    A body over ``inline_body_max`` bytes is returned as the very object given (a memoryview of
    a mapped segment stays one); a smaller body is joined into the first buffer.
    """
    prefix, hb, body, blen = _encode_parts(frame, max_frame_size)
    if blen > inline_body_max:
        return [prefix + hb, body]
    return [b"".join((prefix, hb, body))]


def encode_frame_head(
    frame: Frame, body_len: int, *, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
) -> bytes:
    """Prefix + header of ``frame`` for a body of ``body_len`` bytes that the caller writes
    right after it, in as many pieces as it likes (``frame.body`` is ignored).

    This is how a broker answers a pull with several stored batches without joining them: write
    the head, then each batch's memoryview (``transport.writelines``)."""
    if body_len < 0:
        raise LocalProtocolError(f"body length must be >= 0, got {body_len}")
    head = Frame(frame.code, frame.opaque, frame.flags, frame.header, b"")
    prefix, hb, _body, _ = _encode_parts(head, max_frame_size)
    total = MIN_TOTAL_LEN + len(hb) + body_len
    if total + 4 > max_frame_size:
        raise LocalProtocolError(
            f"frame of {total + 4} bytes (header {len(hb)}, body {body_len}) exceeds the limit "
            f"of {max_frame_size} bytes; send smaller batches"
        )
    # _encode_parts packed total_len for an empty body; patch in the real one.
    return struct.pack("<I", total) + prefix[4:] + hb


def encode_frame_vectored(
    frame: Frame, bodies: list[Buffer], *, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
) -> list[Buffer]:
    """The frame whose body is ``bodies`` concatenated, as buffers for ``transport.writelines``:
    ``[prefix + header, *bodies]``. No body is copied or joined (``frame.body`` is ignored)."""
    n = 0
    for b in bodies:
        n += b.nbytes if type(b) is memoryview else len(b)
    return [encode_frame_head(frame, n, max_frame_size=max_frame_size), *bodies]


# -- decoding ---------------------------------------------------------------------------------


def _prefix_problem(buf: bytes, pos: int, max_frame_size: int) -> str | None:
    """What is wrong with the (possibly partial) prefix at ``pos``, for a person; None if fine."""
    avail = len(buf) - pos
    first = buf[pos : pos + 8].hex(" ")
    if avail >= 5 and buf[pos + 4] != FRAME_MAGIC:
        return (
            f"bad frame magic 0x{buf[pos + 4]:02X} (expected 0x{FRAME_MAGIC:02X}); the peer does "
            f"not speak the tidemq protocol (frame starts {first})"
        )
    if avail >= 6 and buf[pos + 5] != FRAME_VERSION:
        return f"unsupported frame version {buf[pos + 5]} (this side speaks {FRAME_VERSION})"
    if avail >= 4:
        (total,) = struct.unpack_from("<I", buf, pos)
        if total + 4 > max_frame_size:
            return (
                f"frame of {total + 4} bytes exceeds the limit of {max_frame_size} bytes "
                f"(frame starts {first})"
            )
        if total < MIN_TOTAL_LEN:
            return f"frame length {total} is below the {MIN_TOTAL_LEN}-byte minimum"
    if avail >= 7:
        flags = buf[pos + 6]
        if flags > FLAG_ONEWAY:
            return f"frame flags 0x{flags:02X} are invalid: only RESPONSE (0x01) or ONEWAY (0x02)"
    if avail >= 8 and buf[pos + 7]:
        return f"frame reserved byte is 0x{buf[pos + 7]:02X}, must be 0"
    if avail >= PREFIX_SIZE:
        total, *_r, header_len = FRAME_PREFIX.unpack_from(buf, pos)
        if header_len > total - MIN_TOTAL_LEN:
            return f"frame header_len {header_len} exceeds the {total - MIN_TOTAL_LEN} bytes left"
    return None


class FrameDecoder:
    """Turns received bytes into frames. Feed it whatever arrives; it buffers partial frames.

    ``header_types`` picks the header Struct of each frame from ``(flags, code, opaque)`` (see
    ``headers.request_header_type`` / ``headers.response_header_type``); it must not raise.
    Without it, or when it returns None, headers decode as ``dict[str, Any]``.

    A non-empty body is a read-only memoryview into the received bytes (zero-copy; it keeps
    that chunk alive, so copy what must outlive the frame); an empty body is ``b""``.

    When :meth:`feed` raises RemoteProtocolError, frames completed earlier in the same call are
    dropped with it and the decoder stays failed: close the connection.

    Memory: a partial frame is held until it completes (at most ``max_frame_size`` bytes).
    A server that cannot afford to hold it calls :meth:`drop_partial`: the bytes held are
    released, the rest of that frame is discarded as it arrives, and once its last byte is in,
    ``(code, opaque, flags)`` of the dropped frame is appended to :attr:`dropped` so the server
    can answer it (SYSTEM_BUSY) -- the stream stays in sync and the connection usable.
    """

    __slots__ = (
        "max_frame_size", "_resolve", "_decoders", "_chunks", "_buffered", "_need", "_failed",
        "_skip", "_skipped", "dropped",
    )

    def __init__(
        self,
        *,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        header_types: HeaderResolver | None = None,
    ) -> None:
        if max_frame_size < PREFIX_SIZE:
            raise ValueError(f"max_frame_size must be at least {PREFIX_SIZE}, got {max_frame_size}")
        self.max_frame_size = max_frame_size
        self._resolve = header_types
        self._decoders: dict[type | None, msgspec.msgpack.Decoder[Any]] = {
            None: _generic_decoder
        }
        self._chunks: list[Buffer] = []  # bytes of an incomplete frame, in arrival order
        self._buffered = 0  # sum of their lengths
        self._need = PREFIX_SIZE  # bytes that complete the frame (PREFIX_SIZE: length unknown)
        self._failed: str | None = None
        self._skip = 0  # bytes of a dropped frame still to discard
        self._skipped: tuple[int, int, int] = (0, 0, 0)  # its (code, opaque, flags)
        #: (code, opaque, flags) of frames dropped with drop_partial whose last byte has
        #: arrived, oldest first; the caller answers and clears it.
        self.dropped: list[tuple[int, int, int]] = []

    @property
    def buffered(self) -> int:
        """Bytes held for a frame that has not fully arrived."""
        return self._buffered

    @property
    def partial_size(self) -> int:
        """Total size (length field included) of the frame being received; 0 when none is
        partially held or its prefix has not fully arrived."""
        return self._need if self._buffered and self._need > PREFIX_SIZE else 0

    @property
    def missing(self) -> int:
        """Bytes the frame being received still lacks; 0 when none is partially held or its
        prefix has not fully arrived (how much a reader may usefully read next)."""
        if self._buffered and self._need > PREFIX_SIZE:
            return self._need - self._buffered
        return 0

    def drop_partial(self) -> bool:
        """Release the partial frame held and discard the rest of it as it arrives (see the
        class docstring). False, and nothing changes, when no frame with a complete prefix is
        partially held."""
        if not self._buffered or self._need <= PREFIX_SIZE or self._failed is not None:
            return False
        head: Buffer = self._chunks[0]
        if len(head) < PREFIX_SIZE:
            head = b"".join(self._chunks)[:PREFIX_SIZE]
        _total, _m, _v, flags, _r, code, opaque, _h = FRAME_PREFIX.unpack_from(head, 0)
        self._skip = self._need - self._buffered
        self._skipped = (code, opaque, flags)
        self._chunks = []
        self._buffered = 0
        self._need = PREFIX_SIZE
        return True

    def take_partial(self) -> tuple[int, bytes]:
        """Hand the partial frame over to the caller: ``(its total size, the bytes of it held)``,
        and forget it, so the caller can receive the rest into one buffer of that size and
        :meth:`feed` the whole frame at once. ``(0, b"")``, and nothing changes, when no frame
        with a complete prefix is partially held (see :attr:`missing`)."""
        if not self._buffered or self._need <= PREFIX_SIZE or self._failed is not None:
            return 0, b""
        held = b"".join(self._chunks)
        need = self._need
        self._chunks = []
        self._buffered = 0
        self._need = PREFIX_SIZE
        return need, held

    def feed(self, data: Buffer) -> list[Frame]:
        """Add received bytes; return the frames they complete (zero or more), in order.

        ``data`` that is not ``bytes`` is copied once (a caller's reusable buffer must not be
        aliased by returned bodies).
        """
        if self._failed is not None:
            raise RemoteProtocolError(f"the connection already failed: {self._failed}")
        if not data:
            return []
        if self._skip:  # the rest of a dropped frame
            n = len(data)
            if n < self._skip:
                self._skip -= n
                return []
            data = data[self._skip :]
            self._skip = 0
            self.dropped.append(self._skipped)
            if not data:
                return []
        if type(data) is not bytes:
            data = bytes(data)
        if self._buffered:
            self._chunks.append(data)
            self._buffered += len(data)
            # Until the prefix is complete every byte is checked, so garbage fails early.
            if self._buffered < self._need and self._need > PREFIX_SIZE:
                return []
            data = b"".join(self._chunks)
            self._chunks = []
            self._buffered = 0
        try:
            return self._parse(data)
        except RemoteProtocolError as exc:
            self._failed = exc.message
            self._chunks = []
            self._buffered = 0
            raise

    def eof(self) -> None:
        """The peer closed the connection: RemoteProtocolError if it stopped mid-frame."""
        if self._buffered and self._failed is None:
            n, need = self._buffered, self._need
            self._chunks = []
            self._buffered = 0
            self._failed = f"connection closed mid-frame ({n} of {need} bytes received)"
            raise RemoteProtocolError(self._failed)

    def _parse(self, data: bytes) -> list[Frame]:
        frames: list[Frame] = []
        append = frames.append
        unpack = FRAME_PREFIX.unpack_from
        resolve = self._resolve
        decoders = self._decoders
        mv = memoryview(data)
        n = len(data)
        max_total = self.max_frame_size - 4
        pos = 0
        total = 0
        while n - pos >= PREFIX_SIZE:
            total, magic, version, flags, reserved, code, opaque, hlen = unpack(data, pos)
            if (
                total > max_total
                or magic != FRAME_MAGIC
                or version != FRAME_VERSION
                or flags > FLAG_ONEWAY  # 0, RESPONSE or ONEWAY; never both
                or reserved
                or total < MIN_TOTAL_LEN
                or hlen > total - MIN_TOTAL_LEN
            ):
                raise RemoteProtocolError(
                    _prefix_problem(data, pos, self.max_frame_size) or "bad frame prefix"
                )
            end = pos + 4 + total
            if end > n:
                break
            hs = pos + PREFIX_SIZE
            if resolve is None:
                htype = None
                dec = _generic_decoder
            else:
                htype = resolve(flags, code, opaque)
                got = decoders.get(htype)
                if got is None:
                    got = decoders[htype] = _decoder_for(htype)
                dec = got
            try:
                if hlen:
                    header = dec.decode(mv[hs : hs + hlen])
                elif htype is None:
                    header = None
                else:
                    header = dec.decode(_EMPTY_MAP)
            except _DECODE_ERRORS as exc:
                want = "a map with string keys" if htype is None else htype.__name__
                raise RemoteProtocolError(
                    f"header of frame (code {code}, opaque {opaque}, flags 0x{flags:02X}) does "
                    f"not decode as {want}: {exc}"
                ) from exc
            bs = hs + hlen
            # An empty body must not pin the received chunk (a suspended pull holds its frame).
            append(Frame(code, opaque, flags, header, mv[bs:end] if bs < end else b""))
            pos = end
        if pos < n:
            rest = n - pos
            if rest < PREFIX_SIZE:
                problem = _prefix_problem(data, pos, self.max_frame_size)
                if problem is not None:
                    raise RemoteProtocolError(problem)
                self._need = PREFIX_SIZE
            else:
                self._need = 4 + total
            self._chunks = [mv[pos:]]
            self._buffered = rest
        return frames
