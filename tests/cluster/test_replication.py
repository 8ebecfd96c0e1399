"""One ASYNC_MASTER group (master + slave) and two name servers, real processes on loopback:
the slave's CommitLog is byte-identical to the master's, it refuses writes and serves reads, it
catches up after a stop and rebuilds after its disk is lost, and the cluster keeps working when
a name server dies."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import tidemq
from broker.forge import Rec, forge
from broker.wire import Wire, decode_pull, error_message
from support.cluster import info, same_commitlog, start_cluster, wait_until
from tidemq.protocol.codes import RequestCode, ResponseCode
from tidemq.protocol.headers import SendMultiQueueRequestHeader, TopicConfig

TOPIC = "rep"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # a slave 64 KiB behind is sent whole segment runs with sendfile: catch-up uses it here
    c = start_cluster(tmp_path_factory.mktemp("rep"), namesrvs=2,
                      options=("ha_sendfile_min_bytes=65536",))
    try:
        with tidemq.Admin(c.namesrv) as admin:
            admin.create_topic(TOPIC, 4)
        yield c
    finally:
        c.down(10)


def _caught_up(c, master, slave) -> bool:
    m = info(c, master)
    s = info(c, slave)
    return (s["commitlog_max_offset"] == m["commitlog_max_offset"]
            and m.get("ha_max_lag_bytes", -1) == 0)


def test_slave_copies_the_commitlog_byte_for_byte(cluster):
    c = cluster
    master, slave = c.broker("broker-a", 0), c.broker("broker-a", 1)
    with tidemq.Producer(c.namesrv) as p:
        body = os.urandom(3000)
        for i in range(400):  # ~1.7 MB: the 1 MiB segments roll, fillers are copied
            n = 1 if i % 3 else 9
            p.send_batch([tidemq.Message(TOPIC, body, keys=f"k{i}") for _ in range(n)])
    wait_until(lambda: _caught_up(c, master, slave), 15, what="slave caught up")
    assert len(list((Path(slave.data_dir) / "commitlog").iterdir())) >= 2
    assert same_commitlog(master, slave)
    m = info(c, master)
    assert m["broker_role"] == "ASYNC_MASTER" and m["ha_slaves"] == 1
    assert m["ha_in_sync_slaves"] == 1 and m["ha_max_lag_ms"] == 0
    s = info(c, slave)
    assert s["broker_role"] == "SLAVE" and s["ha_connected"] is True
    assert s["ha_lag_bytes"] == 0 and s["epoch"] == m["epoch"] == 1


def test_slave_refuses_writes_and_serves_reads(cluster):
    c = cluster
    slave = c.broker("broker-a", 1)
    with Wire(slave.addr) as w:
        r = w.send_messages(TOPIC, [b"nope"])
        assert r.code == ResponseCode.SERVICE_NOT_AVAILABLE
        assert "is a SLAVE" in error_message(r) and "master" in error_message(r)
        # a frame of batches for many queues is a send too
        batch = forge(TOPIC, [Rec(body=b"nope")], queue_id=0)
        r = w.request(RequestCode.SEND_MULTI_QUEUE,
                      SendMultiQueueRequestHeader(producer_group="pg", batches=1), batch)
        assert r.code == ResponseCode.SERVICE_NOT_AVAILABLE, r
        assert "is a SLAVE" in error_message(r)
        r = w.request(RequestCode.UPDATE_AND_CREATE_TOPIC,
                      TopicConfig(topic_name="x", read_queue_nums=1, write_queue_nums=1))
        assert r.code == ResponseCode.SERVICE_NOT_AVAILABLE
        total = 0
        for q in range(4):
            r = w.pull(TOPIC, 0, queue_id=q, max_msgs=10_000)
            assert r.code == ResponseCode.SUCCESS
            total += len(decode_pull(r, 0))
        assert total > 0
    # the topic the master has reached the slave by the metadata sync
    assert (Path(slave.data_dir) / "config" / "topics.json").read_text().count(TOPIC)


def test_stopped_slave_catches_up(cluster):
    c = cluster
    master, slave = c.broker("broker-a", 0), c.broker("broker-a", 1)
    c.stop(slave)
    with tidemq.Producer(c.namesrv) as p:
        for i in range(200):
            p.send(tidemq.Message(TOPIC, b"while the slave was away %d" % i))
    assert info(c, master)["ha_slaves"] == 0
    c.restart(slave)
    wait_until(lambda: _caught_up(c, master, slave), 15, what="slave caught up")
    assert same_commitlog(master, slave)


def test_wiped_slave_rebuilds_from_the_master(cluster):
    c = cluster
    master, slave = c.broker("broker-a", 0), c.broker("broker-a", 1)
    with tidemq.Producer(c.namesrv) as p:
        p.send(tidemq.Message(TOPIC, b"before the disk was lost"))
    with tidemq.Admin(c.namesrv) as admin:
        mq = admin.topic_queues(TOPIC)[0]
        admin.reset_consumer_offset("g-wipe", mq, 3)
    c.stop(slave)
    c.wipe(slave)
    c.restart(slave)
    wait_until(lambda: _caught_up(c, master, slave), 20, what="wiped slave rebuilt")
    assert same_commitlog(master, slave)
    links = json.loads(info(c, master)["ha_slave_links"])
    assert links[0]["sendfile_bytes"] > 1_000_000  # the copy went out with os.sendfile
    # its consumer offsets come back from the master too
    offsets = Path(slave.data_dir) / "config" / "consumer_offsets.json"
    wait_until(lambda: offsets.exists() and "g-wipe" in offsets.read_text(), 10,
               what="offsets synced")


def test_cluster_keeps_working_without_a_name_server(cluster):
    c = cluster
    ns0 = [p for p in c.procs if p.kind == "namesrv"][0]
    with tidemq.Producer(c.namesrv, send_timeout=3) as p, \
            tidemq.PullConsumer(c.namesrv, "g-ns", consume_from="first") as cons:
        cons.subscribe(TOPIC)
        assert p.send(tidemq.Message(TOPIC, b"one")).status == tidemq.SendStatus.SEND_OK
        c.kill9(ns0)
        sent = [p.send(tidemq.Message(TOPIC, b"after %d" % i)) for i in range(20)]
        assert {r.status for r in sent} == {tidemq.SendStatus.SEND_OK}
        seen = set()
        wait_until(lambda: seen.update(m.msg_id for m in cons.poll(1.0)) or
                   {r.msg_id for r in sent} <= seen, 20, what="consumed through the other")
    # a new client starting now finds the cluster through the surviving name server
    with tidemq.Producer(c.namesrv, send_timeout=5) as p:
        assert p.send(tidemq.Message(TOPIC, b"new")).status == tidemq.SendStatus.SEND_OK
