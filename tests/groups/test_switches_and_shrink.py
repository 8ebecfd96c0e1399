"""Group switches enforced on the broker (BR11) and queue shrinking as RocketMQ does it: a
disabled group is refused with NO_PERMISSION and a message, broadcasting is refused when the
group forbids it, and read queues outlive write queues until they are drained."""

from __future__ import annotations

import threading
import time

import pytest

import tidemq
from tidemq.protocol.codes import ResponseCode

from .cluster import wait_until

FAST = dict(consume_from="first", heartbeat_interval=0.5, persist_interval=0.2)


def _poll_error(c: tidemq.PullConsumer, timeout: float = 5.0) -> tidemq.BrokerError:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            c.poll(timeout=0.2)
        except tidemq.BrokerError as exc:
            return exc
    raise AssertionError("no refusal")


def test_a_disabled_group_is_refused_and_consumes_again_when_enabled(dev) -> None:
    topic, group = "sw-disabled", "sw-disabled-g"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 2)
        admin.update_group(group, consume_enable=False)
    with tidemq.Producer(dev.namesrv) as p:
        for i in range(8):
            p.send(tidemq.Message(topic, b"m%d" % i))
    with tidemq.PullConsumer(dev.namesrv, group, consume_from="first") as c:
        c.subscribe(topic)
        exc = _poll_error(c)
    assert exc.response_code == ResponseCode.NO_PERMISSION
    assert "consume_enable" in str(exc) and "--consume-enable" in str(exc)
    got: list[bytes] = []
    lock = threading.Lock()

    def listener(msgs, ctx):
        with lock:
            got.extend(m.body for m in msgs)
        return tidemq.ConsumeStatus.SUCCESS

    with tidemq.PushConsumer(dev.namesrv, group, listener, **FAST) as pc:
        pc.subscribe(topic)
        time.sleep(2.0)
        assert got == []  # the "a disabled group consumed 8 messages" no more
        with tidemq.Admin(dev.namesrv) as admin:
            admin.update_group(group, consume_enable=True)
        wait_until(lambda: len(got) >= 8, 15)
    assert sorted(got) == sorted(b"m%d" % i for i in range(8))


def test_broadcasting_is_refused_when_the_group_forbids_it(dev) -> None:
    topic, group = "sw-bcast", "sw-bcast-g"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 1)
        admin.update_group(group, consume_broadcast_enable=False)
        qs = admin.topic_queues(topic)
    with tidemq.Producer(dev.namesrv) as p:
        p.send(tidemq.Message(topic, b"x"))
    got: list[bytes] = []

    def listener(msgs, ctx):
        got.extend(m.body for m in msgs)
        return tidemq.ConsumeStatus.SUCCESS

    with tidemq.PushConsumer(dev.namesrv, group, listener, message_model="broadcasting",
                             **FAST) as pc:
        pc.subscribe(topic)
        time.sleep(1.5)
        with tidemq.PullConsumer(dev.namesrv, group, consume_from="first") as c:
            c.assign(qs)  # a pull of the group while it is registered as broadcasting
            exc = _poll_error(c)
    assert got == []
    assert exc.response_code == ResponseCode.NO_PERMISSION and "broadcast" in str(exc)


def _read_queues(admin: tidemq.Admin, topic: str) -> tuple[int, int]:
    [tc] = [t for name, t in admin.topic_configs("broker-a").items() if name == topic]
    return tc.read_queue_nums, tc.shrinking_to


def test_read_queues_outlive_write_queues_until_drained(dev) -> None:
    topic, group = "shrink", "shrink-g"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 4)
        # an empty topic shrinks at once
        admin.create_topic("shrink-empty", 4)
        admin.create_topic("shrink-empty", 2)
        assert _read_queues(admin, "shrink-empty") == (2, 0)
    with tidemq.PullConsumer(dev.namesrv, group, consume_from="first") as c:
        c.subscribe(topic)
        c.poll(timeout=0.5)
        c.commit()
        with tidemq.Producer(dev.namesrv) as p:
            for i in range(12):
                p.send(tidemq.Message(topic, b"m%d" % i), queue_id=i % 4)
        with tidemq.Admin(dev.namesrv) as admin:
            admin.create_topic(topic, 2)  # read 2, write 2: queues 2 and 3 still hold messages
            assert _read_queues(admin, topic) == (4, 2)
            time.sleep(1.5)
            assert _read_queues(admin, topic) == (4, 2)  # nothing consumed yet: kept
            got: list[bytes] = []
            deadline = time.monotonic() + 10
            while len(got) < 12 and time.monotonic() < deadline:
                got += [m.body for m in c.poll(timeout=0.5)]
            assert sorted(got) == sorted(b"m%d" % i for i in range(12))  # nothing hidden
            c.commit()
            wait_until(lambda: _read_queues(admin, topic) == (2, 0), 10)
            wait_until(lambda: len(admin.topic_queues(topic)) == 2, 10)
            # growing again is immediate
            admin.create_topic(topic, 4)
            assert _read_queues(admin, topic) == (4, 0)


@pytest.mark.parametrize("read", [0, 99999])
def test_a_bad_queue_count_is_still_refused(dev, read) -> None:
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic("shrink-bad", 2)
        with pytest.raises(tidemq.BrokerError):
            admin.create_topic("shrink-bad", 2, read_queues=read)


def test_an_ordered_topic_is_consumed_only_by_orderly_push_consumers(dev) -> None:
    topic = "sw-ordered"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 2, order=True)
    with tidemq.Producer(dev.namesrv) as p:
        for i in range(10):
            p.send(tidemq.Message(topic, b"%d" % i), hash_key="k")
    got: list[bytes] = []
    lock = threading.Lock()

    def listener(msgs, ctx):
        with lock:
            got.extend(m.body for m in msgs)
        return tidemq.ConsumeStatus.SUCCESS

    with tidemq.PushConsumer(dev.namesrv, "sw-ordered-concurrent", listener, **FAST) as pc:
        pc.subscribe(topic)
        time.sleep(2.0)
    assert got == []  # refused: NO_PERMISSION, the consumer logs it and retries

    def orderly(msgs, ctx):
        with lock:
            got.extend(m.body for m in msgs)
        return tidemq.ConsumeOrderlyStatus.SUCCESS

    with tidemq.PushConsumer(dev.namesrv, "sw-ordered-orderly", orderly, orderly=True,
                             **FAST) as pc:
        pc.subscribe(topic)
        wait_until(lambda: len(got) >= 10, 15)
    assert got == [b"%d" % i for i in range(10)]  # in order
    with tidemq.PullConsumer(dev.namesrv, "sw-ordered-lite", consume_from="first") as c:
        c.subscribe(topic)  # a lite pull consumer polls each queue in order: allowed
        out: list[bytes] = []
        deadline = time.monotonic() + 10
        while len(out) < 10 and time.monotonic() < deadline:
            out += [m.body for m in c.poll(timeout=0.5)]
    assert out == [b"%d" % i for i in range(10)]
