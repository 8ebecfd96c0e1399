"""Forged batches: any bytes in any field, with valid CRCs (what a hostile or buggy producer
can send once it gets the framing right). A byte-level encoder independent of the product's
encoders, so a test can put what they refuse to build: non-UTF-8 tags, keys and properties,
properties over the limit, records that do not tile their section, a raw_size that lies.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field

import lz4.block
import zstandard

from tidemq.protocol.record import (
    BATCH_MAGIC,
    FORMAT_VERSION,
    INDEX_ENTRY,
    KEYS_ENTRY,
    NO_PREPARED_OFFSET,
    PRODUCER_HEADER,
    RECORD_HEADER,
    STORE_HEADER,
    STORE_HEADER_SIZE,
    Compression,
    crc32c,
    seal_store_header,
    tag_hash,
)

__all__ = ["Rec", "forge", "compress"]


@dataclass
class Rec:
    """One message as raw bytes; ``size_fix`` is added to its record_size field (a lie)."""

    body: bytes = b"x"
    tag: bytes = b""
    props: bytes = b""
    keys: bytes | None = None
    size_fix: int = 0
    extra: bytes = field(default=b"")  # bytes after the record (records that do not tile)


def compress(codec: int, raw: bytes) -> bytes:
    if codec == Compression.LZ4:
        return lz4.block.compress(raw, store_size=False)
    if codec == Compression.ZSTD:
        return zstandard.ZstdCompressor(level=1).compress(raw)
    if codec == Compression.ZLIB:
        return zlib.compress(raw, 1)
    return raw


def forge(
    topic: str,
    recs: list[Rec],
    *,
    queue_id: int = 0,
    compression: int = Compression.NONE,
    records: bytes | None = None,
    raw_size: int | None = None,
    count: int | None = None,
    attributes: int | None = None,
    delay_level: int = 0,
    deliver_at: int = 0,
    producer_id: int = 7,
    base_seq: int = 0,
    rels: list[int] | None = None,
    keys_section: bytes | None = None,
    topic_bytes: bytes | None = None,
) -> bytes:
    """A batch of ``recs`` with valid CRCs; every keyword overrides what would be consistent."""
    raw_parts = []
    index = []
    keys = []
    rel = 0
    for i, r in enumerate(recs):
        size = (24 + len(r.tag) + len(r.props) + len(r.body) + r.size_fix) % (1 << 32)
        raw_parts.append(RECORD_HEADER.pack(size, 1, 0, len(r.tag), 0, len(r.props),
                                            len(r.body)) + r.tag + r.props + r.body + r.extra)
        th = 0
        if r.tag:
            try:
                th = tag_hash(r.tag.decode())
            except UnicodeDecodeError:
                th = 1
        index.append((th, rel if rels is None else rels[i]))
        rel += 28 + len(r.tag) + len(r.props) + len(r.body) + len(r.extra)
        if r.keys is not None:
            keys.append(KEYS_ENTRY.pack(i, len(r.keys)) + r.keys)
    raw = b"".join(raw_parts)
    recs_b = compress(compression, raw) if records is None else records
    keys_b = b"".join(keys) if keys_section is None else keys_section
    idx_b = b"".join(INDEX_ENTRY.pack(h, r) for h, r in index)
    tb = topic.encode() if topic_bytes is None else topic_bytes
    p = STORE_HEADER_SIZE + len(tb)
    total = p + 64 + len(idx_b) + len(keys_b) + len(recs_b)
    attrs = compression | (delay_level << 5) if attributes is None else attributes
    buf = bytearray(total)
    STORE_HEADER.pack_into(buf, 0, total, BATCH_MAGIC, FORMAT_VERSION, 0, 0, 0, 0, 0,
                           NO_PREPARED_OFFSET, queue_id, 0, len(tb), 0, bytes(16))
    buf[STORE_HEADER_SIZE:p] = tb
    PRODUCER_HEADER.pack_into(
        buf, p, 0, attrs, 0, len(recs) if count is None else count, len(keys_b), len(recs_b),
        len(raw) if raw_size is None else raw_size, producer_id, base_seq, deliver_at,
        bytes(16),
    )
    q = p + 64
    buf[q : q + len(idx_b)] = idx_b
    q += len(idx_b)
    buf[q : q + len(keys_b)] = keys_b
    q += len(keys_b)
    buf[q:] = recs_b
    struct.pack_into("<I", buf, p, crc32c(memoryview(buf)[p + 4 :]))
    seal_store_header(buf, 0, p)
    return bytes(buf)
