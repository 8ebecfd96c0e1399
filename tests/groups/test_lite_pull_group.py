"""Lite pull consumers that subscribe share their group's queues (CO8 with CO4): two real
PullConsumers of one group on a 4-queue topic each take 2 queues and every message is consumed
once; they heartbeat (`tidemq group describe` lists them); when one leaves, the other takes its
queues from where it stopped; assign() stays outside the group."""

from __future__ import annotations

import json
import time

from click.testing import CliRunner

import tidemq
from tidemq.cli.main import cli

from .cluster import wait_until

FAST = dict(consume_from="first", heartbeat_interval=0.5, rebalance_interval=1.0,
            auto_commit_interval=0.2)


def _describe(dev, group: str) -> dict:
    r = CliRunner().invoke(cli, ["group", "describe", "--group", group, "--namesrv",
                                 dev.namesrv, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def _poll_all(consumers, got: dict, until, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not until() and time.monotonic() < deadline:
        for c in consumers:
            got.setdefault(c.client_id, []).extend(c.poll(timeout=0.1))


def test_two_pull_consumers_share_the_queues_and_each_message_is_consumed_once(dev) -> None:
    topic, group = "lite-share", "lite-share-g"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 4)
    a = tidemq.PullConsumer(dev.namesrv, group, **FAST)
    b = tidemq.PullConsumer(dev.namesrv, group, **FAST)
    for c in (a, b):
        c.subscribe(topic)
        c.start()
    try:
        wait_until(lambda: len(a.assignment()) == 2 and len(b.assignment()) == 2, 10)
        assert a.assignment().isdisjoint(b.assignment())
        assert sorted(_describe(dev, group)["members"]) == sorted([a.client_id, b.client_id])
        with tidemq.Producer(dev.namesrv) as p:
            for i in range(80):
                p.send(tidemq.Message(topic, b"m%d" % i), queue_id=i % 4)
        got: dict[str, list] = {}
        _poll_all((a, b), got, lambda: sum(map(len, got.values())) >= 80)
        _poll_all((a, b), got, lambda: False, timeout=0.5)  # nothing more arrives
        bodies = [m.body for msgs in got.values() for m in msgs]
        assert sorted(bodies) == sorted(b"m%d" % i for i in range(80))  # once each
        assert all(len(got[c.client_id]) == 40 for c in (a, b))
        for c in (a, b):
            c.commit()
        # b leaves: a takes all four queues and goes on from where b stopped
        b.close()
        wait_until(lambda: len(a.assignment()) == 4, 10)
        assert _describe(dev, group)["members"] == [a.client_id]
        with tidemq.Producer(dev.namesrv) as p:
            for i in range(80, 88):
                p.send(tidemq.Message(topic, b"m%d" % i), queue_id=i % 4)
        more: dict[str, list] = {}
        _poll_all((a,), more, lambda: sum(map(len, more.values())) >= 8)
        _poll_all((a,), more, lambda: False, timeout=0.5)
        assert sorted(m.body for m in more[a.client_id]) == sorted(
            b"m%d" % i for i in range(80, 88))
    finally:
        a.close()
        b.close()


def test_assign_stays_manual_and_outside_the_group(dev) -> None:
    topic, group = "lite-assign", "lite-assign-g"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 2)
        qs = admin.topic_queues(topic)
    with tidemq.PullConsumer(dev.namesrv, group, **FAST) as c:
        c.assign(qs)
        time.sleep(1.0)
        assert c.assignment() == set(qs)
        assert _describe(dev, group)["members"] == []
