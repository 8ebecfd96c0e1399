"""Producer, PullConsumer and Admin against a real `tidemq dev` process."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest

import tidemq
from tidemq import aio
from tidemq.client.errors import NoRouteError


def make_topic(admin: tidemq.Admin, topic: str, queues: int = 4) -> list[tidemq.MessageQueue]:
    admin.create_topic(topic, queues)
    deadline = time.monotonic() + 5
    while True:
        try:
            qs = admin.topic_queues(topic)
            if len(qs) == queues:
                return qs
        except NoRouteError:
            pass
        assert time.monotonic() < deadline, f"topic {topic} never showed up in the route"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def admin(dev):
    with tidemq.Admin(dev.namesrv) as a:
        yield a


def drain(consumer: tidemq.PullConsumer, n: int, timeout: float = 5.0) -> list[tidemq.MessageExt]:
    out: list[tidemq.MessageExt] = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out += consumer.poll(timeout=0.5)
    return out


def test_send_single_and_receive_every_field(dev, admin):
    make_topic(admin, "it-single", 2)
    with tidemq.Producer(dev.namesrv, "pg") as p:
        r = p.send(tidemq.Message("it-single", b"hello", tags="TagA", keys=["k1", "k2"],
                                  properties={"color": "red"}), queue_id=1)
    assert r.status is tidemq.SendStatus.SEND_OK
    assert (r.topic, r.queue_id, r.queue_offset, r.count) == ("it-single", 1, 0, 1)
    assert len(r.msg_id) == 32 and r.msg_ids == [r.msg_id]
    with tidemq.PullConsumer(dev.namesrv, "g-single", consume_from="first") as c:
        c.subscribe("it-single")
        [m] = drain(c, 1)
    assert (m.topic, m.queue_id, m.queue_offset, m.msg_id) == ("it-single", 1, 0, r.msg_id)
    assert (m.body, m.tags, m.keys, m.properties) == (b"hello", "TagA", ["k1", "k2"],
                                                       {"color": "red"})
    now = time.time() * 1000
    assert now - 10_000 < m.born_timestamp <= m.store_timestamp <= now + 1000
    assert m.born_host.startswith("127.0.0.1:") and m.store_host == dev.broker
    assert m.reconsume_times == 0


def test_batch_lands_in_one_queue_with_consecutive_offsets(dev, admin):
    make_topic(admin, "it-batch", 4)
    msgs = [tidemq.Message("it-batch", f"m{i}".encode(), keys=f"key-{i}") for i in range(50)]
    with tidemq.Producer(dev.namesrv) as p:
        r1 = p.send_batch(msgs[:20])
        r2 = p.send_batch(msgs[20:], queue_id=r1.queue_id)
    assert r1.count == 20 and r2.count == 30 and r2.queue_offset == r1.queue_offset + 20
    mq = r1.message_queue
    with tidemq.PullConsumer(dev.namesrv, "g-batch", consume_from="first") as c:
        c.assign([mq])
        got = drain(c, 50)
    assert [m.body for m in got] == [m.body for m in msgs]
    assert [m.queue_offset for m in got] == list(range(50))
    assert [m.msg_id for m in got] == r1.msg_ids + r2.msg_ids
    with pytest.raises(ValueError, match="one topic"):
        tidemq.Producer(dev.namesrv).send_batch([tidemq.Message("a", b""),
                                                 tidemq.Message("b", b"")])


def test_async_oneway_and_callbacks(dev, admin):
    make_topic(admin, "it-async", 2)
    seen: list[tuple[object, object]] = []
    done = threading.Event()

    def cb(result, error):
        seen.append((result, error))
        if len(seen) == 10:
            done.set()

    with tidemq.Producer(dev.namesrv) as p:
        futs = [p.send_async(tidemq.Message("it-async", f"a{i}".encode()), cb) for i in range(10)]
        results = [f.result(5) for f in concurrent.futures.as_completed(futs)]
        p.send_oneway(tidemq.Message("it-async", b"oneway"))
        p.send_oneway([tidemq.Message("it-async", b"ow1"), tidemq.Message("it-async", b"ow2")])
    assert done.wait(5) and all(e is None for _, e in seen)
    assert len({r.msg_id for r in results}) == 10
    with tidemq.PullConsumer(dev.namesrv, "g-async", consume_from="first") as c:
        c.subscribe("it-async")
        got = drain(c, 13)
    assert sorted(m.body for m in got) == sorted(
        [f"a{i}".encode() for i in range(10)] + [b"oneway", b"ow1", b"ow2"])


def test_ordered_sends_by_selector_and_hash_key(dev, admin):
    make_topic(admin, "it-order", 4)

    def by_order_id(queues, msg, order_id):
        return queues[order_id % len(queues)]

    with tidemq.Producer(dev.namesrv) as p:
        rs = [p.send(tidemq.Message("it-order", f"step{i}".encode()), selector=by_order_id,
                     arg=7) for i in range(20)]
        hs = {p.send(tidemq.Message("it-order", b"h"), hash_key="user-42").queue_id
              for _ in range(5)}
    assert {r.queue_id for r in rs} == {7 % 4} and len(hs) == 1
    assert [r.queue_offset for r in rs] == list(range(rs[0].queue_offset,
                                                      rs[0].queue_offset + 20))
    with tidemq.PullConsumer(dev.namesrv, "g-order", consume_from="first") as c:
        c.assign([rs[0].message_queue])
        got = [m for m in drain(c, 20) if m.body.startswith(b"step")]
    assert [m.body for m in got] == [f"step{i}".encode() for i in range(20)]


def test_tag_filter_and_long_poll_wakes_at_once(dev, admin):
    make_topic(admin, "it-tags", 1)
    with tidemq.PullConsumer(dev.namesrv, "g-tags") as c, tidemq.Producer(dev.namesrv) as p:
        c.subscribe("it-tags", "TagA || TagC")
        assert c.poll(timeout=0.3) == []  # starts at the end; the pull is now held
        t0 = time.monotonic()
        p.send_batch([tidemq.Message("it-tags", b"a", tags="TagA"),
                      tidemq.Message("it-tags", b"b", tags="TagB"),
                      tidemq.Message("it-tags", b"c", tags="TagC")])
        got = drain(c, 2)
        waited = time.monotonic() - t0
    assert [(m.body, m.tags) for m in got] == [(b"a", "TagA"), (b"c", "TagC")]
    assert waited < 1.0, f"a held pull took {waited:.3f} s to return (periodic check is 5 s)"


def test_seek_and_commit_and_offsets_survive_restart(dev, admin):
    [mq] = make_topic(admin, "it-seek", 1)
    with tidemq.Producer(dev.namesrv) as p:
        t_mid = 0
        for i in range(10):
            if i == 5:
                time.sleep(0.05)
                t_mid = int(time.time() * 1000)
                time.sleep(0.05)
            p.send(tidemq.Message("it-seek", str(i).encode()))
    with tidemq.PullConsumer(dev.namesrv, "g-seek", consume_from="first",
                             auto_commit=False) as c:
        c.assign([mq])
        assert [m.body for m in drain(c, 10)] == [str(i).encode() for i in range(10)]
        c.seek(mq, 3)
        assert drain(c, 1)[0].queue_offset == 3
        c.seek_to_timestamp(mq, t_mid)
        assert drain(c, 1)[0].body == b"5"
        c.seek_to_end(mq)
        assert c.poll(timeout=0.2) == []
        c.seek_to_begin(mq)
        got = drain(c, 4)[:4]
        c.commit({mq: got[-1].queue_offset + 1})
        assert c.committed(mq) == 4
        with pytest.raises(ValueError, match="outside"):
            c.seek(mq, 999)
    assert admin.consumer_offset("g-seek", mq) == 4
    # A new consumer of the group continues at the committed offset.
    with tidemq.PullConsumer(dev.namesrv, "g-seek", consume_from="last") as c2:
        c2.assign([mq])
        got = drain(c2, 6)
    assert [m.queue_offset for m in got] == list(range(4, 10))
    # Auto-commit on close stored the position.
    assert admin.consumer_offset("g-seek", mq) == 10
    lag = admin.group_lag("g-seek", "it-seek")
    assert [(q.broker_offset, q.consumer_offset, q.lag) for q in lag.queues] == [(10, 10, 0)]


def test_admin_topics_offsets_lag_and_lookup(dev, admin):
    qs = make_topic(admin, "it-admin", 3)
    assert "it-admin" in admin.list_topics()
    assert set(admin.brokers().values()) == {dev.broker}
    with tidemq.Producer(dev.namesrv) as p:
        r = p.send_batch([tidemq.Message("it-admin", b"x", keys="order-9")] * 4, queue_id=2)
    status = {s.queue.queue_id: (s.min_offset, s.max_offset) for s in admin.topic_status(
        "it-admin")}
    assert status == {0: (0, 0), 1: (0, 0), 2: (0, 4)}
    assert admin.max_offset(qs[2]) == 4 and admin.min_offset(qs[2]) == 0
    admin.reset_consumer_offset("g-admin", qs[2], 1)
    lag = admin.group_lag("g-admin", "it-admin")
    assert lag.total_lag == 3
    found = admin.view_message(r.msg_ids[2])
    assert found is not None and found.queue_offset == 2 and found.body == b"x"
    by_key = admin.query_by_key("it-admin", "order-9")
    assert len(by_key) == 4 and all(m.keys == ["order-9"] for m in by_key)
    admin.delete_topic("it-admin")
    deadline = time.monotonic() + 5
    while "it-admin" in admin.list_topics():
        assert time.monotonic() < deadline, "deleted topic still listed"
        time.sleep(0.05)


def test_aio_core_end_to_end(dev, admin):
    make_topic(admin, "it-aio", 2)

    async def main():
        async with aio.Producer(dev.namesrv) as p, aio.PullConsumer(
            dev.namesrv, "g-aio", consume_from="first"
        ) as c:
            c.subscribe("it-aio")
            rs = await asyncio.gather(*(p.send(aio.Message("it-aio", b"%d" % i))
                                        for i in range(20)))
            fut = p.send_async(aio.Message("it-aio", b"last"))
            assert (await fut).topic == "it-aio"
            got: list[aio.MessageExt] = []
            while len(got) < 21:
                batch = await c.poll(timeout=2)
                assert batch, "poll timed out"
                got += batch
            return rs, got

    rs, got = asyncio.run(main())
    ids = {m.msg_id for m in got}
    assert len(got) == 21 and ids >= {r.msg_id for r in rs} and b"last" in {m.body for m in got}


def test_send_async_messages_of_one_iteration_share_a_batch(dev, admin):
    make_topic(admin, "it-autobatch", 2)

    async def main():
        async with aio.Producer(dev.namesrv) as p:
            futs = [p.send_async(aio.Message("it-autobatch", b"%d" % i)) for i in range(50)]
            rs = await asyncio.gather(*futs)
            solo = await p.send_async(aio.Message("it-autobatch", b"solo"), queue_id=1)
        return rs, solo

    rs, solo = asyncio.run(main())
    assert len({r.queue_id for r in rs}) == 1  # one batch, one queue
    assert [r.queue_offset for r in rs] == list(range(rs[0].queue_offset,
                                                      rs[0].queue_offset + 50))
    assert len({r.msg_id for r in rs}) == 50 and solo.queue_id == 1
    with tidemq.PullConsumer(dev.namesrv, "g-autobatch", consume_from="first") as c:
        c.assign([rs[0].message_queue])
        got = drain(c, 50)
    assert [m.body for m in got][:50] == [b"%d" % i for i in range(50)]
    assert [m.msg_id for m in got][:50] == [r.msg_id for r in rs]


def test_subscriber_picks_up_a_topic_created_after_it_started(dev, admin):
    with tidemq.PullConsumer(dev.namesrv, "g-late", consume_from="first") as c:
        c.subscribe("it-late")
        assert c.poll(timeout=0.2) == []  # no such topic yet: nothing, and no error
        admin.create_topic("it-late", 2)
        with tidemq.Producer(dev.namesrv) as p:
            p.send(tidemq.Message("it-late", b"hello late"))
        got = drain(c, 1, timeout=5)
    assert [m.body for m in got] == [b"hello late"]


def test_oneway_right_before_close_is_still_written(dev, admin):
    make_topic(admin, "it-oneway-close", 1)

    async def main():
        async with aio.Producer(dev.namesrv) as p:
            await p.send(aio.Message("it-oneway-close", b"first"))  # connection is open
            await p.send_oneway(aio.Message("it-oneway-close", b"last words"))
        # leaving the block closed the connection right after queueing the one-way frame

    asyncio.run(main())
    with tidemq.PullConsumer(dev.namesrv, "g-oneway-close", consume_from="first") as c:
        c.subscribe("it-oneway-close")
        got = drain(c, 2)
    assert [m.body for m in got] == [b"first", b"last words"]


def test_concurrent_single_sends_report_exact_results(dev, admin):
    """Many coroutines awaiting send(msg) on one producer (the per-request hot path): every
    SendResult names the sequence, id, queue and offset the broker stored, the queues are
    taken round robin (per shared batch), and a consumer reads exactly those ids at those
    places."""
    qs = make_topic(admin, "it-hot", 4)

    async def main():
        async with aio.Producer(dev.namesrv) as p:
            async def worker(k: int) -> list[aio.SendResult]:
                return [await p.send(aio.Message("it-hot", b"%d-%d" % (k, i), tags="T"))
                        for i in range(25)]

            rs = [r for part in await asyncio.gather(*(worker(k) for k in range(16)))
                  for r in part]
            return p.producer_id, rs

    pid, rs = asyncio.run(main())
    assert len(rs) == 400
    assert sorted(r.base_seq for r in rs) == list(range(400))  # one sequence per message
    for r in rs:
        assert r.status is tidemq.SendStatus.SEND_OK and r.count == 1 and r.topic == "it-hot"
        assert r.msg_id == f"{pid:016X}{r.base_seq:016X}" and r.producer_id == pid
        assert r.broker_name == qs[0].broker_name
    per_queue: dict[int, list[int]] = {}
    for r in rs:
        per_queue.setdefault(r.queue_id, []).append(r.queue_offset)
    assert sorted(per_queue) == [0, 1, 2, 3]
    # Batches (the concurrent sends share frames) take the queues round robin: each queue's
    # offsets are 0..n-1 once each.
    for offsets in per_queue.values():
        assert sorted(offsets) == list(range(len(offsets)))
    by_place = {(r.queue_id, r.queue_offset): r.msg_id for r in rs}
    with tidemq.PullConsumer(dev.namesrv, "g-hot", consume_from="first") as c:
        c.subscribe("it-hot")
        got = drain(c, 400)
    assert len(got) == 400
    assert {(m.queue_id, m.queue_offset): m.msg_id for m in got} == by_place
    assert all(m.tags == "T" for m in got)

