"""Standing multi-queue pulls deliver every message on time (issue 17).

Against a broker that lingers 5 ms before answering a woken standing request (the widest
``multi_pull_linger_ms``: it widens the window in which a newer request of the same connection
arrives), a woken queue must never be answered before the answer that made it stand: its
client does not know it stands yet and drops the woken answer, and the queue then waits for
the periodic check (5 s per 4,096 held queues) -- the late deliveries seen at 10,000 queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import struct
import time
from collections.abc import AsyncIterator, Iterator

import pytest

import tidemq
import tidemq.aio as tq
from broker.wire import Wire
from support.cluster import DevCluster, dev_cluster
from tidemq.protocol.codes import RequestCode, ResponseCode
from tidemq.protocol.headers import MultiQueuePull, PullMultiQueueRequestHeader

from .cluster import GROUP_OPTIONS, wait_until

NOT_FOUND = int(ResponseCode.PULL_NOT_FOUND)


@pytest.fixture(scope="module")
def dev() -> Iterator[DevCluster]:
    yield from dev_cluster("tidemq-standing-", *GROUP_OPTIONS, "multi_pull_linger_ms=5")


def _standing(w: Wire, pulls: list[MultiQueuePull]) -> int:
    return w.send(RequestCode.PULL_MULTI_QUEUE, PullMultiQueueRequestHeader(
        consumer_group="standing-g", pulls=pulls, suspend=True, suspend_timeout_millis=3000,
        standing=True))


@contextlib.asynccontextmanager
async def _push_consumer(dev, group: str, topics: list[str], handle, queues: int,
                         settle: float = 0.5) -> AsyncIterator[
        tuple[tq.Producer, tq.PushConsumer]]:
    """A producer, and a push consumer of ``group`` on ``topics`` pulling with standing
    multi-queue pulls from the first queue on, once it holds ``queues`` queues and ``settle``
    seconds more (every queue's start offset resolved, all standing)."""
    async with tq.Producer(dev.namesrv) as p, tq.PushConsumer(
            dev.namesrv, group, handle, consume_from="last",
            heartbeat_interval=1.0, rebalance_interval=1.0, multi_queue_min=1) as c:
        for t in topics:
            c.subscribe(t)
        await asyncio.to_thread(wait_until, lambda: len(c.assignment()) >= queues, 20)
        await asyncio.sleep(settle)
        yield p, c


async def _ticker(ticks: list[int]) -> None:
    """Count the event loop's turns (``ticks[0]``) until cancelled."""
    while True:
        ticks[0] += 1
        await asyncio.sleep(0)


def test_a_woken_queue_is_answered_after_the_answer_that_made_it_stand(dev) -> None:
    topic = "standing-order"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 8)
    with Wire(dev.broker) as w, Wire(dev.broker) as sender:
        standing: set[int] = set()
        for q in range(4):
            held = _standing(w, [MultiQueuePull(topic, 2 * q, 0)])  # stands, held
            time.sleep(0.05)
            sender.send_messages(topic, [b"m%d" % q], queue_id=2 * q)  # wakes it: 5 ms linger
            _standing(w, [MultiQueuePull(topic, 2 * q + 1, 0)])  # a newer request meanwhile
            for _ in range(2):
                r = w.recv(timeout=10)
                assert r.code == ResponseCode.SUCCESS
                standing |= {2 * q if r.opaque == held else 2 * q + 1
                             for x in r.header.results if x.code == NOT_FOUND}
                for wk in r.header.woken:
                    # the client learns that a queue stands from the answer to its pull: a
                    # woken answer before that one has no pull to go to
                    assert wk.queue_id in standing, (q, r.opaque, held)
                    standing.discard(wk.queue_id)
            assert 2 * q not in standing  # woken and answered


_TS = struct.Struct("<qi")


def test_push_consumer_of_standing_pulls_gets_every_message_in_time(dev) -> None:
    """Sends spread at random over 256 queues, a few at a time (so answers and new requests
    cross often): every message arrives, each within 2 s of its send."""
    topics = [f"standing-{i}" for i in range(32)]
    with tidemq.Admin(dev.namesrv) as admin:
        for t in topics:
            admin.create_topic(t, 8)
    late: dict[int, float] = {}
    got: set[int] = set()

    async def handle(msgs, ctx):
        now = time.time()
        for m in msgs:
            ts, i = _TS.unpack_from(m.body)
            got.add(i)
            late[i] = now - ts / 1e9
        return tq.ConsumeStatus.SUCCESS

    total = 3000

    async def go() -> None:
        async with _push_consumer(dev, "standing-push", topics, handle, 256, 1.0) as (p, c):
            rnd = random.Random(17)
            for i in range(total):
                p.send_async(tq.Message(topics[rnd.randrange(len(topics))],
                                        _TS.pack(time.time_ns(), i)))
                if i % 10 == 9:
                    await asyncio.sleep(rnd.random() * 0.002)
            t0 = time.monotonic()
            while len(got) < total and time.monotonic() - t0 < 6:
                await asyncio.sleep(0.02)
            stats = c.stats()
            assert stats["multi_pull_requests"] > 0
            # the queues stand on with their permits: not a pull per message (at least 32
            # permits a pull, about 12 messages a queue here)
            assert stats["pulls"] < total // 2, stats
            # and the single-message pulls of one answer share a listener task
            assert stats["consume_jobs"] < total // 4, stats

    asyncio.run(go())
    missing = sorted(set(range(total)) - got)
    assert not missing, f"{len(missing)} of {total} not received: {missing[:10]}"
    slow = sorted((round(v, 2), i) for i, v in late.items() if v > 2.0)
    assert not slow, f"{len(slow)} messages took over 2 s: {slow[-5:]}"


def test_a_queue_with_permits_stands_on_after_its_answers_until_they_are_used(dev) -> None:
    """``keep`` permits (docs/protocol.md 4.0, "kept standing"): a queue answered with
    messages stands on at its next offset, without a re-pull, while permits are left; the
    answer that uses the last one says it no longer stands, and later messages wait for a
    pull that names the queue again."""
    topic = "standing-keep"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 2)
    with Wire(dev.broker) as w, Wire(dev.broker) as sender:
        first = w.recv(_standing(w, [MultiQueuePull(topic, 1, 0, keep=4)]), timeout=10)
        assert [r.code for r in first.header.results] == [NOT_FOUND]
        got: list[tuple[int, bool]] = []  # (next offset, stands) of each woken answer
        for bodies in ([b"a"], [b"b"], [b"c", b"d"]):
            # a request that names no queue only carries the woken answers
            waiting = _standing(w, [])
            sender.send_messages(topic, bodies, queue_id=1)
            r = w.recv(waiting, timeout=10)
            assert r.code == ResponseCode.SUCCESS
            assert [(wk.queue_id, wk.result.code) for wk in r.header.woken] == [
                (1, int(ResponseCode.SUCCESS))]
            res = r.header.woken[0].result
            got.append((res.next_begin_offset, res.stands))
        assert got == [(1, True), (2, True), (4, False)]  # 4 permits: a, b, c and d
        waiting = _standing(w, [])
        sender.send_messages(topic, [b"e"], queue_id=1)
        r = w.recv(waiting, timeout=10)  # held until its timeout (3 s): nothing stands
        assert r.code == ResponseCode.SUCCESS and not r.header.woken
        # named again, the queue reads from where the client is
        again = w.recv(_standing(w, [MultiQueuePull(topic, 1, 4, keep=4)]), timeout=10)
        assert [(x.code, x.next_begin_offset, x.stands) for x in again.header.results] == [
            (int(ResponseCode.SUCCESS), 5, True)]


def test_a_queue_without_permits_is_answered_once(dev) -> None:
    """Without ``keep`` (an older client), a woken queue stands no more after its answer."""
    topic = "standing-nokeep"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 1)
    with Wire(dev.broker) as w, Wire(dev.broker) as sender:
        w.recv(_standing(w, [MultiQueuePull(topic, 0, 0)]), timeout=10)
        waiting = _standing(w, [])
        sender.send_messages(topic, [b"a"], queue_id=0)
        r = w.recv(waiting, timeout=10)
        assert [(wk.result.next_begin_offset, wk.result.stands) for wk in r.header.woken] == [
            (1, False)]
        waiting = _standing(w, [])
        sender.send_messages(topic, [b"b"], queue_id=0)
        assert not w.recv(waiting, timeout=10).header.woken


def test_a_message_stored_while_its_queue_is_being_answered_is_not_left_behind(dev) -> None:
    """A queue with permits is not held between its read and its answer's departure (the
    5 ms linger here); a message stored in that window must be read when the queue stands on,
    not wait for the periodic check (seconds)."""
    topic = "standing-window"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 1)
    with Wire(dev.broker) as w, Wire(dev.broker) as sender:
        w.recv(_standing(w, [MultiQueuePull(topic, 0, 0, keep=1000)]), timeout=10)
        sent = 0
        got = 0
        for _ in range(5):
            waiting = _standing(w, [])
            sender.send_messages(topic, [b"x"], queue_id=0)  # wakes the queue: 5 ms linger
            sender.send_messages(topic, [b"y"], queue_id=0)  # most likely within the linger
            sent += 2
            t0 = time.monotonic()
            while got < sent:
                r = w.recv(waiting, timeout=10)
                for wk in r.header.woken:
                    assert wk.result.stands
                    got = wk.result.next_begin_offset
                waiting = _standing(w, []) if got < sent else None
            # both within the request timeout (3 s), not after the periodic check
            assert time.monotonic() - t0 < 2.0, sent


def test_the_next_standing_request_is_on_the_broker_while_an_answer_is_handled(dev) -> None:
    """The push consumer's carrier of standing queues is written when an answer arrives,
    before that answer's queues are handled (decoded, handed to the listener): messages stored
    meanwhile are answered in it then, not after a round trip that starts when the handling
    ends (the wait of the slow messages at 10,000 queues)."""
    topic = "standing-carrier"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 8)
    got: list[bytes] = []
    in_flight: list[int] = []

    async def handle(msgs, ctx):
        got.extend(m.body for m in msgs)
        return tq.ConsumeStatus.SUCCESS

    async def go() -> None:
        async with _push_consumer(dev, "standing-carrier", [topic], handle, 8) as (p, c):
            svc = c.pull_service
            orig = svc.on_result

            def on_result(req, r, body, addr):
                in_flight.append(sum(d.in_flight for d in svc._drivers.values()))
                return orig(req, r, body, addr)

            svc.on_result = on_result
            for i in range(20):
                await p.send(tq.Message(topic, b"c%d" % i))
                await asyncio.sleep(0.02)
            await asyncio.to_thread(wait_until, lambda: len(got) >= 20, 10)

    asyncio.run(go())
    assert len(got) == 20
    assert in_flight and min(in_flight) >= 1, in_flight


def test_periodic_passes_over_every_queue_give_the_loop_back(dev, monkeypatch) -> None:
    """A rebalance pass and an offset persist walk every topic / queue of the consumer with
    nothing to wait for (routes, members and addresses cached): without a yield each pass is
    one stretch of the event loop (15 ms and 8 ms at 10,000 queues), and every answer that
    arrives meanwhile waits. With ``loop_share.SLICE`` at 0 they yield at every step."""
    from tidemq.client import loop_share

    topics = [f"share-{i}" for i in range(12)]
    with tidemq.Admin(dev.namesrv) as admin:
        for t in topics:
            admin.create_topic(t, 2)
    ticks = [0]
    seen: dict[str, list[int]] = {"rebalance": [], "persist": []}

    async def handle(msgs, ctx):
        return tq.ConsumeStatus.SUCCESS

    async def go() -> None:
        async with _push_consumer(dev, "share-g", topics, handle, 24, 0.0) as (p, c):
            for t in topics:
                for q in range(2):
                    await p.send(tq.Message(t, b"x"), queue_id=q)
            await asyncio.sleep(0.5)
            monkeypatch.setattr(loop_share, "SLICE", 0.0)
            rb = c.rebalance
            orig_topic = rb._rebalance_topic

            async def one_topic(topic, members, have):
                seen["rebalance"].append(ticks[0])
                return await orig_topic(topic, members, have)

            rb._rebalance_topic = one_topic
            store = c.offset_store
            orig_addr = store.routes.addr_for_read_now

            def addr(mq, *a):
                seen["persist"].append(ticks[0])
                return orig_addr(mq, *a)

            store.routes.addr_for_read_now = addr
            t = asyncio.create_task(_ticker(ticks))
            await rb.do_rebalance()  # the members were asked already: everything cached
            await rb.do_rebalance()
            seen["persist"].clear()
            store._sent.clear()  # every queue's offset to send
            await store.persist_all(set(rb.table))
            store.routes.addr_for_read_now = orig_addr
            t.cancel()

    asyncio.run(go())
    for what, at in seen.items():
        at = at[-24:] if what == "persist" else at[-12:]  # the second pass
        assert len(at) >= 12, (what, at)
        held = sum(1 for a, b in itertools.pairwise(at) if a == b)  # no loop turn between
        assert held <= 1, (what, at)


def test_a_large_answer_is_handled_in_slices_of_the_loop(dev, monkeypatch) -> None:
    """An answer of many woken queues is handled a slice of the loop at a time
    (``loop_share.SLICE``; 0 here: one queue a turn): the listener's runs and the next answers
    go between them, rather than waiting for all of its queues (41-108 ms at 10,000 queues)."""
    from tidemq.client import loop_share

    topic = "standing-slices"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 8)
    got: list[bytes] = []
    seen: list[int] = []
    ticks = [0]

    async def handle(msgs, ctx):
        got.extend(m.body for m in msgs)
        return tq.ConsumeStatus.SUCCESS

    async def go() -> None:
        async with _push_consumer(dev, "standing-slices", [topic], handle, 8) as (p, c):
            monkeypatch.setattr(loop_share, "SLICE", 0.0)
            svc = c.pull_service
            orig = svc.on_result

            def on_result(req, r, body, addr):
                seen.append(ticks[0])
                return orig(req, r, body, addr)

            svc.on_result = on_result
            t = asyncio.create_task(_ticker(ticks))
            for rnd in range(3):  # one message in each queue at once: woken together
                await asyncio.gather(*(p.send(tq.Message(topic, b"s%d-%d" % (rnd, q)),
                                              queue_id=q) for q in range(8)))
                want = 8 * (rnd + 1)
                await asyncio.to_thread(wait_until, lambda n=want: len(got) >= n, 10)
            t.cancel()

    asyncio.run(go())
    assert len(got) == 24
    assert len(seen) >= 24, seen
    held = sum(1 for a, b in itertools.pairwise(seen) if a == b)  # no loop turn between
    assert held <= 2, seen
