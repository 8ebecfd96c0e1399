"""The push consumer's listener contract and ProcessQueue rules on a real broker: async
listeners with hooks and batch paging, ack_index, exceptions, flow control by the per-queue
thresholds, and the consume-timeout clean of a stuck message (CO1-CO3, CO5)."""

from __future__ import annotations

import asyncio
import threading
import time

import tidemq
import tidemq.aio as tq

from .cluster import wait_until

FAST = dict(consume_from="first", heartbeat_interval=1.0, persist_interval=0.2)


def test_async_listener_hooks_and_batch_paging(dev) -> None:
    topic = "pc-async"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 1)
    with tidemq.Producer(dev.namesrv) as p:
        p.send_batch([tidemq.Message(topic, b"m%d" % i) for i in range(10)])
    calls: list[list[bytes]] = []
    hooked: list[tuple[str, str | None, int]] = []

    class Hook:
        def before(self, ctx: tq.ConsumeContext) -> None:
            hooked.append(("before", ctx.status, len(ctx.msgs)))

        def after(self, ctx: tq.ConsumeContext) -> None:
            hooked.append(("after", ctx.status, len(ctx.msgs)))

    async def handle(msgs, ctx):
        await asyncio.sleep(0)  # runs on the consumer's loop
        calls.append([m.body for m in msgs])
        return tq.ConsumeStatus.SUCCESS

    async def go() -> None:
        async with tq.PushConsumer(dev.namesrv, "pc-async-g", handle, hooks=[Hook()],
                                   consume_message_batch_max_size=4, **FAST) as c:
            c.subscribe(topic)
            for _ in range(500):
                if sum(map(len, calls)) >= 10:
                    break
                await asyncio.sleep(0.01)

    asyncio.run(go())
    assert [b for page in calls for b in page] == [b"m%d" % i for i in range(10)]
    assert max(map(len, calls)) == 4  # pages of consume_message_batch_max_size
    assert hooked[:2] == [("before", None, len(calls[0])),
                          ("after", tq.ConsumeStatus.SUCCESS, len(calls[0]))]
    assert len(hooked) == 2 * len(calls)


def test_ack_index_and_exceptions_retry_only_the_rest(dev) -> None:
    topic = "pc-ack"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 1)
    lock = threading.Lock()
    seen: list[tuple[bytes, int]] = []

    def handle(msgs, ctx):
        with lock:
            seen.extend((m.body, m.reconsume_times) for m in msgs)
        if any(m.body == b"boom" and m.reconsume_times == 0 for m in msgs):
            raise RuntimeError("listener bug")  # counts as RECONSUME_LATER
        if len(msgs) == 4 and msgs[0].reconsume_times == 0:
            ctx.ack_index = 1  # the first two are consumed, the last two retried
        return tidemq.ConsumeStatus.SUCCESS

    with tidemq.PushConsumer(dev.namesrv, "pc-ack-g", handle,
                             consume_message_batch_max_size=4, **FAST) as c:
        c.subscribe(topic)
        wait_until(lambda: any(mq.topic.startswith("%RETRY%") for mq in c.assignment()), 5)
        with tidemq.Producer(dev.namesrv) as p:
            p.send_batch([tidemq.Message(topic, b) for b in (b"a", b"b", b"c", b"d")])
            p.send(tidemq.Message(topic, b"boom"))
        wait_until(lambda: len(seen) >= 8, 10)
        time.sleep(0.3)
    assert sorted(seen) == sorted([(b"a", 0), (b"b", 0), (b"c", 0), (b"d", 0), (b"c", 1),
                                   (b"d", 1), (b"boom", 0), (b"boom", 1)])


def test_flow_control_keeps_a_queue_under_its_threshold(dev) -> None:
    topic = "pc-flow"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 1)
    with tidemq.Producer(dev.namesrv) as p:
        for _ in range(100):
            p.send_batch([tidemq.Message(topic, b"x" * 100) for _ in range(10)])
    release = threading.Event()

    def handle(msgs, ctx):
        release.wait(10)
        return tidemq.ConsumeStatus.SUCCESS

    with tidemq.PushConsumer(dev.namesrv, "pc-flow-g", handle, pull_threshold_for_queue=100,
                             consume_thread_max=2, **FAST) as c:
        c.subscribe(topic)
        wait_until(lambda: c.stats()["flow_controlled"] > 3, 10)
        held = c.stats()["in_flight"]
        # A pull goes out only while at most 100 are held, and brings at most 32 more,
        # rounded up to whole stored batches (of 10 here).
        assert 100 < held <= 100 + 40
        release.set()
        wait_until(lambda: c.stats()["consumed"] == 1000, 10)
    with tidemq.Admin(dev.namesrv) as admin:
        assert admin.group_lag("pc-flow-g", topic).total_lag == 0


def test_a_queue_held_back_by_flow_control_pulls_again_once_consumed(dev) -> None:
    """Flow control parks a queue's pull until the listener has consumed enough of it: the
    pull goes out then, not after a fixed 50 ms (which made a fast listener wait for nothing).
    A 1-queue backlog of 1,000, a threshold of 10 messages: nearly every pull is held back."""
    topic = "pc-flow-resume"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 1)
    with tidemq.Producer(dev.namesrv) as p:
        for _ in range(100):
            p.send_batch([tidemq.Message(topic, b"x" * 100) for _ in range(10)])

    def handle(msgs, ctx):
        return tidemq.ConsumeStatus.SUCCESS

    with tidemq.PushConsumer(dev.namesrv, "pc-flow-resume-g", handle,
                             pull_threshold_for_queue=10, **FAST) as c:
        c.subscribe(topic)
        wait_until(lambda: c.stats()["consumed"] == 1000, 20)
        st = c.stats()
    assert st["flow_controlled"] >= 5
    # Most parked pulls were resumed by the consumption itself, not by the 50 ms fallback.
    assert st["flow_resumed_early"] >= st["flow_controlled"] // 2


def test_a_message_stuck_past_the_consume_timeout_is_sent_back(dev) -> None:
    topic = "pc-stuck"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 1)
    release = threading.Event()
    seen: list[tuple[bytes, int]] = []

    def handle(msgs, ctx):
        seen.extend((m.body, m.reconsume_times) for m in msgs)
        if msgs[0].body == b"stuck" and msgs[0].reconsume_times == 0:
            release.wait(10)
        return tidemq.ConsumeStatus.SUCCESS

    with tidemq.PushConsumer(dev.namesrv, "pc-stuck-g", handle, consume_timeout=1.0,
                             **FAST) as c, tidemq.Admin(dev.namesrv) as admin:
        c.subscribe(topic)
        wait_until(lambda: any(mq.topic.startswith("%RETRY%") for mq in c.assignment()), 5)
        with tidemq.Producer(dev.namesrv) as p:
            p.send(tidemq.Message(topic, b"stuck"))
            p.send_batch([tidemq.Message(topic, b"after%d" % i) for i in range(5)])
        # The stuck message pins the committed offset until the clean sends it back...
        wait_until(lambda: len(seen) >= 6, 5)
        assert admin.group_lag("pc-stuck-g", topic).total_lag == 6
        # ... after consume_timeout (1 s; 15 min by default): the offset moves on and the
        # copy comes back through the retry topic while the first call still hangs.
        wait_until(lambda: (b"stuck", 1) in seen, 10)
        wait_until(lambda: admin.group_lag("pc-stuck-g", topic).total_lag == 0, 5)
        release.set()


def test_consume_from_last_first_and_timestamp_for_a_new_group(dev) -> None:
    topic = "pc-from"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 2)
    with tidemq.Producer(dev.namesrv) as p:
        for i in range(4):
            p.send(tidemq.Message(topic, b"old%d" % i))
        time.sleep(0.05)
        cut = int(time.time() * 1000)
        time.sleep(0.05)
        for i in range(4):
            p.send(tidemq.Message(topic, b"mid%d" % i))
    got: dict[str, set[bytes]] = {"last": set(), "first": set(), "timestamp": set()}
    lock = threading.Lock()

    def listener(name: str):  # noqa: ANN202
        def handle(msgs, ctx):
            with lock:
                got[name].update(m.body for m in msgs)
            return tidemq.ConsumeStatus.SUCCESS
        return handle

    opts = dict(heartbeat_interval=1.0, persist_interval=0.2)
    consumers = [
        tidemq.PushConsumer(dev.namesrv, "pc-from-last", listener("last"), consume_from="last",
                            **opts),
        tidemq.PushConsumer(dev.namesrv, "pc-from-first", listener("first"),
                            consume_from="first", **opts),
        tidemq.PushConsumer(dev.namesrv, "pc-from-ts", listener("timestamp"),
                            consume_from="timestamp", consume_timestamp=cut, **opts),
    ]
    try:
        for c in consumers:
            c.subscribe(topic)
            c.start()
        for c in consumers:
            wait_until(lambda c=c: len([q for q in c.assignment() if q.topic == topic]) == 2, 5)
        time.sleep(0.3)  # every queue has its start offset
        with tidemq.Producer(dev.namesrv) as p:
            for i in range(4):
                p.send(tidemq.Message(topic, b"new%d" % i))
        wait_until(lambda: all(len(s) >= n for s, n in
                               zip(got.values(), (4, 12, 8), strict=True)), 10)
        time.sleep(0.2)
    finally:
        for c in consumers:
            c.close()
    old, mid, new = ({b"%s%d" % (k, i) for i in range(4)} for k in (b"old", b"mid", b"new"))
    assert got["last"] == new
    assert got["first"] == old | mid | new
    assert got["timestamp"] == mid | new


def test_a_fast_listener_gets_a_pull_in_one_job_a_slow_one_in_parallel_pages(dev) -> None:
    """Single-message batches (one send each): the listener still gets at most
    consume_message_batch_max_size messages a call; a fast listener is measured fast (its
    pages then travel in one pool job per pull), a slow one keeps running in parallel."""
    from tidemq.client.consume_concurrently import JOB_TARGET

    topic = "pc-bundle"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 1)
    with tidemq.Producer(dev.namesrv) as p:
        for i in range(200):
            p.send(tidemq.Message(topic, b"m%d" % i))
    calls: list[list[bytes]] = []

    def fast(msgs, ctx):
        calls.append([m.body for m in msgs])
        return tidemq.ConsumeStatus.SUCCESS

    with tidemq.PushConsumer(dev.namesrv, "pc-bundle-fast", fast,
                             consume_message_batch_max_size=3, **FAST) as c:
        c.subscribe(topic)
        wait_until(lambda: c.stats()["consumed"] == 200, 10)
        assert 0 < c._aio.consume_service.page_seconds < JOB_TARGET
    assert max(map(len, calls)) == 3
    assert sorted(b for page in calls for b in page) == sorted(b"m%d" % i for i in range(200))
    with tidemq.Admin(dev.namesrv) as admin:
        wait_until(lambda: admin.group_lag("pc-bundle-fast", topic).total_lag == 0, 5)

    lock = threading.Lock()
    active = [0, 0]  # now, peak

    def slow(msgs, ctx):
        with lock:
            active[0] += 1
            active[1] = max(active)
        time.sleep(0.1)
        with lock:
            active[0] -= 1
        return tidemq.ConsumeStatus.SUCCESS

    with tidemq.PushConsumer(dev.namesrv, "pc-bundle-slow", slow, pull_batch_size=8,
                             **FAST) as c:
        c.subscribe(topic)
        wait_until(lambda: c.stats()["consumed"] >= 24, 10)
        assert c._aio.consume_service.page_seconds >= JOB_TARGET
    assert active[1] >= 2  # pages of one pull ran on several pool threads at once


def test_a_failing_hook_retries_its_pages_instead_of_stranding_them(dev) -> None:
    topic = "pc-hook"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 1)
    with tidemq.Producer(dev.namesrv) as p:
        for i in range(5):
            p.send(tidemq.Message(topic, b"h%d" % i))
    seen: list[tuple[bytes, int]] = []
    failed = threading.Event()

    class Hook:
        def before(self, ctx: tq.ConsumeContext) -> None:
            if not failed.is_set():
                failed.set()
                raise RuntimeError("hook fails once")

        def after(self, ctx: tq.ConsumeContext) -> None:
            pass

    def handle(msgs, ctx):
        seen.extend((m.body, m.reconsume_times) for m in msgs)
        return tidemq.ConsumeStatus.SUCCESS

    with tidemq.PushConsumer(dev.namesrv, "pc-hook-g", handle, hooks=[Hook()], **FAST) as c, \
            tidemq.Admin(dev.namesrv) as admin:
        c.subscribe(topic)
        # Every message is consumed: those of the failed job come back through the retry
        # topic, and the committed offset moves past them.
        wait_until(lambda: {b for b, _ in seen} == {b"h%d" % i for i in range(5)}, 10)
        assert any(n == 1 for _, n in seen)
        wait_until(lambda: admin.group_lag("pc-hook-g", topic).total_lag == 0, 5)
