"""SEND_MULTI_QUEUE (issue 17) against a real broker: one frame of batches for many queues,
every batch through the whole door (the same refusals as SEND_BATCH, in its own result), the
good ones stored and readable; a body that does not frame is refused whole; the producer
gathers the open batches of many topics into such frames."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from tidemq.client.admin import Admin
from tidemq.client.consumer import PullConsumer
from tidemq.client.message import Message
from tidemq.client.producer import Producer
from tidemq.protocol.codes import RequestCode
from tidemq.protocol.headers import (
    MultiQueuePull,
    PullMultiQueueRequestHeader,
    SendMultiQueueRequestHeader,
)
from tidemq.protocol.record import BatchView

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
                # ~10 messages a topic's batch: plain ones take the frame's small-batch
                # encoder; a batch holding a tagged message (i = 0, 140: topic 0) the full one
                futs = [p.send_async(Message(topics[i % 20], b"m%d" % i,
                                             tags="x" if i % 140 == 0 else None))
                        for i in range(200)]
                results = await asyncio.gather(*futs)
                assert p.multi.frames >= 1
                assert all(r.queue_offset >= 1 for r in results)
            c = PullConsumer(ns.addr, "g-spread", consume_from="first", auto_commit=False)
            for t in topics:
                c.subscribe(t)
            got: list[tuple[bytes, str | None]] = []
            async with c:
                while len(got) < 220:
                    msgs = await c.poll(timeout=5)
                    assert msgs, len(got)
                    got += [(m.body, m.tags or None) for m in msgs]
            assert sorted(got, key=repr) == sorted(
                [(b"first", None)] * 20
                + [(b"m%d" % i, "x" if i % 140 == 0 else None) for i in range(200)], key=repr)

        asyncio.run(run())
    finally:
        br.stop()
        ns.stop()


def test_spread_traffic_keeps_its_multi_queue_frames_while_the_broker_is_avoided(tmp_path):
    # One slow answer (>= 550 ms: a large frame queued behind others on a loaded machine)
    # puts the broker on the latency-fault list for 30 s. The frames must keep going (the
    # queue choice handles the avoidance): falling back to one request per batch made spread
    # traffic slower still, and the timeouts that followed renewed the avoidance.
    ns = start_namesrv(tmp_path)
    br = start_broker(tmp_path, ns.addr)
    try:
        async def run() -> None:
            topics = [f"avoid{i}" for i in range(20)]
            async with Admin(ns.addr) as admin:
                for t in topics:
                    await admin.create_topic(t, 4)
            async with Producer(ns.addr, batch_max_delay=0.005) as p:
                for t in topics:  # routes cached
                    await p.send(Message(t, b"first"))
                broker = p.router.cached(topics[0]).write_queues[0].broker_name
                p.router.record(broker, 600.0)  # a slow answer: avoided for 30 s
                assert p.router.faults.avoiding
                batches0 = p.accumulator.batches
                futs = [p.send_async(Message(topics[i % 20], b"m%d" % i)) for i in range(200)]
                results = await asyncio.gather(*futs)
                assert p.multi.frames >= 1
                # no batch went alone (each of the 20 topics' batches rode in a frame)
                assert p.accumulator.batches == batches0
                assert len({(r.topic, r.queue_id, r.queue_offset) for r in results}) == 200

        asyncio.run(run())
    finally:
        br.stop()
        ns.stop()


def test_a_message_refused_in_a_multi_queue_frame_fails_only_its_own_caller(tmp_path):
    # the client's properties limit is above the broker's (32 KiB): only the broker refuses
    ns = start_namesrv(tmp_path)
    br = start_broker(tmp_path, ns.addr)
    try:
        async def run() -> list[object]:
            topics = [f"iso{i}" for i in range(10)]
            async with Admin(ns.addr) as admin:
                for t in topics:
                    await admin.create_topic(t, 1)
            async with Producer(ns.addr, batch_max_delay=0.005,
                                max_properties_size=128 * 1024) as p:
                for t in topics:  # routes cached
                    await p.send(Message(t, b"first"))
                msgs = [Message(topics[i % 10], b"m%d" % i) for i in range(100)]
                msgs[33] = Message(topics[3], b"bad", properties={"big": "x" * 40_000})
                futs = [p.send_async(m) for m in msgs]
                out = await asyncio.gather(*futs, return_exceptions=True)
                assert p.multi.frames >= 1
                return out

        out = asyncio.run(run())
        errors = [i for i, r in enumerate(out) if isinstance(r, BaseException)]
        assert errors == [33], [out[i] for i in errors[:3]]
        assert "propert" in str(out[33])

        async def read() -> list[bytes]:
            c = PullConsumer(ns.addr, "g-iso", consume_from="first", auto_commit=False)
            c.subscribe("iso3")
            got: list[bytes] = []
            async with c:
                while len(got) < 10:
                    msgs = await c.poll(timeout=5)
                    assert msgs, got
                    got += [m.body for m in msgs]
            return got

        assert sorted(asyncio.run(read())) == sorted(
            [b"first"] + [b"m%d" % i for i in range(3, 100, 10) if i != 33])
    finally:
        br.stop()
        ns.stop()


# -- PULL_MULTI_QUEUE -----------------------------------------------------------------------------


def _pull_multi(w: Wire, pulls, *, suspend_ms: int | None = None, timeout: float = 10.0):
    h = PullMultiQueueRequestHeader(consumer_group="cg", pulls=pulls,
                                    suspend=suspend_ms is not None,
                                    suspend_timeout_millis=suspend_ms or 0)
    return w.request(RequestCode.PULL_MULTI_QUEUE, h, timeout=timeout)


def _bodies(frame, pulls):
    """The messages of each queue of a PULL_MULTI_QUEUE answer."""
    out = []
    pos = 0
    body = frame.body
    for p, r in zip(pulls, frame.header.results, strict=True):
        part = body[pos : pos + r.body_bytes]
        pos += r.body_bytes
        msgs = []
        q = 0
        while q < len(part):
            v = BatchView(part, q)
            v.verify()
            msgs += [m.body for m in v.messages(max(0, p.queue_offset - v.queue_offset))]
            q += v.total_size
        out.append(msgs)
    assert pos == len(body)
    return out


def test_one_pull_serves_many_queues_each_through_the_door(wire, topic):
    assert wire.create_topic(topic, 4).code == R.SUCCESS
    for q in (0, 2):
        wire.send_messages(topic, [b"q%d-%d" % (q, i) for i in range(3)], queue_id=q)
    pulls = [MultiQueuePull(topic, 0, 1), MultiQueuePull(topic, 1, 0),
             MultiQueuePull(topic, 2, 0, max_msg_nums=2), MultiQueuePull(topic, 9, 0),
             MultiQueuePull("SCHEDULE_TOPIC_XXXX", 0, 0),
             MultiQueuePull(topic, 0, 0, subscription="||")]
    r = _pull_multi(wire, pulls)
    assert r.code == R.SUCCESS, error_message(r)
    res = r.header.results
    assert [x.code for x in res[:4]] == [R.SUCCESS, R.PULL_NOT_FOUND, R.SUCCESS,
                                         R.INVALID_ARGUMENT]
    assert res[4].code != R.SUCCESS and res[5].code == R.SUBSCRIPTION_PARSE_FAILED
    assert "out of range" in res[3].message
    assert (res[0].next_begin_offset, res[0].max_offset) == (3, 3)
    got = _bodies(r, pulls)
    assert got[0] == [b"q0-1", b"q0-2"] and got[1] == [] and got[2][:2] == [b"q2-0", b"q2-1"]


def test_a_held_multi_pull_wakes_on_any_of_its_queues(broker, topic):
    with Wire(broker.addr) as w, Wire(broker.addr) as sender:
        assert w.create_topic(topic, 8).code == R.SUCCESS
        pulls = [MultiQueuePull(topic, q, 0) for q in range(8)]
        t0 = time.monotonic()
        opaque = w.send(RequestCode.PULL_MULTI_QUEUE, PullMultiQueueRequestHeader(
            consumer_group="cg", pulls=pulls, suspend=True, suspend_timeout_millis=5000))
        time.sleep(0.3)
        sender.send_messages(topic, [b"wake"], queue_id=5)
        r = w.recv(opaque, timeout=10)
        assert time.monotonic() - t0 < 3
        assert r.code == R.SUCCESS
        assert [x.code for x in r.header.results].count(R.SUCCESS) == 1
        assert _bodies(r, pulls)[5] == [b"wake"]
        # nothing arrives: answered at the timeout, every queue PULL_NOT_FOUND
        pulls = [MultiQueuePull(topic, q, 1 if q == 5 else 0) for q in range(8)]
        t0 = time.monotonic()
        r = _pull_multi(w, pulls, suspend_ms=600)
        assert 0.5 < time.monotonic() - t0 < 3
        assert {x.code for x in r.header.results} == {R.PULL_NOT_FOUND}


def test_a_consumer_of_many_queues_pulls_them_in_multi_queue_requests(tmp_path):
    ns = start_namesrv(tmp_path)
    br = start_broker(tmp_path, ns.addr)
    try:
        async def run() -> None:
            topics = [f"many{i}" for i in range(12)]
            async with Admin(ns.addr) as admin:
                for t in topics:
                    await admin.create_topic(t, 8)
            async with Producer(ns.addr) as p:
                await asyncio.gather(*(p.send(Message(t, b"%s-%d" % (t.encode(), i)))
                                       for t in topics for i in range(5)))
            c = PullConsumer(ns.addr, "g-many", consume_from="first", auto_commit=False,
                             multi_queue_min=16, suspend_timeout=2.0)
            for t in topics:
                c.subscribe(t)
            got: list[bytes] = []
            async with c:
                while len(got) < 60:
                    msgs = await c.poll(timeout=5)
                    assert msgs, len(got)
                    got += [m.body for m in msgs]
                assert c._lite.requests >= 1
                assert len(c._lite._drivers) == 1
                assert all(q.task is None for q in c._queues.values())  # no task per queue
                # tailing: a held multi pull wakes for a new message on any queue
                async with Producer(ns.addr) as p:
                    await p.send(Message("many7", b"late"))
                late = await c.poll(timeout=5)
                assert [m.body for m in late] == [b"late"]
            assert sorted(got) == sorted(b"%s-%d" % (t.encode(), i) for t in topics
                                         for i in range(5))

        asyncio.run(run())
    finally:
        br.stop()
        ns.stop()


def test_a_multi_pull_answer_stays_within_one_read(wire, topic):
    assert wire.create_topic(topic, 4).code == R.SUCCESS
    big = b"x" * 900_000
    for q in range(4):
        for _ in range(3):
            wire.send_messages(topic, [big], queue_id=q)
    pulls = [MultiQueuePull(topic, q, 0, max_msg_nums=32) for q in range(4)]
    r = _pull_multi(wire, pulls)
    res = r.header.results
    assert res[0].code == R.SUCCESS and len(r.body) <= 8 << 20
    assert res[-1].code == R.PULL_RETRY_IMMEDIATELY and res[-1].next_begin_offset == 0


def test_many_queues_start_where_the_group_committed_without_a_lookup_per_queue(tmp_path):
    """The multi pull resolves a new queue's start on the broker: the group's committed offset,
    else consume_from."""
    ns = start_namesrv(tmp_path)
    br = start_broker(tmp_path, ns.addr)
    try:
        async def run() -> None:
            async with Admin(ns.addr) as admin:
                await admin.create_topic("resolved", 32)
                route = await admin.topic_queues("resolved")
                async with Producer(ns.addr) as p:
                    for mq in route:
                        await p.send_batch([Message("resolved", b"%d-%d" % (mq.queue_id, i))
                                            for i in range(4)], queue_id=mq)
                # the group has consumed 3 messages of queue 5 and nothing elsewhere
                five = next(mq for mq in route if mq.queue_id == 5)
                await admin.reset_consumer_offset("g-res", five, 3)
            c = PullConsumer(ns.addr, "g-res", consume_from="last", auto_commit=False,
                             multi_queue_min=16, suspend_timeout=1.0)
            c.subscribe("resolved")
            got: list[bytes] = []
            async with c:
                for _ in range(10):
                    got += [m.body for m in await c.poll(timeout=1)]
                    if got:
                        break
                assert got == [b"5-3"]  # queue 5 from its committed offset; others from last
                for _ in range(100):
                    if all(c.position(mq) == 4 for mq in c.assignment()):
                        break
                    await asyncio.sleep(0.05)
                assert {c.position(mq) for mq in c.assignment()} == {4}
                assert len(c.assignment()) == 32
                assert c._lite.requests >= 1

        asyncio.run(run())
    finally:
        br.stop()
        ns.stop()


def test_spread_traffic_over_many_topics_is_split_into_bounded_frames(tmp_path):
    from tidemq.client import multi_sender

    ns = start_namesrv(tmp_path)
    br = start_broker(tmp_path, ns.addr)
    try:
        async def run() -> None:
            topics = [f"wide{i}" for i in range(40)]
            async with Admin(ns.addr) as admin:
                for t in topics:
                    await admin.create_topic(t, 2)
            async with Producer(ns.addr, batch_max_delay=0.005) as p:
                for t in topics:
                    await p.send(Message(t, b"first"))
                frames0 = p.multi.frames
                old = multi_sender.MAX_FRAME_BATCHES
                multi_sender.MAX_FRAME_BATCHES = 8
                try:
                    rs = await asyncio.gather(*(p.send_async(Message(t, b"x" * 100))
                                                for t in topics))
                finally:
                    multi_sender.MAX_FRAME_BATCHES = old
                assert all(r.queue_offset >= 1 for r in rs)
                assert p.multi.frames - frames0 >= 5  # 40 batches, at most 8 a frame

        asyncio.run(run())
    finally:
        br.stop()
        ns.stop()


def _standing(w: Wire, pulls, suspend_ms: int = 5000) -> int:
    return w.send(RequestCode.PULL_MULTI_QUEUE, PullMultiQueueRequestHeader(
        consumer_group="cg", pulls=pulls, suspend=True, suspend_timeout_millis=suspend_ms,
        standing=True))


def _woken(frame) -> dict[int, list[bytes]]:
    """The messages of each woken queue of a standing answer, by queue id."""
    pos = sum(r.body_bytes for r in frame.header.results)
    out = {}
    for wk in frame.header.woken:
        part = frame.body[pos : pos + wk.result.body_bytes]
        pos += wk.result.body_bytes
        out[wk.queue_id] = [m.body for m in decode_pull(SimpleNamespace(body=part), 0)]
    return out


def test_standing_pulls_stay_held_past_the_answer(broker, topic):
    with Wire(broker.addr) as w, Wire(broker.addr) as sender:
        assert w.create_topic(topic, 8).code == R.SUCCESS
        opaque = _standing(w, [MultiQueuePull(topic, q, 0) for q in range(8)])
        time.sleep(0.3)
        sender.send_messages(topic, [b"five"], queue_id=5)
        r = w.recv(opaque, timeout=10)
        assert r.code == R.SUCCESS and r.header.standing
        # its own queues found nothing (they stand); queue 5 comes back woken
        assert {x.code for x in r.header.results} == {R.PULL_NOT_FOUND}
        assert [(x.topic, x.queue_id) for x in r.header.woken] == [(topic, 5)]
        assert _woken(r) == {5: [b"five"]}
        # a queue woken while no request is held waits for the next one, answered at once
        sender.send_messages(topic, [b"two"], queue_id=2)
        time.sleep(0.2)
        t0 = time.monotonic()
        r = w.recv(_standing(w, []), timeout=10)
        assert time.monotonic() - t0 < 1 and _woken(r) == {2: [b"two"]}
        # queues 2 and 5 no longer stand: a message there wakes nothing
        sender.send_messages(topic, [b"again"], queue_id=5)
        t0 = time.monotonic()
        r = w.recv(_standing(w, [], suspend_ms=600), timeout=10)
        assert 0.5 < time.monotonic() - t0 < 3 and r.header.woken == []


def test_a_frame_of_single_messages_is_one_unit_and_a_bad_batch_refuses_only_its_part(
        wire, topic):
    """The frame path (issue 17): plain one-message batches checked as columns and stored by
    one put_frame, interleaved with batches that need the per-batch door (two messages,
    non-ASCII text, a damaged CRC, a queue that does not exist, a lying record): each gets
    its own result, the refusals worded as for a SEND_BATCH, and every queue's offsets
    follow the body's order."""
    assert wire.create_topic(f"{topic}a", 4).code == R.SUCCESS
    assert wire.create_topic(f"{topic}b", 4).code == R.SUCCESS
    a, b = f"{topic}a", f"{topic}b"
    damaged = bytearray(forge(b, [Rec(body=b"zz")], queue_id=2))
    damaged[-1] ^= 0xFF
    bodies = [
        forge(a, [Rec(body=b"a0", tag=b"t1")], queue_id=1),
        forge(b, [Rec(body=b"b0")], queue_id=2),
        forge(a, [Rec(body=b"a1"), Rec(body=b"a2")], queue_id=1),    # two messages
        forge(a, [Rec(body=b"a3", tag="é".encode())], queue_id=1),   # UTF-8, not ASCII
        bytes(damaged),                                                # CRC
        forge(b, [Rec(body=b"q")], queue_id=7),                        # no such queue
        forge(b, [Rec(body=b"x", size_fix=1)], queue_id=2),            # sizes lie
        forge(a, [Rec(body=b"a4", props=b"k\x01v\x02")], queue_id=1),
        forge(b, [Rec(body=b"b1")], queue_id=2),
    ]
    r = _multi(wire, bodies)
    assert r.code == R.SUCCESS, error_message(r)
    res = r.header.results
    assert [x.code for x in res] == [R.SUCCESS, R.SUCCESS, R.SUCCESS, R.SUCCESS,
                                    R.MESSAGE_ILLEGAL, R.INVALID_ARGUMENT, R.MESSAGE_ILLEGAL,
                                    R.SUCCESS, R.SUCCESS]
    assert "CRC32C mismatch" in res[4].message and "out of range" in res[5].message
    assert "record sizes are inconsistent" in res[6].message
    assert [(x.queue_offset, x.count) for x in res if x.code == R.SUCCESS] == [
        (0, 1), (0, 1), (1, 2), (3, 1), (4, 1), (1, 1)]
    msgs = decode_pull(wire.pull(a, 0, queue_id=1), 0)
    assert [(m.body, m.queue_offset) for m in msgs] == [
        (b"a0", 0), (b"a1", 1), (b"a2", 2), (b"a3", 3), (b"a4", 4)]
    assert msgs[0].tags == "t1" and msgs[3].tags == "é" and msgs[4].properties == {"k": "v"}
    assert [m.body for m in decode_pull(wire.pull(b, 0, queue_id=2), 0)] == [b"b0", b"b1"]


def test_a_topic_changed_between_frames_is_checked_again_on_the_frame_path(wire, topic):
    """The frame path remembers a plain topic's door (its config and stats counter, one
    lookup per batch): a change of the topic between two frames (fewer write queues, then
    read-only) applies to the very next frame, and every stored batch is counted in the
    topic's stats."""
    assert wire.create_topic(topic, 4).code == R.SUCCESS
    one = [forge(topic, [Rec(body=b"m")], queue_id=q) for q in (1, 3)]
    assert [x.code for x in _multi(wire, one).header.results] == [R.SUCCESS, R.SUCCESS]
    assert wire.create_topic(topic, 2).code == R.SUCCESS  # queue 3 no longer exists
    res = _multi(wire, one).header.results
    assert [x.code for x in res] == [R.SUCCESS, R.INVALID_ARGUMENT]
    assert "out of range" in res[1].message
    assert wire.create_topic(topic, 2, perm=4).code == R.SUCCESS  # read-only
    res = _multi(wire, one[:1]).header.results
    assert [x.code for x in res] == [R.NO_PERMISSION]
    assert wire.create_topic(topic, 2).code == R.SUCCESS
    assert [x.code for x in _multi(wire, one[:1]).header.results] == [R.SUCCESS]
    r = wire.request(RequestCode.GET_TOPIC_STATS, {"topic": topic})
    assert r.header.put_msgs == 4
    assert [m.body for m in decode_pull(wire.pull(topic, 0, queue_id=1), 0)] == [b"m"] * 3
