"""The reference codec of the batch (layout in ``layout.py``): the general encoder
(:func:`encode_batch`), the validated zero-copy view (:class:`BatchView`) and its decoded
messages (:class:`StoredMessage`), the serving path's lean check (:func:`stored_span`), and the
helpers for the variable parts (properties, hosts, UTF-8, compression).

Properties are encoded as RocketMQ does: ``name 0x01 value 0x02`` repeated (neither byte may
appear in a name or value). A message's unique id is derived, never stored: the 32 hex digits of
``producer_id`` and ``base_seq + i``; this is what SendResult.msg_id and the id index use.
"""

from __future__ import annotations

import functools
import ipaddress
import struct
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import lz4.block
import zstandard

from tidemq.protocol.batch.layout import (
    ATTR_COMPRESSION_MASK,
    ATTR_DELAY_MASK,
    ATTR_DELAY_SHIFT,
    ATTR_TXN_MASK,
    ATTR_TXN_SHIFT,
    BATCH_MAGIC,
    CRC_FIELD,
    FILLER_MAGIC,
    FILLER_MIN,
    FORMAT_VERSION,
    INDEX_ENTRY,
    INDEX_ENTRY_SIZE,
    KEYS_ENTRY,
    MAX_BATCH_SIZE,
    MAX_DELAY_LEVEL,
    NO_PREPARED_OFFSET,
    PRODUCER_HEADER,
    PRODUCER_HEADER_SIZE,
    PROP_NAME_SEP,
    PROP_SEP,
    RECORD_HEADER,
    RECORD_HEADER_SIZE,
    STORE_CRC_FROM,
    STORE_CRC_OFFSET,
    STORE_HEADER,
    STORE_HEADER_SIZE,
    TOTAL_SIZE_MAGIC,
    ZERO_HOST,
    Compression,
    TxnType,
    crc32c,
)
from tidemq.protocol.batch.tags import tag_hash
from tidemq.protocol.errors import CorruptBatchError, ProtocolError

__all__ = [
    "BATCH_MAGIC",
    "FILLER_MAGIC",
    "FILLER_MIN",
    "STORE_HEADER",
    "PRODUCER_HEADER",
    "INDEX_ENTRY",
    "RECORD_HEADER",
    "Compression",
    "TxnType",
    "MessageData",
    "BatchView",
    "StoredMessage",
    "encode_batch",
    "delay_level_for",
    "deliver_at_for",
    "DEFAULT_MAX_PROPERTIES_SIZE",
    "properties_over_limit",
    "tag_hash",
    "unique_id",
    "parse_unique_id",
    "encode_properties",
    "decode_properties",
    "DEFAULT_MAX_RAW_SIZE",
    "decode_utf8",
    "crc32c",
    "pack_host",
    "unpack_host",
]

def delay_level_for(level: object) -> int:
    """The delay level a batch carries for a requested ``level``: ValueError for a negative
    or non-integer one; one above MAX_DELAY_LEVEL (31, what attribute bits 5-9 hold) is
    clamped to it, and the broker clamps further to its schedule's highest level (18 by
    default), as RocketMQ does with a level above its maximum."""
    if isinstance(level, bool) or not isinstance(level, int):
        raise ValueError(f"delay_level must be an integer, got {level!r}")
    if level < 0:
        raise ValueError(
            f"delay_level must be >= 0 (0 = no delay, 1..18 the broker's levels), got {level}"
        )
    return level if level <= MAX_DELAY_LEVEL else MAX_DELAY_LEVEL


#: Bytes of one message's encoded properties a broker takes by default (RocketMQ: 32 KiB;
#: the broker's ``max_properties_size``, the client's ``Producer(max_properties_size=)``).
DEFAULT_MAX_PROPERTIES_SIZE = 32 * 1024


def properties_over_limit(index: int, size: int, limit: int) -> str:
    """Why message ``index`` with ``size`` bytes of properties is refused (over ``limit``)."""
    return (
        f"message {index} has {size} bytes of properties, over the limit of {limit} "
        "(max_properties_size); move data into the body"
    )


def deliver_at_for(at: object) -> int:
    """``at`` as the batch's deliver_at (ms since the epoch, 0 = now): ValueError unless it is
    an integer in 0..2**63-1 (the field is an i64)."""
    if isinstance(at, bool) or not isinstance(at, int):
        raise ValueError(f"deliver_at must be an integer (ms since the epoch), got {at!r}")
    if not 0 <= at < 1 << 63:
        raise ValueError(f"deliver_at must be 0 (now) or ms since the epoch, got {at}")
    return at

def unique_id(producer_id: int, seq: int) -> str:
    """The 32-hex-digit unique message id of message ``seq`` of producer ``producer_id``
    (both u64 fields of a batch: one 128-bit number formats the same digits in half the time
    of two; a sequence past u64, ``base_seq + i`` of a batch at the top, keeps its digits)."""
    if seq >> 64:
        return f"{producer_id:016X}{seq:016X}"
    return "%032X" % (producer_id << 64 | seq)


def parse_unique_id(msg_id: str) -> tuple[int, int]:
    """Inverse of :func:`unique_id`; raises ValueError on anything else."""
    if len(msg_id) != 32:
        raise ValueError(f"a message id has 32 hex digits, got {msg_id!r}")
    return int(msg_id[:16], 16), int(msg_id[16:], 16)


@functools.lru_cache(maxsize=1024)
def pack_host(host: str | None) -> bytes:
    """16-byte IPv6 form of an address (IPv4 mapped); unknown or empty host -> zeros.
    Cached: a broker or producer talks to few hosts, and ipaddress costs ~10 us a call."""
    if not host:
        return ZERO_HOST
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return ZERO_HOST
    if ip.version == 4:
        return ipaddress.IPv6Address("::ffff:" + str(ip)).packed
    return ip.packed


def unpack_host(raw: bytes) -> str:
    ip = ipaddress.IPv6Address(bytes(raw))
    mapped = ip.ipv4_mapped
    return str(mapped) if mapped is not None else str(ip)


def encode_properties(props: dict[str, str] | None) -> bytes:
    if not props:
        return b""
    parts = []
    for k, v in props.items():
        k, v = str(k), str(v)
        if PROP_NAME_SEP in k or PROP_SEP in k or PROP_NAME_SEP in v or PROP_SEP in v:
            raise ValueError(f"property {k!r} contains a reserved separator byte 0x01/0x02")
        parts.append(f"{k}{PROP_NAME_SEP}{v}{PROP_SEP}")
    return "".join(parts).encode()


def decode_properties(raw: bytes | memoryview) -> dict[str, str]:
    """Properties of one record; CorruptBatchError when they are not UTF-8."""
    if not raw:
        return {}
    out = {}
    for item in decode_utf8(raw, "properties").split(PROP_SEP):
        if item:
            k, _, v = item.partition(PROP_NAME_SEP)
            out[k] = v
    return out


def decode_utf8(raw: bytes | memoryview, what: str) -> str:
    """``raw`` decoded as UTF-8; CorruptBatchError naming ``what`` (and the byte) if it is not.
    Every string of a batch (topic, tags, keys, properties) is read through here, so a reader
    meets one error type for every kind of undecodable record."""
    try:
        return str(raw, "utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptBatchError(
            f"{what}: not UTF-8 ({exc.reason} at byte {exc.start} of {len(raw)})"
        ) from None


def _compress(codec: int, raw: bytes) -> bytes:
    if codec == Compression.LZ4:
        packed: bytes = lz4.block.compress(raw, store_size=False)
        return packed
    if codec == Compression.ZSTD:
        return zstandard.ZstdCompressor(level=1).compress(raw)
    if codec == Compression.ZLIB:
        return zlib.compress(raw, 1)
    raise ValueError(f"unknown compression codec {codec}")


#: The largest uncompressed records section a reader accepts when it passes no limit of its
#: own: the broker's default largest batch (max_message_size 4 MiB plus 64 KiB of headers).
#: The broker passes its configured limit, a consumer its ``max_uncompressed_bytes``.
DEFAULT_MAX_RAW_SIZE = 4 * 1024 * 1024 + 64 * 1024


def _decompress(
    codec: int, data: bytes | memoryview, raw_size: int, limit: int = DEFAULT_MAX_RAW_SIZE
) -> bytes:
    """The records section, never more than ``raw_size`` bytes of output, and ``raw_size``
    itself at most ``limit``: a batch declaring or holding more (a decompression bomb) is
    CorruptBatchError before more than ``raw_size`` bytes are ever allocated.

    lz4 block: the output buffer is ``raw_size`` and the decoder stops at its end. zstd: the
    frame's own content size, when it has one, must be ``raw_size`` (python-zstandard sizes its
    output from that field and ignores ``max_output_size`` then); without one, the output is
    capped at ``raw_size``. zlib: a decompressobj with ``max_length = raw_size``; a stream that
    has not ended by then is too large."""
    if raw_size > limit:
        raise CorruptBatchError(
            f"records section declares {raw_size} bytes uncompressed, over this reader's limit "
            f"of {limit} bytes"
        )
    if raw_size < RECORD_HEADER_SIZE:
        # cannot hold one record; and 0 would mean "no limit" to zlib's max_length
        raise CorruptBatchError(f"records section declares {raw_size} bytes uncompressed")
    try:
        if codec == Compression.LZ4:
            out: bytes = lz4.block.decompress(data, uncompressed_size=raw_size)
        elif codec == Compression.ZSTD:
            declared = zstandard.frame_content_size(data)
            if declared not in (-1, raw_size):
                raise CorruptBatchError(
                    f"zstd frame says {declared} bytes uncompressed, the batch {raw_size}"
                )
            out = zstandard.ZstdDecompressor().decompress(data, max_output_size=raw_size)
        elif codec == Compression.ZLIB:
            d = zlib.decompressobj()
            out = d.decompress(data, raw_size)
            if not d.eof:
                raise CorruptBatchError(
                    f"zlib stream does not end within the batch's raw_size of {raw_size} bytes"
                )
        else:
            raise CorruptBatchError(f"unknown compression codec {codec} in batch attributes")
    except CorruptBatchError:
        raise
    except Exception as exc:  # every codec raises its own type; all mean the same here
        raise CorruptBatchError(f"records section does not decompress: {exc}") from exc
    if len(out) != raw_size:
        raise CorruptBatchError(
            f"records decompress to {len(out)} bytes, the batch says {raw_size}"
        )
    return out


@dataclass(slots=True)
class MessageData:
    """What a producer puts in one message; ``encode_batch`` turns a list of them into a batch."""

    body: bytes
    tags: str | None = None
    keys: str | None = None
    properties: dict[str, str] | None = None
    flag: int = 0
    born_ts: int = 0


def encode_batch(
    topic: str,
    messages: Sequence[MessageData],
    *,
    queue_id: int = 0,
    producer_id: int = 0,
    base_seq: int = 0,
    born_host: str | None = None,
    born_port: int = 0,
    deliver_at: int = 0,
    delay_level: int = 0,
    txn: int = TxnType.NOT_TYPE,
    compression: int = Compression.NONE,
    compress_min: int = 0,
    reconsume_times: int = 0,
    prepared_offset: int = NO_PREPARED_OFFSET,
    max_properties_size: int | None = None,
) -> bytearray:
    """Encode ``messages`` into one batch (store fields zero, as a producer sends it).

    ``compression`` is applied only when the raw records are at least ``compress_min`` bytes and
    the result is smaller. ``max_properties_size``: ValueError for a message whose properties
    encode to more bytes (None: no limit -- the broker's door has one, batch_rules.py).
    """
    if not messages:
        raise ValueError("a batch holds at least one message")
    delay_level = delay_level_for(delay_level)
    deliver_at = deliver_at_for(deliver_at)
    topic_b = topic.encode()
    if not topic_b or len(topic_b) > 0xFFFF:
        raise ValueError("topic must be 1..65535 bytes of UTF-8")
    n = len(messages)
    index = bytearray(n * INDEX_ENTRY_SIZE)
    keys_parts: list[bytes] = []
    rec_parts: list[bytes] = []
    rel = 0
    pack_rec = RECORD_HEADER.pack
    pack_idx = INDEX_ENTRY.pack_into
    for i, m in enumerate(messages):
        tags_b = m.tags.encode() if m.tags else b""
        props_b = encode_properties(m.properties)
        if max_properties_size is not None and len(props_b) > max_properties_size:
            raise ValueError(properties_over_limit(i, len(props_b), max_properties_size))
        body = m.body if isinstance(m.body, bytes | bytearray) else bytes(m.body)
        if len(tags_b) > 0xFFFF:
            raise ValueError("tags must be at most 65535 bytes")
        size = RECORD_HEADER_SIZE - 4 + len(tags_b) + len(props_b) + len(body)
        rec_parts.append(
            pack_rec(size, m.born_ts, m.flag, len(tags_b), 0, len(props_b), len(body))
        )
        rec_parts.append(tags_b)
        rec_parts.append(props_b)
        rec_parts.append(body)
        pack_idx(index, i * INDEX_ENTRY_SIZE, tag_hash(m.tags), rel)
        rel += size + 4
        if m.keys:
            kb = m.keys.encode()
            if len(kb) > 0xFFFF:
                raise ValueError("keys must be at most 65535 bytes")
            keys_parts.append(KEYS_ENTRY.pack(i, len(kb)))
            keys_parts.append(kb)
    raw = b"".join(rec_parts)
    records = raw
    codec = Compression.NONE
    if compression != Compression.NONE and len(raw) >= compress_min:
        packed = _compress(compression, raw)
        if len(packed) < len(raw):
            records, codec = packed, compression
    keys = b"".join(keys_parts)
    attributes = codec | (txn << ATTR_TXN_SHIFT) | (delay_level << ATTR_DELAY_SHIFT)
    p = STORE_HEADER_SIZE + len(topic_b)
    total = p + PRODUCER_HEADER_SIZE + len(index) + len(keys) + len(records)
    if total > MAX_BATCH_SIZE:
        raise ValueError(f"batch of {total} bytes exceeds the format limit {MAX_BATCH_SIZE}")
    buf = bytearray(total)
    STORE_HEADER.pack_into(
        buf, 0, total, BATCH_MAGIC, FORMAT_VERSION, 0, 0, 0, 0, 0, prepared_offset,
        queue_id, reconsume_times, len(topic_b), 0, ZERO_HOST,
    )
    buf[STORE_HEADER_SIZE:p] = topic_b
    PRODUCER_HEADER.pack_into(
        buf, p, 0, attributes, born_port, n, len(keys), len(records), len(raw),
        producer_id, base_seq, deliver_at, pack_host(born_host),
    )
    q = p + PRODUCER_HEADER_SIZE
    buf[q : q + len(index)] = index
    q += len(index)
    buf[q : q + len(keys)] = keys
    q += len(keys)
    buf[q:] = records
    CRC_FIELD.pack_into(buf, p, crc32c(memoryview(buf)[p + 4 :]))
    seal_store_header(buf, 0, p)
    return buf


def seal_store_header(buf: bytearray | memoryview, pos: int, producer_start: int) -> None:
    """Recompute store_crc of the batch at ``pos`` after its store fields changed.

    ``producer_start`` is the producer section's offset relative to ``pos`` (72 + topic_len).
    """
    mv = memoryview(buf)
    CRC_FIELD.pack_into(
        buf, pos + STORE_CRC_OFFSET, crc32c(mv[pos + STORE_CRC_FROM : pos + producer_start])
    )


@dataclass(slots=True)
class StoredMessage:
    """One decoded message of a batch (what consumers see as MessageExt)."""

    topic: str
    queue_id: int
    queue_offset: int
    phys_offset: int
    index: int
    body: bytes
    tags: str | None
    keys: str | None
    properties: dict[str, str]
    flag: int
    born_ts: int
    store_ts: int
    born_host: str
    store_host: str
    reconsume_times: int
    msg_id: str
    delay_level: int = 0
    deliver_at: int = 0
    txn: int = 0
    prepared_offset: int = NO_PREPARED_OFFSET
    extra: dict[str, object] = field(default_factory=dict)


class BatchView:
    """Zero-copy, validated view of one batch in a buffer (a mapping, a frame body, bytes).

    Construction checks the framing (sizes, magic, section bounds) and raises
    :class:`CorruptBatchError` for anything malformed; ``verify()`` also checks both CRCs.
    Header fields are plain attributes; messages are decoded lazily by :meth:`messages`.
    """

    __slots__ = (
        "buf", "pos", "total_size", "store_crc", "phys_offset", "queue_offset", "store_ts",
        "prepared_offset", "queue_id", "reconsume_times", "topic_len", "store_port",
        "store_host_raw", "producer_start", "batch_crc", "attributes", "born_port", "count",
        "keys_size", "records_size", "raw_size", "producer_id", "base_seq", "deliver_at",
        "born_host_raw", "index_start", "keys_start", "records_start", "_keys",
    )
    buf: memoryview
    pos: int
    total_size: int
    store_crc: int
    phys_offset: int
    queue_offset: int
    store_ts: int
    prepared_offset: int
    queue_id: int
    reconsume_times: int
    topic_len: int
    store_port: int
    store_host_raw: bytes
    producer_start: int
    batch_crc: int
    attributes: int
    born_port: int
    count: int
    keys_size: int
    records_size: int
    raw_size: int
    producer_id: int
    base_seq: int
    deliver_at: int
    born_host_raw: bytes
    index_start: int
    keys_start: int
    records_start: int

    def __init__(self, buf: bytes | bytearray | memoryview, pos: int = 0) -> None:
        mv = buf if isinstance(buf, memoryview) else memoryview(buf)
        avail = len(mv) - pos
        if avail < STORE_HEADER_SIZE:
            raise CorruptBatchError(f"{avail} bytes cannot hold a batch header (72 needed)")
        (
            self.total_size, magic, version, reserved, self.store_crc, self.phys_offset,
            self.queue_offset, self.store_ts, self.prepared_offset, self.queue_id,
            self.reconsume_times, self.topic_len, self.store_port, self.store_host_raw,
        ) = STORE_HEADER.unpack_from(mv, pos)
        if magic != BATCH_MAGIC:
            raise CorruptBatchError(f"bad batch magic 0x{magic:04X} (expected 0x{BATCH_MAGIC:04X})")
        if version != FORMAT_VERSION or reserved:
            raise CorruptBatchError(
                f"unsupported batch format version {version} / reserved byte {reserved}"
            )
        total = self.total_size
        p = STORE_HEADER_SIZE + self.topic_len
        if total > avail or total < p + PRODUCER_HEADER_SIZE:
            raise CorruptBatchError(
                f"batch total_size {total} does not fit its headers or the {avail} bytes given"
            )
        (
            self.batch_crc, self.attributes, self.born_port, self.count, self.keys_size,
            self.records_size, self.raw_size, self.producer_id, self.base_seq,
            self.deliver_at, self.born_host_raw,
        ) = PRODUCER_HEADER.unpack_from(mv, pos + p)
        self.buf = mv
        self.pos = pos
        self._keys: dict[int, str] | None = None
        self.producer_start = p
        self.index_start = p + PRODUCER_HEADER_SIZE
        self.keys_start = self.index_start + self.count * INDEX_ENTRY_SIZE
        self.records_start = self.keys_start + self.keys_size
        if self.count == 0 or self.records_start + self.records_size != total:
            raise CorruptBatchError(
                f"batch sections (count {self.count}, keys {self.keys_size}, records "
                f"{self.records_size}) do not add up to total_size {total}"
            )

    # -- integrity -------------------------------------------------------------------------
    def store_crc_ok(self) -> bool:
        mv, pos = self.buf, self.pos
        return crc32c(mv[pos + STORE_CRC_FROM : pos + self.producer_start]) == self.store_crc

    def batch_crc_ok(self) -> bool:
        mv, pos = self.buf, self.pos
        start = pos + self.producer_start + 4
        return crc32c(mv[start : pos + self.total_size]) == self.batch_crc

    def verify(self) -> None:
        """Raise CorruptBatchError unless both CRCs match."""
        if not self.batch_crc_ok():
            raise CorruptBatchError("batch CRC32C mismatch: the producer section is damaged")
        if not self.store_crc_ok():
            raise CorruptBatchError("store header CRC32C mismatch: the batch header is damaged")

    # -- header accessors --------------------------------------------------------------------
    @property
    def topic(self) -> str:
        """The topic; CorruptBatchError when its bytes are not UTF-8."""
        s = self.pos + STORE_HEADER_SIZE
        return decode_utf8(self.buf[s : s + self.topic_len], "topic")

    @property
    def topic_bytes(self) -> bytes:
        s = self.pos + STORE_HEADER_SIZE
        return bytes(self.buf[s : s + self.topic_len])

    @property
    def compression(self) -> int:
        return self.attributes & ATTR_COMPRESSION_MASK

    @property
    def txn(self) -> int:
        return (self.attributes & ATTR_TXN_MASK) >> ATTR_TXN_SHIFT

    @property
    def delay_level(self) -> int:
        return (self.attributes & ATTR_DELAY_MASK) >> ATTR_DELAY_SHIFT

    @property
    def bytes_view(self) -> memoryview:
        """The whole batch, zero-copy."""
        return self.buf[self.pos : self.pos + self.total_size]

    def index_view(self) -> memoryview:
        """count x (tag_hash u64, rel_offset u32) entries, zero-copy."""
        s = self.pos + self.index_start
        return self.buf[s : s + self.count * INDEX_ENTRY_SIZE]

    def tag_hash_at(self, i: int) -> int:
        h: int = INDEX_ENTRY.unpack_from(self.buf, self.pos + self.index_start + i * 12)[0]
        return h

    def keys(self) -> dict[int, str]:
        """message index -> keys string, for messages that have keys; CorruptBatchError for a
        malformed keys section or keys that are not UTF-8. Parsed once per view: the broker's
        door checks the section (batch_rules.py) and the store's key index reads it again."""
        out = self._keys
        if out is None:
            out = self._keys = self._parse_keys(True)
        return out

    def raw_keys(self) -> dict[int, memoryview]:
        """message index -> the keys bytes as stored (not decoded); CorruptBatchError when the
        keys section's framing is broken."""
        return self._parse_keys(False)

    def _parse_keys(self, decode: bool) -> dict[int, Any]:
        """The keys section, entry by entry: CorruptBatchError for an entry truncated,
        pointing outside the batch, or out of message order (entries go in increasing message
        order, one per message), and with ``decode`` for keys that are not UTF-8. One loop
        for both (decoding as it goes costs ~40 % less than a second pass over the entries)."""
        out: dict[int, Any] = {}
        if not self.keys_size:
            return out
        mv = self.buf
        q = self.pos + self.keys_start
        end = q + self.keys_size
        count = self.count
        unpack = KEYS_ENTRY.unpack_from
        last = -1
        i = n = 0
        try:
            while q < end:
                if q + 6 > end:
                    raise CorruptBatchError("keys section entry is truncated")
                i, n = unpack(mv, q)
                q += 6
                if q + n > end or i >= count:
                    raise CorruptBatchError("keys section entry points outside the batch")
                if i <= last:
                    raise CorruptBatchError(
                        f"keys section entry for message {i} follows message {last}: entries "
                        "go in increasing message order, one per message"
                    )
                last = i
                out[i] = str(mv[q : q + n], "utf-8") if decode else mv[q : q + n]
                q += n
        except UnicodeDecodeError:
            decode_utf8(mv[q : q + n], f"keys of message {i}")  # raises, naming the byte
            raise
        return out

    def unique_id(self, i: int) -> str:
        return unique_id(self.producer_id, self.base_seq + i)

    def raw_records(self, limit: int = DEFAULT_MAX_RAW_SIZE) -> memoryview:
        """The records section, decompressed if needed (zero-copy when not compressed); a
        compressed section over ``limit`` bytes uncompressed is CorruptBatchError (see
        :func:`_decompress`)."""
        s = self.pos + self.records_start
        data = self.buf[s : s + self.records_size]
        codec = self.compression
        if codec == Compression.NONE:
            return data
        return memoryview(_decompress(codec, data, self.raw_size, limit))

    def messages(
        self, start: int = 0, limit: int = DEFAULT_MAX_RAW_SIZE
    ) -> Iterator[StoredMessage]:
        """Decode messages ``start..count-1`` (``start`` is the first wanted message).

        Lazily, message by message: CorruptBatchError is raised when the message about to be
        yielded cannot be decoded (record sizes, a tag, key or property that is not UTF-8), so
        a reader that wants one message is not stopped by another. The batch-wide parts --
        the records section (decompressed up to ``limit`` bytes), the keys section's framing,
        the topic -- raise before the first message."""
        raw = self.raw_records(limit)
        keys = self.raw_keys()
        topic = self.topic
        born_host = unpack_host(self.born_host_raw)
        store_host = unpack_host(self.store_host_raw)
        idx = self.index_view()
        rlen = len(raw)
        delay, txn = self.delay_level, self.txn
        for i in range(start, self.count):
            _th, rel = INDEX_ENTRY.unpack_from(idx, i * INDEX_ENTRY_SIZE)
            if rel + RECORD_HEADER_SIZE > rlen:
                raise CorruptBatchError(f"message {i} starts outside the records section")
            size, born_ts, flag, tl, _r, pl, bl = RECORD_HEADER.unpack_from(raw, rel)
            q = rel + RECORD_HEADER_SIZE
            if size + 4 != RECORD_HEADER_SIZE + tl + pl + bl or q + tl + pl + bl > rlen:
                raise CorruptBatchError(f"message {i} record sizes are inconsistent")
            tags = decode_utf8(raw[q : q + tl], f"tags of message {i}") if tl else None
            q += tl
            try:
                props = decode_properties(raw[q : q + pl]) if pl else {}
            except CorruptBatchError as exc:
                raise CorruptBatchError(f"message {i} {exc.message}") from None
            q += pl
            kraw = keys.get(i)
            yield StoredMessage(
                topic=topic, queue_id=self.queue_id, queue_offset=self.queue_offset + i,
                phys_offset=self.phys_offset, index=i, body=bytes(raw[q : q + bl]), tags=tags,
                keys=decode_utf8(kraw, f"keys of message {i}") if kraw is not None else None,
                properties=props, flag=flag, born_ts=born_ts,
                store_ts=self.store_ts, born_host=born_host, store_host=store_host,
                reconsume_times=self.reconsume_times,
                msg_id=unique_id(self.producer_id, self.base_seq + i), delay_level=delay,
                deliver_at=self.deliver_at, txn=txn, prepared_offset=self.prepared_offset,
            )


# What the serving path reads of a stored batch: total_size, magic, version, reserved, store_crc,
# queue_offset (bytes 0-28) and topic_len (52); then batch_crc and count of the producer section.
_SERVE_STORE = struct.Struct("<IHBBI8xQ")
_SERVE_TOPIC_LEN = struct.Struct("<H")
_SERVE_PRODUCER = struct.Struct("<IxxxxI")


def stored_span(
    buf: bytes | bytearray | memoryview, pos: int, size: int, verify: bool = True
) -> tuple[int, int]:
    """(queue_offset, count) of the stored batch of ``size`` bytes at ``pos`` (the size its
    consume-queue unit records), checking the magic, the version and reserved byte, the size,
    the sections and, with ``verify``, both CRCs; CorruptBatchError otherwise.

    The per-batch check of the read path, leaner than a :class:`BatchView`: a stored batch was
    fully validated when it was put, and what can have changed since -- the bytes on disk -- is
    what the two CRCs cover (store_crc: the header from byte 12; batch_crc: the producer
    section); the bytes before 12 are cross-checked against the unit's size and the magic."""
    total, magic, version, reserved, store_crc, queue_offset = _SERVE_STORE.unpack_from(buf, pos)
    if magic != BATCH_MAGIC or version != FORMAT_VERSION or reserved or total != size:
        raise CorruptBatchError(
            f"no batch of {size} bytes here (total_size {total}, magic 0x{magic:04X}, "
            f"version {version}, reserved {reserved})"
        )
    p = pos + STORE_HEADER_SIZE + _SERVE_TOPIC_LEN.unpack_from(buf, pos + 52)[0]
    if p + PRODUCER_HEADER_SIZE > pos + total:
        raise CorruptBatchError(f"batch of {total} bytes cannot hold its headers")
    batch_crc, count = _SERVE_PRODUCER.unpack_from(buf, p)
    if verify:
        mv = buf if isinstance(buf, memoryview) else memoryview(buf)
        if crc32c(mv[p + 4 : pos + total]) != batch_crc:
            raise CorruptBatchError("batch CRC32C mismatch: the producer section is damaged")
        if crc32c(mv[pos + STORE_CRC_FROM : p]) != store_crc:
            raise CorruptBatchError("store header CRC32C mismatch: the batch header is damaged")
    if count == 0:
        raise CorruptBatchError("batch holds no message")
    return queue_offset, count


def read_total_size_magic(buf: bytes | bytearray | memoryview, pos: int) -> tuple[int, int]:
    """(total_size, magic) at ``pos``; used to walk a segment batch by batch."""
    return TOTAL_SIZE_MAGIC.unpack_from(buf, pos)


def check_frame_fits(total_size: int, limit: int) -> None:
    if total_size > limit:
        raise ProtocolError(f"batch of {total_size} bytes exceeds the limit of {limit} bytes")


def filter_fields(
    view: BatchView, start: int, raw: memoryview | None = None
) -> Iterator[tuple[int, str | None, dict[str, str] | None]]:
    """``(index, tag, properties)`` of messages ``start..count-1`` of a batch; properties and
    tag are None for a message whose record does not decode (sizes, UTF-8) -- a filter selects
    nothing then, and the reader that later decodes the whole message reports it. ``raw``: the
    batch's records section when the caller already has it (decompressed)."""
    if raw is None:
        raw = view.raw_records()
    idx = view.index_view()
    rlen = len(raw)
    unpack_index = INDEX_ENTRY.unpack_from
    unpack_record = RECORD_HEADER.unpack_from
    for i in range(start, view.count):
        rel = unpack_index(idx, i * INDEX_ENTRY_SIZE)[1]
        if rel + RECORD_HEADER_SIZE > rlen:
            yield i, None, None
            continue
        size, _born, _flag, tl, _r, pl, bl = unpack_record(raw, rel)
        q = rel + RECORD_HEADER_SIZE
        if size + 4 != RECORD_HEADER_SIZE + tl + pl + bl or q + tl + pl + bl > rlen:
            yield i, None, None
            continue
        try:
            tag = decode_utf8(raw[q : q + tl], "tags") if tl else None
            props = decode_properties(raw[q + tl : q + tl + pl]) if pl else {}
        except CorruptBatchError:
            yield i, None, None
            continue
        yield i, tag, props
