"""SYNC_MASTER under load, then kill -9 of the master: every acknowledged (SEND_OK) message is
on the slave, and on it again after `tidemq cluster promote`; the old master rejoins as a slave
of the promoted one and cuts what it alone had. Real processes on loopback."""

from __future__ import annotations

import asyncio
import collections
import json
import subprocess
import sys
import time

import pytest

import tidemq
import tidemq.aio
from support.cluster import info, same_commitlog, start_cluster, wait_until
from tidemq.client.message import SendStatus

TOPIC = "fo"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("fo"), groups=2, role="SYNC_MASTER")
    try:
        with tidemq.Admin(c.namesrv) as admin:
            admin.create_topic(TOPIC, 4)
        yield c
    finally:
        c.down(10)


async def _load(namesrv: str, stop_at: float, kill_at: float, kill, senders: int = 16):
    """``senders`` coroutines sending one message or a small batch after another until
    ``stop_at``; ``kill()`` runs once at ``kill_at``. Returns every SendResult and error."""
    results: list[tidemq.SendResult] = []
    errors: list[BaseException] = []
    killed = False
    async with tidemq.aio.Producer(namesrv, send_timeout=3, auto_batch=False) as p:
        async def sender(k: int) -> None:
            nonlocal killed
            i = 0
            loop = asyncio.get_running_loop()
            while loop.time() < stop_at:
                if not killed and loop.time() >= kill_at:
                    killed = True
                    await asyncio.to_thread(kill)
                msgs = [tidemq.Message(TOPIC, b"s%d-%d-%d" % (k, i, j)) for j in range(1 + i % 3)]
                i += 1
                try:
                    results.append(await p.send_batch(msgs))
                except tidemq.TidemqError as exc:
                    errors.append(exc)

        await asyncio.gather(*(sender(k) for k in range(senders)))
    return results, errors


def _read_group(namesrv: str, group: str, broker: str, want: int, timeout: float = 20.0):
    """Every message of TOPIC on ``broker``'s queues, read as a fresh consumer group (from
    whatever broker of the group answers); msg id -> count."""
    seen: collections.Counter[str] = collections.Counter()
    with tidemq.PullConsumer(namesrv, group, consume_from="first") as cons:
        cons.assign([tidemq.MessageQueue(TOPIC, broker, q) for q in range(4)])
        deadline = time.monotonic() + timeout
        quiet = 0
        while time.monotonic() < deadline:
            msgs = cons.poll(0.5)
            seen.update(m.msg_id for m in msgs)
            quiet = quiet + 1 if not msgs else 0
            if sum(seen.values()) >= want and quiet >= 2:
                break
    return seen


def _tidemq(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "tidemq.cli.main", *args], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_sync_master_kill_then_promote_loses_no_acknowledged_message(cluster):
    c = cluster
    a0, a1 = c.broker("broker-a", 0), c.broker("broker-a", 1)
    for m in (a0, c.broker("broker-b", 0)):
        wait_until(lambda m=m: info(c, m).get("ha_in_sync_slaves") == 1, 10,
                   what="slave in sync")
    loop_t0 = time.monotonic()

    async def run():
        now = asyncio.get_running_loop().time()
        return await _load(c.namesrv, now + 3.0, now + 1.5, lambda: c.kill9(a0))

    results, errors = asyncio.run(run())
    acked = collections.defaultdict(set)
    statuses = collections.Counter((r.broker_name, r.status.value) for r in results)
    for r in results:
        if r.status is SendStatus.SEND_OK:
            acked[r.broker_name].update(f"{r.msg_id[:16]}{r.base_seq + i:016X}"
                                        for i in range(r.count))
    assert acked["broker-a"] and acked["broker-b"], statuses
    took = time.monotonic() - loop_t0
    # every send went on: the producers moved to broker-b after the kill
    assert len(errors) <= 16, errors[:3]

    # 1. every message broker-a acknowledged is on its slave (read while the master is dead)
    n_a = len(acked["broker-a"])
    seen = _read_group(c.namesrv, "check-slave", "broker-a", n_a)
    missing = acked["broker-a"] - set(seen)
    assert not missing, f"{len(missing)} acknowledged messages are not on the slave"

    # an ordered send pinned to a queue of the masterless group fails, clearly
    with tidemq.Producer(c.namesrv) as p, pytest.raises(tidemq.TidemqError, match="no master"):
        p.send(tidemq.Message(TOPIC, b"ordered"),
               queue_id=tidemq.MessageQueue(TOPIC, "broker-a", 0))
    # so does cancelling a timed message held there (was a bare KeyError)
    on_a = next(r for r in results if r.broker_name == "broker-a")
    with tidemq.Producer(c.namesrv) as p, pytest.raises(tidemq.TidemqError,
                                                        match="cannot cancel.*no master"):
        p.cancel(on_a)

    # 2. promote the slave: the same messages, now from the master of epoch 2
    out = json.loads(_tidemq("cluster", "promote", "--namesrv", c.namesrv,
                             "--broker-name", "broker-a", "--json"))
    assert out["epoch"] == 2 and out["role"] == "SYNC_MASTER" and out["was_id"] == 1
    wait_until(lambda: info(c, a1)["broker_id"] == 0, 5, what="promoted")
    seen2 = _read_group(c.namesrv, "check-promoted", "broker-a", n_a)
    assert not acked["broker-a"] - set(seen2)
    # duplicates: a send whose answer the kill swallowed was retried on broker-b
    both = set(seen2) & acked["broker-b"]
    dups = sum(n - 1 for n in seen2.values() if n > 1) + len(both)
    assert dups <= 16 * 3, dups
    print(f"\nSYNC_MASTER kill: {sum(statuses.values())} sends in {took:.1f} s {dict(statuses)}, "
          f"{n_a} acked on broker-a all on its slave, {dups} duplicates, "
          f"{out['unreplicated_bytes']} bytes only the old master had, {len(errors)} errors")

    # the promoted master takes writes (no slave yet: stored, answered SLAVE_NOT_AVAILABLE)
    with tidemq.Producer(c.namesrv) as p:
        r = p.send(tidemq.Message(TOPIC, b"epoch 2"), queue_id=tidemq.MessageQueue(
            TOPIC, "broker-a", 0))
        assert r.status is SendStatus.SLAVE_NOT_AVAILABLE
    # ... which a producer may refuse to accept: it sends again to another group (RocketMQ's
    # retryAnotherBrokerWhenNotStoreOK), so every result is SEND_OK, some on broker-b
    with tidemq.Producer(c.namesrv, retry_another_broker_when_not_store_ok=True,
                         latency_fault=False) as p:
        rs = [p.send(tidemq.Message(TOPIC, b"retried %d" % i)) for i in range(16)]
    assert {r.status for r in rs} == {SendStatus.SEND_OK}
    assert {r.broker_name for r in rs} == {"broker-b"}

    # 3. the old master comes back as a slave of the promoted one: it cuts what only it had
    #    and copies the rest; SYNC_MASTER sends are acknowledged again
    a0.args[a0.args.index("--role") + 1] = "SLAVE"
    a0.args[a0.args.index("--broker-id") + 1] = "2"
    a0.broker_id = 2
    c.restart(a0)
    wait_until(lambda: info(c, a1).get("ha_in_sync_slaves") == 1, 15, what="old master joined")
    with tidemq.Producer(c.namesrv) as p:
        r = p.send(tidemq.Message(TOPIC, b"replicated again"),
                   queue_id=tidemq.MessageQueue(TOPIC, "broker-a", 1))
        assert r.status is SendStatus.SEND_OK
    wait_until(lambda: info(c, a0)["commitlog_max_offset"] ==
               info(c, a1)["commitlog_max_offset"], 10, what="caught up")
    assert same_commitlog(a0, a1)
    assert info(c, a0)["epoch"] == 2
    m = info(c, a1)
    assert m["ha_wait_rounds"] <= m["ha_waited_sends"]
