"""Envelopes: how the broker parks a batch on a system topic until it may be delivered.

A held batch (delayed, timed, or a transaction's half message) is stored whole, as the body of
a one-message *envelope* batch on a system topic, with RocketMQ's properties naming where it
goes::

    envelope batch (topic SCHEDULE_TOPIC_XXXX / rmq_sys_wheel_timer / RMQ_SYS_TRANS_HALF_TOPIC)
      producer_id, base_seq   = the inner batch's (so the id index finds the envelope by the
                                 message id the producer got back: cancel, check, lookup)
      deliver_at              = when it is due (timer), else 0
      message 0 properties    REAL_TOPIC, REAL_QID, COUNT (+ service-specific ones)
      message 0 body          = the inner batch, byte for byte as the producer sent it

Delivery puts the inner bytes to ``REAL_TOPIC`` / ``REAL_QID`` (the store stamps new store
fields; the producer section and its CRC are untouched, so consumers still verify it end to
end). Wrapping is one copy per batch, never per message.

Why not rewrite the topic in place, as RocketMQ does: the producer section (attributes, records)
is covered by the producer's CRC and never modified, and the store header has no room for the
real topic; an envelope keeps both intact.

Threads: plain functions; callers are on the broker's event loop.
"""

from __future__ import annotations

from tidemq.protocol.errors import TidemqError
from tidemq.protocol.record import MessageData, StoredMessage, encode_batch
from tidemq.store.message_store import MessageStore, id_block_key

__all__ = [
    "REAL_TOPIC",
    "REAL_QID",
    "COUNT",
    "wrap",
    "unwrap",
    "delivered_copy_exists",
    "find_envelopes",
]

REAL_TOPIC = "REAL_TOPIC"
REAL_QID = "REAL_QID"
COUNT = "COUNT"


def wrap(
    topic: str,
    queue_id: int,
    inner: bytes | bytearray | memoryview,
    *,
    real_topic: str,
    real_qid: int,
    producer_id: int,
    base_seq: int,
    count: int,
    born_ts: int,
    deliver_at: int = 0,
    extra: dict[str, str] | None = None,
) -> bytearray:
    """The envelope batch holding ``inner`` (see the module docstring)."""
    props = {REAL_TOPIC: real_topic, REAL_QID: str(real_qid), COUNT: str(count)}
    if extra:
        props.update(extra)
    return encode_batch(
        topic,
        [MessageData(bytes(inner), properties=props, born_ts=born_ts)],
        queue_id=queue_id,
        producer_id=producer_id,
        base_seq=base_seq,
        deliver_at=deliver_at,
    )


def unwrap(store: MessageStore, phys: int) -> StoredMessage:
    """The envelope's one message (properties and the inner batch as ``body``); raises
    CorruptBatchError / OffsetOutOfRangeError when the bytes at ``phys`` are not readable."""
    v = store.read_batch(phys)
    v.verify()
    return next(v.messages())


def delivered_copy_exists(
    store: MessageStore, producer_id: int, base_seq: int, real_topic: str, since_ts: int,
    reconsume_times: int | None = None,
) -> bool:
    """True when the id index shows a batch of ``real_topic`` with this producer id and base
    sequence stored at or after ``since_ts`` (the envelope's store time): the delivery of that
    envelope reached the CommitLog before a crash. Used on recovery only, to deliver at most
    once what a crash left without its progress mark."""
    if not producer_id or not store.config.index_enabled:
        return False
    for phys in store.index.query(id_block_key(producer_id, base_seq), since_ts, 2**62, 256):
        try:
            v = store.read_batch(phys)
        except Exception:  # gone or damaged: not a delivered copy we can trust
            continue
        if (v.producer_id == producer_id and v.base_seq == base_seq
                and v.topic_bytes == real_topic.encode()
                and v.store_ts >= since_ts
                and (reconsume_times is None or v.reconsume_times == reconsume_times)):
            return True
    return False


def find_envelopes(
    store: MessageStore, topic: str, producer_id: int, seq: int, since_ts: int = 0
) -> list[tuple[int, StoredMessage]]:
    """(phys, message) of every envelope on ``topic`` whose inner batch holds message
    ``seq`` of ``producer_id``, oldest first."""
    out = []
    for phys in store.index.query(id_block_key(producer_id, seq), since_ts, 2**62, 256):
        try:
            v = store.read_batch(phys)
        except Exception:
            continue
        if v.topic_bytes != topic.encode() or v.producer_id != producer_id:
            continue
        try:
            m = next(v.messages())
            n = int(m.properties.get(COUNT, "1"))
        except (TidemqError, ValueError):  # not a readable envelope: not one to act on
            continue
        if v.base_seq <= seq < v.base_seq + n:
            out.append((phys, m))
    out.sort(key=lambda e: e[0])
    return out
