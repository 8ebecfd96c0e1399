"""Streaming reads: micro-batches with new data and new queues, admission limits, restart from a
checkpoint, consumer-group offsets, timestamps, AvailableNow."""

from __future__ import annotations

import time

import pytest
from tests.spark.conftest import Collector, create_topic, send, wait_for

import tidemq

pytestmark = pytest.mark.timeout(300)


def _stream(spark, dev, topic, **opts):
    r = (spark.readStream.format("tidemq").option("namesrv", dev.namesrv)
         .option("topics", topic).option("startingOffsets", "earliest"))
    for k, v in opts.items():
        r = r.option(k, v)
    return r.load()


def _start(df, collector, tmp_path, name="ckpt", **trigger):
    w = df.writeStream.foreachBatch(collector).option("checkpointLocation",
                                                      str(tmp_path / name))
    if trigger:
        w = w.trigger(**trigger)
    return w.start()


def _keys(rows):
    return [(r[1], r[2]) for r in rows]


def test_stream_across_micro_batches_with_new_data_and_a_new_queue(spark, dev, tmp_path):
    topic = "st-grow"
    create_topic(dev, topic, 2)
    for q in range(2):
        send(dev, topic, q, [f"a{q}-{i}".encode() for i in range(50)])
    c = Collector()
    query = _start(_stream(spark, dev, topic), c, tmp_path)
    try:
        query.processAllAvailable()
        assert len(c.rows) == 100
        send(dev, topic, 1, [f"b1-{i}".encode() for i in range(30)])
        query.processAllAvailable()
        assert len(c.rows) == 130
        create_topic(dev, topic, 3)  # a third queue appears while the query runs
        send(dev, topic, 2, [f"c2-{i}".encode() for i in range(20)])
        wait_for(lambda: len(c.rows) >= 150, 60, "rows of the new queue")
        query.processAllAvailable()
    finally:
        query.stop()
    rows = c.rows
    keys = _keys(rows)
    assert len(keys) == len(set(keys)) == 150  # nothing twice
    want = ({(0, i) for i in range(50)} | {(1, i) for i in range(80)}
            | {(2, i) for i in range(20)})
    assert set(keys) == want  # nothing skipped
    bodies = {(r[1], r[2]): bytes(r[3]) for r in rows}
    assert bodies[(1, 60)] == b"b1-10" and bodies[(2, 19)] == b"c2-19"
    assert len([b for b in c.batches.values() if b]) >= 3


def test_max_offsets_per_trigger_is_respected(spark, dev, tmp_path):
    topic = "st-limit"
    create_topic(dev, topic, 2)
    send(dev, topic, 0, [b"x%d" % i for i in range(300)])
    send(dev, topic, 1, [b"y%d" % i for i in range(200)])
    c = Collector()
    query = _start(_stream(spark, dev, topic, maxOffsetsPerTrigger=120), c, tmp_path)
    try:
        query.processAllAvailable()
        progress = query.recentProgress
    finally:
        query.stop()
    sizes = [len(rows) for _b, rows in sorted(c.batches.items()) if rows]
    assert sum(sizes) == 500 and len(set(_keys(c.rows))) == 500
    assert max(sizes) <= 120 and len(sizes) >= 5
    assert all(p["numInputRows"] <= 120 for p in progress)


def test_max_bytes_per_trigger_is_respected(spark, dev, tmp_path):
    topic = "st-bytes"
    create_topic(dev, topic, 1)
    send(dev, topic, 0, [b"%04d" % i + b"." * 996 for i in range(300)])  # 1000-byte bodies
    c = Collector()
    query = _start(_stream(spark, dev, topic, maxBytesPerTrigger=50_000), c, tmp_path)
    try:
        query.processAllAvailable()
    finally:
        query.stop()
    sizes = [len(rows) for _b, rows in sorted(c.batches.items()) if rows]
    assert sum(sizes) == 300
    assert max(sizes) <= 50 and len(sizes) >= 6


def test_restart_from_checkpoint_reads_nothing_twice_and_skips_nothing(spark, dev, tmp_path):
    topic = "st-restart"
    create_topic(dev, topic, 2)
    for q in range(2):
        send(dev, topic, q, [f"{q}-{i}".encode() for i in range(200)])
    c = Collector()
    df = _stream(spark, dev, topic, maxOffsetsPerTrigger=50)
    query = _start(df, c, tmp_path, processingTime="200 milliseconds")
    try:
        wait_for(lambda: len(c.batches) >= 3, 60, "three micro-batches")
    finally:
        query.stop()  # stopped mid-stream: 400 messages, 50 per batch
    first_run = len(c.rows)
    assert 100 <= first_run < 400
    for q in range(2):
        send(dev, topic, q, [f"{q}-{i}".encode() for i in range(200, 250)])
    query = _start(_stream(spark, dev, topic, maxOffsetsPerTrigger=50), c, tmp_path)
    try:
        query.processAllAvailable()
    finally:
        query.stop()
    keys = _keys(c.rows)  # a replayed batch id replaces its first run's rows
    assert len(keys) == len(set(keys)) == 500
    assert set(keys) == {(q, i) for q in range(2) for i in range(250)}


def test_group_offsets_are_committed(spark, dev, tmp_path):
    topic, group = "st-group", "spark-lag-test"
    create_topic(dev, topic, 2)
    send(dev, topic, 0, [b"g%d" % i for i in range(70)])
    send(dev, topic, 1, [b"h%d" % i for i in range(30)])
    c = Collector()
    query = _start(_stream(spark, dev, topic, group=group), c, tmp_path,
                   processingTime="200 milliseconds")
    try:
        query.processAllAvailable()
        with tidemq.Admin(dev.namesrv, timeout=10.0) as admin:
            def caught_up() -> bool:
                lag = admin.group_lag(group, topic)
                return len(lag.queues) == 2 and lag.total_lag == 0
            wait_for(caught_up, 30, "group lag 0")
            send(dev, topic, 0, [b"late%d" % i for i in range(5)])
            query.processAllAvailable()
            wait_for(caught_up, 30, "group lag 0 again")
            lag = admin.group_lag(group, topic)
    finally:
        query.stop()
    offsets = {q.queue.queue_id: q.consumer_offset for q in lag.queues}
    assert offsets == {0: 75, 1: 30}


def test_starting_timestamp(spark, dev, tmp_path):
    topic = "st-ts"
    create_topic(dev, topic, 1)
    send(dev, topic, 0, [b"old%d" % i for i in range(10)])
    time.sleep(1.2)
    t = int(time.time() * 1000)
    time.sleep(0.2)
    send(dev, topic, 0, [b"new%d" % i for i in range(10)])
    c = Collector()
    df = (spark.readStream.format("tidemq").option("namesrv", dev.namesrv)
          .option("topics", topic).option("startingTimestamp", t).load())
    query = _start(df, c, tmp_path)
    try:
        query.processAllAvailable()
        send(dev, topic, 0, [b"newer%d" % i for i in range(5)])
        query.processAllAvailable()
    finally:
        query.stop()
    bodies = sorted(bytes(r[3]) for r in c.rows)
    assert bodies == sorted([b"new%d" % i for i in range(10)] + [b"newer%d" % i for i in range(5)])


def test_available_now_reads_what_exists_in_limited_batches(spark, dev, tmp_path):
    topic = "st-now"
    create_topic(dev, topic, 2)
    send(dev, topic, 0, [b"n%d" % i for i in range(90)])
    send(dev, topic, 1, [b"m%d" % i for i in range(60)])
    c = Collector()
    query = _start(_stream(spark, dev, topic, maxOffsetsPerTrigger=40), c, tmp_path,
                   availableNow=True)
    assert query.awaitTermination(120)
    sizes = [len(rows) for _b, rows in sorted(c.batches.items()) if rows]
    assert sum(sizes) == 150 and max(sizes) <= 40


def test_topic_pattern_picks_up_a_new_topic(spark, dev, tmp_path):
    create_topic(dev, "pat-a", 1)
    send(dev, "pat-a", 0, [b"a%d" % i for i in range(10)])
    c = Collector()
    df = (spark.readStream.format("tidemq").option("namesrv", dev.namesrv)
          .option("topicPattern", "pat-.*").option("startingOffsets", "earliest").load())
    query = _start(df, c, tmp_path)
    try:
        query.processAllAvailable()
        assert len(c.rows) == 10
        create_topic(dev, "pat-b", 2)
        send(dev, "pat-b", 1, [b"b%d" % i for i in range(7)])
        wait_for(lambda: len(c.rows) >= 17, 60, "rows of the new topic")
    finally:
        query.stop()
    assert sorted((r[0], r[1], r[2]) for r in c.rows) == sorted(
        [("pat-a", 0, i) for i in range(10)] + [("pat-b", 1, i) for i in range(7)])
