"""The lite pull consumer with many queues (issue 17), against a real `tidemq dev`: one pull
driver per broker pulls every queue (standing PULL_MULTI_QUEUE requests, no task per queue),
every message arrives once, a seek and a tailing message work through it; the consumer-wide
cap (``pull_threshold_for_all``) bounds what it buffers, queue by queue or through drivers."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from tidemq.client.admin import Admin
from tidemq.client.consumer import PullConsumer
from tidemq.client.message import Message
from tidemq.client.producer import Producer


async def _topics(namesrv: str, prefix: str, n: int, queues: int) -> list[str]:
    names = [f"{prefix}{i}" for i in range(n)]
    async with Admin(namesrv) as admin:
        for t in names:
            await admin.create_topic(t, queues)
    return names


async def _spread(namesrv: str, topics: list[str], queues: int, count: int,
                  tag: str) -> list[bytes]:
    """``count`` messages with distinct bodies at random over every queue of the topics, each
    stored on its own (a pull's batch size then counts messages)."""
    rnd = random.Random(count)
    bodies = [b"%s-%d" % (tag.encode(), i) for i in range(count)]
    async with Producer(namesrv, auto_batch=False) as p:
        sends = []
        for b in bodies:
            t = topics[rnd.randrange(len(topics))]
            sends.append(p.send_batch([Message(t, b)], queue_id=rnd.randrange(queues)))
        await asyncio.gather(*sends)
    return bodies


def _consumer(dev, group: str, topics: list[str], **kw) -> PullConsumer:
    """A lite PullConsumer of ``group`` subscribed to ``topics``: from the first offset, no
    auto-commit, pull drivers from 16 queues, 2 s held pulls (``kw`` overrides)."""
    opts = {"consume_from": "first", "auto_commit": False, "multi_queue_min": 16,
            "suspend_timeout": 2.0, **kw}
    c = PullConsumer(dev.namesrv, group, **opts)
    for t in topics:
        c.subscribe(t)
    return c


async def _poll_until(c: PullConsumer, n: int, got: list[bytes], timeout: float = 5.0) -> None:
    while len(got) < n:
        msgs = await c.poll(timeout=timeout)
        assert msgs, f"only {len(got)} of {n} messages arrived"
        got += [m.body for m in msgs]


def test_many_queues_are_pulled_by_one_driver_and_every_message_arrives_once(dev) -> None:
    async def run() -> None:
        topics = await _topics(dev.namesrv, "drv", 8, 8)  # 64 queues
        bodies = await _spread(dev.namesrv, topics, 8, 2000, "a")
        c = _consumer(dev, "g-drv", topics, pull_batch_size=16)
        got: list[bytes] = []
        async with c:
            await _poll_until(c, len(bodies), got)
            assert len(c.assignment()) == 64
            assert len(c._lite._drivers) == 1
            assert all(q.task is None for q in c._queues.values())  # no task per queue
            # far fewer requests than queue pulls (each request carries many queues)
            assert 1 <= c._lite.requests < c._lite.pulls / 4
            # tailing: the queues stand on the broker; a new message wakes its queue
            await asyncio.sleep(0.3)
            async with Producer(dev.namesrv) as p:
                await p.send(Message(topics[5], b"late"))
            late = await c.poll(timeout=5)
            assert [m.body for m in late] == [b"late"]
            assert await c.poll(timeout=0.5) == []  # and nothing else: no duplicates
            # a seek goes through the driver too: the fullest queue again from its start
            mq = max(c.assignment(), key=lambda m: c.position(m) or 0)
            before = c.position(mq)
            assert before and before > 1
            assert all(c.position(m) for m in c.assignment())  # every queue had messages
            await c.seek(mq, 0)
            again: list[bytes] = []
            await _poll_until(c, before, again)
            assert await c.poll(timeout=0.5) == []
            assert all(b in set(bodies) for b in again) and len(set(again)) == before
        dup = [b for b, k in Counter(got).items() if k > 1]
        assert not dup, dup[:5]
        assert sorted(got) == sorted(bodies)

    asyncio.run(run())


@pytest.mark.parametrize("multi_queue_min", [0, 16], ids=["queue-by-queue", "drivers"])
def test_the_consumer_wide_cap_bounds_what_it_buffers(dev, multi_queue_min: int) -> None:
    cap, batch, queues = 100, 8, 32

    async def run() -> None:
        topics = await _topics(dev.namesrv, f"cap{multi_queue_min}-", 4, 8)
        bodies = await _spread(dev.namesrv, topics, 8, 3000, f"c{multi_queue_min}")
        c = _consumer(dev, f"g-cap{multi_queue_min}", topics, multi_queue_min=multi_queue_min,
                      pull_batch_size=batch, max_poll_records=40, pull_threshold_for_all=cap)
        got: list[bytes] = []
        peak = 0
        async with c:
            while len(got) < len(bodies):
                msgs = await c.poll(timeout=5)
                assert msgs, f"only {len(got)} of {len(bodies)} messages arrived"
                got += [m.body for m in msgs]
                # let the pulls the poll allowed arrive before looking
                await asyncio.sleep(0.002)
                peak = max(peak, c.stats()["buffered"])
                assert c._buffered == sum(q.buffered for q in c._queues.values())
            # the cap is checked before each pull: what is in flight then (one batch per
            # queue at most) may land on top of it; never the 3,000 of the backlog
            assert cap <= peak <= cap + queues * batch
        assert not [b for b, k in Counter(got).items() if k > 1]
        assert sorted(got) == sorted(bodies)

    asyncio.run(run())


def test_non_persistent_topics_through_the_drivers_lose_nothing(dev):
    """Non-persistent topics (%NP%, memory only; the broker resolves no start for them in a
    multi pull): every message sent after the consumer started arrives, once."""
    async def run() -> None:
        topics = await _topics(dev.namesrv, "%NP%drv", 3, 8)  # 24 queues
        c = _consumer(dev, "g-np", topics, consume_from="last")
        got: list[bytes] = []
        async with c:
            for _ in range(100):  # every queue knows where it starts
                if len(c.assignment()) == 24 and all(
                        c.position(mq) is not None for mq in c.assignment()):
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)
            bodies = await _spread(dev.namesrv, topics, 8, 300, "np")
            await _poll_until(c, len(bodies), got)
            assert await c.poll(timeout=0.5) == []
        assert sorted(got) == sorted(bodies)

    asyncio.run(run())


def test_queues_stand_on_with_permits_and_are_pulled_once(dev) -> None:
    """With permits (LitePulls.keep_permits) a queue answered with messages stands on at its
    next offset: draining a backlog names each queue once, and a later message arrives
    without any queue being pulled again (before: every queue a second time, to stand)."""

    async def run() -> None:
        topics = await _topics(dev.namesrv, "kp", 4, 8)  # 32 queues
        bodies = await _spread(dev.namesrv, topics, 8, 200, "k")  # ~6 a queue, < batch size
        c = _consumer(dev, "g-kp", topics, pull_batch_size=32)
        got: list[bytes] = []
        async with c:
            await _poll_until(c, len(bodies), got)
            await asyncio.sleep(0.3)
            assert c._lite.pulls == 32
            assert all(q.standing for q in c._queues.values())
            async with Producer(dev.namesrv) as p:
                await p.send(Message(topics[2], b"late"), queue_id=3)
            late = await c.poll(timeout=5)
            assert [m.body for m in late] == [b"late"]
            assert c._lite.pulls == 32  # woken through its standing pull, not pulled again
        assert sorted(got) == sorted(bodies)

    asyncio.run(run())


def test_queues_by_topic_walk_in_sorted_order() -> None:
    """PullConsumer._apply orders its queues with _by_topic (faster than sorting 100,000
    MessageQueue structs): the same order as sorted()."""
    from tidemq.client.consumer import _by_topic
    from tidemq.client.message import MessageQueue

    rnd = random.Random(3)
    mqs = {MessageQueue(f"t{rnd.randrange(50)}", rnd.choice("ab"), rnd.randrange(20))
           for _ in range(600)}
    by = _by_topic(mqs)
    assert [mq for t in sorted(by) for mq in by[t]] == sorted(mqs)
    assert {t: len(v) for t, v in by.items()} == Counter(mq.topic for mq in mqs)


def test_the_first_requests_are_sized_so_no_queue_comes_back_not_read(dev) -> None:
    """300 queues of 16 KiB each (4.7 MiB, more than one answer's 4 MiB): the driver sends a
    probe of 64 queues first and sizes the others' requests by its answer, so every queue is
    read by its first pull (before: one request of 300, ~44 answered "not read" and sent
    again)."""

    async def run() -> None:
        topics = await _topics(dev.namesrv, "sz", 75, 4)  # 300 queues
        body = random.Random(5).randbytes(16 * 1024)  # incompressible
        async with Producer(dev.namesrv, auto_batch=False) as p:
            await asyncio.gather(*(p.send_batch([Message(t, body)], queue_id=q)
                                   for t in topics for q in range(4)))
        c = _consumer(dev, "g-sz", topics, pull_batch_size=32)
        got: list[bytes] = []
        async with c:
            await _poll_until(c, 300, got)
            await asyncio.sleep(0.3)
            assert c._lite.pulls == 300  # each queue once: none "not read" and sent again
            assert c._lite.requests <= 6
        assert got == [body] * 300

    asyncio.run(run())

