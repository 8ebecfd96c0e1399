"""Every send path batches (client/accumulator.py): concurrent ``await send()`` and blocking
``send()`` from many threads share frames, a send that finds nothing in flight leaves at once,
each caller keeps its own result and error, ordered sends keep their order, the send timeout
covers the wait in the container and the pending bound blocks or raises."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

import tidemq
from tidemq import aio
from tidemq.bench.client_bench import ensure_topic

pytestmark = pytest.mark.timeout(120)


def _run(coro):
    return asyncio.run(coro)


def _bodies(dev, topic: str, queue_id: int | None = None) -> list[bytes]:
    with tidemq.Admin(dev.namesrv) as admin:
        mqs = [mq for mq in admin.topic_queues(topic)
               if queue_id is None or mq.queue_id == queue_id]
    out: list[bytes] = []
    with tidemq.PullConsumer(dev.namesrv, f"g-{topic}") as c:
        c.assign(mqs)
        for mq in mqs:
            c.seek_to_begin(mq)
        idle = 0
        while idle < 3:
            got = c.poll(0.3)
            idle = 0 if got else idle + 1
            out.extend(m.body for m in sorted(got, key=lambda m: (m.queue_id, m.queue_offset)))
    return out


def test_concurrent_awaited_sends_share_frames_and_each_gets_its_own_result(dev):
    async def main():
        await ensure_topic(dev.namesrv, "ab-many", 4)
        async with aio.Producer(dev.namesrv) as p:
            await p.send(aio.Message("ab-many", b"warm"))
            b0 = p.accumulator.batches
            results = await asyncio.gather(
                *(p.send(aio.Message("ab-many", f"m{i}".encode(), keys=f"k{i}"))
                  for i in range(640)))
            return results, p.accumulator.batches - b0

    results, batches = _run(main())
    assert len({r.msg_id for r in results}) == 640
    assert all(r.status == tidemq.SendStatus.SEND_OK and r.count == 1 for r in results)
    assert len({(r.queue_id, r.queue_offset) for r in results}) == 640
    assert batches < 640 / 8, f"{batches} frames for 640 concurrent sends"


def test_send_async_of_1_kib_messages_leaves_in_batches_of_about_500_by_default(dev):
    # batch_max_bytes is 512 KiB by default (producer.BATCH_MAX_BYTES; 128 KiB made ~125
    # messages of 1 KiB a batch, and each batch's own cost was ~1.2 µs of client CPU a message)
    async def main():
        await ensure_topic(dev.namesrv, "ab-big-batches", 4)
        async with aio.Producer(dev.namesrv) as p:
            await p.send(aio.Message("ab-big-batches", b"warm"))
            b0 = p.accumulator.batches
            futs = [p.send_async(aio.Message("ab-big-batches", bytes(1000), keys=f"k{i}"))
                    for i in range(2000)]
            await p.flush()
            return [f.result() for f in futs], p.accumulator.batches - b0

    results, batches = _run(main())
    assert len({(r.queue_id, r.queue_offset) for r in results}) == 2000
    assert batches <= 4, f"{batches} batches for 2000 messages of 1000 bytes"


def test_awaited_sends_past_batch_max_messages_leave_in_full_batches(dev):
    # The senders joining a batch that leaves at the end of the loop iteration (the
    # accumulator's fast join) still cut it at batch_max_messages, each with its own result.
    async def main():
        await ensure_topic(dev.namesrv, "ab-cut", 4)
        async with aio.Producer(dev.namesrv, batch_max_messages=50) as p:
            await p.send(aio.Message("ab-cut", b"warm"))
            b0, m0 = p.accumulator.batches, p.accumulator.batched_messages
            results = await asyncio.gather(
                *(p.send(aio.Message("ab-cut", f"c{i}".encode())) for i in range(200)))
            acc = p.accumulator
            return results, acc.batches - b0, acc.batched_messages - m0

    results, batches, messages = _run(main())
    assert messages == 200
    # 4 of 50, or the first alone (nothing in flight) and 50, 50, 50, 49
    assert batches in (4, 5), f"{batches} batches for 200 sends of at most 50"
    assert len({(r.queue_id, r.queue_offset) for r in results}) == 200
    assert all(r.status == tidemq.SendStatus.SEND_OK for r in results)


def test_a_send_that_finds_nothing_in_flight_leaves_at_once(dev):
    async def main():
        # a linger of 2 s: an awaited send must not wait for it
        async with aio.Producer(dev.namesrv, batch_max_delay=2.0) as p:
            await p.send(aio.Message("ab-idle", b"warm"))
            t0 = time.monotonic()
            for i in range(20):
                await p.send(aio.Message("ab-idle", f"i{i}".encode()))
            return (time.monotonic() - t0) / 20

    per_send = _run(main())
    assert per_send < 0.2, f"{per_send * 1000:.0f} ms per idle send"


def test_one_illegal_message_fails_only_its_own_caller(dev):
    async def main():
        await ensure_topic(dev.namesrv, "ab-bad", 2)
        async with aio.Producer(dev.namesrv, max_properties_size=1024) as p:
            await p.send(aio.Message("ab-bad", b"warm"))
            msgs = [aio.Message("ab-bad", f"ok{i}".encode()) for i in range(30)]
            msgs[13] = aio.Message("ab-bad", b"bad", properties={"big": "x" * 4000})
            return await asyncio.gather(*(p.send(m) for m in msgs), return_exceptions=True)

    out = _run(main())
    errors = [i for i, r in enumerate(out) if isinstance(r, BaseException)]
    assert errors == [13] and isinstance(out[13], tidemq.MessageRejectedError)
    assert sorted(_bodies(dev, "ab-bad")) == sorted([b"warm"] + [f"ok{i}".encode()
                                                                 for i in range(30) if i != 13])


def test_ordered_sends_keep_their_order(dev):
    async def main():
        await ensure_topic(dev.namesrv, "ab-order", 4)
        async with aio.Producer(dev.namesrv, batch_max_messages=64) as p:
            futs = [p.send_async(aio.Message("ab-order", f"a{i:05d}".encode()), queue_id=2)
                    for i in range(500)]

            async def keyed(k: int) -> None:  # each key's sends in order, keys concurrent
                for i in range(100):
                    await p.send(aio.Message("ab-order", f"k{k}-{i:05d}".encode()),
                                 hash_key=f"key-{k}")

            await asyncio.gather(*futs, *(keyed(k) for k in range(8)))

    _run(main())
    q2 = [b for b in _bodies(dev, "ab-order", 2) if b.startswith(b"a")]
    assert q2 == [f"a{i:05d}".encode() for i in range(500)]
    everything = _bodies(dev, "ab-order")
    for k in range(8):
        mine = [b for b in everything if b.startswith(f"k{k}-".encode())]
        assert mine == [f"k{k}-{i:05d}".encode() for i in range(100)]


def test_blocking_sends_from_many_threads_share_frames(dev):
    with tidemq.Producer(dev.namesrv) as p:
        p.send(tidemq.Message("ab-threads", b"warm"))
        b0 = p._aio.accumulator.batches
        results: list = []
        lock = threading.Lock()

        def run(t: int) -> None:
            for i in range(50):
                r = p.send(tidemq.Message("ab-threads", f"t{t}-{i}".encode()))
                with lock:
                    results.append(r)

        ts = [threading.Thread(target=run, args=(t,)) for t in range(16)]
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        batches = p._aio.accumulator.batches - b0
    assert len({r.msg_id for r in results}) == 800
    assert batches < 800, f"{batches} frames for 800 sends from 16 threads"


def test_the_send_timeout_covers_the_wait_behind_a_batch_in_flight(dev):
    async def main():
        await ensure_topic(dev.namesrv, "ab-timeout", 1)
        async with aio.Producer(dev.namesrv, retries=0) as p:
            await p.send(aio.Message("ab-timeout", b"warm"))
            os.kill(dev.proc.pid, signal.SIGSTOP)
            try:
                first = asyncio.ensure_future(
                    p.send(aio.Message("ab-timeout", b"first"), timeout=3.0))
                await asyncio.sleep(0.05)  # in flight, unanswered
                t0 = time.monotonic()
                with pytest.raises(tidemq.RequestTimeoutError):
                    await p.send(aio.Message("ab-timeout", b"second"), timeout=0.3)
                waited = time.monotonic() - t0
            finally:
                os.kill(dev.proc.pid, signal.SIGCONT)
            await asyncio.gather(first, return_exceptions=True)
            return waited

    waited = _run(main())
    assert 0.25 <= waited < 1.5, f"the second send failed after {waited:.2f} s"


def test_the_pending_bound_blocks_or_raises(dev):
    async def main(block: bool):
        async with aio.Producer(dev.namesrv, max_pending_messages=4,
                                block_if_queue_full=block) as p:
            await p.send(aio.Message("ab-bound", b"warm"))
            out = await asyncio.gather(
                *(p.send(aio.Message("ab-bound", f"b{i}".encode())) for i in range(40)),
                return_exceptions=True)
            assert p._npending == 0
            return out

    blocked = _run(main(True))
    assert all(isinstance(r, tidemq.SendResult) for r in blocked)
    raised = _run(main(False))
    full = [r for r in raised if isinstance(r, tidemq.ProducerQueueFullError)]
    assert full and len(full) < 40


def test_a_forked_child_gets_a_fresh_producer(dev):
    """fork() after the parent used the producer: the child's producer builds its own loop
    thread and connections on its next call (the parent's do not exist there)."""
    with tidemq.Producer(dev.namesrv) as p:
        p.send(tidemq.Message("ab-fork", b"parent"))
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only if its sends were stored
            code = 1
            try:
                r = p.send(tidemq.Message("ab-fork", b"child"), timeout=10)
                f = p.send_async(tidemq.Message("ab-fork", b"child-async"))
                if r.status == tidemq.SendStatus.SEND_OK and f.result(10).queue_offset >= 0:
                    code = 0
                p.close()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        p.send(tidemq.Message("ab-fork", b"parent again"))  # the parent's is untouched
    assert sorted(_bodies(dev, "ab-fork")) == [b"child", b"child-async", b"parent",
                                               b"parent again"]


def test_write_queues_of_a_new_topic_are_those_of_the_default_route(dev):
    with tidemq.Producer(dev.namesrv, default_topic_queues=3) as p:
        assert [q.queue_id for q in p.write_queues("ab-not-yet")] == [0, 1, 2]
        _run(ensure_topic(dev.namesrv, "ab-five", 5))
        assert [q.queue_id for q in p.write_queues("ab-five")] == [0, 1, 2, 3, 4]


def test_a_lone_blocking_send_refused_by_the_broker_fails_only_itself(dev):
    # A lone send is written without a task and answered from the connection's callback;
    # an answer that is not SEND_OK goes back through the send's coroutine (retry policy,
    # error): the caller gets the broker's refusal, and the producer keeps sending.
    with tidemq.Producer(dev.namesrv, max_properties_size=128 * 1024) as p:
        ok1 = p.send(tidemq.Message("ab-lone", b"first"))
        big = tidemq.Message("ab-lone", b"x", properties={"p": "v" * 40_000})
        with pytest.raises(tidemq.BrokerError) as err:
            p.send(big)
        assert "propert" in str(err.value).lower()
        ok2 = p.send(tidemq.Message("ab-lone", b"second"))
        assert ok1.status is tidemq.SendStatus.SEND_OK and ok2.status is tidemq.SendStatus.SEND_OK
        assert p._aio.accumulator.npending == 0
    assert sorted(_bodies(dev, "ab-lone")) == [b"first", b"second"]


def test_a_blocking_send_from_a_send_async_callback_raises_instead_of_hanging(dev):
    """The callback runs on the tidemq-io thread, where a blocking send would wait for the
    very loop it blocks: it is refused at once (the thread is recognised by its id)."""
    with tidemq.Producer(dev.namesrv) as p:
        p.send(tidemq.Message("cb-io", b"warm"))
        errors: list[BaseException] = []
        done = threading.Event()

        def callback(result, error):
            try:
                p.send(tidemq.Message("cb-io", b"inner"))
            except RuntimeError as exc:
                errors.append(exc)
            finally:
                done.set()

        p.send_async(tidemq.Message("cb-io", b"outer"), callback=callback).result(10)
        assert done.wait(10)
        assert len(errors) == 1 and "tidemq-io" in str(errors[0])
        assert p.send(tidemq.Message("cb-io", b"after")).queue_offset >= 0  # still usable


def test_a_blocking_send_to_a_cached_route_without_writable_queues_fails_at_once(dev):
    """A lone blocking send whose cached route has no writable queue (a read-only topic; a
    group with only slaves after its master died) gets NoRouteError at once, every time: the
    refusal must not escape into the loop thread's callback and leave the caller waiting
    for its send timeout (nor leave its bucket marked in flight)."""
    from tidemq.protocol.headers import Perm

    async def read_only():
        async with aio.Admin(dev.namesrv) as admin:
            await admin.create_topic("ab-ro", 2, perm=Perm.READ)

    _run(read_only())
    with tidemq.Producer(dev.namesrv, send_timeout=5.0) as p:
        for _ in range(3):  # the first finds no cached route; the others find it cached
            t0 = time.monotonic()
            with pytest.raises(tidemq.NoRouteError, match="no writable queue"):
                p.send(tidemq.Message("ab-ro", b"x"))
            assert time.monotonic() - t0 < 2.0
        assert p._aio.accumulator.npending == 0


def test_a_message_the_broker_refuses_in_a_shared_blocking_batch_fails_only_its_caller(dev):
    # Batches of waiting callers are written without a task and answered from the
    # connection's callback; a batch the broker refuses for one message's content goes back
    # through the coroutine path, which fails just that message and sends the others again.
    with tidemq.Producer(dev.namesrv, max_properties_size=128 * 1024) as p:
        p.send(tidemq.Message("ab-shared-bad", b"warm"))
        b0 = p._aio.accumulator.batches
        errors: list[tuple[int, int, BaseException]] = []
        lock = threading.Lock()

        def run(t: int) -> None:
            for i in range(30):
                if (t, i) == (3, 10):
                    m = tidemq.Message("ab-shared-bad", b"bad", properties={"p": "v" * 40_000})
                else:
                    m = tidemq.Message("ab-shared-bad", f"t{t}-{i}".encode())
                try:
                    p.send(m)
                except Exception as exc:  # noqa: BLE001 - collected and checked below
                    with lock:
                        errors.append((t, i, exc))

        ts = [threading.Thread(target=run, args=(t,)) for t in range(8)]
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        assert p._aio.accumulator.batches - b0 < 240  # they did share frames
        assert p._aio.accumulator.npending == 0
    assert [(t, i) for t, i, _ in errors] == [(3, 10)]
    assert isinstance(errors[0][2], tidemq.BrokerError)
    assert sorted(_bodies(dev, "ab-shared-bad")) == sorted(
        [b"warm"] + [f"t{t}-{i}".encode() for t in range(8) for i in range(30)
                     if (t, i) != (3, 10)])


def test_many_awaiting_coroutines_travel_as_two_alternating_groups(dev, monkeypatch):
    # Coroutines each awaiting its sends: one group's batch is in flight while the other
    # group gathers (the broker stores one while the client runs the other's senders), not
    # all in lock-step; the groups even out (the first lone send's caller joins one). The
    # threshold is lowered so that 64 coroutines (a quick test) are enough.
    from tidemq.client import accumulator

    monkeypatch.setattr(accumulator, "PIPELINE_MIN", 8)

    async def main():
        await ensure_topic(dev.namesrv, "ab-groups", 4)
        async with aio.Producer(dev.namesrv) as p:
            await p.send(aio.Message("ab-groups", b"warm"))
            acc = p.accumulator
            b0, m0 = acc.batches, acc.batched_messages
            two = 0

            async def run(t: int) -> list:
                nonlocal two
                out = []
                for i in range(20):
                    out.append(await p.send(aio.Message("ab-groups", f"{t}-{i}".encode())))
                    two += acc._buckets["ab-groups"].inflight >= 2 or (
                        acc._buckets["ab-groups"].inflight == 1
                        and bool(acc._buckets["ab-groups"].msgs))
                return out

            results = [r for rs in await asyncio.gather(*(run(t) for t in range(64)))
                       for r in rs]
            return results, acc.batches - b0, acc.batched_messages - m0, two

    results, batches, msgs, two = _run(main())
    assert len({r.msg_id for r in results}) == 64 * 20 == msgs
    assert 20 * 2 - 2 <= batches <= 20 * 2 + 4, f"{batches} batches for 20 rounds of 64"
    assert two > 64 * 20 / 2  # most sends saw a batch in flight and another gathering
