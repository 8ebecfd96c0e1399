"""Pulsar subscription types (SPEC CO10) on server-side dispatch, against a real name server +
broker: exclusive refusal, one mode per group, failover takeover after a kill -9, cumulative
and negative acks, seek; shared with four consumer processes and one killed under load
(nothing lost, redeliveries bounded and counted); key-shared per-key order through a consumer
joining and one dying (kill -9)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import tidemq
from tidemq import aio

from .cluster import wait_until


def _send(namesrv: str, topic: str, bodies: list[str], key: str | None = None) -> None:
    with tidemq.Producer(namesrv) as p:
        for b in bodies:
            p.send(tidemq.Message(topic, b.encode(), keys=key))


def _consumer(dev, topic: str, sub: str, sub_type: str, name: str, **kw) -> aio.Consumer:
    kw.setdefault("initial_position", "earliest")
    kw.setdefault("await_duration", 0.3)
    kw.setdefault("heartbeat_interval", 1.0)  # the test broker drops a member silent for 3 s
    return aio.Consumer(dev.namesrv, topic, sub, subscription_type=sub_type,
                        consumer_name=name, **kw)


def test_exclusive_refuses_a_second_consumer_and_other_types(dev) -> None:
    topic, sub = "st_excl", "st_excl_s"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 2)

    async def main() -> None:
        async with _consumer(dev, topic, sub, "Exclusive", "owner-1"):
            second = _consumer(dev, topic, sub, "Exclusive", "second-2")
            with pytest.raises(aio.BrokerError) as e:
                await second.start()
            assert e.value.code == "CONSUMER_BUSY"
            assert "owner-1" in str(e.value)
            await second.close()
            shared = _consumer(dev, topic, sub, "Shared", "shared-3")
            with pytest.raises(aio.BrokerError) as e2:
                await shared.start()
            assert e2.value.code == "CONSUME_MODE_CONFLICT"
            assert "Exclusive" in str(e2.value)
            await shared.close()
            async with aio.SimpleConsumer(dev.namesrv, sub) as simple:
                simple.subscribe(topic)
                with pytest.raises(aio.BrokerError) as e3:
                    await simple.receive(1)
                assert e3.value.code == "CONSUME_MODE_CONFLICT"
        # the owner closed: the subscription is free again, for any type
        async with _consumer(dev, topic, sub, "Exclusive", "second-2"):
            pass

    asyncio.run(main())


def test_cumulative_ack_and_negative_ack_with_backoff(dev) -> None:
    topic, sub = "st_cumul", "st_cumul_s"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 1)
    _send(dev.namesrv, topic, [f"m{i}" for i in range(10)])

    async def main() -> None:
        async with _consumer(dev, topic, sub, "Exclusive", "c1") as c:
            got = [await c.receive(5.0) for _ in range(10)]
            assert [m.body for m in got] == [f"m{i}".encode() for i in range(10)]
            assert await c.acknowledge_cumulative(got[5]) == 6  # m0..m5 in one frame
            await c.acknowledge(got[8])
            async with aio.Admin(dev.namesrv) as admin:
                # the lag counts what is not acked, the hole at m8 included: m6, m7, m9
                assert (await admin.group_lag(sub, topic)).total_lag == 3
        # m6, m7, m9 were not acked: they come again, nothing else does
        async with _consumer(dev, topic, sub, "Shared", "c2",
                             negative_ack_redelivery_delay=0.4) as c:
            again = [await c.receive(5.0) for _ in range(3)]
            assert [m.body for m in again] == [b"m6", b"m7", b"m9"]
            # as in Pulsar: no cumulative ack on a Shared subscription (nothing acked by it)
            with pytest.raises(aio.ClientError, match="not allowed on a Shared") as ce:
                await c.acknowledge_cumulative(again[2])
            assert ce.value.code == "INVALID_CONFIGURATION"
            for m in again[1:]:
                await c.acknowledge(m)
            m6 = again[0]
            t0 = time.monotonic()
            c.negative_acknowledge(m6)
            m = await c.receive(5.0)
            t1 = time.monotonic()
            assert (m.body, m.delivery_attempt) == (b"m6", m6.delivery_attempt + 1)
            assert t1 - t0 >= 0.35
            c.negative_acknowledge(m)  # backoff: twice the delay for the next attempt
            m = await c.receive(5.0)
            assert time.monotonic() - t1 >= 0.75
            assert m.body == b"m6"
            await c.acknowledge(m)
            assert await c.receive(0.5) is None
            assert c.stats()["negative_acked"] == 2
            # seek back to the start: everything comes again
            await c.seek(timestamp=0)
            ten = [await c.receive(5.0) for _ in range(10)]
            assert sorted(m.body for m in ten) == sorted(f"m{i}".encode() for i in range(10))
            # negative acks of one loop turn travel as one CHANGE_INVISIBLE_TIME frame, each
            # with its own backoff; all ten come back
            frames = c.stats()["negative_ack_frames"]
            for m in ten:
                c.negative_acknowledge(m)
            again10 = [await c.receive(5.0) for _ in range(10)]
            assert sorted(m.body for m in again10) == sorted(m.body for m in ten)
            assert c.stats()["negative_ack_frames"] == frames + 1  # one frame for the ten
        # `tidemq group reset-offset` moves a POP subscription too (its window, not only the
        # committed offset the window would overwrite)
        async with aio.Admin(dev.namesrv) as admin:
            await admin.reset_group_offsets(sub, topic, offset=8)
        async with _consumer(dev, topic, sub, "Shared", "c3") as c:
            assert sorted([(await c.receive(5.0)).body for _ in range(2)]) == [b"m8", b"m9"]
            assert await c.receive(0.5) is None

    asyncio.run(main())


def _spawn(dev, topic: str, sub: str, sub_type: str, name: str, path: str, pause: float = 0.0
           ) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, os.path.join(os.path.dirname(__file__), "subscription_consumer_proc.py"),
         dev.namesrv, topic, sub, sub_type, name, path, str(pause)],
        stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "ready"
    return p


def _read(path: str) -> list[tuple[int, str, int]]:
    """(monotonic ns, body, attempt) per line written."""
    try:
        with open(path) as f:
            rows = [ln.split() for ln in f]
    except FileNotFoundError:
        return []
    return [(int(r[0]), r[1], int(r[2])) for r in rows if len(r) == 3]


def _stop(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def test_failover_standby_takes_over_after_kill9(dev, tmp_path) -> None:
    topic, sub = "st_failover", "st_failover_s"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 1)  # one queue: one active consumer, the first by name
    tmp = str(tmp_path)
    pa, pb = os.path.join(tmp, "a.txt"), os.path.join(tmp, "b.txt")
    active = _spawn(dev, topic, sub, "Failover", "fo-a", pa)  # first by name: active
    standby = _spawn(dev, topic, sub, "Failover", "fo-b", pb)
    try:
        _send(dev.namesrv, topic, [f"a{i}" for i in range(50)])
        wait_until(lambda: len(_read(pa)) >= 50, 15, 0.05)
        time.sleep(0.3)
        assert _read(pb) == []  # the standby received nothing
        active.send_signal(signal.SIGKILL)
        active.wait()
        t0 = time.monotonic()
        _send(dev.namesrv, topic, [f"b{i}" for i in range(50)])
        took = wait_until(lambda: {b for _t, b, _a in _read(pb)} >= {f"b{i}" for i in range(50)},
                          15, 0.05)
        # within a heartbeat: the broker saw the connection close, no expiry needed
        assert time.monotonic() - t0 < 3.0, took
    finally:
        _stop([active, standby])
    assert {b for _t, b, _a in _read(pa)} == {f"a{i}" for i in range(50)}


def test_failover_deals_the_queues_of_a_topic_over_its_consumers(dev) -> None:
    """Failover on a multi-queue topic, as Pulsar's on a partitioned one: queue q's active
    consumer is member q % n by name; a joining consumer takes its queues at once, a leaving
    one's go back to the others."""
    topic, sub = "st_failover4", "st_failover4_s"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 4)

    async def drain(cs: dict[str, aio.Consumer], n: int) -> dict[str, set[int]]:
        """Receive and ack until ``n`` messages came in all; the queues each one got."""
        got: dict[str, set[int]] = {name: set() for name in cs}
        seen: set[tuple[int, int]] = set()
        deadline = time.monotonic() + 20

        async def one(name: str, c: aio.Consumer) -> None:
            while len(seen) < n and time.monotonic() < deadline:
                m = await c.receive(timeout=0.2)
                if m is None:
                    continue
                got[name].add(m.message.queue_id)
                seen.add((m.message.queue_id, m.message.queue_offset))
                await c.acknowledge(m)

        await asyncio.gather(*(one(name, c) for name, c in cs.items()))
        assert len(seen) == n
        await asyncio.sleep(0.5)  # nothing more for anyone
        for c in cs.values():
            assert await c.receive(timeout=0.1) is None
        return got

    async def main() -> None:
        async with _consumer(dev, topic, sub, "Failover", "fo4-a") as a:
            _send(dev.namesrv, topic, [f"x{i}" for i in range(20)])
            assert await drain({"a": a}, 20) == {"a": {0, 1, 2, 3}}  # alone: every queue
            async with _consumer(dev, topic, sub, "Failover", "fo4-b") as b:
                _send(dev.namesrv, topic, [f"y{i}" for i in range(40)])
                assert await drain({"a": a, "b": b}, 40) == {"a": {0, 2}, "b": {1, 3}}
            _send(dev.namesrv, topic, [f"z{i}" for i in range(20)])  # b left: all a's again
            assert await drain({"a": a}, 20) == {"a": {0, 1, 2, 3}}

    asyncio.run(main())


def test_shared_four_processes_one_killed_under_load_loses_nothing(dev, tmp_path) -> None:
    topic, sub = "st_shared", "st_shared_s"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 4)
    tmp = str(tmp_path)
    paths = [os.path.join(tmp, f"c{i}.txt") for i in range(4)]
    procs = [_spawn(dev, topic, sub, "Shared", f"sh-{i}", p) for i, p in enumerate(paths)]
    sent: list[str] = []
    stop = threading.Event()

    def produce() -> None:
        with tidemq.Producer(dev.namesrv) as p:
            i = 0
            while not stop.is_set():
                batch = [f"k{i + k:06d}" for k in range(20)]
                for b in batch:
                    p.send(tidemq.Message(topic, b.encode()))
                sent.extend(batch)
                i += 20
                time.sleep(0.005)

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        time.sleep(1.5)
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        time.sleep(1.0)
    finally:
        stop.set()
        producer.join()
    try:
        wait_until(lambda: {b for p in paths for _t, b, _a in _read(p)} >= set(sent), 30, 0.2)
    finally:
        _stop(procs)
    records = [r for p in paths for r in _read(p)]
    assert len(sent) > 500
    seen = [b for _t, b, _a in records]
    dups = len(seen) - len(set(seen))
    # only what the killed consumer held comes back: its receiver queue (64) and the batch it
    # was writing (16), revived at once when its connection closed
    assert dups <= 64 + 16, dups
    redelivered = [b for _t, b, a in records if a > 1]
    # every second delivery is counted as a redelivery (attempt > 1); some redelivered ones
    # were never seen before (they waited in the killed consumer's receiver queue)
    assert dups <= len(redelivered) <= 64 + 16, (dups, len(redelivered))
    assert len(_read(paths[0])) > 0  # the killed consumer did consume before it died
    assert all(_read(p) for p in paths[1:])  # shared: every consumer got messages


def test_key_shared_order_per_key_through_a_join_and_a_kill9(dev, tmp_path) -> None:
    topic, sub = "st_keys", "st_keys_s"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 2)
    tmp = str(tmp_path)
    paths = [os.path.join(tmp, f"c{i}.txt") for i in range(3)]
    # slow consumers: their receiver queues are full when the third joins and when one dies
    procs = [_spawn(dev, topic, sub, "Key_Shared", f"ks-{i}", paths[i], 0.05) for i in range(2)]
    keys = [f"key{k}" for k in range(24)]
    sent: list[str] = []
    stop = threading.Event()

    def produce() -> None:
        with tidemq.Producer(dev.namesrv) as p:
            seq = 0
            while not stop.is_set():
                for k in keys:  # a key's messages go to one queue (by key), in order
                    b = f"{k}:{seq:05d}"
                    p.send(tidemq.Message(topic, b.encode(), keys=k), queue_id=int(k[3:]) % 2)
                    sent.append(b)
                seq += 1
                time.sleep(0.02)

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        time.sleep(1.2)
        procs.append(_spawn(dev, topic, sub, "Key_Shared", "ks-2", paths[2], 0.05))  # joins
        time.sleep(1.2)
        procs[0].send_signal(signal.SIGKILL)  # dies holding messages
        procs[0].wait()
        time.sleep(1.2)
    finally:
        stop.set()
        producer.join()
    try:
        wait_until(lambda: {b for p in paths for _t, b, _a in _read(p)} >= set(sent), 30, 0.2)
    finally:
        _stop(procs)
    killed = {(t, b) for t, b, _a in _read(paths[0])}
    rows = sorted((t, b, a, i) for i, p in enumerate(paths) for t, b, a in _read(p))
    assert {b for _t, b, _a, _i in rows} == set(sent)  # nothing lost
    assert all(_read(p) for p in paths)  # the joining consumer got keys too
    last: dict[str, int] = {}
    for t, b, a, _i in rows:
        k, seq = b.split(":")
        s = int(seq)
        if s <= last.get(k, -1):
            # only a redelivery of what the killed consumer held may go back, and only when
            # every later message of the key seen before it was the killed one's too
            assert a > 1, (b, a)
            later = [(t2, b2) for t2, b2, _a2, _i2 in rows
                     if t2 < t and b2.split(":")[0] == k and int(b2.split(":")[1]) > s]
            assert all(x in killed for x in later), (b, later[:3])
        last[k] = max(last.get(k, -1), s)


def test_key_shared_joining_consumer_waits_for_what_was_sent_before_it(dev) -> None:
    """Pulsar's recently-joined-consumer rule, deterministically: B joins while A holds every
    message sent so far unacked; B gets nothing until A acked them, then the keys that moved
    to B continue there, in order; A never waits for B."""
    topic, sub = "st_keys_join", "st_keys_join_s"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 1)
    keys = [f"key{k}" for k in range(40)]

    def send(rnd: int) -> None:
        with tidemq.Producer(dev.namesrv) as p:
            p.send_batch([tidemq.Message(topic, f"{k}:{rnd}".encode(), keys=k) for k in keys])

    async def drain(c: aio.Consumer, timeout: float) -> list[aio.ReceivedMessage]:
        out: list[aio.ReceivedMessage] = []
        while True:
            got = await c.batch_receive(100, timeout)
            if not got:
                return out
            out += got

    async def main() -> None:
        send(0)
        async with _consumer(dev, topic, sub, "Key_Shared", "ks-a") as a:
            before = await drain(a, 1.0)
            assert len(before) == 40  # A alone: every key, nothing acked yet
            async with _consumer(dev, topic, sub, "Key_Shared", "ks-b") as b:
                send(1)
                # A gets its own keys' new messages at once; B waits
                a_new = await drain(a, 1.0)
                assert 0 < len(a_new) < 40
                assert await b.batch_receive(100, 0.8) == []
                for m in before:
                    await a.acknowledge(m)
                b_new = await drain(b, 2.0)
                assert sorted(m.body for m in a_new + b_new) == sorted(
                    f"{k}:1".encode() for k in keys)  # every key once, on one consumer
                assert {m.body.split(b":")[0] for m in a_new}.isdisjoint(
                    {m.body.split(b":")[0] for m in b_new})

    asyncio.run(main())


def test_key_shared_held_pop_is_woken_when_another_consumers_read_ahead_routes_to_it(
        dev) -> None:
    """A stalled read-ahead must not leave a consumer waiting for its poll deadline: 25 000
    messages of one key, then 200 of other keys, sent while both consumers are members and
    the key's owner does not receive yet. The other one reads ahead until MAX_PENDING
    (20 000) offsets wait for the owner, finds none of its own and is held (10 s poll). No
    arrival comes after the backlog is stored; the owner's pops take the pending offsets,
    read the mixed part and route some of it to the held one, which is woken then."""
    topic, sub = "st_keys_route_wake", "st_keys_route_wake_s"
    total = 25_200
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 1)
    done = [0]

    async def run(c: aio.Consumer, got: list[bytes], t0: float) -> None:
        while done[0] < total and time.monotonic() - t0 < 6.0:
            msgs = await c.batch_receive(500, 0.2)
            for m in msgs:
                got.append(m.body)
                c.acknowledge_nowait(m)
            done[0] += len(msgs)

    async def main() -> None:
        a_got: list[bytes] = []
        b_got: list[bytes] = []
        kw = dict(await_duration=10.0, ack_timeout=120.0)
        async with _consumer(dev, topic, sub, "Key_Shared", "ks-ra", **kw) as a, \
                _consumer(dev, topic, sub, "Key_Shared", "ks-rb", **kw) as b:
            await asyncio.sleep(0.5)  # both members, both pops held on the empty queue

            def send() -> None:
                with tidemq.Producer(dev.namesrv) as p:
                    for _ in range(25):
                        p.send_batch([tidemq.Message(topic, b"one", keys="the-one-key")
                                      for _ in range(1000)])
                    p.send_batch([tidemq.Message(topic, f"k{k}".encode(), keys=f"other-{k}")
                                  for k in range(200)])

            await asyncio.to_thread(send)
            await asyncio.sleep(0.5)  # every arrival's wake is over
            t0 = time.monotonic()
            await asyncio.gather(run(a, a_got, t0), run(b, b_got, t0))
        both = a_got + b_got
        # the one key went to one consumer, and the other one got its share of the rest well
        # before its held pop's 10 s poll ran out
        assert len(both) == total, (len(a_got), len(b_got))
        assert both.count(b"one") == 25_000
        assert (b"one" in a_got) != (b"one" in b_got)
        assert set(both) - {b"one"} == {f"k{k}".encode() for k in range(200)}

    asyncio.run(main())


def test_key_shared_orders_by_sharding_key_before_keys_and_spreads_keyless(dev) -> None:
    """The ordering key is the sharding key (``__SHARDINGKEY``) when there is one, else the
    first key; keyless messages go to any consumer."""
    topic, sub = "st_keys_sharding", "st_keys_sharding_s"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 1)
    groups = [f"g{i}" for i in range(12)]

    async def main() -> None:
        async with _consumer(dev, topic, sub, "Key_Shared", "ksg-a") as a, \
                _consumer(dev, topic, sub, "Key_Shared", "ksg-b") as b:
            async with aio.Producer(dev.namesrv) as p:  # both are members before any message
                await p.send_batch(
                    [aio.Message(topic, f"{g}:{n}".encode(), keys=f"unique-{g}-{n}",
                                 properties={"__SHARDINGKEY": g})
                     for n in range(4) for g in groups]
                    + [aio.Message(topic, f"none:{n}".encode()) for n in range(40)])
            got: dict[str, list[bytes]] = {"a": [], "b": []}
            for name, c in (("a", a), ("b", b)):
                while m := await c.receive(1.0):
                    got[name].append(m.body)
                    await c.acknowledge(m)
            assert len(got["a"]) + len(got["b"]) == 88
            owner = {}
            for name, bodies in got.items():
                for body in bodies:
                    g = body.split(b":")[0]
                    if g != b"none":
                        assert owner.setdefault(g, name) == name  # one consumer per group
                # in order per group on its consumer
                for g in groups:
                    seq = [x for x in bodies if x.startswith(f"{g}:".encode())]
                    assert seq == sorted(seq)
            assert set(owner.values()) == {"a", "b"}  # 12 groups spread over both

    asyncio.run(main())


def test_a_consumer_started_paused_joins_but_pops_nothing_until_resumed(dev) -> None:
    """``start_paused`` (Pulsar's startPaused): the consumer is a member of the subscription
    but takes no message until ``resume()``; ``pause()`` stops it again."""
    topic, sub = "st_paused", "st_paused_s"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 2)

    async def drain(c: aio.Consumer, n: int) -> list[bytes]:
        got: list[bytes] = []
        while len(got) < n:
            m = await c.receive(5.0)
            assert m is not None, f"{len(got)} of {n}"
            got.append(m.body)
            await c.acknowledge(m)
        return got

    async def main() -> None:
        async with _consumer(dev, topic, sub, "Shared", "paused-a", start_paused=True) as a, \
                _consumer(dev, topic, sub, "Shared", "running-b") as b:
            assert a.paused and not b.paused
            async with aio.Admin(dev.namesrv) as admin:  # joined: a member already
                assert (await admin.group_info(sub)).members == ["paused-a", "running-b"]
            _send(dev.namesrv, topic, [f"x{i}" for i in range(20)])
            assert sorted(await drain(b, 20)) == sorted(f"x{i}".encode() for i in range(20))
            assert a.stats()["queued"] == 0 and await a.receive(0.2) is None
            b.pause()
            await asyncio.sleep(0.5)  # b's held pop (await_duration 0.3 s) has ended
            a.resume()
            _send(dev.namesrv, topic, [f"y{i}" for i in range(10)])
            assert sorted(await drain(a, 10)) == sorted(f"y{i}".encode() for i in range(10))
            assert b.stats()["queued"] == 0 and await b.receive(0.2) is None

    asyncio.run(main())
