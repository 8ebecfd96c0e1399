"""Delay levels and timed messages across a promotion: a slave never delivers them itself; the
promoted slave delivers what was still due, exactly once, and not what the old master had
delivered or cancelled. Real processes on loopback."""

from __future__ import annotations

import collections
import time

import tidemq
from support.cluster import info, start_cluster, wait_until

TOPIC = "ps"


def _bodies(namesrv: str, group: str, want: int, timeout: float) -> collections.Counter[bytes]:
    got: collections.Counter[bytes] = collections.Counter()
    with tidemq.PullConsumer(namesrv, group, consume_from="first") as cons:
        cons.subscribe(TOPIC)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got.update(m.body for m in cons.poll(0.3))
            if sum(got.values()) >= want:
                for _ in range(3):  # nothing more should come
                    got.update(m.body for m in cons.poll(0.3))
                break
    return got


def test_delay_and_timer_state_follow_the_promotion(tmp_path):
    c = start_cluster(tmp_path, options=("message_delay_level=1s 4s",))
    try:
        master, slave = c.broker("broker-a", 0), c.broker("broker-a", 1)
        with tidemq.Admin(c.namesrv) as admin:
            admin.create_topic(TOPIC, 2)
        wait_until(lambda: info(c, master).get("ha_in_sync_slaves") == 1, 10, what="in sync")
        with tidemq.Producer(c.namesrv) as p:
            p.send(tidemq.Message(TOPIC, b"d1", delay_level=1))
            p.send(tidemq.Message(TOPIC, b"t1", deliver_after=1.0))
            # due only after the master is gone; the cancelled one after the master's last
            # timer progress, so only the cancellation record keeps it from being delivered
            p.send(tidemq.Message(TOPIC, b"d2", delay_level=2))
            p.send(tidemq.Message(TOPIC, b"t2", deliver_after=4.0))
            doomed = p.send(tidemq.Message(TOPIC, b"t-cancelled", deliver_after=4.5))
            p.cancel(doomed)
        got = _bodies(c.namesrv, "g-before", 2, 10)
        assert got == {b"d1": 1, b"t1": 1}  # the master delivered these
        # the slave copied, and delivered nothing itself: its log is the master's
        wait_until(lambda: info(c, slave)["commitlog_max_offset"] ==
                   info(c, master)["commitlog_max_offset"], 10, what="slave caught up")
        s = info(c, slave)
        assert s["delay_delivered"] == 0 and s["timer_delivered"] == 0
        time.sleep(1.5)  # a metadata copy: delay and timer progress
        c.kill9(master)
        wait_until(lambda: not info(c, slave)["ha_connected"], 10, what="master gone")
        with tidemq.Admin(c.namesrv) as admin:
            admin.promote(slave.addr)
        got = _bodies(c.namesrv, "g-after", 4, 15)
        time.sleep(1.5)  # the cancelled one would have been due by now
        got += _bodies(c.namesrv, "g-after", 0, 1)
        assert got == {b"d1": 1, b"t1": 1, b"d2": 1, b"t2": 1}, got
    finally:
        c.down(10)
