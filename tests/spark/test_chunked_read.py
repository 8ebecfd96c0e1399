"""Chunked messages (PR5) in the Spark source: whatever offsets the ranges end at, a chunked
message comes out once and whole, from the range holding its first chunk; incomplete ones
expire by the store time of their first chunk, so replays never expire complete messages.
Read through ``read_range`` (what a Spark task runs) against a real broker, no JVM needed."""

from __future__ import annotations

import hashlib
import os

import pytest

import tidemq
from tidemq.client import chunking
from tidemq.client.chunk_columns import ColumnAssembler
from tidemq.client.range_reader import RangeReader
from tidemq.spark.planner import QueueRange
from tidemq.spark.source import read_range

from .conftest import Collector, create_topic, wait_for


def _rows(dev, topic: str, broker: str, start: int, end: int) -> list[tuple[int, bytes, dict]]:
    part = QueueRange(dev.namesrv, {}, topic, broker, 0, start, end, None, True, 10.0)
    out = []
    for rb in read_range(part):
        d = rb.to_pydict()
        out += list(zip(d["queue_offset"], d["body"], d["properties"], strict=True))
    return out


def test_a_range_ending_inside_a_chunked_message_emits_it_whole_and_once(dev) -> None:
    topic = "spark-chunks"
    create_topic(dev, topic, 1)
    body = os.urandom(9 * 1024 * 1024)  # 3 chunks at the 4 MiB broker limit
    with tidemq.Producer(dev.namesrv, producer_name="spark-chunker", send_timeout=30) as p:
        p.send(tidemq.Message(topic, b"before"))
        r = p.send(tidemq.Message(topic, body, properties={"k": "v"}))
        p.send(tidemq.Message(topic, b"after"))
    first, last = 1, r.queue_offset  # chunks at 1..3, "after" at 4
    assert last == 3
    everything = _rows(dev, topic, r.broker_name, 0, 5)
    for cut in range(first + 1, last + 1):  # every cut inside the message
        a = _rows(dev, topic, r.broker_name, 0, cut)
        b = _rows(dev, topic, r.broker_name, cut, 5)
        assert [o for o, _, _ in a] == [0, last] and [o for o, _, _ in b] == [4]
        assert a + b == everything
    whole = everything[1]
    assert hashlib.sha256(whole[1]).digest() == hashlib.sha256(body).digest()
    props = dict(whole[2]) if not isinstance(whole[2], dict) else whole[2]
    assert props == {"k": "v"}
    # a range starting on a later chunk (the message was emitted before it) skips the chunks
    assert _rows(dev, topic, r.broker_name, 2, 4) == []


def test_incomplete_chunks_expire_by_store_time_only_when_the_rest_is_not_stored(dev) -> None:
    topic = "spark-chunks-partial"
    create_topic(dev, topic, 1)
    parts = chunking.split(tidemq.Message(topic, b"z" * 5000), "dead-producer", 2000)
    with tidemq.Producer(dev.namesrv) as p:
        p.send(parts[0])  # the producer died after its first chunk
        p.send(tidemq.Message(topic, b"later"))
        broker = p.send(tidemq.Message(topic, b"last")).broker_name
    mq = tidemq.MessageQueue(topic, broker, 0)
    with RangeReader(dev.namesrv) as reader:
        chunks = list(reader.read(mq, 0, 3))
        store_ts = int(chunks[0].store_ts[0])
    asm = ColumnAssembler(expire_ms=60_000)
    out = [asm.feed(c) for c in chunks]
    assert [len(c) for c in out] == [2]  # "later" and "last"; the chunk is held
    assert asm.pending and asm.expire(store_ts + 59_000) == 0  # not yet: the rest may come
    assert asm.expire(store_ts + 61_000) == 1 and not asm.pending and asm.expired == 1


@pytest.mark.timeout(300)
def test_a_stream_of_one_offset_per_micro_batch_gets_the_chunked_message_whole_once(
        spark, dev, tmp_path) -> None:
    topic = "spark-chunks-stream"
    create_topic(dev, topic, 1)
    body = os.urandom(9 * 1024 * 1024)  # 3 chunks
    with tidemq.Producer(dev.namesrv, producer_name="spark-stream-chunker",
                         send_timeout=30) as p:
        p.send(tidemq.Message(topic, b"before"))
        p.send(tidemq.Message(topic, body))
        p.send(tidemq.Message(topic, b"after"))
    c = Collector("queue_offset", "body")
    df = (spark.readStream.format("tidemq").option("namesrv", dev.namesrv)
          .option("topics", topic).option("startingOffsets", "earliest")
          .option("maxOffsetsPerTrigger", "1").load())
    query = (df.writeStream.foreachBatch(c).option("checkpointLocation", str(tmp_path / "ck"))
             .start())
    try:
        wait_for(lambda: len(c.rows) >= 3, 120, "three rows")
        query.processAllAvailable()
    finally:
        query.stop()
    rows = c.rows
    assert [len(b) for _o, b in rows] == [6, len(body), 5]  # whole, once, in order
    assert hashlib.sha256(bytes(rows[1][1])).digest() == hashlib.sha256(body).digest()
    # the micro-batches that started on the later chunks emitted nothing
    assert sum(1 for rs in c.batches.values() if rs) == 3
