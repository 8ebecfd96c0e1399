"""Retry and dead-letter queues (BR7, CO5): a failed message comes back through
``%RETRY%<group>`` on the delay schedule (level 3 + reconsume times; the module's broker uses a
test-sized schedule, see cluster.py), with its original topic and id, and after the group's
maximum (16) it lands in ``%DLQ%<group>`` with its origin recorded."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import tidemq
from tidemq.client.connection import ConnectionPool
from tidemq.protocol.codes import RequestCode, ResponseCode
from tidemq.protocol.errors import BrokerError
from tidemq.protocol.headers import PullMessageRequestHeader

from .cluster import TEST_LEVELS_MS, wait_until


class Recorder:
    """A listener that records every attempt and fails the first ``fail`` of each message."""

    def __init__(self, fail: int = 10**9) -> None:
        self.fail = fail
        self.lock = threading.Lock()
        self.calls: list[tuple[float, str, str, int, dict[str, str], bytes]] = []
        self.tries: dict[bytes, int] = {}

    def __call__(self, msgs, ctx):  # noqa: ANN001, ANN204
        now = time.monotonic()
        ok = True
        with self.lock:
            for m in msgs:
                self.calls.append((now, m.topic, m.msg_id, m.reconsume_times, m.properties,
                                   m.body))
                n = self.tries[m.body] = self.tries.get(m.body, 0) + 1
                ok = ok and n > self.fail
        return tidemq.ConsumeStatus.SUCCESS if ok else tidemq.ConsumeStatus.RECONSUME_LATER

    def count(self) -> int:
        with self.lock:
            return len(self.calls)


def test_always_failing_message_is_retried_16_times_on_schedule_then_dead_lettered(dev) -> None:
    topic, group = "retry-t", "retry-g"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 4)
    rec = Recorder()
    with tidemq.PushConsumer(dev.namesrv, group, rec, consume_from="first",
                             heartbeat_interval=1.0) as c:
        c.subscribe(topic)
        # The retry topic is created by the first heartbeat; wait until its route is there.
        wait_until(lambda: any(mq.topic == "%RETRY%" + group for mq in c.assignment()), 5)
        with tidemq.Producer(dev.namesrv) as p:
            sent = p.send(tidemq.Message(topic, b"doomed", tags="TagA", keys="order-1"))
        wait_until(lambda: rec.count() >= 17, 30, 0.02)
        with tidemq.Admin(dev.namesrv) as admin:
            wait_until(lambda: len(admin.dlq_messages(group)) == 1, 5, 0.05)
            time.sleep(0.5)  # nothing more comes
            dlq = admin.dlq_messages(group)
    calls = rec.calls
    assert len(calls) == 17  # the first delivery and 16 retries
    assert [x[3] for x in calls] == list(range(17))  # reconsume times
    assert {x[1] for x in calls} == {topic}  # the original topic restored on every retry
    assert {x[2] for x in calls} == {sent.msg_id}  # the same message id every time
    assert all(x[4].get("RETRY_TOPIC") == topic for x in calls[1:])
    waits = [b[0] - a[0] for a, b in zip(calls, calls[1:], strict=False)]
    levels = [TEST_LEVELS_MS[2 + n] / 1000 for n in range(16)]  # retry n waits level 3 + n
    print("retry waits (s):", " ".join(f"{w:.3f}/{lv:g}" for w, lv in zip(waits, levels,
                                                                          strict=True)))
    for n, (w, lv) in enumerate(zip(waits, levels, strict=True)):
        assert lv - 0.005 <= w <= lv + 0.5, f"retry {n + 1} came after {w:.3f} s, level {lv}"
    assert len(dlq) == 1
    d = dlq[0]
    assert d.body == b"doomed" and d.tags == "TagA" and d.keys == ["order-1"]
    assert d.properties["RETRY_TOPIC"] == topic
    assert d.properties["ORIGIN_MESSAGE_ID"] == sent.msg_id
    assert d.topic == "%DLQ%" + group


def test_max_reconsume_times_per_group_and_per_consumer(dev) -> None:
    topic = "retry-max"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 2)
        cfg = admin.update_group("retry-max-g", retry_max_times=2)
        assert cfg.retry_max_times == 2
        assert admin.group_info("retry-max-g").config.retry_max_times == 2
    by_group, by_client = Recorder(), Recorder()
    with tidemq.Producer(dev.namesrv) as p:
        p.send(tidemq.Message(topic, b"m"))
    opts = dict(consume_from="first", heartbeat_interval=1.0)
    with tidemq.PushConsumer(dev.namesrv, "retry-max-g", by_group, **opts) as a, \
            tidemq.PushConsumer(dev.namesrv, "retry-one-g", by_client, max_reconsume_times=1,
                                **opts) as b, tidemq.Admin(dev.namesrv) as admin:
        a.subscribe(topic)
        b.subscribe(topic)
        wait_until(lambda: len(admin.dlq_messages("retry-max-g")) == 1
                   and len(admin.dlq_messages("retry-one-g")) == 1, 15, 0.05)
        time.sleep(0.5)
    assert [x[3] for x in by_group.calls] == [0, 1, 2]  # the group's retry_max_times: 2
    assert [x[3] for x in by_client.calls] == [0, 1]  # the consumer's max_reconsume_times: 1


def test_a_retried_message_that_succeeds_is_not_seen_again(dev) -> None:
    topic, group = "retry-ok", "retry-ok-g"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 2)
    rec = Recorder(fail=2)
    with tidemq.Producer(dev.namesrv) as p:
        for i in range(20):
            p.send(tidemq.Message(topic, b"m%d" % i))
    with tidemq.PushConsumer(dev.namesrv, group, rec, consume_from="first",
                             heartbeat_interval=1.0, consume_message_batch_max_size=4) as c:
        c.subscribe(topic)
        wait_until(lambda: rec.count() >= 60, 15, 0.02)
        time.sleep(0.5)
    assert rec.count() == 60  # 2 failures and 1 success each, nothing after the success
    assert {x[1] for x in rec.calls} == {topic}
    assert sorted(rec.tries.values()) == [3] * 20
    with tidemq.Admin(dev.namesrv) as admin:
        assert admin.dlq_messages(group) == []


def test_dead_letter_topic_is_not_readable_by_a_consumer_group(dev) -> None:
    with tidemq.Admin(dev.namesrv) as admin:
        dlq = admin.dlq_messages("retry-g")
    assert dlq, "runs after the first test of this module"

    async def pull() -> None:
        pool = ConnectionPool()
        try:
            await pool.request(dev.broker, RequestCode.PULL_MESSAGE, PullMessageRequestHeader(
                consumer_group="retry-g", topic="%DLQ%retry-g", queue_id=0, queue_offset=0,
                max_msg_nums=1, sys_flag=0, suspend_timeout_millis=0))
        finally:
            pool.close()

    with pytest.raises(BrokerError) as e:
        asyncio.run(pull())
    assert e.value.response_code == ResponseCode.NO_PERMISSION
