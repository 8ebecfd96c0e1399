"""Delayed delivery end to end (ref BR8, PR8): delay levels through SCHEDULE_TOPIC_XXXX (test-sized
levels), delivery at any time to the millisecond from the durable time index, cancel, the
40-day limit, and a kill -9 of the broker with messages pending: none lost, none doubled, none
early. Lateness is measured and printed.

Lateness is measured from the producer's born timestamp (set just before the send, so slightly
before the broker stored the message): ``delivered.store_timestamp - (born + delay)``; "never
early" is ``delivered.store_timestamp >= born + delay`` (exact for deliver_at).
"""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import time
from collections.abc import Iterator

import pytest
from producer_path_helpers import make_topic, runtime_info

from support.cluster import DevCluster, start_dev, stop_dev
from tidemq import aio
from tidemq.protocol.codes import ResponseCode

LEVELS = "300ms 600ms 1s"
LEVEL_MS = [300, 600, 1000]
OPTIONS = (f"message_delay_level={LEVELS}", "timer_bucket_ms=1000", "timer_checkpoint_ms=200")


@pytest.fixture(scope="module")
def dev() -> Iterator[DevCluster]:
    with tempfile.TemporaryDirectory(prefix="tidemq-delay-") as d:
        c = start_dev(d, *OPTIONS)
        try:
            yield c
        finally:
            stop_dev(c)


def pct(values: list[int], p: float) -> int:
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * p))]


async def collect(namesrv: str, topic: str, group: str, n: int, timeout: float) -> list:
    out: list = []
    async with aio.PullConsumer(namesrv, group, consume_from="first") as c:
        c.subscribe(topic)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(out) < n and loop.time() < deadline:
            out += await c.poll(timeout=0.3)
    return out


# A latency bound measured on a shared 2-core machine: one run can miss it when another process
# takes the CPU; a real regression misses it on every run, so two reruns are allowed.
@pytest.mark.flaky(reruns=2)
def test_delay_levels_are_never_early(dev: DevCluster) -> None:
    async def main() -> None:
        topic = "delay-levels"
        await make_topic(dev.namesrv, topic, 2)
        async with aio.Producer(dev.namesrv) as p:
            # Route and connection first: lateness is measured from the born timestamp, which
            # must not include the producer's first route lookup.
            await p.send(aio.Message(topic, b"warm"))
            sends = []
            for i in range(60):
                level = 1 + i % 3
                sends.append(p.send(aio.Message(topic, f"{level}:{i}".encode(),
                                                delay_level=level)))
                if i % 10 == 9:
                    await asyncio.sleep(0.05)  # spread the store times a little
            results = await asyncio.gather(*sends)
            # a level beyond the highest is clamped to it (RocketMQ)
            results.append(await p.send(aio.Message(topic, b"3:clamped", delay_level=9)))
        got = await collect(dev.namesrv, topic, "delay-levels-g", len(results) + 1, 30)
        got = [m for m in got if m.body != b"warm"]
        assert sorted(m.body for m in got) == sorted(
            [f"{1 + i % 3}:{i}".encode() for i in range(60)] + [b"3:clamped"]
        )
        late = []
        for m in got:
            delay = LEVEL_MS[int(m.body.split(b":")[0]) - 1]
            due = m.born_timestamp + delay
            assert m.store_timestamp >= due, (
                f"{m.body!r} delivered {due - m.store_timestamp} ms early")
            late.append(m.store_timestamp - due)
        print(f"\ndelay levels: {len(late)} messages, lateness ms p50={pct(late, .5)} "
              f"p99={pct(late, .99)} max={max(late)}")
        assert pct(late, 0.99) <= 100, f"p99 lateness {pct(late, .99)} ms > 100 ms"
        info = await runtime_info(dev.broker)
        assert info["delay_delivered"] >= len(results)

    asyncio.run(main())


# A latency bound measured on a shared 2-core machine: one run can miss it when another process
# takes the CPU; a real regression misses it on every run, so two reruns are allowed.
@pytest.mark.flaky(reruns=2)
def test_deliver_at_to_the_millisecond_and_cancel(dev: DevCluster) -> None:
    async def main() -> None:
        topic = "timed"
        await make_topic(dev.namesrv, topic, 2)
        async with aio.Producer(dev.namesrv) as p:
            now = int(time.time() * 1000)
            at = [now + 800 + 37 * i for i in range(50)]  # across several 1 s buckets
            sends = [p.send(aio.Message(topic, f"t{i}".encode(), deliver_at=a))
                     for i, a in enumerate(at)]
            sends.append(p.send(aio.Message(topic, b"after", deliver_after=0.5)))
            doomed = p.send(aio.Message(topic, b"cancelled", deliver_after=1.0))
            results = await asyncio.gather(*sends, doomed)
            await p.cancel(results[-1])
            with pytest.raises(aio.BrokerError) as err:
                await p.cancel(results[-1])  # not pending any more
            assert err.value.response_code == ResponseCode.QUERY_NOT_FOUND
            # 30 days ahead is accepted and stays pending; beyond the 40-day limit is refused
            month = await p.send(aio.Message(topic, b"month", deliver_after=30 * 86400))
            with pytest.raises((aio.BrokerError, aio.MessageRejectedError)):
                await p.send(aio.Message(topic, b"too far", deliver_after=41 * 86400))
        got = await collect(dev.namesrv, topic, "timed-g", 51, 30)
        await asyncio.sleep(1.2)  # the cancelled one would be due by now
        got += await collect(dev.namesrv, topic, "timed-g", 1, 0.5)
        bodies = sorted(m.body for m in got)
        assert bodies == sorted([f"t{i}".encode() for i in range(50)] + [b"after"])
        late = []
        for m in got:
            if m.body == b"after":
                continue
            due = at[int(m.body[1:])]
            assert m.store_timestamp >= due, (
                f"{m.body!r} delivered {due - m.store_timestamp} ms early")
            late.append(m.store_timestamp - due)
        print(f"\ndeliver_at: {len(late)} messages, lateness ms p50={pct(late, .5)} "
              f"p99={pct(late, .99)} max={max(late)}")
        assert pct(late, 0.99) <= 100, f"p99 lateness {pct(late, .99)} ms > 100 ms"
        info = await runtime_info(dev.broker)
        assert info["timer_bucket_files"] >= 1  # the 30-day message is still pending
        assert month.msg_id

    asyncio.run(main())


# A latency bound measured on a shared 2-core machine: one run can miss it when another process
# takes the CPU; a real regression misses it on every run, so two reruns are allowed.
@pytest.mark.flaky(reruns=2)
def test_deliver_at_is_at_most_100_ms_late_at_p99_under_load(dev: DevCluster) -> None:
    """Timed messages come due while another process produces and consumes 20,000 messages
    a second through the same broker (`tidemq bench e2e --rate 20000`)."""
    import subprocess
    import sys

    async def main() -> None:
        topic = "timed-load"
        await make_topic(dev.namesrv, topic, 2)
        load = subprocess.Popen(
            [sys.executable, "-m", "tidemq.cli.main", "bench", "e2e", "--namesrv", dev.namesrv,
             "--topic", "load", "--size", "100", "--rate", "20000", "--seconds", "30",
             "--json"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            await asyncio.sleep(1.0)  # the load is running
            async with aio.Producer(dev.namesrv) as p:
                now = int(time.time() * 1000)
                at = [now + 500 + 10 * i for i in range(200)]  # due over 2 s
                await asyncio.gather(*(p.send(aio.Message(topic, f"l{i}".encode(),
                                                          deliver_at=a))
                                       for i, a in enumerate(at)))
            got = await collect(dev.namesrv, topic, "timed-load-g", 200, 30)
            still_loading = load.poll() is None
        finally:
            load.kill()
            load.wait()
        assert still_loading, "the load generator stopped before the timed messages were due"
        assert sorted(m.body for m in got) == sorted(f"l{i}".encode() for i in range(200))
        late = []
        for m in got:
            due = at[int(m.body[1:])]
            assert m.store_timestamp >= due, f"{m.body!r} early"
            late.append(m.store_timestamp - due)
        print(f"\ndeliver_at under load (load still running: {still_loading}): lateness ms "
              f"p50={pct(late, .5)} p99={pct(late, .99)} max={max(late)}")
        assert pct(late, 0.99) <= 100, f"p99 lateness {pct(late, .99)} ms > 100 ms"

    asyncio.run(main())


@pytest.mark.parametrize("flush", ["async", "sync"])
def test_kill_9_with_pending_messages_loses_and_doubles_nothing(flush: str) -> None:
    """Under SYNC_FLUSH the delay levels deliver without waiting for each fsync and persist
    only the progress known durable; a kill -9 must still lose and double nothing."""
    async def send_all(c: DevCluster, topic: str) -> tuple[dict[bytes, int], list[bytes]]:
        await make_topic(c.namesrv, topic, 2)
        due: dict[bytes, int] = {}
        async with aio.Producer(c.namesrv) as p:
            now = int(time.time() * 1000)
            sends = []
            for i in range(300):
                a = now + 300 + 10 * i  # due from 0.3 s to 3.3 s
                body = f"at{i}".encode()
                due[body] = a
                sends.append(p.send(aio.Message(topic, body, deliver_at=a)))
            for i in range(30):
                body = f"lv{i}".encode()
                sends.append(p.send(aio.Message(topic, body, delay_level=1 + i % 3)))
            await asyncio.gather(*sends)
        return due, [f"lv{i}".encode() for i in range(30)]

    opts = (*OPTIONS, f"flush_mode={flush}")
    with tempfile.TemporaryDirectory(prefix="tidemq-delay-kill-") as d:
        c = start_dev(d, *opts)
        try:
            due, levels = asyncio.run(send_all(c, "timed-kill"))
            time.sleep(1.0)  # some delivered, many pending
            os.kill(c.proc.pid, signal.SIGKILL)
            c.proc.wait()
            t0 = time.monotonic()
            c = start_dev(d, *opts)
            print(f"\nrestart after kill -9: {time.monotonic() - t0:.2f} s")
            got = asyncio.run(collect(c.namesrv, "timed-kill", "kill-g", 330, 30))
            asyncio.run(asyncio.sleep(1.0))
            got += asyncio.run(collect(c.namesrv, "timed-kill", "kill-g", 1, 0.5))
        finally:
            stop_dev(c)
    bodies = [m.body for m in got]
    assert len(bodies) == len(set(bodies)), "a message was delivered twice"
    assert sorted(bodies) == sorted(list(due) + levels), "a message was lost"
    for m in got:
        if m.body in due:
            assert m.store_timestamp >= due[m.body], f"{m.body!r} delivered early"
