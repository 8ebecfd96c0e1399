"""Single fields of an encoded batch, read or changed in place (layout in ``layout.py``).

The batch is never re-encoded after the producer built it: a retry re-targets it at another
queue, a transaction producer marks it prepared, the broker moves a half message to another
topic and stamps the store fields at append time. Each of those is one function here, so no
other module computes an offset of the layout.

Pure functions over buffers: any thread.
"""

from __future__ import annotations

from tidemq.protocol.batch.codec import seal_store_header
from tidemq.protocol.batch.layout import (
    ATTR_TXN_MASK,
    ATTR_TXN_SHIFT,
    CRC_FIELD,
    H_TOPIC_LEN,
    H_TOTAL_SIZE,
    P_ATTRIBUTES_OFFSET,
    P_BASE_SEQ_OFFSET,
    P_COUNT_OFFSET,
    P_PRODUCER_ID_OFFSET,
    PHYS_OFFSET_OFFSET,
    PREPARED_OFFSET_OFFSET,
    PRODUCER_HEADER_SIZE,
    QUEUE_ID_OFFSET,
    QUEUE_OFFSET_OFFSET,
    STORE_ADDR_OFFSET,
    STORE_ADDR_SIZE,
    STORE_FIELDS,
    STORE_FIELDS_OFFSET,
    STORE_HEADER,
    STORE_HEADER_SIZE,
    STORE_TS_OFFSET,
    TOPIC_LEN_OFFSET,
    TxnType,
    crc32c,
)

__all__ = [
    "topic_len_at",
    "producer_start_at",
    "phys_offset_at",
    "queue_offset_at",
    "set_queue_id",
    "mark_prepared",
    "with_topic",
    "stamp_store_fields",
    "set_prepared_offset",
    "dedup_fields_at",
]

Buffer = bytes | bytearray | memoryview


def topic_len_at(buf: Buffer, pos: int = 0) -> int:
    """topic_len of the batch at ``pos``."""
    return int.from_bytes(buf[pos + TOPIC_LEN_OFFSET : pos + TOPIC_LEN_OFFSET + 2], "little")


def producer_start_at(buf: Buffer, pos: int = 0) -> int:
    """Where the producer section of the batch at ``pos`` starts, relative to ``pos``."""
    return STORE_HEADER_SIZE + topic_len_at(buf, pos)


def phys_offset_at(buf: Buffer, pos: int = 0) -> int:
    """phys_offset (the CommitLog offset the store stamped) of the stored batch at ``pos``."""
    return int.from_bytes(buf[pos + PHYS_OFFSET_OFFSET : pos + PHYS_OFFSET_OFFSET + 8], "little")


def queue_offset_at(buf: Buffer, pos: int = 0) -> int:
    """queue_offset (of message 0) of the stored batch at ``pos``."""
    q = QUEUE_OFFSET_OFFSET
    return int.from_bytes(buf[pos + q : pos + q + 8], "little")


def set_queue_id(batch: bytearray, queue_id: int) -> None:
    """Re-target an encoded batch at another queue (a retry on another broker) in place."""
    batch[QUEUE_ID_OFFSET : QUEUE_ID_OFFSET + 4] = queue_id.to_bytes(4, "little")
    seal_store_header(batch, 0, producer_start_at(batch))


def mark_prepared(batch: bytearray) -> None:
    """Set the batch's transaction type to PREPARED and re-seal its producer CRC."""
    p = producer_start_at(batch)
    a = p + P_ATTRIBUTES_OFFSET
    attrs = int.from_bytes(batch[a : a + 2], "little")
    attrs = (attrs & ~ATTR_TXN_MASK) | (TxnType.PREPARED << ATTR_TXN_SHIFT)
    batch[a : a + 2] = attrs.to_bytes(2, "little")
    CRC_FIELD.pack_into(batch, p, crc32c(memoryview(batch)[p + 4 :]))


def with_topic(data: Buffer, topic: str, producer_start: int, total_size: int) -> bytearray:
    """A copy of the batch with another topic in its store header (the producer section and
    its CRC unchanged): how a batch is moved to the discard topic. ``producer_start`` and
    ``total_size`` are the batch's (``BatchView`` has them)."""
    tb = topic.encode()
    rest = bytes(memoryview(data)[producer_start:total_size])
    total = STORE_HEADER_SIZE + len(tb) + len(rest)
    buf = bytearray(total)
    fields = list(STORE_HEADER.unpack_from(data, 0))
    fields[H_TOTAL_SIZE] = total
    fields[H_TOPIC_LEN] = len(tb)
    STORE_HEADER.pack_into(buf, 0, *fields)
    buf[STORE_HEADER_SIZE : STORE_HEADER_SIZE + len(tb)] = tb
    buf[STORE_HEADER_SIZE + len(tb) :] = rest
    seal_store_header(buf, 0, STORE_HEADER_SIZE + len(tb))
    return buf


def stamp_store_fields(
    buf: bytearray, *, phys_offset: int, queue_offset: int, store_ts: int, queue_id: int,
    store_addr: bytes, producer_start: int,
) -> None:
    """Set the store fields of the batch at 0 -- phys_offset, queue_offset, store_ts, queue_id
    and the store address (``store_addr``: store_port u16 + store_host 16s, 18 bytes) -- and
    re-seal its store header: an in-memory copy that never reaches the CommitLog
    (non-persistent topics). The store's own put stamps with ``layout.STORE_TAIL``."""
    STORE_FIELDS.pack_into(buf, STORE_FIELDS_OFFSET, phys_offset, queue_offset, store_ts)
    buf[QUEUE_ID_OFFSET : QUEUE_ID_OFFSET + 4] = queue_id.to_bytes(4, "little")
    buf[STORE_ADDR_OFFSET : STORE_ADDR_OFFSET + STORE_ADDR_SIZE] = store_addr
    seal_store_header(buf, 0, producer_start)


def set_prepared_offset(buf: bytearray, offset: int) -> None:
    """Set prepared_offset (the half message a committed copy names) without re-sealing: the
    store's put stamps every store field and seals the header when it appends the copy."""
    buf[PREPARED_OFFSET_OFFSET : PREPARED_OFFSET_OFFSET + 8] = offset.to_bytes(
        8, "little", signed=True
    )


def dedup_fields_at(buf: Buffer, pos: int, end: int) -> tuple[int, int, int, int] | None:
    """(producer_id, base_seq, count, store_ts) of the stored batch at ``pos``, read field by
    field (the deduplication table's replay of the CommitLog); None when its headers would
    run past ``end``."""
    if pos + STORE_HEADER_SIZE > end:
        return None
    p = pos + producer_start_at(buf, pos)
    if p + PRODUCER_HEADER_SIZE > end:
        return None

    def u(at: int, n: int) -> int:
        return int.from_bytes(buf[at : at + n], "little")

    return (u(p + P_PRODUCER_ID_OFFSET, 8), u(p + P_BASE_SEQ_OFFSET, 8), u(p + P_COUNT_OFFSET, 4),
            u(pos + STORE_TS_OFFSET, 8))
