"""Broadcasting (CO7): every member gets every message; each member's offsets live in its own
local file (``<offset_dir>/<instance_name>/<group>/offsets.json``) and survive a restart;
RECONSUME_LATER is only logged (no retry topic, no second delivery), as in RocketMQ."""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections import Counter

import tidemq

from .cluster import wait_until

TOPIC, GROUP = "bc", "bc-g"


class Seen:
    def __init__(self, fail: bytes | None = None) -> None:
        self.lock = threading.Lock()
        self.bodies: Counter[bytes] = Counter()
        self.fail = fail

    def __call__(self, msgs, ctx):  # noqa: ANN001, ANN204
        with self.lock:
            self.bodies.update(m.body for m in msgs)
        if self.fail is not None and any(m.body == self.fail for m in msgs):
            return tidemq.ConsumeStatus.RECONSUME_LATER
        return tidemq.ConsumeStatus.SUCCESS

    def total(self) -> int:
        with self.lock:
            return sum(self.bodies.values())


def test_every_member_gets_everything_and_offsets_survive_a_restart(dev, caplog) -> None:
    caplog.set_level(logging.WARNING, "tidemq.client.consume_concurrently")
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(TOPIC, 4)
    offset_dir = tempfile.mkdtemp(prefix="tidemq-bc-offsets-")
    opts = dict(message_model="broadcasting", consume_from="first", offset_dir=offset_dir,
                heartbeat_interval=1.0, persist_interval=0.5)
    listeners = [Seen(fail=b"m7"), Seen(), Seen()]
    members = [tidemq.PushConsumer(dev.namesrv, GROUP, listeners[i], instance_name=f"bc-{i}",
                                   **opts) for i in range(3)]
    first = [b"m%d" % i for i in range(100)]
    second = [b"n%d" % i for i in range(50)]
    try:
        for c in members:
            c.subscribe(TOPIC)
            c.start()
        for c in members:  # broadcasting: each member holds every queue
            wait_until(lambda c=c: len([mq for mq in c.assignment() if mq.topic == TOPIC]) == 4,
                       5)
        with tidemq.Producer(dev.namesrv) as p:
            for b in first:
                p.send(tidemq.Message(TOPIC, b))
        wait_until(lambda: all(s.total() >= 100 for s in listeners), 10, 0.02)
        time.sleep(0.3)
        for s in listeners:
            assert s.bodies == Counter(first)  # everything, once -- m7 too, not retried
        logged = [r.getMessage() for r in caplog.records if "not retried" in r.getMessage()]
        assert len(logged) == 1, logged  # the failure of m7, only logged
        assert not any(mq.topic.startswith("%RETRY%") for mq in members[0].assignment())
        with tidemq.Admin(dev.namesrv) as admin:
            info = admin.group_info(GROUP)
        assert info.message_model == "BROADCASTING" and len(info.members) == 3
        # Member 2 stops (persisting its offsets to its file), misses nothing while down...
        members[2].close()
        path = os.path.join(offset_dir, "bc-2", GROUP, "offsets.json")
        assert os.path.exists(path)
        with tidemq.Producer(dev.namesrv) as p:
            for b in second:
                p.send(tidemq.Message(TOPIC, b))
        # ... and, restarted with the same instance name, continues where it stopped: only the
        # 50 new messages, although consume_from="first" would start it at offset 0.
        again = Seen()
        members[2] = tidemq.PushConsumer(dev.namesrv, GROUP, again, instance_name="bc-2", **opts)
        members[2].subscribe(TOPIC)
        members[2].start()
        wait_until(lambda: again.total() >= 50 and all(s.total() >= 150 for s in listeners[:2]),
                   10, 0.02)
        time.sleep(0.3)
        assert again.bodies == Counter(second)
        for s in listeners[:2]:
            assert s.bodies == Counter(first + second)
    finally:
        for c in members:
            c.close()
    with tidemq.Admin(dev.namesrv) as admin:
        info = admin.group_info(GROUP)
    assert info.members == []  # every member left cleanly
