"""SQL92 subscriptions end to end (BR10): a lite pull consumer and a push consumer get exactly
the messages their expression selects, from batches and single messages over several queues;
an SQL string is never taken for a tag; a bad expression is refused at subscribe."""

from __future__ import annotations

import threading
import time

import pytest

import tidemq

from .cluster import wait_until

FAST = dict(consume_from="first", heartbeat_interval=1.0, persist_interval=0.2)
SQL = "region = 'eu' AND amount > 100 OR TAGS = 'vip'"


def produce(dev, topic: str) -> set[bytes]:
    """60 messages over 4 queues, half in batches; returns the bodies SQL selects."""
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 4)
    msgs = []
    for i in range(60):
        props = {"region": ["eu", "us", "apac"][i % 3], "amount": str(i * 7)}
        msgs.append(tidemq.Message(topic, b"m%d" % i, tags="vip" if i % 17 == 0 else "std",
                                   properties=props))
    with tidemq.Producer(dev.namesrv) as p:
        for q in range(4):
            p.send_batch(msgs[q * 8:(q + 1) * 8], queue_id=q)
        for m in msgs[32:]:
            p.send(m)
    return {b"m%d" % i for i in range(60)
            if (i % 3 == 0 and i * 7 > 100) or i % 17 == 0}


def test_pull_consumer_gets_exactly_the_selected_messages(dev) -> None:
    want = produce(dev, "sql-pull")
    with tidemq.PullConsumer(dev.namesrv, "sql-pull-g", consume_from="first") as c:
        c.subscribe("sql-pull", sql=SQL)
        got: list[bytes] = []
        deadline = time.monotonic() + 10
        while len(got) < len(want) and time.monotonic() < deadline:
            got += [m.body for m in c.poll(timeout=0.5)]
        got += [m.body for m in c.poll(timeout=0.5)]  # nothing more arrives
    assert sorted(got) == sorted(want)


def test_push_consumer_gets_exactly_the_selected_messages(dev) -> None:
    want = produce(dev, "sql-push")
    got: list[bytes] = []
    lock = threading.Lock()

    def listener(msgs, ctx):
        with lock:
            got.extend(m.body for m in msgs)
        return tidemq.ConsumeStatus.SUCCESS

    with tidemq.PushConsumer(dev.namesrv, "sql-push-g", listener, **FAST) as c:
        c.subscribe("sql-push", sql=SQL)
        wait_until(lambda: len(got) >= len(want), 15)
        time.sleep(0.5)
        with tidemq.Admin(dev.namesrv) as admin:
            info = admin.group_info("sql-push-g")
    assert sorted(got) == sorted(want)
    # the heartbeat told the broker the SQL92 subscription
    assert any(s.expression == SQL and s.expression_type == "SQL92" for s in info.subscriptions)


def test_sql_is_never_taken_for_a_tag_and_bad_sql_is_refused(dev) -> None:
    with tidemq.PullConsumer(dev.namesrv, "sql-bad-g") as c:
        with pytest.raises(ValueError, match="sql="):
            c.subscribe("orders", "region = 'eu'")
        with pytest.raises(tidemq.SqlFilterError, match="ends too early"):
            c.subscribe("orders", sql="region =")
        with pytest.raises(ValueError, match="not both"):
            c.subscribe("orders", "TagA", sql="a = 1")
