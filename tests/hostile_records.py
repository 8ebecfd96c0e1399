"""Builders of hostile batches the client refuses to build: CRC-valid batches whose tags, keys,
properties or topic are not UTF-8, and decompression bombs of each codec.

Each is what a careless or hostile producer can put on the wire (or what a bug, a replica or an
older version left on disk): the CRCs are right, so only a reader that decodes the content can
tell. Shared by the protocol, client and broker tests of "tolerate on the way out".
"""

from __future__ import annotations

import zlib

import lz4.block
import zstandard

from tidemq.protocol.record import (
    BATCH_MAGIC,
    CRC_FIELD,
    FORMAT_VERSION,
    INDEX_ENTRY,
    NO_PREPARED_OFFSET,
    PRODUCER_HEADER,
    RECORD_HEADER,
    RECORD_HEADER_SIZE,
    STORE_HEADER,
    STORE_HEADER_SIZE,
    BatchView,
    Compression,
    crc32c,
    seal_store_header,
)

#: Two bytes that never occur in UTF-8 (0xFF, 0xFE): any field holding them does not decode.
NOT_UTF8 = b"\xff\xfe"


def reseal(batch: bytearray) -> bytearray:
    """Recompute both CRCs of ``batch`` after its bytes were changed."""
    v = BatchView(batch)
    p = v.producer_start
    CRC_FIELD.pack_into(batch, p, crc32c(memoryview(batch)[p + 4 :]))
    seal_store_header(batch, 0, p)
    return batch


def poison(batch: bytearray, placeholder: str, bad: bytes | None = None) -> bytearray:
    """``batch`` with the one occurrence of ``placeholder`` (UTF-8, at least 2 bytes) after the
    store header replaced by ``bad`` (default: NOT_UTF8 then the placeholder's tail) of the same
    length, CRCs resealed: a CRC-valid batch whose field is not UTF-8."""
    old = placeholder.encode()
    new = bad if bad is not None else NOT_UTF8 + old[len(NOT_UTF8) :]
    assert len(new) == len(old) and len(old) >= 2
    start = STORE_HEADER_SIZE
    i = batch.index(old, start)
    assert batch.find(old, i + 1) < 0, f"{placeholder!r} occurs more than once"
    batch[i : i + len(old)] = new
    return reseal(batch)


def _records(body_len: int) -> bytes:
    """One record header for a body of ``body_len`` bytes (the body follows: zeros)."""
    return RECORD_HEADER.pack(RECORD_HEADER_SIZE - 4 + body_len, 1, 0, 0, 0, 0, body_len)


def compressed_zeros(codec: int, raw_size: int, *, content_size: bool = True) -> bytes:
    """A records section of one message whose body is ``raw_size - 28`` zero bytes,
    compressed, without ever holding the raw bytes (except lz4: block mode has no stream)."""
    head = _records(raw_size - RECORD_HEADER_SIZE)
    chunk = bytes(1 << 20)
    left = raw_size - len(head)
    if codec == Compression.ZLIB:
        c = zlib.compressobj(9)
        parts = [c.compress(head)]
        while left > 0:
            parts.append(c.compress(chunk[: min(left, len(chunk))]))
            left -= len(chunk)
        parts.append(c.flush())
        return b"".join(parts)
    if codec == Compression.ZSTD:
        cctx = zstandard.ZstdCompressor(level=3, write_content_size=content_size)
        co = cctx.compressobj(size=raw_size if content_size else -1)
        parts = [co.compress(head)]
        while left > 0:
            parts.append(co.compress(chunk[: min(left, len(chunk))]))
            left -= len(chunk)
        parts.append(co.flush())
        return b"".join(parts)
    if codec == Compression.LZ4:
        return lz4.block.compress(head + bytes(left), store_size=False, mode="high_compression",
                                  compression=12)
    raise ValueError(codec)


def bomb(topic: str, codec: int, raw_size: int, *, declared: int | None = None,
         content_size: bool = True, queue_id: int = 0, producer_id: int = 0x5EED,
         base_seq: int = 0) -> bytearray:
    """A CRC-valid batch of one message whose records section decompresses to ``raw_size``
    bytes while the batch declares ``declared`` (default: the truth)."""
    records = compressed_zeros(codec, raw_size, content_size=content_size)
    topic_b = topic.encode()
    p = STORE_HEADER_SIZE + len(topic_b)
    q = p + PRODUCER_HEADER.size
    total = q + INDEX_ENTRY.size + len(records)
    buf = bytearray(total)
    STORE_HEADER.pack_into(buf, 0, total, BATCH_MAGIC, FORMAT_VERSION, 0, 0, 0, 0, 0,
                           NO_PREPARED_OFFSET, queue_id, 0, len(topic_b), 0, bytes(16))
    buf[STORE_HEADER_SIZE:p] = topic_b
    PRODUCER_HEADER.pack_into(buf, p, 0, codec, 0, 1, 0, len(records),
                              raw_size if declared is None else declared, producer_id, base_seq,
                              0, bytes(16))
    INDEX_ENTRY.pack_into(buf, q, 0, 0)
    buf[q + INDEX_ENTRY.size :] = records
    return reseal(buf)
