"""Ordered consumption (CO6) with broker-side queue locks (BR6).

The module's broker expires queue locks after 1.5 s (``queue_lock_max_live_ms``; 60 s by
default) and the consumers renew theirs every 0.3 s (``lock_interval``; 20 s by default), so
the lock rules are exercised in seconds.
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest

import tidemq
from tidemq.client.connection import ConnectionPool
from tidemq.protocol.codes import RequestCode
from tidemq.protocol.headers import LockBatchRequestHeader, QueueRef

from .cluster import GROUP_OPTIONS, DevCluster, start_dev, stop_dev, wait_until

LOCK_LIVE_MS = 1500
QUEUES = 8
KEYS = 24
PER_KEY = 40
ORDERLY = dict(orderly=True, consume_from="first", lock_interval=0.3,
               suspend_current_queue_time=0.05, persist_interval=0.5,
               heartbeat_interval=1.0)


@pytest.fixture(scope="module")
def dev() -> Iterator[DevCluster]:
    with tempfile.TemporaryDirectory(prefix="tidemq-orderly-") as d:
        c = start_dev(d, *GROUP_OPTIONS, f"queue_lock_max_live_ms={LOCK_LIVE_MS}")
        try:
            yield c
        finally:
            stop_dev(c)


def _lock(dev: DevCluster, group: str, client_id: str, topic: str, qids: list[int],
          broker_name: str) -> set[int]:
    """LOCK_BATCH_MQ as ``client_id``: the queue ids it holds afterwards."""
    async def go() -> set[int]:
        pool = ConnectionPool()
        try:
            f = await pool.request(dev.broker, RequestCode.LOCK_BATCH_MQ, LockBatchRequestHeader(
                consumer_group=group, client_id=client_id,
                queues=[QueueRef(topic=topic, broker_name=broker_name, queue_id=q)
                        for q in qids]))
            return {q.queue_id for q in f.header.locked}
        finally:
            pool.close()

    return asyncio.run(go())


def test_per_key_order_holds_across_rebalances_and_suspends(dev) -> None:
    topic, group = "ord", "ord-g"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, QUEUES)
    lock = threading.Lock()
    records: list[tuple[int, int, str]] = []  # (key, seq, consumer) of each SUCCESS
    suspended: set[tuple[int, int]] = set()
    active: dict[int, str] = {}  # queue id -> consumer inside the listener now
    overlaps: list[tuple[int, str, str]] = []

    def listener_for(name: str):  # noqa: ANN202
        def handle(msgs, ctx):
            qid = ctx.message_queue.queue_id
            with lock:
                other = active.get(qid)
                if other is not None:
                    overlaps.append((qid, other, name))
                active[qid] = name
            try:
                time.sleep(0.001)  # widen the window in which an overlap would show
                with lock:
                    for m in msgs:
                        k, s = map(int, m.body.split(b":"))
                        if s % 10 == 5 and (k, s) not in suspended:
                            suspended.add((k, s))
                            return tidemq.ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT
                    for m in msgs:
                        k, s = map(int, m.body.split(b":"))
                        records.append((k, s, name))
                return tidemq.ConsumeOrderlyStatus.SUCCESS
            finally:
                with lock:
                    active.pop(qid, None)
        return handle

    def produce() -> None:
        with tidemq.Producer(dev.namesrv) as p:
            for s in range(PER_KEY):
                for k in range(KEYS):
                    p.send(tidemq.Message(topic, f"{k}:{s}".encode()), queue_id=k % QUEUES)
                time.sleep(0.03)

    consumers = {"c1": tidemq.PushConsumer(dev.namesrv, group, listener_for("c1"), **ORDERLY)}
    consumers["c1"].subscribe(topic)
    consumers["c1"].start()
    producer = threading.Thread(target=produce)
    producer.start()
    try:
        for name in ("c2", "c3"):  # 1 -> 2 -> 3 members while messages flow
            time.sleep(0.4)
            c = tidemq.PushConsumer(dev.namesrv, group, listener_for(name), **ORDERLY)
            c.subscribe(topic)
            c.start()
            consumers[name] = c
        time.sleep(0.4)
        consumers.pop("c2").close()  # 3 -> 2
        producer.join()

        def done() -> bool:
            with lock:
                return {(k, s) for k, s, _ in records} >= {
                    (k, s) for k in range(KEYS) for s in range(PER_KEY)}

        wait_until(done, 30, 0.05)
    finally:
        producer.join()
        for c in consumers.values():
            c.close()
    per_key: dict[int, list[int]] = {}
    for k, s, _ in records:
        per_key.setdefault(k, []).append(s)
    redelivered = 0
    for k, seqs in per_key.items():
        high = -1
        for s in seqs:
            # In order: the next message or, after a rebalance, one already consumed again
            # (at-least-once from the committed offset) -- never a skip forward.
            assert s <= high + 1, f"key {k}: {s} consumed right after {high} ({seqs})"
            if s <= high:
                redelivered += 1
            high = max(high, s)
        assert high == PER_KEY - 1
    # Every suspended message came again, after which its successors followed in order.
    assert len(suspended) == KEYS * (PER_KEY // 10)
    assert overlaps == [], f"two members consumed one queue at once: {overlaps[:5]}"
    users = {name for _, _, name in records}
    print(f"ordered: {len(records)} successes, {len(suspended)} suspends, {redelivered} "
          f"re-deliveries after rebalances, consumers used {sorted(users)}")
    assert users >= {"c1", "c3"}


def test_a_queue_locked_by_another_client_waits_for_the_lock_to_expire(dev) -> None:
    topic, group = "ord-lock", "ord-lock-g"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 2)
        broker_name = admin.topic_queues(topic)[0].broker_name
    got: dict[int, float] = {}
    lock = threading.Lock()

    def handle(msgs, ctx):
        with lock:
            got.setdefault(ctx.message_queue.queue_id, time.monotonic())
        return tidemq.ConsumeOrderlyStatus.SUCCESS

    # A client that locks queue 0 and then falls silent (never renews, never unlocks).
    assert _lock(dev, group, "ghost@1@x", topic, [0], broker_name) == {0}
    locked_at = time.monotonic()
    with tidemq.Producer(dev.namesrv) as p:
        for q in (0, 1):
            for i in range(5):
                p.send(tidemq.Message(topic, b"x%d" % i), queue_id=q)
    with tidemq.PushConsumer(dev.namesrv, group, handle, **ORDERLY) as c:
        c.subscribe(topic)
        wait_until(lambda: len(got) == 2, 10)
        waited0 = got[0] - locked_at
        waited1 = got[1] - locked_at
        print(f"queue 1 consumed after {waited1:.2f} s, locked queue 0 after {waited0:.2f} s "
              f"(lock expiry {LOCK_LIVE_MS / 1000:g} s)")
        assert waited1 < LOCK_LIVE_MS / 1000
        assert waited0 >= LOCK_LIVE_MS / 1000 - 0.05
        # The consumer renews its locks (every 0.3 s), so they never expire while it lives.
        time.sleep(2 * LOCK_LIVE_MS / 1000)
        assert _lock(dev, group, "ghost@1@x", topic, [0, 1], broker_name) == set()
    # close() unlocked: the queues are free at once.
    assert _lock(dev, group, "ghost@1@x", topic, [0, 1], broker_name) == {0, 1}


def test_lock_table_defaults_expire_after_60_s_and_renewal_keeps_the_holder() -> None:
    from tidemq.broker.config import BrokerConfig
    from tidemq.broker.queue_lock import QueueLockManager

    assert BrokerConfig().queue_lock_max_live_ms == 60_000
    locks = QueueLockManager(BrokerConfig().queue_lock_max_live_ms)
    q = ("t", "b", 0)
    assert locks.try_lock("g", "a", [q], now=0.0) == [q]
    assert locks.try_lock("g", "b", [q], now=59.0) == []  # still a's
    assert locks.try_lock("g", "a", [q], now=40.0) == [q]  # renewed (every 20 s)
    assert locks.try_lock("g", "b", [q], now=99.0) == []  # 59 s after the renewal
    assert locks.try_lock("g", "b", [q], now=100.5) == [q]  # expired: b takes it
    assert locks.holder("g", q, now=100.5) == "b"
    locks.release_client("g", "b")
    assert locks.holder("g", q, now=100.5) is None


def test_a_message_out_of_local_retries_goes_to_the_dlq_and_the_queue_moves_on(dev) -> None:
    topic, group = "ord-dlq", "ord-dlq-g"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 1)
    lock = threading.Lock()
    calls: list[bytes] = []

    def handle(msgs, ctx):
        with lock:
            calls.extend(m.body for m in msgs)
        if any(m.body == b"poison" for m in msgs):
            return tidemq.ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT
        return tidemq.ConsumeOrderlyStatus.SUCCESS

    with tidemq.Producer(dev.namesrv) as p:
        for b in (b"a", b"poison", b"b", b"c"):
            p.send(tidemq.Message(topic, b))
    with tidemq.PushConsumer(dev.namesrv, group, handle, max_reconsume_times=2,
                             **ORDERLY) as c, tidemq.Admin(dev.namesrv) as admin:
        c.subscribe(topic)
        wait_until(lambda: b"c" in calls, 10)
        dlq = admin.dlq_messages(group)
    # Three attempts (two local retries), then the DLQ; the queue resumes in order.
    assert calls == [b"a", b"poison", b"poison", b"poison", b"b", b"c"]
    assert [m.body for m in dlq] == [b"poison"]
    assert dlq[0].properties["RETRY_TOPIC"] == topic
