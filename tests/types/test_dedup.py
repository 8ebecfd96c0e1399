"""Deduplication by producer name and sequence id (ref PR6, BR12)."""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile

import pytest
from producer_path_helpers import dev_cluster, drain, make_topic, runtime_info

from support.cluster import start_dev, stop_dev
from tidemq import aio
from tidemq.broker.dedup import DupStatus, MessageDeduplication
from tidemq.protocol.headers import dedup_producer_id, is_dedup_producer

# A small store for the table-level tests (the default index file alone is 420 MB).
_SMALL_STORE = dict(segment_size=1 << 20, cq_units_per_file=1024, index_slots=1024,
                    index_max_entries=4096)


@pytest.fixture(scope="module")
def cluster():
    yield from dev_cluster()


def test_producer_id_is_stable_and_marked():
    a = dedup_producer_id("orders-1")
    assert a == dedup_producer_id("orders-1") != dedup_producer_id("orders-2")
    assert is_dedup_producer(a)
    assert a == 0xCD538A924EEC27FD  # pinned: other machines and releases must agree
    p = aio.Producer("127.0.0.1:1")
    assert not is_dedup_producer(p.producer_id)  # unnamed producers are never deduplicated


def test_table_classifies_pushed_persisted_and_failed():
    d = MessageDeduplication("/nonexistent/dedup.json")
    pid = dedup_producer_id("p")
    assert d.check(pid, 0, 10) is DupStatus.NEW  # pushed 9, persisted none
    assert d.check(pid, 5, 1) is DupStatus.UNCERTAIN  # pushed, not yet durable
    d.persisted_up_to(pid, 9)
    assert d.check(pid, 0, 10) is DupStatus.DUPLICATE
    assert d.check(pid, 9, 1) is DupStatus.DUPLICATE
    assert d.check(pid, 10, 5) is DupStatus.NEW  # pushed 14
    d.failed(pid)  # the put of 10..14 failed: a resend must be taken
    assert d.check(pid, 10, 5) is DupStatus.NEW
    assert d.last_sequence(pid) == 9
    assert (d.duplicates, d.uncertain) == (2, 1)


def test_duplicate_is_acknowledged_not_stored_and_sequence_continues(cluster):
    async def main():
        topic = "dedup-basic"
        await make_topic(cluster.namesrv, topic, 1)
        msgs = [aio.Message(topic, f"m{i}".encode()) for i in range(3)]
        async with aio.Producer(cluster.namesrv, producer_name="orders-1") as p:
            assert p.last_sequence_id == -1
            r1 = await p.send_batch(msgs)
            assert (r1.status, r1.base_seq, r1.queue_offset) == (aio.SendStatus.SEND_OK, 0, 0)
            again = await p.send_batch(msgs, sequence_id=0)  # a resend with the same ids
            assert again.status is aio.SendStatus.DUPLICATE and again.queue_offset == -1
            r2 = await p.send(aio.Message(topic, b"next"))
            assert (r2.base_seq, r2.queue_offset) == (3, 3)
        async with aio.Producer(cluster.namesrv, producer_name="orders-1") as p2:
            # A restarted producer continues after what the broker persisted for its name.
            assert p2.last_sequence_id == 3
            r3 = await p2.send(aio.Message(topic, b"after restart"))
            assert (r3.status, r3.base_seq, r3.queue_offset) == (aio.SendStatus.SEND_OK, 4, 4)
            dup = await p2.send(aio.Message(topic, b"next"), sequence_id=3)
            assert dup.status is aio.SendStatus.DUPLICATE
        async with aio.PullConsumer(cluster.namesrv, "g-dedup", consume_from="first") as c:
            c.subscribe(topic)
            got = await drain(c, 5)
            await asyncio.sleep(0.3)
            got += await c.poll(timeout=0.2)
        assert [m.body for m in got] == [b"m0", b"m1", b"m2", b"next", b"after restart"]
        info = await runtime_info(cluster.broker)
        assert info["dedup_duplicates"] >= 2

    asyncio.run(main())


def _commitlog_end(info: dict) -> int:
    return int(info["commitlog_max_offset"])


def test_resend_after_kill_9_and_restart_stores_nothing_twice():
    """Batches sent before a kill -9 (some after the last dedup snapshot) are re-sent after the
    restart with the same sequence ids: every resend is a DUPLICATE, nothing is stored twice."""
    with tempfile.TemporaryDirectory(prefix="tidemq-dedup-kill-") as d:
        c = start_dev(d, "dedup_snapshot_interval_ms=300")
        topic = "dedup-kill"
        batches = [[aio.Message(topic, f"b{b}-m{i}".encode()) for i in range(10)]
                   for b in range(40)]

        async def before():
            await make_topic(c.namesrv, topic, 2)
            async with aio.Producer(c.namesrv, producer_name="spark-q1-p0") as p:
                for b in batches[:20]:
                    await p.send_batch(b, sequence_id=_seq(b, batches), queue_id=0)
                await asyncio.sleep(1.0)  # a snapshot covers the first 20 batches ...
                for b in batches[20:]:  # ... the last 20 only the CommitLog replay can find
                    await p.send_batch(b, sequence_id=_seq(b, batches), queue_id=1)
            return await runtime_info(c.broker)

        info1 = asyncio.run(before())
        os.kill(c.proc.pid, signal.SIGKILL)
        c.proc.wait()
        c2 = start_dev(d, "dedup_snapshot_interval_ms=300")
        try:
            async def after():
                info = await runtime_info(c2.broker)
                assert info["dedup_replayed_batches"] >= 20, info
                async with aio.Producer(c2.namesrv, producer_name="spark-q1-p0") as p:
                    assert p.last_sequence_id == 399
                    for k, b in enumerate(batches):
                        r = await p.send_batch(b, sequence_id=_seq(b, batches),
                                               queue_id=0 if k < 20 else 1)
                        assert r.status is aio.SendStatus.DUPLICATE, (k, r)
                    r = await p.send(aio.Message(topic, b"new"), queue_id=1)
                    assert r.status is aio.SendStatus.SEND_OK and r.base_seq == 400
                info2 = await runtime_info(c2.broker)
                async with aio.Admin(c2.namesrv) as admin:
                    qs = sorted(await admin.topic_queues(topic))
                    maxes = [await admin.max_offset(mq) for mq in qs]
                return info2, maxes

            info2, maxes = asyncio.run(after())
            assert maxes == [200, 201]  # 20 batches of 10 per queue, plus the one new message
            assert info2["dedup_duplicates"] == 40
            print("commitlog end before kill", _commitlog_end(info1), "after resends",
                  _commitlog_end(info2))
        finally:
            stop_dev(c2)


def _seq(b, batches) -> int:
    return batches.index(b) * 10


def test_resend_in_the_uncertain_window_is_answered_retry_later(tmp_path):
    """SYNC_FLUSH: a resend that arrives while the first copy is stored but not yet durable
    gets RETRY_LATER (the first copy may still fail); once it is durable, DUPLICATE. Both
    frames are written in one packet, so the broker handles the second before the flush
    thread's answer for the first can reach its event loop."""
    from broker.wire import Wire, batch, start_broker
    from tidemq.protocol.codes import RequestCode, ResponseCode
    from tidemq.protocol.frame import Frame, encode_frame
    from tidemq.protocol.headers import (
        QueueOffsetRequestHeader,
        SendMessageRequestHeader,
        dedup_producer_id,
    )

    srv = start_broker(tmp_path, "", "-o", "flush_mode=sync")
    try:
        with Wire(srv.addr) as w:
            assert w.create_topic("dd-window", 1).code == ResponseCode.SUCCESS
            body = bytes(batch("dd-window", [b"once"], producer_id=dedup_producer_id("w"),
                               base_seq=5))
            h = SendMessageRequestHeader(producer_group="pg", topic="dd-window", queue_id=0)
            w.send_raw(b"".join(encode_frame(Frame(RequestCode.SEND_MESSAGE, op, 0, h, body))
                                for op in (9001, 9002)))
            first, second = w.recv(9001), w.recv(9002)
            assert first.code == ResponseCode.SUCCESS
            assert second.code == ResponseCode.RETRY_LATER
            again = w.request(RequestCode.SEND_MESSAGE, h, body)
            assert again.code == ResponseCode.DUPLICATE
            mx = w.request(RequestCode.GET_MAX_OFFSET,
                           QueueOffsetRequestHeader(topic="dd-window", queue_id=0))
            assert mx.header.offset == 1  # stored once
    finally:
        srv.stop()


def test_snapshot_golden_bytes_and_replay_after_it(tmp_path):
    """docs/format.md section 7: the snapshot file layout, and a restart that loads it and
    replays only the CommitLog after its offset."""
    from tidemq.broker.dedup import _encoder, _Snapshot
    from tidemq.protocol.record import MessageData, encode_batch
    from tidemq.store.config import StoreConfig
    from tidemq.store.message_store import MessageStore

    pid = dedup_producer_id("orders-1")
    raw = _encoder.encode(_Snapshot(1048576, {str(pid): 399}, 1700000000000,
                                    {str(pid): 1699999990000}))
    assert raw == (b'{"commitlog_offset":1048576,"producers":{"14795321561836169213":399},'
                   b'"written_at":1700000000000,"last_seen":{"14795321561836169213":1699999990000}}')
    store = MessageStore(StoreConfig(data_dir=str(tmp_path / "store"), **_SMALL_STORE))
    try:
        path = str(tmp_path / "dedup.json")
        d = MessageDeduplication(path)
        d.recover(store)
        for seq in range(0, 50, 10):  # five batches of 10
            assert d.check(pid, seq, 10) is DupStatus.NEW
            store.put(encode_batch("t", [MessageData(b"x")] * 10, producer_id=pid,
                                   base_seq=seq))
            d.persisted_up_to(pid, seq + 9)
        d.save_now(store)  # covers seq 0..49
        store.put(encode_batch("t", [MessageData(b"y")] * 10, producer_id=pid, base_seq=50))
        again = MessageDeduplication(path)
        again.recover(store)
        assert again.replayed_batches == 1  # only the batch after the snapshot's offset
        assert again.last_sequence(pid) == 59
        assert again.check(pid, 50, 10) is DupStatus.DUPLICATE
        assert again.check(pid, 60, 1) is DupStatus.NEW
    finally:
        store.close()


def test_snapshot_beyond_the_commitlog_end_is_not_trusted(tmp_path):
    """A snapshot covering more CommitLog than recovery kept (data lost with a torn tail) is
    ignored and the table rebuilt from the CommitLog: a resend of a lost batch is stored."""
    from tidemq.broker.dedup import _encoder, _Snapshot
    from tidemq.protocol.record import MessageData, encode_batch
    from tidemq.store.config import StoreConfig
    from tidemq.store.message_store import MessageStore

    pid = dedup_producer_id("lost")
    path = tmp_path / "dedup.json"
    path.write_bytes(_encoder.encode(_Snapshot(10 << 20, {str(pid): 99}, 0)))
    store = MessageStore(StoreConfig(data_dir=str(tmp_path / "store"), **_SMALL_STORE))
    try:
        store.put(encode_batch("t", [MessageData(b"x")] * 10, producer_id=pid, base_seq=0))
        d = MessageDeduplication(str(path))
        d.recover(store)
        assert d.last_sequence(pid) == 9  # from the CommitLog, not the snapshot's 99
        assert d.check(pid, 10, 10) is DupStatus.NEW
    finally:
        store.close()


def test_snapshot_is_written_without_named_producers_so_restart_replays_little(tmp_path):
    """The snapshot's offset is where a restart's replay begins: a broker whose producers are
    all unnamed must write it too (it used not to, and replayed the whole CommitLog)."""
    from tidemq.protocol.record import MessageData, encode_batch
    from tidemq.store.config import StoreConfig
    from tidemq.store.message_store import MessageStore

    store = MessageStore(StoreConfig(data_dir=str(tmp_path / "store"), **_SMALL_STORE))
    try:
        for i in range(100):
            store.put(encode_batch("t", [MessageData(b"x")], producer_id=7, base_seq=i))
        d = MessageDeduplication(str(tmp_path / "dedup.json"))
        d.recover(store)
        assert d.replayed_batches == 100
        d.save_now(store)
        again = MessageDeduplication(str(tmp_path / "dedup.json"))
        again.recover(store)
        assert again.replayed_batches == 0
    finally:
        store.close()


def test_inactive_producers_leave_the_table_and_the_snapshot(tmp_path):
    """Pulsar's producer inactivity timeout: a name silent for inactivity_s is dropped at the
    next snapshot (unless a batch of it is still unconfirmed); last-seen times survive a
    restart; a file without them counts its producers as seen when it was written."""
    import json

    from tidemq.broker.dedup import _encoder, _Snapshot
    from tidemq.protocol.record import MessageData, encode_batch
    from tidemq.store.config import StoreConfig
    from tidemq.store.message_store import MessageStore

    now = [1_000_000.0]
    old, busy, fresh = (dedup_producer_id(n) for n in ("spark-q-0", "spark-q-1", "orders"))
    store = MessageStore(StoreConfig(data_dir=str(tmp_path / "store"), **_SMALL_STORE))
    try:
        path = str(tmp_path / "dedup.json")
        d = MessageDeduplication(path, inactivity_s=3600, clock=lambda: now[0])
        d.recover(store)
        for pid in (old, busy):
            assert d.check(pid, 0, 10) is DupStatus.NEW
            store.put(encode_batch("t", [MessageData(b"x")] * 10, producer_id=pid))
        d.persisted_up_to(old, 9)  # busy's batch is never confirmed: it must stay
        now[0] += 3000
        assert d.check(fresh, 0, 1) is DupStatus.NEW
        d.persisted_up_to(fresh, 0)
        now[0] += 700  # old and busy silent for 3700 s, fresh for 700 s
        d.save_now(store)
        with open(path) as f:
            snap = json.load(f)
        assert set(snap["producers"]) == {str(busy), str(fresh)}
        assert snap["last_seen"][str(fresh)] == int((now[0] - 700) * 1000)
        assert d.expired == 1 and d.stats()["dedup_expired_producers"] == 1
        # Gone: a resend of its old sequence is new again (Pulsar behaves the same).
        assert d.check(old, 0, 10) is DupStatus.NEW

        # A restart keeps the last-seen times of the snapshot.
        d2 = MessageDeduplication(path, inactivity_s=3600, clock=lambda: now[0])
        d2.recover(store)
        assert d2.last_seen[fresh] == pytest.approx(now[0] - 700)
        # A file of an older version (no last_seen): its producers were seen at written_at.
        with open(path, "wb") as f:
            f.write(_encoder.encode(_Snapshot(store.max_phys_offset, {str(fresh): 0}, 5_000)))
        d3 = MessageDeduplication(path, inactivity_s=3600, clock=lambda: now[0])
        d3.recover(store)
        assert d3.last_seen[fresh] == 5.0
        d3.expire_inactive()
        assert fresh not in d3.persisted
    finally:
        store.close()
