"""Shared helpers for store tests."""

from __future__ import annotations

from tidemq.protocol.record import MessageData, encode_batch
from tidemq.store.config import StoreConfig
from tidemq.store.flush import FlushMode
from tidemq.store.message_store import MessageStore

SMALL = dict(
    segment_size=64 * 1024,
    cq_units_per_file=64,
    index_slots=64,
    index_max_entries=256,
    checkpoint_interval_ms=60_000,  # tests flush explicitly
)


def config(path, **kw) -> StoreConfig:
    opts = dict(SMALL)
    opts.update(kw)
    return StoreConfig(data_dir=str(path), **opts)


def open_store(path, **kw) -> MessageStore:
    return MessageStore(config(path, **kw))


def batch(
    topic: str,
    bodies: list[bytes],
    *,
    queue_id: int = 0,
    tags=None,
    keys=None,
    producer_id: int = 1,
    base_seq: int = 0,
    **kw,
) -> bytearray:
    msgs = [
        MessageData(
            b,
            tags=(tags[i] if isinstance(tags, list) else tags),
            keys=(keys[i] if isinstance(keys, list) else keys),
        )
        for i, b in enumerate(bodies)
    ]
    return encode_batch(
        topic, msgs, queue_id=queue_id, producer_id=producer_id, base_seq=base_seq, **kw
    )


def read_all(store: MessageStore, topic: str, queue_id: int = 0, start: int = 0):
    out = []
    off = start
    while True:
        res = store.get_messages(topic, queue_id, off, 1000)
        if not res.batches:
            return out, res
        out.extend(res.messages())
        off = res.next_begin_offset


__all__ = ["FlushMode", "config", "open_store", "batch", "read_all"]
