"""Topics, consumer offsets, queue offsets, stats and message queries on a real broker."""

from __future__ import annotations

import time

from tidemq.protocol.headers import TopicConfig
from tidemq.protocol.record import BatchView, unique_id

from .wire import RequestCode, ResponseCode, decode_pull

R = ResponseCode


def test_topic_create_update_list_delete(wire, topic):
    assert wire.create_topic(topic, 3).code == R.SUCCESS
    r = wire.request(RequestCode.GET_ALL_TOPIC_CONFIG)
    assert r.code == R.SUCCESS and r.header.broker_name == "broker-a"
    tc = r.header.topics[topic]
    assert (tc.read_queue_nums, tc.write_queue_nums, tc.perm, tc.order) == (3, 3, 6, False)
    upd = TopicConfig(topic_name=topic, read_queue_nums=4, write_queue_nums=2, order=True)
    assert wire.request(RequestCode.UPDATE_AND_CREATE_TOPIC, upd).code == R.SUCCESS
    tc = wire.request(RequestCode.GET_ALL_TOPIC_CONFIG).header.topics[topic]
    assert (tc.read_queue_nums, tc.write_queue_nums, tc.order) == (4, 2, True)
    assert wire.send_messages(topic, [b"x"], queue_id=2).code == R.INVALID_ARGUMENT
    assert wire.send_messages(topic, [b"x"], queue_id=1).code == R.SUCCESS
    assert wire.request(RequestCode.DELETE_TOPIC, {"topic": topic}).code == R.SUCCESS
    assert topic not in wire.request(RequestCode.GET_ALL_TOPIC_CONFIG).header.topics
    assert wire.pull(topic, 0, queue_id=1).code == R.TOPIC_NOT_EXIST


def test_auto_create_uses_eight_queues(wire, topic):
    assert wire.send_messages(topic, [b"x"], queue_id=7).code == R.SUCCESS
    tc = wire.request(RequestCode.GET_ALL_TOPIC_CONFIG).header.topics[topic]
    assert (tc.read_queue_nums, tc.write_queue_nums) == (8, 8)
    assert wire.send_messages(topic, [b"x"], queue_id=8).code == R.INVALID_ARGUMENT


def test_consumer_offsets_commit_query_and_piggy_back(wire, topic):
    q = {"consumer_group": "g1", "topic": topic, "queue_id": 0}
    wire.send_messages(topic, [b"a", b"b", b"c"])
    r = wire.request(RequestCode.QUERY_CONSUMER_OFFSET, q)
    assert r.code == R.QUERY_NOT_FOUND and "no committed offset" in r.header.message
    r = wire.request(RequestCode.UPDATE_CONSUMER_OFFSET, {**q, "commit_offset": 2})
    assert r.code == R.SUCCESS
    assert wire.request(RequestCode.QUERY_CONSUMER_OFFSET, q).header.offset == 2
    # Piggy-backed on a pull (PullSysFlag.COMMIT_OFFSET).
    p = wire.pull(topic, 2, group="g1", commit_offset=3)
    assert p.code == R.SUCCESS
    assert wire.request(RequestCode.QUERY_CONSUMER_OFFSET, q).header.offset == 3
    # One-way commit, then a query on the same connection sees it.
    wire.send(RequestCode.UPDATE_CONSUMER_OFFSET, {**q, "commit_offset": 1}, oneway=True)
    assert wire.request(RequestCode.QUERY_CONSUMER_OFFSET, q).header.offset == 1


def test_min_max_offset_and_search_by_time(wire, topic):
    wire.send_messages(topic, [b"a", b"b"])
    time.sleep(0.02)
    middle = int(time.time() * 1000)
    time.sleep(0.02)
    wire.send_messages(topic, [b"c"])
    q = {"topic": topic, "queue_id": 0}
    assert wire.request(RequestCode.GET_MIN_OFFSET, q).header.offset == 0
    assert wire.request(RequestCode.GET_MAX_OFFSET, q).header.offset == 3
    r = wire.request(RequestCode.SEARCH_OFFSET_BY_TIMESTAMP, {**q, "timestamp": middle})
    assert r.code == R.SUCCESS and r.header.offset == 2
    r = wire.request(RequestCode.SEARCH_OFFSET_BY_TIMESTAMP, {**q, "timestamp": 0})
    assert r.header.offset == 0
    r = wire.request(RequestCode.GET_MAX_OFFSET, {"topic": topic, "queue_id": 5})
    assert r.header.offset == 0


def test_consume_stats_show_lag_per_queue(wire, topic):
    wire.create_topic(topic, 2)
    wire.send_messages(topic, [b"a", b"b", b"c", b"d"], queue_id=0)
    wire.send_messages(topic, [b"e"], queue_id=1)
    p = wire.pull(topic, 0, group="lagging", max_msgs=32, commit_offset=0)
    wire.request(RequestCode.UPDATE_CONSUMER_OFFSET,
                 {"consumer_group": "lagging", "topic": topic, "queue_id": 0, "commit_offset": 3})
    assert p.code == R.SUCCESS
    r = wire.request(RequestCode.GET_CONSUME_STATS, {"consumer_group": "lagging", "topic": topic})
    assert r.code == R.SUCCESS
    qs = {q.queue_id: q for q in r.header.queues}
    assert (qs[0].broker_offset, qs[0].consumer_offset, qs[0].lag) == (4, 3, 1)
    assert (qs[1].broker_offset, qs[1].consumer_offset, qs[1].lag) == (1, 0, 1)
    assert qs[0].last_timestamp > 0
    assert r.header.total_lag == 2
    assert r.header.consume_tps > 0
    assert r.header.pulled_msgs == 4 and r.header.pulled_bytes > 0
    # Without a topic: every topic the group has offsets for.
    r = wire.request(RequestCode.GET_CONSUME_STATS, {"consumer_group": "lagging"})
    assert {q.topic for q in r.header.queues} == {topic}


def test_topic_stats(wire, topic):
    wire.create_topic(topic, 2)
    wire.send_messages(topic, [b"a", b"b"], queue_id=1)
    r = wire.request(RequestCode.GET_TOPIC_STATS, {"topic": topic})
    assert r.code == R.SUCCESS
    qs = {q.queue_id: q for q in r.header.queues}
    assert (qs[0].min_offset, qs[0].max_offset, qs[0].last_update_timestamp) == (0, 0, 0)
    assert (qs[1].max_offset, qs[1].last_update_timestamp > 0) == (2, True)
    assert (r.header.put_msgs, r.header.put_tps > 0) == (2, True)
    assert r.header.put_bytes > 0


def test_query_by_key_and_view_by_id(wire, topic):
    wire.send_messages(topic, [b"a", b"b", b"c"], keys=[None, "order-42", None],
                       producer_id=0x55, base_seq=10)
    r = wire.request(RequestCode.QUERY_MESSAGE, {"topic": topic, "key": "order-42"})
    assert r.code == R.SUCCESS
    [idx] = r.header.indexes
    v = BatchView(r.body)
    assert v.total_size == len(r.body)
    [m] = list(v.messages(idx))[:1]
    assert (m.body, m.keys, m.queue_offset) == (b"b", "order-42", 1)
    r = wire.request(RequestCode.VIEW_MESSAGE_BY_ID, {"msg_id": unique_id(0x55, 12)})
    assert r.code == R.SUCCESS
    m = next(BatchView(r.body).messages(r.header.indexes[0]))
    assert (m.body, m.msg_id) == (b"c", unique_id(0x55, 12))


def test_runtime_info_counts_puts_and_gets(wire, topic):
    before = wire.request(RequestCode.GET_BROKER_RUNTIME_INFO).header.table
    wire.send_messages(topic, [b"x" * 10] * 5)
    p = wire.pull(topic, 0)
    assert len(decode_pull(p, 0)) == 5
    t = wire.request(RequestCode.GET_BROKER_RUNTIME_INFO).header.table
    assert t["put_total_msgs"] - before["put_total_msgs"] == 5
    assert t["get_total_msgs"] - before["get_total_msgs"] == 5
    assert t["put_total_batches"] - before["put_total_batches"] == 1
    assert t["rss_bytes"] > 0 and t["topics"] >= 1 and t["connections"] >= 1
    assert t["put_tps"] > 0 and t["commitlog_max_offset"] > 0
