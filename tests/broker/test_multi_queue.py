"""SEND_MULTI_QUEUE (issue 17) against a real broker: one frame of batches for many queues,
every batch through the whole door (the same refusals as SEND_BATCH, in its own result), the
good ones stored and readable; a body that does not frame is refused whole; the producer
gathers the open batches of many topics into such frames."""

from __future__ import annotations

import asyncio

from tidemq.client.admin import Admin
from tidemq.client.consumer import PullConsumer
from tidemq.client.message import Message
from tidemq.client.producer import Producer
from tidemq.protocol.codes import RequestCode
from tidemq.protocol.headers import SendMultiQueueRequestHeader

from .forge import Rec, forge
from .wire import ResponseCode, Wire, decode_pull, error_message, start_broker, start_namesrv

R = ResponseCode


def _multi(w: Wire, bodies: list[bytes], group: str = "pg", n: int | None = None):
    h = SendMultiQueueRequestHeader(producer_group=group, batches=len(bodies) if n is None else n)
    return w.request(RequestCode.SEND_MULTI_QUEUE, h, b"".join(bodies))


def test_each_batch_passes_the_door_and_gets_its_own_result(wire, topic):
    for t in (f"{topic}a", f"{topic}b"):
        assert wire.create_topic(t, 4).code == R.SUCCESS
    bodies = [
        forge(f"{topic}a", [Rec(body=b"a0"), Rec(body=b"a1")], queue_id=1),
        forge(f"{topic}b", [Rec(body=b"b0")], queue_id=3),
        forge("SCHEDULE_TOPIC_XXXX", [Rec(body=b"no")]),            # a system topic
        forge(f"{topic}a", [Rec(body=b"x", tag=b"\xc3(")], queue_id=0),  # not UTF-8
        forge(f"{topic}b", [Rec(body=b"q")], queue_id=9),            # no such queue
        forge(f"{topic}a", [Rec(body=b"a2")], queue_id=1),
    ]
    r = _multi(wire, bodies)
    assert r.code == R.SUCCESS, error_message(r)
    res = r.header.results
    assert [x.code for x in res] == [R.SUCCESS, R.SUCCESS, R.NO_PERMISSION, R.MESSAGE_ILLEGAL,
                                    R.INVALID_ARGUMENT, R.SUCCESS]
    assert "system topic" in res[2].message and "UTF-8" in res[3].message
    assert "out of range" in res[4].message
    assert (res[0].queue_offset, res[0].count) == (0, 2)
    assert (res[5].queue_offset, res[5].count) == (2, 1)
    msgs = decode_pull(wire.pull(f"{topic}a", 0, queue_id=1), 0)
    assert [m.body for m in msgs] == [b"a0", b"a1", b"a2"]
    assert [m.body for m in decode_pull(wire.pull(f"{topic}b", 0, queue_id=3), 0)] == [b"b0"]


def test_a_body_that_does_not_frame_is_refused_whole(wire, topic):
    good = forge(topic, [Rec(body=b"g")])
    for bodies, n, words in [
        ([good, good], 3, "header says 3 batches"),
        ([good, good[:-1]], 2, "runs past the body end"),
        ([good, b"\x01\x00\x00\x00xx"], 2, "says it is 1 bytes"),
        ([good, good, good], 2, "holds more"),
    ]:
        r = _multi(wire, bodies, n=n)
        assert r.code == R.MESSAGE_ILLEGAL and words in error_message(r), error_message(r)
    r = _multi(wire, [good], group="bad group")
    assert r.code == R.SUCCESS and r.header.results[0].code == R.INVALID_ARGUMENT
    # nothing of the refused frames was stored
    assert decode_pull(wire.pull(topic, 0), 0) == []


def test_the_producer_sends_spread_traffic_in_multi_queue_frames(tmp_path):
    ns = start_namesrv(tmp_path)
    br = start_broker(tmp_path, ns.addr)
    try:
        async def run() -> None:
            topics = [f"spread{i}" for i in range(20)]
            async with Admin(ns.addr) as admin:
                for t in topics:
                    await admin.create_topic(t, 4)
            async with Producer(ns.addr, batch_max_delay=0.005) as p:
                for t in topics:  # routes cached
                    await p.send(Message(t, b"first"))
                futs = [p.send_async(Message(topics[i % 20], b"m%d" % i)) for i in range(200)]
                results = await asyncio.gather(*futs)
                assert p.multi.frames >= 1
                assert all(r.queue_offset >= 1 for r in results)
            c = PullConsumer(ns.addr, "g-spread", consume_from="first", auto_commit=False)
            for t in topics:
                c.subscribe(t)
            got: list[bytes] = []
            async with c:
                while len(got) < 220:
                    msgs = await c.poll(timeout=5)
                    assert msgs, len(got)
                    got += [m.body for m in msgs]
            assert sorted(got) == sorted([b"first"] * 20 + [b"m%d" % i for i in range(200)])

        asyncio.run(run())
    finally:
        br.stop()
        ns.stop()
