"""SQL92 subscriptions on a real broker: whole batches served with member bitmaps, selective
scans, NO_MATCHED past what cannot match, long polling, and SUBSCRIPTION_PARSE_FAILED for bad
expressions at the pull and at the heartbeat."""

from __future__ import annotations

import time

from tidemq.protocol.codes import PullStatus, pull_status
from tidemq.protocol.headers import (
    ConsumerData,
    HeartbeatRequestHeader,
    MultiQueuePull,
    PullMessageRequestHeader,
    PullMultiQueueRequestHeader,
    SendMessageRequestHeader,
    SubscriptionData,
    pull_sys_flag,
)
from tidemq.protocol.members import member_offsets
from tidemq.protocol.record import Compression, MessageData, encode_batch

from .wire import RequestCode, ResponseCode, Wire, error_message


def send(wire, topic, props_list, *, tags=None, compression=Compression.NONE):
    msgs = [MessageData(f"m{i}".encode(), tags=tags, properties=p)
            for i, p in enumerate(props_list)]
    body = encode_batch(topic, msgs, compression=compression)
    r = wire.request(
        RequestCode.SEND_BATCH if len(msgs) > 1 else RequestCode.SEND_MESSAGE,
        SendMessageRequestHeader(producer_group="pg", topic=topic, queue_id=0,
                                 batch=len(msgs) > 1),
        bytes(body),
    )
    assert r.code == ResponseCode.SUCCESS, error_message(r)
    return r


def sql_pull(wire, topic, offset, sql, *, max_msgs=32, suspend_ms=None, timeout=10.0):
    h = PullMessageRequestHeader(
        consumer_group="cg", topic=topic, queue_id=0, queue_offset=offset, max_msg_nums=max_msgs,
        sys_flag=pull_sys_flag(subscription=True, suspend=suspend_ms is not None),
        suspend_timeout_millis=suspend_ms or 0, subscription=sql, expression_type="SQL92",
    )
    return wire.request(RequestCode.PULL_MESSAGE, h, timeout=timeout)


def test_whole_batches_with_the_selected_members(wire, topic):
    props = [{"a": str(i), "region": "eu" if i % 2 else "us"} for i in range(10)]
    sent = send(wire, topic, props)
    assert sent.header.queue_offset == 0
    p = sql_pull(wire, topic, 0, "a >= 3 AND region = 'eu'")
    assert p.code == ResponseCode.SUCCESS
    assert len(p.header.members) == 1
    # the stored batch, whole: every message is in the body, the bitmap names the selected
    assert int.from_bytes(p.body[:4], "little") == len(p.body)
    assert member_offsets(p.body, p.header.members) == {3, 5, 7, 9}
    assert p.header.next_begin_offset == 10


def test_compressed_batches_and_the_tag_are_filtered_too(wire, topic):
    send(wire, topic, [{"n": str(i)} for i in range(40)], tags="T1",
         compression=Compression.ZSTD)
    send(wire, topic, [{"n": str(i)} for i in range(40, 50)], tags="T2")
    p = sql_pull(wire, topic, 0, "TAGS = 'T2' AND n > 44 OR TAGS = 'T1' AND n < 2")
    assert p.code == ResponseCode.SUCCESS
    assert member_offsets(p.body, p.header.members) == {0, 1, 45, 46, 47, 48, 49}


def test_a_selective_filter_scans_on_to_fill_the_answer(wire, topic):
    for i in range(200):  # 200 single-message batches, one in 20 selected
        send(wire, topic, [{"k": str(i)}])
    p = sql_pull(wire, topic, 0, "k IN ('7', '27', '47', '67', '87', '107', '127')", max_msgs=4)
    assert p.code == ResponseCode.SUCCESS
    assert member_offsets(p.body, p.header.members) == {7, 27, 47, 67}
    assert len(p.header.members) == 4  # only the batches with a member are in the body
    assert p.header.next_begin_offset == 68


def test_nothing_selected_moves_past_what_cannot_match(wire, topic):
    send(wire, topic, [{"a": "1"}] * 5)
    p = sql_pull(wire, topic, 0, "a = 2")
    assert pull_status(p.code) is PullStatus.NO_MATCHED_MSG
    assert p.header.next_begin_offset == 5
    p = sql_pull(wire, topic, 5, "a = 2")
    assert pull_status(p.code) is PullStatus.NO_NEW_MSG


def test_a_held_sql_pull_wakes_for_a_new_message(broker, wire, topic):
    send(wire, topic, [{"a": "1"}])
    with Wire(broker.addr) as w2:
        h = PullMessageRequestHeader(
            consumer_group="cg", topic=topic, queue_id=0, queue_offset=1,
            sys_flag=pull_sys_flag(subscription=True, suspend=True),
            suspend_timeout_millis=5000, subscription="a = 2", expression_type="SQL92")
        opaque = w2.send(RequestCode.PULL_MESSAGE, h)
        time.sleep(0.2)
        t0 = time.monotonic()
        send(wire, topic, [{"a": "2"}])
        r = w2.recv(opaque, timeout=5)
    assert time.monotonic() - t0 < 2.0
    assert r.code == ResponseCode.SUCCESS
    assert member_offsets(r.body, r.header.members) == {1}


def test_bad_sql_is_refused_at_the_pull_with_the_reason(wire, topic):
    send(wire, topic, [{"a": "1"}])
    for sql, why in [("a >", "ends too early"), ("a = NULL", "IS [NOT] NULL"),
                     ("a > 'x'", "cannot be compared"), ("", "required"),
                     ("region = 'eu", "unexpected character")]:
        p = sql_pull(wire, topic, 0, sql)
        assert p.code == ResponseCode.SUBSCRIPTION_PARSE_FAILED, sql
        assert why in error_message(p), (sql, error_message(p))
    h = PullMessageRequestHeader(consumer_group="cg", topic=topic, queue_id=0, queue_offset=0,
                                 subscription="x", expression_type="XPATH")
    p = wire.request(RequestCode.PULL_MESSAGE, h)
    assert p.code == ResponseCode.SUBSCRIPTION_PARSE_FAILED
    assert "XPATH" in error_message(p)
    # the connection is fine afterwards
    assert sql_pull(wire, topic, 0, "a = 1").code == ResponseCode.SUCCESS


def test_bad_sql_is_refused_at_the_heartbeat(wire, topic):
    def heartbeat(sql, kind="SQL92"):
        cd = ConsumerData(group="sqlg", subscriptions=[
            SubscriptionData(topic=topic, expression=sql, expression_type=kind)])
        return wire.request(RequestCode.HEART_BEAT,
                            HeartbeatRequestHeader(client_id="c1", consumers=[cd]))

    r = heartbeat("a BETWEEN 3 AND 1")
    assert r.code == ResponseCode.SUBSCRIPTION_PARSE_FAILED
    assert "lower bound" in error_message(r) and topic in error_message(r)
    assert heartbeat("a", "LUA").code == ResponseCode.SUBSCRIPTION_PARSE_FAILED
    assert heartbeat("a BETWEEN 1 AND 3").code == ResponseCode.SUCCESS


def test_a_multi_queue_pull_answers_an_sql92_queue_as_a_pull_would(wire, topic):
    """PULL_MULTI_QUEUE reads each queue with PULL_MESSAGE's read: the same batches, member
    bitmaps and next offset in the queue's result (and the tag filter of a plain queue)."""
    send(wire, topic, [{"a": str(i), "region": "eu" if i % 2 else "us"} for i in range(10)])
    sql = "a >= 3 AND region = 'eu'"
    single = sql_pull(wire, topic, 0, sql)
    pulls = [MultiQueuePull(topic, 0, 0, sys_flag=pull_sys_flag(subscription=True),
                            subscription=sql, expression_type="SQL92"),
             MultiQueuePull(topic, 0, 4, sys_flag=pull_sys_flag(subscription=True),
                            subscription="a = 'none'", expression_type="SQL92"),
             MultiQueuePull(topic, 0, 0)]
    r = wire.request(RequestCode.PULL_MULTI_QUEUE,
                     PullMultiQueueRequestHeader(consumer_group="cg", pulls=pulls))
    assert r.code == ResponseCode.SUCCESS, error_message(r)
    sel, none, plain = r.header.results
    assert sel.code == ResponseCode.SUCCESS and sel.members == single.header.members
    assert sel.body_bytes == len(single.body) and r.body[: sel.body_bytes] == single.body
    assert member_offsets(r.body[: sel.body_bytes], sel.members) == {3, 5, 7, 9}
    assert (sel.next_begin_offset, sel.max_offset) == (10, 10)
    assert none.code != ResponseCode.SUCCESS and none.body_bytes == 0 and not none.members
    assert none.next_begin_offset == single.header.next_begin_offset == 10
    assert plain.code == ResponseCode.SUCCESS and plain.members == []
    assert r.body[sel.body_bytes :] == single.body  # the whole batch again, no bitmap
