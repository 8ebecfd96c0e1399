"""Consumers through a master's death: a push consumer keeps consuming from the slave with no
loss and commits its offsets there; when the master returns, those offsets flow back to it (the
larger offset wins). And the pull-side suggestion: a consumer far behind is sent to the slave.
Real processes on loopback."""

from __future__ import annotations

import threading

import pytest

import tidemq
from support.cluster import info, start_cluster, wait_until

TOPIC = "pc"
N = 1500


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(
        tmp_path_factory.mktemp("pc"),
        # every consumer counts as "far behind": pulls are sent to the slave (RocketMQ's rule)
        options=("slave_read_enable=true", "access_message_in_memory_max_ratio=0.0000001"),
    )
    try:
        with tidemq.Admin(c.namesrv) as admin:
            admin.create_topic(TOPIC, 4)
        wait_until(lambda: info(c, c.broker("broker-a", 0)).get("ha_in_sync_slaves") == 1, 10,
                   what="slave in sync")
        yield c
    finally:
        c.down(10)


def test_push_consumer_survives_the_master_and_its_offsets_flow_back(cluster):
    c = cluster
    master, slave = c.broker("broker-a", 0), c.broker("broker-a", 1)
    with tidemq.Producer(c.namesrv) as p:
        ids = {p.send(tidemq.Message(TOPIC, b"m%d" % i)).msg_id for i in range(N)}
    wait_until(lambda: info(c, slave)["commitlog_max_offset"] ==
               info(c, master)["commitlog_max_offset"], 10, what="slave caught up")
    seen: set[str] = set()
    lock = threading.Lock()
    half = threading.Event()

    def listener(msgs, ctx):  # noqa: ANN001
        with lock:
            seen.update(m.msg_id for m in msgs)
            if len(seen) >= N // 3:
                half.set()
        if half.is_set() and master.alive():
            threading.Event().wait(0.002)  # slow down: the kill lands mid-way
        return tidemq.ConsumeStatus.SUCCESS

    with tidemq.PushConsumer(c.namesrv, "g-push", listener, consume_from="first",
                             persist_interval=0.3) as consumer:
        consumer.subscribe(TOPIC)
        assert half.wait(20), "the consumer never got going"
        c.kill9(master)
        wait_until(lambda: ids <= seen, 30, what="every message consumed after the kill")
        # offsets are committed on the slave while the master is away
        wait_until(lambda: _slave_offsets_done(c, slave), 10, what="offsets on the slave")
    assert ids <= seen

    # the master returns: the slave hands it the offsets it took (max wins)
    c.restart(master)
    with tidemq.Admin(c.namesrv) as admin:
        queues = [tidemq.MessageQueue(TOPIC, "broker-a", q) for q in range(4)]

        def master_has_them() -> bool:
            try:
                return all(admin.consumer_offset("g-push", mq) == admin.max_offset(mq)
                           for mq in queues)
            except tidemq.TidemqError:
                return False

        wait_until(master_has_them, 20, what="offsets flowed back to the master")
    assert info(c, master)["broker_id"] == 0
    assert info(c, slave)["ha_connected"] is True


def _slave_offsets_done(c, slave) -> bool:
    import json
    from pathlib import Path

    path = Path(slave.data_dir) / "config" / "consumer_offsets.json"
    if not path.exists():
        return False
    table = json.loads(path.read_text())["offset_table"].get(f"{TOPIC}@g-push", {})
    return sum(table.values()) >= N


def test_far_behind_consumer_is_sent_to_the_slave(cluster):
    """With slave reads on and a tiny memory ratio, every pull is 'far behind': the master's
    answer suggests the slave, and the consumer's pulls go there (the slave's pull counter
    moves, the master's does not)."""
    c = cluster
    master, slave = c.broker("broker-a", 0), c.broker("broker-a", 1)
    wait_until(lambda: info(c, slave).get("ha_connected"), 20, what="slave follows")
    with tidemq.Producer(c.namesrv) as p:
        ids = {p.send(tidemq.Message(TOPIC, b"far %d" % i)).msg_id for i in range(200)}
    wait_until(lambda: info(c, slave)["commitlog_max_offset"] ==
               info(c, master)["commitlog_max_offset"], 10, what="slave caught up")
    s0, m0 = info(c, slave)["get_total_msgs"], info(c, master)["get_total_msgs"]
    got: set[str] = set()
    with tidemq.PullConsumer(c.namesrv, "g-far", consume_from="first") as cons:
        cons.subscribe(TOPIC)
        wait_until(lambda: got.update(m.msg_id for m in cons.poll(0.5)) or ids <= got, 20,
                   what="read everything")
    from_slave = info(c, slave)["get_total_msgs"] - s0
    from_master = info(c, master)["get_total_msgs"] - m0
    # the first pull of each queue goes to the master, which sends the consumer on
    assert from_slave > from_master, (from_slave, from_master)
