"""Orderly POP on the wire (broker/pop_orderly.py): one message per message group
(``__SHARDINGKEY``, else the queue) in flight, the next only after an ack or a revive (which
comes first), a held pop woken by the ack that frees a group, NOTIFICATION in orderly mode, and
one group popping either orderly or not."""

from __future__ import annotations

import time

from tidemq.protocol.pop import NotificationRequestHeader, PopMessageRequestHeader
from tidemq.protocol.receipt import decode_receipt
from tidemq.protocol.record import MessageData, encode_batch

from .test_pop import ack, handles, pop
from .wire import RequestCode, ResponseCode, SendMessageRequestHeader, Wire, error_message

G = "pgo"


def send_grouped(w, topic, items):
    """One stored batch of messages [(body, message group or None)]."""
    msgs = [MessageData(b.encode(), properties={"__SHARDINGKEY": g} if g else None)
            for b, g in items]
    r = w.request(RequestCode.SEND_BATCH, SendMessageRequestHeader(
        producer_group="pg", topic=topic, queue_id=0, batch=True),
        bytes(encode_batch(topic, msgs, queue_id=0)))
    assert r.code == ResponseCode.SUCCESS, error_message(r)


def opop(w, topic, group=G, **kw):
    r = pop(w, topic, group, order=True, **kw)
    assert r.code in (ResponseCode.SUCCESS, ResponseCode.PULL_NOT_FOUND), error_message(r)
    return handles(r, topic) if r.code == ResponseCode.SUCCESS else []


def offs(hs):
    return [decode_receipt(h).offset for h in hs]


def test_one_message_per_group_in_flight_in_order(wire, topic):
    wire.create_topic(topic, 1)
    # offsets: 0 a1, 1 b1, 2 a2, 3 c1, 4 b2, 5 a3, 6 (no group), 7 (no group)
    send_grouped(wire, topic, [("a1", "a"), ("b1", "b"), ("a2", "a"), ("c1", "c"),
                               ("b2", "b"), ("a3", "a"), ("q1", None), ("q2", None)])
    first = opop(wire, topic, invisible_ms=60_000)
    assert offs(first) == [0, 1, 3, 6]  # a1 b1 c1 and the queue's own group
    assert opop(wire, topic) == []  # every group has one in flight
    assert ack(wire, first[:1], G) == [0]  # a1 done: a2 may go, nothing else
    assert offs(opop(wire, topic, invisible_ms=60_000)) == [2]
    assert ack(wire, first[1:], G) == [0, 0, 0]
    assert offs(opop(wire, topic, invisible_ms=60_000)) == [4, 7]  # b2, q2; a2 still out
    # mixing: an unordered pop of an orderly group is refused
    r = pop(wire, topic, G)
    assert r.code == ResponseCode.CONSUME_MODE_CONFLICT and "orderly" in error_message(r)


def test_a_revive_comes_before_the_groups_later_messages(wire, topic):
    wire.create_topic(topic, 1)
    send_grouped(wire, topic, [("a1", "a"), ("a2", "a"), ("b1", "b")])
    g = G + "r"
    [a1, b1] = opop(wire, topic, g, invisible_ms=300)
    assert offs([a1, b1]) == [0, 2]
    assert ack(wire, [b1], g) == [0]
    assert opop(wire, topic, g) == []  # a2 waits for a1
    time.sleep(0.35)
    [again] = opop(wire, topic, g, invisible_ms=60_000)
    assert (decode_receipt(again).offset, decode_receipt(again).attempt) == (0, 2)
    assert ack(wire, [a1], g) == [ResponseCode.NO_MESSAGE]  # the expired delivery is stale
    assert ack(wire, [again], g) == [0]
    assert offs(opop(wire, topic, g, invisible_ms=60_000)) == [1]


def test_an_ack_wakes_a_held_orderly_pop_and_notification(broker, topic):
    g = G + "w"
    with Wire(broker.addr) as w1, Wire(broker.addr) as w2:
        w1.create_topic(topic, 1)
        send_grouped(w1, topic, [("a1", "a"), ("a2", "a")])
        [a1] = opop(w1, topic, g, invisible_ms=60_000)
        n = w2.recv(w2.send(RequestCode.NOTIFICATION, NotificationRequestHeader(
            consumer_group=g, topic=topic, init_mode="EARLIEST", order=True)), timeout=5)
        assert n.header.has_msg is False  # a2 is held back by a1
        opaque = w2.send(RequestCode.POP_MESSAGE, PopMessageRequestHeader(
            consumer_group=g, topic=topic, poll_ms=5000, invisible_ms=60_000,
            init_mode="EARLIEST", order=True))
        time.sleep(0.2)
        t0 = time.perf_counter()
        assert ack(w1, [a1], g) == [0]
        r = w2.recv(opaque, timeout=5)
        assert time.perf_counter() - t0 < 0.5
        assert r.code == ResponseCode.SUCCESS and offs(handles(r, topic)) == [1]
