"""Batch reads: exact offset ranges, every column, timestamp ranges, tag filter, splitting."""

from __future__ import annotations

import datetime as dt
import json
import time

import pytest
from tests.spark.conftest import create_topic, send

import tidemq

pytestmark = pytest.mark.timeout(300)

TOPIC = "br-orders"


@pytest.fixture(scope="module")
def loaded(dev):
    create_topic(dev, TOPIC, 3)
    for q in range(3):
        send(dev, TOPIC, q, [f"q{q}-{i}".encode() for i in range(100)])
    # queue 0 gets 50 more with tags, keys and properties
    with tidemq.Producer(dev.namesrv) as p:
        for i in range(100, 150):
            p.send(tidemq.Message(TOPIC, f"q0-{i}".encode(), tags="paid" if i % 2 else "created",
                                  keys=[f"order-{i}", f"cust-{i % 7}"],
                                  properties={"region": "eu", "i": str(i)}), queue_id=0)
    return dev


def _read(spark, dev, **opts):
    r = spark.read.format("tidemq").option("namesrv", dev.namesrv)
    for k, v in opts.items():
        r = r.option(k, v)
    return r.load()


def test_batch_read_of_exact_offset_ranges(spark, loaded):
    start = json.dumps({TOPIC: {"0": 10, "1": 0, "2": 95}})
    end = json.dumps({TOPIC: {"0": 20, "1": 3, "2": -1}})
    rows = _read(spark, loaded, topics=TOPIC, startingOffsets=start, endingOffsets=end) \
        .select("queue_id", "queue_offset", "body").collect()
    got = sorted((r.queue_id, r.queue_offset, bytes(r.body)) for r in rows)
    want = sorted([(0, o, f"q0-{o}".encode()) for o in range(10, 20)]
                  + [(1, o, f"q1-{o}".encode()) for o in range(0, 3)]
                  + [(2, o, f"q2-{o}".encode()) for o in range(95, 100)])
    assert got == want


def test_batch_read_whole_topic_and_every_column(spark, loaded):
    df = _read(spark, loaded, topics=TOPIC)
    assert [f.name for f in df.schema.fields] == [
        "topic", "queue_id", "queue_offset", "msg_id", "keys", "tags", "body", "properties",
        "born_timestamp", "store_timestamp", "reconsume_times"]
    rows = df.collect()
    assert len(rows) == 350
    assert len({r.msg_id for r in rows}) == 350
    by = {(r.queue_id, r.queue_offset): r for r in rows}
    r = by[(0, 101)]
    assert r.topic == TOPIC and bytes(r.body) == b"q0-101" and r.tags == "paid"
    assert sorted(r.keys) == ["cust-3", "order-101"]
    assert r.properties["region"] == "eu" and r.properties["i"] == "101"
    assert r.reconsume_times == 0 and len(r.msg_id) == 32
    now = dt.datetime.now(dt.UTC).replace(tzinfo=None)
    assert abs((now - r.store_timestamp).total_seconds()) < 300
    assert r.born_timestamp <= r.store_timestamp + dt.timedelta(seconds=1)
    plain = by[(1, 5)]
    assert plain.tags is None and plain.keys == [] and plain.properties == {}


def test_tag_filter_is_applied(spark, loaded):
    rows = _read(spark, loaded, topics=TOPIC, tags="paid").collect()
    assert sorted(r.queue_offset for r in rows) == list(range(101, 150, 2))
    assert {r.tags for r in rows} == {"paid"}
    both = _read(spark, loaded, topics=TOPIC, tags="paid || created").count()
    assert both == 50


def test_timestamp_range(spark, dev):
    topic = "br-time"
    create_topic(dev, topic, 1)
    send(dev, topic, 0, [b"old-%d" % i for i in range(20)])
    time.sleep(1.2)
    t = int(time.time() * 1000)
    time.sleep(0.2)
    send(dev, topic, 0, [b"new-%d" % i for i in range(30)])
    rows = _read(spark, dev, topics=topic, startingTimestamp=str(t)).collect()
    assert sorted(bytes(r.body) for r in rows) == sorted(b"new-%d" % i for i in range(30))


def test_min_partitions_splits_a_hot_queue(spark, loaded):
    df = _read(spark, loaded, assign=json.dumps({TOPIC: [0]}), minPartitions="4")
    assert df.rdd.getNumPartitions() == 4
    offs = sorted(r.queue_offset for r in df.select("queue_offset").collect())
    assert offs == list(range(150))


def test_topic_pattern(spark, loaded):
    n = _read(spark, loaded, topicPattern="br-ord.*").count()
    assert n == 350


@pytest.mark.parametrize("opts, text", [
    ({}, "set exactly one of the options topics"),
    ({"topics": TOPIC, "startingOffsets": "{bad"}, "startingOffsets must be"),
    ({"topics": TOPIC, "startingOffsets": json.dumps({TOPIC: {"9": 0}})}, "does not exist"),
    ({"topics": TOPIC, "maxOffsetsPerTrigger": "x"}, "must be an integer"),
])
def test_bad_options_give_clear_errors(spark, loaded, opts, text):
    with pytest.raises(Exception, match=text):
        _read(spark, loaded, **opts).collect()
