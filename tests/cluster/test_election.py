"""Automatic master election on etcd (docs/cluster.md "Automatic election"): real brokers, name
servers and a 1-member etcd of the test's own on loopback, leases of 3 s.

- SYNC_MASTER under load, kill -9 of the master: the slave is elected (epoch 2), writes resume
  on the group, every acknowledged message is readable, a push consumer loses nothing; the old
  master, restarted with its old flags, rejoins as a slave.
- SIGSTOP of the SYNC_MASTER across an election: a send it took while paused is not
  acknowledged when it wakes; it restarts itself as a slave; nothing acknowledged is lost.
- ASYNC_MASTER made to diverge (its slave paused while it takes writes, then killed): the
  elected slave's epoch starts where its log ends; the old master rejoins and cuts its tail."""

from __future__ import annotations

import asyncio
import collections
import json
import threading
import time

import pytest

import tidemq
import tidemq.aio
from support.cluster import info, needs_etcd, same_commitlog, start_cluster, wait_until
from tidemq.client.message import SendStatus

pytestmark = needs_etcd

TOPIC = "el"


def _acked_ids(r: tidemq.SendResult) -> set[str]:
    return {f"{r.msg_id[:16]}{r.base_seq + i:016X}" for i in range(r.count)}


def _master(c, name: str = "broker-a"):
    for p in c.brokers(name):
        try:
            i = info(c, p)
        except tidemq.TidemqError:
            continue
        if i.get("broker_role") != "SLAVE" and not i.get("fenced"):
            return p, i
    return None, None


def _isr(c, p) -> list[str]:
    return json.loads(info(c, p).get("group_isr") or "[]")


def _wait_group_in_sync(c, master, n: int = 2, timeout: float = 20) -> None:
    wait_until(lambda: len(_isr(c, master)) == n and info(c, master).get("ha_in_sync_slaves"),
               timeout, what=f"{n} members in the in-sync set in etcd")


def _read_all(namesrv: str, group: str, want: set[str], timeout: float = 20.0):
    seen: collections.Counter[str] = collections.Counter()
    with tidemq.PullConsumer(namesrv, group, consume_from="first") as cons:
        cons.assign([tidemq.MessageQueue(TOPIC, "broker-a", q) for q in range(4)])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not want <= set(seen):
            seen.update(m.msg_id for m in cons.poll(0.5))
    return seen


async def _load(namesrv: str, seconds: float, at: float, action, senders: int = 8):
    """Senders of small batches for ``seconds``; ``action()`` runs once at ``at`` s. Returns
    [(time sent, time answered, SendResult)], errors, and the monotonic time the action
    ended."""
    results: list[tuple[float, float, tidemq.SendResult]] = []
    errors: list[BaseException] = []
    acted = [0.0, 0.0]
    async with tidemq.aio.Producer(namesrv, send_timeout=3, auto_batch=False) as p:
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def sender(k: int) -> None:
            i = 0
            while loop.time() - t0 < seconds:
                if not acted[0] and loop.time() - t0 >= at:
                    acted[0] = time.monotonic()
                    await asyncio.to_thread(action)
                    acted[1] = time.monotonic()
                msgs = [tidemq.Message(TOPIC, b"s%d-%d-%d" % (k, i, j)) for j in range(1 + i % 3)]
                i += 1
                try:
                    t = time.monotonic()
                    r = await p.send_batch(msgs)
                    results.append((t, time.monotonic(), r))
                except tidemq.TidemqError as exc:
                    errors.append(exc)
                    await asyncio.sleep(0.05)

        await asyncio.gather(*(sender(k) for k in range(senders)))
    return results, errors, acted[1]


@pytest.fixture(scope="module")
def sync_cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("el-sync"), role="SYNC_MASTER", election=True)
    try:
        with tidemq.Admin(c.namesrv) as admin:
            admin.create_topic(TOPIC, 4)
        _wait_group_in_sync(c, c.broker("broker-a", 0))
        yield c
    finally:
        c.down(10)


def test_master_killed_slave_elected_writes_resume_nothing_acknowledged_lost(sync_cluster):
    c = sync_cluster
    a0, a1 = c.broker("broker-a", 0), c.broker("broker-a", 1)
    assert info(c, a0)["epoch"] == 1 and info(c, a1)["broker_role"] == "SLAVE"

    # a push consumer reads through the whole failover
    seen: set[str] = set()
    lock = threading.Lock()

    def listener(msgs, ctx):  # noqa: ANN001
        with lock:
            seen.update(m.msg_id for m in msgs)
        return tidemq.ConsumeStatus.SUCCESS

    with tidemq.PushConsumer(c.namesrv, "g-el-push", listener, consume_from="first",
                             persist_interval=0.3) as consumer:
        consumer.subscribe(TOPIC)
        results, errors, killed = asyncio.run(_load(c.namesrv, 9.0, 1.5, lambda: c.kill9(a0)))
        acked = set().union(*(_acked_ids(r) for _s, _t, r in results
                              if r.status is SendStatus.SEND_OK))
        stored = set().union(*(_acked_ids(r) for _s, _t, r in results))
        assert acked
        # 1. the slave was elected: master of epoch 2, id 0, the old master's role
        i1 = info(c, a1)
        assert (i1["broker_role"], i1["broker_id"], i1["epoch"]) == ("SYNC_MASTER", 0, 2), i1
        assert i1["elections_won"] == 1
        # 2. writes resumed on the group within 10 s of the kill (stored, answered; no slave
        #    is in sync yet, so SLAVE_NOT_AVAILABLE)
        after = sorted(t for sent, t, _r in results if sent > killed)
        assert after and after[0] - killed < 10, (after[:1], killed)
        gap = after[0] - killed
        # 3. every acknowledged message is readable (from the new master), and the push
        #    consumer got every message stored
        got = _read_all(c.namesrv, "check-el", acked)
        assert not acked - set(got), f"{len(acked - set(got))} acknowledged messages lost"
        wait_until(lambda: stored - seen == set() or None, 30,
                   what="the push consumer consumed every stored message")
    statuses = collections.Counter(r.status.value for _s, _t, r in results)
    dups = sum(n - 1 for n in got.values() if n > 1)
    print(f"\nelection: writable again {gap:.2f} s after the kill; {dict(statuses)}; "
          f"{len(errors)} errors; {dups} duplicates")

    # 4. the old master, restarted with its old flags (--role SYNC_MASTER --broker-id 0),
    #    reads etcd and joins as a slave of the new master; SEND_OK again once it is in sync
    c.restart(a0)
    i0 = info(c, a0)
    assert i0["broker_role"] == "SLAVE" and i0["broker_id"] >= 1, i0
    _wait_group_in_sync(c, a1)
    with tidemq.Producer(c.namesrv) as p:
        assert p.send(tidemq.Message(TOPIC, b"in sync again")).status is SendStatus.SEND_OK
    wait_until(lambda: info(c, a0)["commitlog_max_offset"] ==
               info(c, a1)["commitlog_max_offset"], 10, what="old master caught up")
    assert same_commitlog(a0, a1)
    assert info(c, a0)["epoch"] == 2


def test_paused_master_acknowledges_nothing_after_an_election(sync_cluster):
    c = sync_cluster
    old, _ = _master(c)
    assert old is not None
    new = next(p for p in c.brokers("broker-a") if p is not old)
    _wait_group_in_sync(c, old)
    epoch = info(c, old)["epoch"]
    late: dict[str, object] = {}

    def pause_then_send() -> None:
        c.pause(old)
        # a send the paused master takes into its socket buffer: answered only when it wakes
        # (after the election); the client waits long enough to see that answer
        with tidemq.Producer(c.namesrv, send_timeout=30) as p:
            try:
                late["result"] = p.send(tidemq.Message(TOPIC, b"to the paused master"),
                                        queue_id=tidemq.MessageQueue(TOPIC, "broker-a", 0))
            except tidemq.TidemqError as exc:
                late["error"] = exc

    def pause() -> None:
        th = threading.Thread(target=pause_then_send)
        th.start()
        late["thread"] = th
        # the other broker is elected while this one sleeps; then it wakes
        wait_until(lambda: info(c, new).get("broker_role") == "SYNC_MASTER", 20,
                   what="the slave elected while the master is paused")
        time.sleep(0.5)
        c.resume(old)

    results, _errors, paused = asyncio.run(_load(c.namesrv, 10.0, 1.0, pause))
    th = late["thread"]
    assert isinstance(th, threading.Thread)
    th.join(40)
    # the woken master answered nothing as written: its lease had lapsed
    assert "result" not in late or late["result"].status is not SendStatus.SEND_OK, late
    assert "error" in late and "lease" in str(late["error"]), late
    acked = set().union(*(_acked_ids(r) for _s, _t, r in results
                          if r.status is SendStatus.SEND_OK))
    got = _read_all(c.namesrv, "check-pause", acked)
    assert not acked - set(got), f"{len(acked - set(got))} acknowledged messages lost"
    assert info(c, new)["epoch"] == epoch + 1
    # the old master restarted itself in place as a slave (same pid) and follows again
    wait_until(lambda: info(c, old).get("broker_role") == "SLAVE", 20,
               what="the woken master restarted as a slave")
    assert info(c, old)["pid"] == old.pid
    _wait_group_in_sync(c, new)
    wait_until(lambda: info(c, old)["commitlog_max_offset"] ==
               info(c, new)["commitlog_max_offset"], 10, what="caught up")
    assert same_commitlog(old, new)


def test_divergent_old_master_rejoins_and_cuts_its_tail(tmp_path):
    c = start_cluster(tmp_path, role="ASYNC_MASTER", election=True)
    try:
        m, s = c.broker("broker-a", 0), c.broker("broker-a", 1)
        with tidemq.Admin(c.namesrv) as admin:
            admin.create_topic(TOPIC, 4)
        _wait_group_in_sync(c, m)
        body = b"x" * 1000
        with tidemq.Producer(c.namesrv) as p:
            for _i in range(50):
                p.send_batch([tidemq.Message(TOPIC, body) for _ in range(20)])
            wait_until(lambda: info(c, s)["commitlog_max_offset"] ==
                       info(c, m)["commitlog_max_offset"], 10, what="slave caught up")
            # the slave sleeps while the master takes 16 MiB (acknowledged at once: ASYNC);
            # then the master dies, and the slave wakes holding at most what its socket had
            c.pause(s)
            for _i in range(800):
                p.send_batch([tidemq.Message(TOPIC, body) for _ in range(20)])
        m_end = info(c, m)["commitlog_max_offset"]
        c.kill9(m)
        c.resume(s)
        wait_until(lambda: info(c, s).get("broker_role") == "ASYNC_MASTER", 20,
                   what="slave elected")
        si = info(c, s)
        assert si["epoch"] == 2 and si["epoch_start_offset"] < m_end, (si, m_end)
        with tidemq.Producer(c.namesrv) as p:

            def sent(i: int) -> bool:
                try:  # until the name servers name the new master
                    return p.send(tidemq.Message(TOPIC, b"epoch 2 %d" % i)) is not None
                except tidemq.TidemqError:
                    return False

            for i in range(10):
                wait_until(lambda i=i: sent(i), 10, step=0.1, what="a send to the new master")
        # the old master comes back with its old flags: a slave of epoch 2 that cuts the tail
        # only it had (its epoch-1 bytes past the point the new master's log diverged)
        c.restart(m)
        wait_until(lambda: info(c, m).get("ha_connected"), 20, what="old master follows")
        mi = info(c, m)
        assert mi["broker_role"] == "SLAVE"
        assert mi["ha_truncated_bytes"] == m_end - si["epoch_start_offset"], (mi, m_end, si)
        wait_until(lambda: info(c, m)["commitlog_max_offset"] ==
                   info(c, s)["commitlog_max_offset"], 10, what="caught up")
        assert same_commitlog(m, s)
        assert info(c, m)["epoch"] == 2
    finally:
        c.down(10)
