"""The client's hot-path codecs: Messages -> one batch, pulled batches -> MessageExt lists.

Both produce / accept exactly ``record.py``'s batch format (tests compare against
``record.encode_batch`` and ``record.BatchView.messages``); they exist because the generic
versions spend ~0.7 µs (encode) and ~3 µs (decode) per message in Python, which caps a client
far below the broker. The tricks, each measured:

- encode: per-batch numpy arrays for the record headers and the message index instead of a
  ``struct.pack`` per message; messages of equal body size (the common fixed-size case) are laid
  out as one 2-D array with no per-message Python at all; tag hashes are cached per tag.
- decode: the record headers of a batch are gathered by one numpy fancy-index; messages become
  ``MessageExt`` Structs holding body / offset / tags, everything else lazy (``message.py``).

Pure functions: any thread may call them.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence

import numpy as np

from tidemq.client.message import Message, MessageExt, _BatchMeta
from tidemq.protocol.errors import CorruptBatchError
from tidemq.protocol.record import (
    ATTR_COMPRESSION_MASK,
    BATCH_MAGIC,
    CRC_FIELD,
    DEFAULT_MAX_PROPERTIES_SIZE,
    DEFAULT_MAX_RAW_SIZE,
    FORMAT_VERSION,
    INDEX_ENTRY,
    INDEX_ENTRY_SIZE,
    KEYS_ENTRY,
    NO_PREPARED_OFFSET,
    PRODUCER_HEADER,
    PRODUCER_HEADER_SIZE,
    RECORD_HEADER,
    RECORD_HEADER_SIZE,
    STORE_CRC_FROM,
    STORE_HEADER,
    STORE_HEADER_SIZE,
    BatchView,
    Compression,
    MessageData,
    crc32c,
    decode_utf8,
    delay_level_for,
    deliver_at_for,
    encode_batch,
    encode_properties,
    properties_over_limit,
    seal_store_header,
    tag_hash,
    unpack_host,
)

__all__ = [
    "encode_messages",
    "decode_batches",
    "decode_pull_body",
    "set_queue_id",
    "parse_tag_expression",
]

_ZERO16 = bytes(16)
_QUEUE_ID_OFFSET = 44

_REC_DTYPE = np.dtype(
    [
        ("size", "<u4"), ("born_ts", "<i8"), ("flag", "<u4"), ("tl", "<u2"), ("res", "<u2"),
        ("pl", "<u4"), ("bl", "<u4"),
    ]
)
assert _REC_DTYPE.itemsize == RECORD_HEADER_SIZE
_IDX_DTYPE = np.dtype([("hash", "<u8"), ("rel", "<u4")])
assert _IDX_DTYPE.itemsize == INDEX_ENTRY_SIZE
_ARANGE_REC = np.arange(RECORD_HEADER_SIZE, dtype=np.int64)

_tag_hashes: dict[str, int] = {}
_SMALL = 32  # batches up to this many messages are coded without numpy


def _tag_hash(tag: str) -> int:
    h = _tag_hashes.get(tag)
    if h is None:
        h = tag_hash(tag)
        if len(_tag_hashes) < 65536:  # bounded: tags are few in practice
            _tag_hashes[tag] = h
    return h


_tag_entries: dict[str, tuple[bytes, int]] = {}


def _tag_entry(tag: str) -> tuple[bytes, int]:
    """(UTF-8 bytes, hash) of a tag, cached: tags are few, and both cost per message."""
    e = _tag_entries.get(tag)
    if e is None:
        b = tag.encode()
        if len(b) > 0xFFFF:
            raise ValueError("tags must be at most 65535 bytes")
        e = (b, tag_hash(tag))
        if len(_tag_entries) < 65536:
            _tag_entries[tag] = e
    return e


def _props_bytes(props: dict[str, str], i: int, max_props: int) -> bytes:
    """``record.encode_properties`` for one message in one join and two counts: a separator
    inside a name or value shows as more separators than properties, and then the reference
    encoder names the culprit."""
    s = "".join([f"{k}\x01{v}\x02" for k, v in props.items()])
    n = len(props)
    if s.count("\x01") != n or s.count("\x02") != n:
        b = encode_properties(props)  # raises, naming the property
    else:
        b = s.encode()
    if len(b) > max_props:
        raise ValueError(properties_over_limit(i, len(b), max_props))
    return b


def encode_messages(
    topic: str,
    messages: Sequence[Message],
    *,
    queue_id: int,
    producer_id: int,
    base_seq: int,
    born_ts: int,
    born_host: bytes = _ZERO16,
    born_port: int = 0,
    compression: int = Compression.NONE,
    compress_min: int = 0,
    max_properties_size: int = DEFAULT_MAX_PROPERTIES_SIZE,
) -> bytearray:
    """One batch holding ``messages`` (all of ``topic``), as ``record.encode_batch`` builds it.

    ``born_host`` is the 16-byte packed address (``record.pack_host``); every message gets
    ``born_ts``. Raises ValueError for a message the format cannot hold or the broker's door
    would refuse (protocol/batch_rules.py): properties over ``max_properties_size``, a
    negative delay level (one above 31 is clamped, as the broker clamps one above its highest).
    """
    n = len(messages)
    if n == 1 and compression == Compression.NONE:
        m = messages[0]
        if not (m.keys or m.delay_level or m.deliver_at):
            return _encode_one(topic, queue_id, m, producer_id, base_seq, born_ts, born_host,
                               born_port, max_properties_size)
    if n == 0:
        raise ValueError("a batch holds at least one message")
    topic_b = topic.encode()
    if not topic_b or len(topic_b) > 0xFFFF:
        raise ValueError("topic must be 1..65535 bytes of UTF-8")
    p = STORE_HEADER_SIZE + len(topic_b)
    q = p + PRODUCER_HEADER_SIZE
    plain = not any(
        [m.tags or m.properties or m.keys or m.delay_level or m.deliver_at for m in messages]
    )
    if plain and compression == Compression.NONE and n > _SMALL:
        # A large plain batch is written straight into its final buffer (no extra copies).
        bodies = [m.body for m in messages]
        lens = np.fromiter(map(len, bodies), dtype=np.int64, count=n)
        rec_size = int(lens.sum()) + n * RECORD_HEADER_SIZE
        r = q + n * INDEX_ENTRY_SIZE
        buf = bytearray(r + rec_size)
        _plain_into(buf, q, r, bodies, lens, born_ts)
        return _seal(buf, p, topic_b, queue_id, producer_id, base_seq, born_host, born_port,
                     n, 0, rec_size, 0, 0)
    delay = deliver_at = 0
    if not plain:
        delay = messages[0].delay_level
        deliver_at = messages[0].deliver_at
        if any(m.delay_level != delay or m.deliver_at != deliver_at for m in messages):
            raise ValueError("all messages of one batch must share delay_level and deliver_at")
        delay = delay_level_for(delay)
        deliver_at = deliver_at_for(deliver_at)
    if compression != Compression.NONE:
        return _encode_generic(
            topic, messages, queue_id, producer_id, base_seq, born_ts, born_host, born_port,
            compression, compress_min, max_properties_size,
        )
    if n > _SMALL:
        # One allocation, one copy of every payload: the sections joined straight into the
        # batch buffer after room for the headers.
        parts, index, keys, rec_size = _general_records(messages, born_ts, max_properties_size)
        buf = bytearray().join([bytes(q), index, keys, *parts])
        return _seal(buf, p, topic_b, queue_id, producer_id, base_seq, born_host, born_port,
                     n, len(keys), rec_size, delay, deliver_at)
    records, index, keys = _small_records(messages, born_ts, max_properties_size)
    total = q + len(index) + len(keys) + len(records)
    buf = bytearray(total)
    buf[q : q + len(index)] = index
    q += len(index)
    if keys:
        buf[q : q + len(keys)] = keys
        q += len(keys)
    buf[q:] = records
    return _seal(buf, p, topic_b, queue_id, producer_id, base_seq, born_host, born_port, n,
                 len(keys), len(records), delay, deliver_at)


# A batch of one message (what ``Producer.send(msg)`` sends), after its store header:
# the producer section, the one index entry and the record header, packed in one call.
_ONE_TAIL = struct.Struct(
    "<I"  # P+0   batch_crc (0, then CRC'd)
    "H"  # P+4   attributes (0: no compression, no delay)
    "H"  # P+6   born_port
    "I"  # P+8   count (1)
    "I"  # P+12  keys_size (0)
    "I"  # P+16  records_size
    "I"  # P+20  raw_size (= records_size)
    "Q"  # P+24  producer_id
    "Q"  # P+32  base_seq
    "q"  # P+40  deliver_at (0)
    "16s"  # P+48  born_host
    "Q"  # P+64  index: tag_hash
    "I"  # P+72  index: rel_offset (0)
    "I"  # P+76  record_size
    "q"  # P+80  born_ts
    "I"  # P+88  flag (0)
    "H"  # P+92  tags_len
    "H"  # P+94  reserved
    "I"  # P+96  props_len
    "I"  # P+100 body_len
)
assert _ONE_TAIL.size == PRODUCER_HEADER_SIZE + INDEX_ENTRY_SIZE + RECORD_HEADER_SIZE
_one_heads: dict[tuple[str, int], bytes] = {}


def _one_head(topic: str, queue_id: int) -> bytes:
    """Bytes [4, 72 + topic_len) of a producer's batch for (topic, queue_id): magic, version,
    store_crc and the store fields. On the wire they depend on nothing else, so their CRC is
    computed once per queue instead of once per message."""
    key = (topic, queue_id)
    head = _one_heads.get(key)
    if head is None:
        topic_b = topic.encode()
        if not topic_b or len(topic_b) > 0xFFFF:
            raise ValueError("topic must be 1..65535 bytes of UTF-8")
        buf = bytearray(STORE_HEADER_SIZE + len(topic_b))
        STORE_HEADER.pack_into(
            buf, 0, 0, BATCH_MAGIC, FORMAT_VERSION, 0, 0, 0, 0, 0, NO_PREPARED_OFFSET,
            queue_id, 0, len(topic_b), 0, _ZERO16,
        )
        buf[STORE_HEADER_SIZE:] = topic_b
        seal_store_header(buf, 0, len(buf))
        head = bytes(buf[4:])
        if len(_one_heads) < 65536:  # bounded: a producer writes to few queues
            _one_heads[key] = head
    return head


def _encode_one(
    topic: str, queue_id: int, m: Message, producer_id: int, base_seq: int, born_ts: int,
    born_host: bytes, born_port: int, max_props: int = DEFAULT_MAX_PROPERTIES_SIZE,
) -> bytearray:
    """A batch of one message without keys, delay or compression: the bytes of
    ``record.encode_batch`` (tests compare them) with one ``pack_into`` for the fixed fields
    and one CRC, ~4x cheaper than the general path for a single send."""
    head = _one_head(topic, queue_id)
    tags = m.tags
    if tags:
        tags_b = tags.encode()
        if len(tags_b) > 0xFFFF:
            raise ValueError("tags must be at most 65535 bytes")
        thash = _tag_hash(tags)
    else:
        tags_b = b""
        thash = 0
    props_b = encode_properties(m.properties) if m.properties else b""
    if len(props_b) > max_props:
        raise ValueError(properties_over_limit(0, len(props_b), max_props))
    body = m.body
    p = len(head) + 4
    payload_at = p + _ONE_TAIL.size
    rec_size = RECORD_HEADER_SIZE + len(tags_b) + len(props_b) + len(body)
    total = payload_at + rec_size - RECORD_HEADER_SIZE
    buf = bytearray(total)
    buf[4:p] = head
    _ONE_TAIL.pack_into(
        buf, p, 0, 0, born_port, 1, 0, rec_size, rec_size, producer_id, base_seq, 0, born_host,
        thash, 0, rec_size - 4, born_ts, 0, len(tags_b), 0, len(props_b), len(body),
    )
    if props_b:
        tags_b += props_b
    if tags_b:
        buf[payload_at : payload_at + len(tags_b)] = tags_b
        payload_at += len(tags_b)
    buf[payload_at:] = body
    CRC_FIELD.pack_into(buf, 0, total)  # total_size, outside both CRCs
    CRC_FIELD.pack_into(buf, p, crc32c(memoryview(buf)[p + 4 :]))
    return buf


def _seal(
    buf: bytearray, p: int, topic_b: bytes, queue_id: int, producer_id: int, base_seq: int,
    born_host: bytes, born_port: int, n: int, keys_size: int, records_size: int, delay: int,
    deliver_at: int,
) -> bytearray:
    """Write both headers and the topic into ``buf`` (sections already in place), CRC it."""
    total = len(buf)
    STORE_HEADER.pack_into(
        buf, 0, total, BATCH_MAGIC, FORMAT_VERSION, 0, 0, 0, 0, 0, NO_PREPARED_OFFSET,
        queue_id, 0, len(topic_b), 0, _ZERO16,
    )
    buf[STORE_HEADER_SIZE:p] = topic_b
    PRODUCER_HEADER.pack_into(
        buf, p, 0, delay << 5, born_port, n, keys_size, records_size, records_size,
        producer_id, base_seq, deliver_at, born_host,
    )
    buf[p : p + 4] = crc32c(memoryview(buf)[p + 4 :]).to_bytes(4, "little")
    seal_store_header(buf, 0, p)
    return buf


def _plain_into(
    buf: bytearray, idx_at: int, rec_at: int, bodies: list[bytes], lens: np.ndarray,
    born_ts: int,
) -> None:
    """Index and records of messages with no tags, keys or properties, written into ``buf``."""
    n = len(bodies)
    hdr = np.zeros(n, dtype=_REC_DTYPE)
    hdr["size"] = lens + (RECORD_HEADER_SIZE - 4)
    hdr["born_ts"] = born_ts
    hdr["bl"] = lens
    rec_sizes = lens + RECORD_HEADER_SIZE
    arr = np.frombuffer(buf, dtype=np.uint8)
    idx = arr[idx_at:rec_at].view(_IDX_DTYPE)
    idx["rel"] = np.cumsum(rec_sizes) - rec_sizes
    rec = arr[rec_at:]
    first = int(lens[0])
    if bool((lens == first).all()):
        # Fixed-size bodies: one 2-D array, header columns then body columns, no Python loop.
        rec2d = rec.reshape(n, RECORD_HEADER_SIZE + first)
        rec2d[:, :RECORD_HEADER_SIZE] = hdr.view(np.uint8).reshape(n, RECORD_HEADER_SIZE)
        if first:
            joined = np.frombuffer(b"".join(bodies), dtype=np.uint8)
            rec2d[:, RECORD_HEADER_SIZE:] = joined.reshape(n, first)
        return
    hv = memoryview(hdr.tobytes())
    parts: list[bytes | memoryview] = [b""] * (2 * n)
    parts[0::2] = [hv[i : i + RECORD_HEADER_SIZE]
                   for i in range(0, n * RECORD_HEADER_SIZE, RECORD_HEADER_SIZE)]
    parts[1::2] = bodies
    rec[:] = np.frombuffer(b"".join(parts), dtype=np.uint8)


def _small_records(messages: Sequence[Message], born_ts: int, max_props: int
                   ) -> tuple[bytes, bytes, bytes]:
    """Records, index and keys of a few messages: struct only (numpy's per-call overhead of
    several microseconds outweighs its gain below ~_SMALL messages)."""
    pack = RECORD_HEADER.pack
    pack_idx = INDEX_ENTRY.pack
    parts: list[bytes] = []
    idx: list[bytes] = []
    keys_parts: list[bytes] = []
    rel = 0
    for i, m in enumerate(messages):
        tags = m.tags
        tags_b = tags.encode() if tags else b""
        if len(tags_b) > 0xFFFF:
            raise ValueError("tags must be at most 65535 bytes")
        props_b = encode_properties(m.properties) if m.properties else b""
        if len(props_b) > max_props:
            raise ValueError(properties_over_limit(i, len(props_b), max_props))
        body = m.body
        size = RECORD_HEADER_SIZE - 4 + len(tags_b) + len(props_b) + len(body)
        parts.append(pack(size, born_ts, 0, len(tags_b), 0, len(props_b), len(body)))
        if tags_b:
            parts.append(tags_b)
        if props_b:
            parts.append(props_b)
        parts.append(body)
        idx.append(pack_idx(_tag_hash(tags) if tags_b else 0, rel))  # type: ignore[arg-type]
        rel += size + 4
        if m.keys:
            kb = m.keys_string.encode()  # type: ignore[union-attr]
            if len(kb) > 0xFFFF:
                raise ValueError("keys must be at most 65535 bytes")
            keys_parts.append(KEYS_ENTRY.pack(i, len(kb)))
            keys_parts.append(kb)
    return b"".join(parts), b"".join(idx), b"".join(keys_parts)


def _general_records(messages: Sequence[Message], born_ts: int, max_props: int
                     ) -> tuple[list[bytes | memoryview], bytes, bytes, int]:
    """Records, index and keys section of messages with tags, keys or properties, each of its
    own size, tags, keys and properties: per message only what differs (its tag from a cache,
    its properties, three lengths); the record headers and the index are built as columns
    (numpy). Returns (the records as parts to join, index, keys, records size)."""
    n = len(messages)
    tls = [0] * n
    pls = [0] * n
    bls = [0] * n
    hashes = [0] * n
    tbs: list[bytes] = [b""] * n
    pbs: list[bytes] = [b""] * n
    bodies: list[bytes] = [b""] * n
    keys_parts: list[bytes] = []
    entries = _tag_entries
    for i, m in enumerate(messages):
        tags = m.tags
        if tags:
            e = entries.get(tags) or _tag_entry(tags)
            tbs[i] = tb = e[0]
            tls[i] = len(tb)
            hashes[i] = e[1]
        props = m.properties
        if props:
            pbs[i] = pb = _props_bytes(props, i, max_props)
            pls[i] = len(pb)
        bodies[i] = body = m.body
        bls[i] = len(body)
        k = m.keys
        if k:
            kb = (k if type(k) is str else m.keys_string).encode()  # type: ignore[union-attr]
            if len(kb) > 0xFFFF:
                raise ValueError("keys must be at most 65535 bytes")
            keys_parts.append(KEYS_ENTRY.pack(i, len(kb)))
            keys_parts.append(kb)
    hdr = np.zeros(n, dtype=_REC_DTYPE)
    tl = np.array(tls, dtype=np.int64)
    pl = np.array(pls, dtype=np.int64)
    bl = np.array(bls, dtype=np.int64)
    sizes = tl + pl + bl + (RECORD_HEADER_SIZE - 4)
    hdr["size"] = sizes
    hdr["born_ts"] = born_ts
    hdr["tl"] = tl
    hdr["pl"] = pl
    hdr["bl"] = bl
    idx = np.empty(n, dtype=_IDX_DTYPE)
    idx["hash"] = np.array(hashes, dtype=np.uint64)
    ends = np.cumsum(sizes + 4)
    idx["rel"] = ends - (sizes + 4)
    hv = memoryview(hdr.tobytes())
    parts: list[bytes | memoryview] = [b""] * (4 * n)
    parts[0::4] = [hv[i : i + RECORD_HEADER_SIZE]
                   for i in range(0, n * RECORD_HEADER_SIZE, RECORD_HEADER_SIZE)]
    parts[1::4] = tbs
    parts[2::4] = pbs
    parts[3::4] = bodies
    return parts, idx.tobytes(), b"".join(keys_parts), int(ends[-1])


def _encode_generic(
    topic: str,
    messages: Sequence[Message],
    queue_id: int,
    producer_id: int,
    base_seq: int,
    born_ts: int,
    born_host: bytes,
    born_port: int,
    compression: int,
    compress_min: int,
    max_props: int,
) -> bytearray:
    """The reference encoder (compression, per-batch delay) for what the fast path skips."""
    data = [
        MessageData(m.body, m.tags, m.keys_string, m.properties, 0, born_ts) for m in messages
    ]
    return encode_batch(
        topic, data, queue_id=queue_id, producer_id=producer_id, base_seq=base_seq,
        born_host=unpack_host(born_host) if born_host != _ZERO16 else None,
        born_port=born_port, deliver_at=messages[0].deliver_at,
        delay_level=messages[0].delay_level, compression=compression,
        compress_min=compress_min, max_properties_size=max_props,
    )


def set_queue_id(batch: bytearray, queue_id: int) -> None:
    """Re-target an encoded batch at another queue (a retry on another broker) in place."""
    batch[_QUEUE_ID_OFFSET : _QUEUE_ID_OFFSET + 4] = queue_id.to_bytes(4, "little")
    topic_len = int.from_bytes(batch[52:54], "little")
    seal_store_header(batch, 0, STORE_HEADER_SIZE + topic_len)


# -- decoding ------------------------------------------------------------------------------------


def parse_tag_expression(expression: str | None) -> frozenset[str] | None:
    """``"*"`` / empty -> None (everything); ``"TagA || TagB"`` -> {"TagA", "TagB"}."""
    if expression is None:
        return None
    expression = expression.strip()
    if not expression or expression == "*":
        return None
    tags = frozenset(t.strip() for t in expression.split("||") if t.strip())
    if not tags:
        raise ValueError(f"subscription expression {expression!r} names no tag")
    return tags


def decode_batches(
    body: bytes | bytearray | memoryview,
    *,
    from_offset: int,
    broker_name: str = "",
    tags: frozenset[str] | None = None,
    check_crc: bool = True,
    topic: str | None = None,
    max_uncompressed: int = DEFAULT_MAX_RAW_SIZE,
) -> list[MessageExt]:
    """Messages with queue offset >= ``from_offset`` in the batches of a pull response body.

    ``tags`` (from :func:`parse_tag_expression`) keeps only messages whose tag is in the set
    (the broker filters by tag hash only). Raises CorruptBatchError for damaged bytes or a
    record that does not decode (strict: readers that must go on use :func:`decode_pull_body`
    with ``on_corrupt``).
    """
    return decode_pull_body(body, from_offset=from_offset, broker_name=broker_name, tags=tags,
                            check_crc=check_crc, topic=topic,
                            max_uncompressed=max_uncompressed)[0]


def decode_pull_body(
    body: bytes | bytearray | memoryview,
    *,
    from_offset: int,
    broker_name: str = "",
    tags: frozenset[str] | None = None,
    check_crc: bool = True,
    topic: str | None = None,
    on_corrupt: Callable[[int, int, str], None] | None = None,
    max_uncompressed: int = DEFAULT_MAX_RAW_SIZE,
) -> tuple[list[MessageExt], int]:
    """:func:`decode_batches` plus the queue offset right after the last batch of the body
    (``from_offset`` when the body is empty).

    ``on_corrupt(queue_offset, count, reason)`` (CO9; "tolerate on the way out"): what cannot
    be decoded is reported there and skipped instead of raising, so a consumer moves past it:

    - a batch failing its CRC, or whose records do not decompress (or would decompress to more
      than ``max_uncompressed`` bytes, or to another size than the batch declares), or whose
      record sizes do not add up: the whole batch, ``count`` its messages;
    - one message whose tag, keys or properties are not UTF-8: that message alone, count 1
      (the others of its batch are delivered);
    - a batch whose framing is broken ends the body (its end cannot be known): count -1.

    Each batch's headers -- and for a batch of one message its index entry and record header
    too -- are read by one ``struct.unpack_from`` (:func:`_heads`); a single-message,
    uncompressed, keyless batch then becomes its MessageExt right here. Anything else, and any
    batch failing a check, goes through the general paths (BatchView for what looks damaged, so
    errors read as BatchView words them).
    """
    mv = body if isinstance(body, memoryview) else memoryview(body)
    end = len(mv)
    if not end:
        return [], from_offset
    based = _base_bytes(mv)
    if based is None:
        # One copy of the whole body rather than one per batch: every message slices its body
        # out of this one bytes object.
        buf: bytes = bytes(mv)
        boff = 0
        mv = memoryview(buf)
    else:
        buf, boff = based
    out: list[MessageExt] = []
    append = out.append
    end_offset = from_offset
    heads = _heads(len(topic.encode()) if topic else 0)  # the batches of a pull share a topic
    last_tb = b""
    btopic = topic if topic is not None else ""
    bad: list[tuple[int, str]] | None = [] if on_corrupt is not None else None
    pos = 0
    while pos < end:
        a = boff + pos
        avail = end - pos
        h = None
        if avail >= heads.size:
            h = heads.unpack_from(buf, a)
            if heads.size != _HEADS_FIXED + h[11]:  # another topic length than guessed
                heads = _heads(h[11])
                h = heads.unpack_from(buf, a) if avail >= heads.size else None
        if h is not None:
            total = h[0]
            p = STORE_HEADER_SIZE + h[11]
            count = h[17]
            # BatchView's framing checks, then verify()'s two CRCs.
            if not (h[1] == BATCH_MAGIC and h[2] == FORMAT_VERSION and not h[3]
                    and total <= avail and count
                    and p + PRODUCER_HEADER_SIZE + count * INDEX_ENTRY_SIZE + h[18] + h[19]
                    == total
                    and (not check_crc
                         or (crc32c(mv[pos + p + 4 : pos + total]) == h[14]
                             and crc32c(mv[pos + STORE_CRC_FROM : pos + p]) == h[4]))):
                h = None
        if h is None:
            # Damaged (or too short for the combined read): BatchView checks and words it.
            nxt, end_offset = _decode_checked(mv, buf, boff, pos, from_offset, end_offset,
                                              broker_name, tags, check_crc, topic, on_corrupt,
                                              out, max_uncompressed)
            if nxt < 0:
                break
            pos = nxt
            continue
        qo = h[6]
        if qo + count > end_offset:
            end_offset = qo + count
        start = from_offset - qo
        if start >= count:
            pos += total
            continue
        if start < 0:
            start = 0
        if topic is None:
            tb = buf[a + STORE_HEADER_SIZE : a + p]
            if tb != last_tb:
                try:
                    btopic = tb.decode()
                except UnicodeDecodeError:
                    if on_corrupt is None:
                        raise CorruptBatchError("topic: not UTF-8") from None
                    on_corrupt(qo + start, count - start, "topic: not UTF-8")
                    pos += total
                    continue
                last_tb = tb
        rec = a + p + PRODUCER_HEADER_SIZE + INDEX_ENTRY_SIZE
        if count == 1 and not h[18] and not h[15] & ATTR_COMPRESSION_MASK and not h[26]:
            # One message (RocketMQ's send(msg)): its record header was read with the batch's.
            tl, pl, bl = h[30], h[32], h[33]
            q = rec + RECORD_HEADER_SIZE
            n = tl + pl + bl
            if h[27] + 4 == RECORD_HEADER_SIZE + n and n <= h[19] - RECORD_HEADER_SIZE:
                try:
                    tag = buf[q : q + tl].decode() if tl else None
                    if pl:
                        buf[q + tl : q + tl + pl].decode()  # properties must decode too
                except UnicodeDecodeError:
                    why = _why_undecodable(buf, q, tl, pl, 0)
                    if on_corrupt is None:
                        raise CorruptBatchError(why) from None
                    on_corrupt(qo, 1, why)
                    pos += total
                    continue
                if tags is None or tag in tags:
                    q += tl + pl
                    append(MessageExt(buf[q : q + bl], qo, tag,
                                      _BatchMeta(btopic, broker_name, h, buf, a, buf, rec), 0))
                pos += total
                continue
        elif on_corrupt is None:
            out.extend(_decode_general(mv, buf, a, pos, h, rec, start, btopic, broker_name,
                                       tags, max_uncompressed, None))
            pos += total
            continue
        else:
            try:
                out.extend(_decode_general(mv, buf, a, pos, h, rec, start, btopic,
                                           broker_name, tags, max_uncompressed, bad))
            except CorruptBatchError as exc:
                on_corrupt(qo + start, count - start, exc.message)
            if bad:
                for i, why in bad:
                    on_corrupt(qo + i, 1, why)
                bad.clear()
            pos += total
            continue
        # A single-message batch whose record sizes disagree: let the checked path word it.
        nxt, end_offset = _decode_checked(mv, buf, boff, pos, from_offset, end_offset,
                                          broker_name, tags, check_crc, topic, on_corrupt, out,
                                          max_uncompressed)
        if nxt < 0:
            break
        pos = nxt
    return out, end_offset


# Bytes of a batch that _heads(topic_len) reads, less the topic: both headers, index entry 0
# and record header 0 (with no keys section, message 0's record follows index entry 0).
_HEADS_FIXED = STORE_HEADER_SIZE + PRODUCER_HEADER_SIZE + INDEX_ENTRY_SIZE + RECORD_HEADER_SIZE
_heads_by_topic_len: dict[int, struct.Struct] = {}


def _heads(topic_len: int) -> struct.Struct:
    """One struct over a batch whose topic is ``topic_len`` bytes: STORE_HEADER's 14 fields
    (0-13), the topic skipped, PRODUCER_HEADER's 11 (14-24) -- the layout of
    ``_BatchMeta.h`` -- then index entry 0 (25-26) and record header 0 (27-33), which are
    where they say only when the batch has no keys section."""
    s = _heads_by_topic_len.get(topic_len)
    if s is None:
        s = struct.Struct(
            STORE_HEADER.format + f"{topic_len}x" + PRODUCER_HEADER.format[1:]
            + INDEX_ENTRY.format[1:] + RECORD_HEADER.format[1:]
        )
        assert s.size == _HEADS_FIXED + topic_len
        _heads_by_topic_len[topic_len] = s
    return s


def _why_undecodable(raw: bytes, q: int, tl: int, pl: int, i: int) -> str:
    """Which string of the record at ``raw[q:]`` (tags ``tl`` bytes, then properties ``pl``)
    is not UTF-8, in BatchView's words. Only called once a decode has failed."""
    try:
        if tl:
            decode_utf8(raw[q : q + tl], f"tags of message {i}")
        decode_utf8(raw[q + tl : q + tl + pl], f"properties of message {i}")
    except CorruptBatchError as exc:
        return exc.message
    return f"message {i} does not decode"


def _keys_checked(src: bytes, q: int, size: int, count: int
                  ) -> tuple[dict[int, str], dict[int, str]]:
    """The keys section at ``src[q:q + size]``: (index -> keys that decode, index -> why the
    keys of that message do not). CorruptBatchError when its framing is broken."""
    out: dict[int, str] = {}
    bad: dict[int, str] = {}
    end = q + size
    while q < end:
        if q + 6 > end:
            raise CorruptBatchError("keys section entry is truncated")
        i, n = KEYS_ENTRY.unpack_from(src, q)
        q += 6
        if q + n > end or i >= count:
            raise CorruptBatchError("keys section entry points outside the batch")
        try:
            out[i] = decode_utf8(src[q : q + n], f"keys of message {i}")
        except CorruptBatchError as exc:
            bad[i] = exc.message
        q += n
    return out, bad


def _decode_general(
    mv: memoryview, buf: bytes, a: int, pos: int, h: tuple, rec: int, start: int, topic: str,
    broker_name: str, tags: frozenset[str] | None, max_raw: int,
    bad: list[tuple[int, str]] | None,
) -> list[MessageExt]:
    """Messages ``start..`` of the framed, CRC-checked batch at ``buf[a:]`` (``mv[pos:]``)
    whose headers are ``h``; ``rec`` is where its records would start without keys.

    A message that does not decode is appended to ``bad`` as (index, reason) and skipped, or
    raises CorruptBatchError when ``bad`` is None; a batch-wide problem always raises."""
    if h[15] & ATTR_COMPRESSION_MASK:
        raw = bytes(BatchView(mv, pos).raw_records(max_raw))
        off, rlen = 0, len(raw)
    else:
        raw = buf
        off = rec - INDEX_ENTRY_SIZE + h[17] * INDEX_ENTRY_SIZE + h[18]
        rlen = off + h[19]
    meta = _BatchMeta(topic, broker_name, h, buf, a, raw, off)
    bad_keys: dict[int, str] = {}
    if h[18]:  # keys: checked once per batch here, so MessageExt.keys never fails later
        meta._keys, bad_keys = _keys_checked(buf, rec - INDEX_ENTRY_SIZE
                                             + h[17] * INDEX_ENTRY_SIZE, h[18], h[17])
    if bad is None:
        msgs = _decode_one(meta, raw, off, rlen, h[17], start, tags, None)
        for m in msgs:
            if m._i in bad_keys:
                raise CorruptBatchError(bad_keys[m._i])
        return msgs
    msgs = _decode_one(meta, raw, off, rlen, h[17], start, tags, bad)
    if bad_keys:
        bad.extend((m._i, bad_keys[m._i]) for m in msgs if m._i in bad_keys)
        msgs = [m for m in msgs if m._i not in bad_keys]
    return msgs


def _decode_checked(
    mv: memoryview, buf: bytes, boff: int, pos: int, from_offset: int, end_offset: int,
    broker_name: str, tags: frozenset[str] | None, check_crc: bool, topic: str | None,
    on_corrupt: Callable[[int, int, str], None] | None, out: list[MessageExt], max_raw: int,
) -> tuple[int, int]:
    """The batch at ``mv[pos:]`` through BatchView and every check, messages appended to
    ``out``: (where the next batch starts, or -1 to stop; the new end offset)."""
    try:
        view = BatchView(mv, pos)
    except CorruptBatchError as exc:
        if on_corrupt is None:
            raise
        on_corrupt(end_offset, -1, str(exc))
        return -1, end_offset
    nxt = pos + view.total_size
    end_offset = max(end_offset, view.queue_offset + view.count)
    start = from_offset - view.queue_offset
    if start >= view.count:
        return nxt, end_offset
    start = max(start, 0)
    bad: list[tuple[int, str]] | None = [] if on_corrupt is not None else None
    try:
        if check_crc:
            view.verify()
        h = STORE_HEADER.unpack_from(mv, pos) + PRODUCER_HEADER.unpack_from(
            mv, pos + view.producer_start)
        out.extend(_decode_general(mv, buf, boff + pos, pos, h,
                                   boff + pos + view.index_start + INDEX_ENTRY_SIZE, start,
                                   topic if topic is not None else view.topic, broker_name,
                                   tags, max_raw, bad))
    except CorruptBatchError as exc:
        if on_corrupt is None:
            raise
        on_corrupt(view.queue_offset + start, view.count - start, str(exc))
    if bad and on_corrupt is not None:
        for i, why in bad:
            on_corrupt(view.queue_offset + i, 1, why)
    return nxt, end_offset


def _base_bytes(mv: memoryview) -> tuple[bytes, int] | None:
    """(the bytes object ``mv`` views, the offset of ``mv[0]`` in it), or None."""
    base = mv.obj
    if type(base) is not bytes or not mv.contiguous or mv.itemsize != 1:
        return None
    if len(mv) == len(base):
        return base, 0
    off = np.frombuffer(mv, dtype=np.uint8).ctypes.data - np.frombuffer(
        base, dtype=np.uint8).ctypes.data
    if not 0 <= off <= len(base) - len(mv):
        return None
    return base, off


def _decode_small(
    meta: _BatchMeta, raw: bytes, off: int, rlen: int, count: int, start: int,
    tags: frozenset[str] | None, bad: list[tuple[int, str]] | None,
) -> list[MessageExt]:
    out: list[MessageExt] = []
    unpack_idx = INDEX_ENTRY.unpack_from
    unpack_rec = RECORD_HEADER.unpack_from
    index = meta.src
    ipos = meta.index_pos()
    qo = meta.queue_offset
    for i in range(start, count):
        _h, rel = unpack_idx(index, ipos + i * INDEX_ENTRY_SIZE)
        rel += off
        if rel + RECORD_HEADER_SIZE > rlen:
            raise CorruptBatchError(f"message {i} starts outside the records section")
        size, _ts, _f, tl, _r, pl, bl = unpack_rec(raw, rel)
        q = rel + RECORD_HEADER_SIZE
        if size + 4 != RECORD_HEADER_SIZE + tl + pl + bl or q + tl + pl + bl > rlen:
            raise CorruptBatchError(f"message {i} record sizes are inconsistent")
        try:
            tag = raw[q : q + tl].decode() if tl else None
            if tags is not None and tag not in tags:
                continue
            if pl:
                raw[q + tl : q + tl + pl].decode()  # properties must decode too
        except UnicodeDecodeError:
            why = _why_undecodable(raw, q, tl, pl, i)
            if bad is None:
                raise CorruptBatchError(why) from None
            bad.append((i, why))
            continue
        s = q + tl + pl
        out.append(MessageExt(raw[s : s + bl], qo + i, tag, meta, i))
    return out


def _decode_one(
    meta: _BatchMeta, raw: bytes, off: int, rlen: int, count: int, start: int,
    tags: frozenset[str] | None, bad: list[tuple[int, str]] | None,
) -> list[MessageExt]:
    """Messages ``start..count-1`` of a batch whose records section is ``raw[off:rlen]``;
    undecodable ones go to ``bad`` (see :func:`_decode_general`)."""
    if count - start <= _SMALL:
        return _decode_small(meta, raw, off, rlen, count, start, tags, bad)
    idx = np.frombuffer(meta.src, dtype=_IDX_DTYPE, count=count, offset=meta.index_pos())[start:]
    rel = idx["rel"].astype(np.int64) + off
    if len(rel) and (int(rel.max()) + RECORD_HEADER_SIZE > rlen or int(rel.min()) < off):
        raise CorruptBatchError("a message of the batch starts outside its records section")
    rawnp = np.frombuffer(raw, dtype=np.uint8)
    hdr = rawnp[rel[:, None] + _ARANGE_REC].view(_REC_DTYPE).reshape(-1)
    tl = hdr["tl"].astype(np.int64)
    pl = hdr["pl"].astype(np.int64)
    bl = hdr["bl"].astype(np.int64)
    sizes = hdr["size"].astype(np.int64)
    bstart = rel + RECORD_HEADER_SIZE + tl + pl
    bend = bstart + bl
    if bool(((sizes + 4) != (RECORD_HEADER_SIZE + tl + pl + bl)).any()) or (
        len(bend) and int(bend.max()) > rlen
    ):
        raise CorruptBatchError("record sizes of the batch are inconsistent")
    qo = meta.queue_offset
    b = meta
    n = len(rel)
    if not bool(tl.any()) and not bool(pl.any()):
        if tags is not None:
            return []
        return [
            MessageExt(raw[s:e], qo + i, None, b, i)
            for i, s, e in zip(range(start, start + n), bstart.tolist(), bend.tolist(), strict=True)
        ]
    # Tags or properties: each is decoded (tags are kept, properties only checked so that
    # MessageExt.properties never fails later); an undecodable record is skipped.
    tstart = (rel + RECORD_HEADER_SIZE).tolist()
    tls = tl.tolist()
    pls = pl.tolist()
    out: list[MessageExt] = []
    append = out.append
    for i, s, e, ts, t, p in zip(
        range(start, start + n), bstart.tolist(), bend.tolist(), tstart, tls, pls, strict=True
    ):
        try:
            tag = raw[ts : ts + t].decode() if t else None
            if tags is not None and tag not in tags:
                continue
            if p:
                raw[ts + t : s].decode()
        except UnicodeDecodeError:
            why = _why_undecodable(raw, ts, t, p, i)
            if bad is None:
                raise CorruptBatchError(why) from None
            bad.append((i, why))
            continue
        append(MessageExt(raw[s:e], qo + i, tag, b, i))
    return out
