"""POP on a real broker (docs/pop-dispatch.md): whole batches with member bitmaps, disjoint pops,
grouped acks with per-handle results, stale handles, change of invisible time, redelivery with
attempt + 1, dead letters after the group's retry_max_times, long polling, filters, and one
consumption mode per group."""

from __future__ import annotations

import time

from tidemq.protocol.batch.fields import queue_offset_at
from tidemq.protocol.headers import SubscriptionGroupConfig
from tidemq.protocol.members import member_offsets
from tidemq.protocol.pop import (
    AckMessageRequestHeader,
    ChangeInvisibleRequestHeader,
    PopMessageRequestHeader,
    receipt_handles,
)
from tidemq.protocol.receipt import decode_receipt, encode_receipt

from .wire import RequestCode, ResponseCode, error_message


def pop(wire, topic, group="pg1", **kw):
    kw.setdefault("init_mode", "EARLIEST")
    h = PopMessageRequestHeader(consumer_group=group, topic=topic, **kw)
    return wire.request(RequestCode.POP_MESSAGE, h, timeout=15)


def handles(frame, topic):
    """Receipt handle strings of a pop answer, with each batch's base offset read from the body."""
    out = []
    pos = 0
    body = bytes(frame.body)
    for j in range(len(frame.header.batches)):
        total = int.from_bytes(body[pos:pos + 4], "little")
        base = queue_offset_at(body, pos)
        out += [encode_receipt(h) for h in receipt_handles(frame.header, topic, j, base)]
        pos += total
    assert pos == len(body)
    return out


def ack(wire, hs, group="pg1"):
    r = wire.request(RequestCode.ACK_MESSAGE,
                     AckMessageRequestHeader(consumer_group=group, handles=hs))
    assert r.code == ResponseCode.SUCCESS, error_message(r)
    return r.header.results


def test_two_pops_share_one_batch_with_disjoint_members(wire, topic):
    wire.create_topic(topic, 1)
    wire.send_messages(topic, [b"m%d" % i for i in range(10)])
    a = pop(wire, topic, max_msg_nums=4, invisible_ms=60_000)
    b = pop(wire, topic, max_msg_nums=4, invisible_ms=60_000)
    assert a.code == b.code == ResponseCode.SUCCESS, error_message(a)
    assert bytes(a.body) == bytes(b.body)  # the stored batch, whole, not re-encoded
    assert member_offsets(a.body, [x.members for x in a.header.batches]) == {0, 1, 2, 3}
    assert member_offsets(b.body, [x.members for x in b.header.batches]) == {4, 5, 6, 7}
    ha, hb = handles(a, topic), handles(b, topic)
    assert [decode_receipt(h).offset for h in ha] == [0, 1, 2, 3]
    # acks travel grouped: one frame, a result per handle; a second ack of one is stale
    assert ack(wire, ha + hb[:1] + ["v1 garbage"]) == [0] * 5 + [ResponseCode.INVALID_ARGUMENT]
    assert ack(wire, ha[:1]) == [ResponseCode.NO_MESSAGE]
    c = pop(wire, topic, max_msg_nums=32, invisible_ms=60_000)
    assert [decode_receipt(h).offset for h in handles(c, topic)] == [8, 9]
    assert pop(wire, topic).code == ResponseCode.PULL_NOT_FOUND


def test_unacked_comes_back_with_attempt_plus_one_and_stale_ack_is_refused(wire, topic):
    wire.create_topic(topic, 1)
    wire.send_messages(topic, [b"x", b"y"])
    first = handles(pop(wire, topic, invisible_ms=300), topic)
    assert [decode_receipt(h).attempt for h in first] == [1, 1]
    time.sleep(0.4)
    again = pop(wire, topic, invisible_ms=60_000)
    assert again.code == ResponseCode.SUCCESS
    hs = handles(again, topic)
    assert [(decode_receipt(h).offset, decode_receipt(h).attempt) for h in hs] == [(0, 2), (1, 2)]
    assert ack(wire, first) == [ResponseCode.NO_MESSAGE] * 2  # popped again since: stale
    assert ack(wire, hs) == [0, 0]


def test_change_invisible_time_gives_a_new_handle(wire, topic):
    wire.create_topic(topic, 1)
    wire.send_messages(topic, [b"x"])
    [h] = handles(pop(wire, topic, invisible_ms=300), topic)
    r = wire.request(RequestCode.CHANGE_INVISIBLE_TIME, ChangeInvisibleRequestHeader(
        consumer_group="pg1", handle=h, invisible_ms=60_000))
    assert r.code == ResponseCode.SUCCESS, error_message(r)
    new = r.header.handle
    assert new != h and decode_receipt(new).offset == 0
    time.sleep(0.4)
    assert pop(wire, topic).code == ResponseCode.PULL_NOT_FOUND  # still invisible
    r2 = wire.request(RequestCode.CHANGE_INVISIBLE_TIME, ChangeInvisibleRequestHeader(
        consumer_group="pg1", handle=h, invisible_ms=1000))
    assert r2.code == ResponseCode.NO_MESSAGE and "stale" in error_message(r2)
    assert ack(wire, [h, new]) == [ResponseCode.NO_MESSAGE, 0]


def test_dead_letter_after_retry_max_times(wire, topic):
    wire.create_topic(topic, 1)
    group = "pgdlq"
    r = wire.request(RequestCode.UPDATE_AND_CREATE_SUBSCRIPTION_GROUP,
                     SubscriptionGroupConfig(group_name=group, retry_max_times=2))
    assert r.code == ResponseCode.SUCCESS, error_message(r)
    wire.send_messages(topic, [b"poison"])
    attempts = []
    for _ in range(3):
        p = pop(wire, topic, group, invisible_ms=100)
        if p.code == ResponseCode.SUCCESS:
            attempts += [decode_receipt(h).attempt for h in handles(p, topic)]
        time.sleep(0.15)
    assert attempts == [1, 2]
    assert pop(wire, topic, group).code == ResponseCode.PULL_NOT_FOUND
    # the copy is in the group's dead-letter queue
    from tidemq.protocol.headers import QueueOffsetRequestHeader
    mx = wire.request(RequestCode.GET_MAX_OFFSET,
                      QueueOffsetRequestHeader(topic="%DLQ%" + group, queue_id=0))
    assert mx.code == ResponseCode.SUCCESS and mx.header.offset == 1


def test_long_polling_wakes_on_arrival_and_times_out(broker, topic):
    from .wire import Wire
    with Wire(broker.addr) as w1, Wire(broker.addr) as w2:
        w1.create_topic(topic, 2)
        t0 = time.monotonic()
        assert pop(w1, topic, poll_ms=300).code == ResponseCode.PULL_NOT_FOUND
        assert time.monotonic() - t0 >= 0.28
        opaque = w1.send(RequestCode.POP_MESSAGE, PopMessageRequestHeader(
            consumer_group="pg1", topic=topic, poll_ms=5000, init_mode="EARLIEST"))
        time.sleep(0.1)
        w2.send_messages(topic, [b"late"], queue_id=1)
        r = w1.recv(opaque, timeout=5)
        assert r.code == ResponseCode.SUCCESS
        assert r.header.batches[0].queue_id == 1


def test_tag_filter_and_bad_subscription(wire, topic):
    wire.create_topic(topic, 1)
    wire.send_messages(topic, [b"a"], tags="A")
    wire.send_messages(topic, [b"b"], tags="B")
    r = pop(wire, topic, subscription="B")
    assert [decode_receipt(h).offset for h in handles(r, topic)] == [1]
    assert pop(wire, topic).code == ResponseCode.PULL_NOT_FOUND  # offset 0 was skipped for good
    bad = pop(wire, topic, subscription="a = ", expression_type="SQL92")
    assert bad.code == ResponseCode.SUBSCRIPTION_PARSE_FAILED


def test_a_group_has_one_consumption_mode(wire, topic):
    wire.create_topic(topic, 1)
    wire.send_messages(topic, [b"a"])
    assert pop(wire, topic, "popgrp").code == ResponseCode.SUCCESS
    r = wire.pull(topic, 0, group="popgrp")
    assert r.code == ResponseCode.CONSUME_MODE_CONFLICT
    assert "one consumption mode" in error_message(r)
    assert wire.pull(topic, 0, group="pullgrp").code == ResponseCode.SUCCESS
    r = pop(wire, topic, "pullgrp")
    assert r.code == ResponseCode.CONSUME_MODE_CONFLICT, error_message(r)


def test_sql92_subscription_pops_only_the_selected(wire, topic):
    from tidemq.protocol.headers import SendMessageRequestHeader
    from tidemq.protocol.record import MessageData, encode_batch
    wire.create_topic(topic, 1)
    msgs = [MessageData(b"m%d" % i, properties={"region": "eu" if i % 3 == 0 else "us"})
            for i in range(9)]
    r = wire.request(RequestCode.SEND_BATCH, SendMessageRequestHeader(
        producer_group="pg", topic=topic, queue_id=0, batch=True), bytes(encode_batch(topic, msgs)))
    assert r.code == ResponseCode.SUCCESS, error_message(r)
    p = pop(wire, topic, "pgsql", subscription="region = 'eu'", expression_type="SQL92")
    assert p.code == ResponseCode.SUCCESS, error_message(p)
    assert [decode_receipt(h).offset for h in handles(p, topic)] == [0, 3, 6]
    assert pop(wire, topic, "pgsql", subscription="region = 'eu'",
               expression_type="SQL92").code == ResponseCode.PULL_NOT_FOUND


def test_change_invisible_time_names_one_form_exactly(wire, topic):
    """One handle, or many with one invisible time each: both, neither, or a count mismatch
    is refused with INVALID_ARGUMENT naming the two forms (nothing changes)."""
    wire.create_topic(topic, 1)
    wire.send_messages(topic, [b"x"])
    [h] = handles(pop(wire, topic, invisible_ms=60_000), topic)
    bad = [
        ChangeInvisibleRequestHeader(consumer_group="pg1", handle=h, handles=[h],
                                     invisible=[1000]),  # both
        ChangeInvisibleRequestHeader(consumer_group="pg1"),  # neither
        ChangeInvisibleRequestHeader(consumer_group="pg1", handles=[h, h],
                                     invisible=[1000]),  # one time for two handles
    ]
    for header in bad:
        r = wire.request(RequestCode.CHANGE_INVISIBLE_TIME, header)
        assert r.code == ResponseCode.INVALID_ARGUMENT
        assert "not both or neither" in error_message(r)
    # the handle is untouched: still the current one
    assert ack(wire, [h]) == [0]
