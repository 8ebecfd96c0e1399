"""Consumers joining 1 -> 3 and leaving 3 -> 2: each change settles (every queue owned by
exactly one member) within 1 s through the broker's notification, and nothing is lost."""

from __future__ import annotations

import threading
import time

import pytest

import tidemq

from .cluster import wait_until

TOPIC = "rebal"
QUEUES = 8


def _owners(consumers: list[tidemq.PushConsumer]) -> list[tidemq.MessageQueue] | None:
    """Every queue of TOPIC once, sorted, if the group has settled; else None."""
    owned = [mq for c in consumers for mq in c.assignment() if mq.topic == TOPIC]
    return sorted(owned) if len(owned) == len(set(owned)) == QUEUES else None


def _broker_view(dev, consumers: list[tidemq.PushConsumer]) -> bool:
    """The broker lists exactly these members of the group."""
    with tidemq.Admin(dev.namesrv) as admin:
        info = admin.group_info("rebal-g")
    return info.members == sorted(c.client_id for c in consumers)


# A latency bound measured on a shared 2-core machine: one run can miss it when another process
# takes the CPU; a real regression misses it on every run, so two reruns are allowed.
@pytest.mark.flaky(reruns=2)
def test_join_and_leave_settle_within_a_second_and_lose_nothing(dev) -> None:
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(TOPIC, QUEUES)
    seen: set[bytes] = set()
    lock = threading.Lock()

    def handle(msgs, ctx):
        with lock:
            seen.update(m.body for m in msgs)
        return tidemq.ConsumeStatus.SUCCESS

    sent: list[bytes] = []
    stop = threading.Event()

    def produce() -> None:
        with tidemq.Producer(dev.namesrv) as p:
            i = 0
            while not stop.is_set():
                bodies = [b"m%06d" % (i + k) for k in range(10)]
                p.send_batch([tidemq.Message(TOPIC, b) for b in bodies])
                sent.extend(bodies)
                i += 10
                time.sleep(0.002)

    opts = dict(consume_from="first", rebalance_interval=20.0, persist_interval=1.0,
                heartbeat_interval=1.0)
    consumers = [tidemq.PushConsumer(dev.namesrv, "rebal-g", handle, **opts)]
    consumers[0].start()
    consumers[0].subscribe(TOPIC)
    wait_until(lambda: _owners(consumers) is not None, 10)
    assert _broker_view(dev, consumers)
    producer = threading.Thread(target=produce)
    producer.start()
    try:
        for _ in range(2):  # 1 -> 2 -> 3
            c = tidemq.PushConsumer(dev.namesrv, "rebal-g", handle, **opts)
            c.subscribe(TOPIC)
            t0 = time.monotonic()
            c.start()
            started = time.monotonic() - t0
            consumers.append(c)
            settle = wait_until(lambda: _owners(consumers) is not None
                                and all(x.assignment() for x in consumers), 5, 0.005)
            print(f"join -> {len(consumers)} members: start() {started:.3f} s, "
                  f"settled {settle:.3f} s after it ({started + settle:.3f} s after the join)")
            assert started + settle <= 1.0
            assert _broker_view(dev, consumers)
            time.sleep(0.5)  # consume under load for a while
        leaving = consumers.pop(1)
        leaving.close()
        settle = wait_until(lambda: _owners(consumers) is not None, 5, 0.005)
        print(f"leave -> {len(consumers)} members: settled {settle:.3f} s after close()")
        assert settle <= 1.0
        assert _broker_view(dev, consumers)  # close() unregistered at once
        time.sleep(0.5)
    finally:
        stop.set()
        producer.join()
    try:
        wait_until(lambda: seen >= set(sent), 30, 0.1)
    finally:
        for c in consumers:
            c.close()
    print(f"sent {len(sent)}, consumed {len(seen)} distinct")
