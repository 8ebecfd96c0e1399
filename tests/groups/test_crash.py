"""kill -9 of a consumer under load: its queues move to the others once the broker expires it
(heartbeat expiry, test-sized to 3 s), every message is consumed at least once, and the
duplicates are only messages the dead consumer had consumed but not yet committed."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import tidemq
from tidemq.client.connection import ConnectionPool
from tidemq.protocol.codes import RequestCode
from tidemq.protocol.headers import ConsumerGroupRequestHeader

from .cluster import EXPIRY_MS, wait_until

TOPIC = "crash"
GROUP = "crash-g"
PERSIST_INTERVAL = 1.0  # the consumers' offset persist interval (consumer_proc.py)


def _read(path: str) -> list[tuple[str, float]]:
    out = []
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 2:
                out.append((parts[0], float(parts[1])))
    return out


def _members(dev) -> list[str]:
    async def go() -> list[str]:
        pool = ConnectionPool()
        try:
            f = await pool.request(dev.broker, RequestCode.GET_CONSUMER_LIST_BY_GROUP,
                                   ConsumerGroupRequestHeader(consumer_group=GROUP))
            return list(f.header.consumer_ids)
        finally:
            pool.close()

    return asyncio.run(go())


def _spawn(dev, path: str) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, os.path.join(os.path.dirname(__file__), "consumer_proc.py"),
         dev.namesrv, GROUP, TOPIC, path],
        stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "ready"
    return p


def test_kill_9_moves_queues_after_expiry_and_loses_nothing(dev) -> None:
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(TOPIC, 8)
    tmp = tempfile.mkdtemp(prefix="tidemq-crash-")
    paths = [os.path.join(tmp, f"c{i}.txt") for i in range(3)]
    procs = [_spawn(dev, p) for p in paths]
    sent: list[str] = []
    stop = threading.Event()

    def produce() -> None:
        with tidemq.Producer(dev.namesrv) as p:
            i = 0
            while not stop.is_set():
                batch = [tidemq.Message(TOPIC, f"m{i + k:07d}".encode()) for k in range(20)]
                for m in batch:
                    p.send(m)
                sent.extend(m.body.decode() for m in batch)
                i += 20
                time.sleep(0.01)

    producer = threading.Thread(target=produce)
    producer.start()
    victim = procs[0]
    try:
        time.sleep(2.0)
        # SIGSTOP first: the process hangs with its connections open, so only the broker's
        # heartbeat expiry can take its queues away; then kill -9.
        assert len(_members(dev)) == 3
        victim.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        expired = wait_until(lambda: len(_members(dev)) == 2, 20, 0.1)
        victim.kill()  # kill -9 (SIGKILL ends a stopped process too)
        victim.wait()
        time.sleep(2.0)
    finally:
        stop.set()
        producer.join()
    try:
        def consumed() -> set[str]:
            return {b for p in paths for b, _ in _read(p)}

        wait_until(lambda: consumed() >= set(sent), 60, 0.2)
    finally:
        for p in procs[1:]:
            p.send_signal(signal.SIGTERM)
        for p in procs[1:]:
            p.wait(20)
    records = [r for p in paths for r in _read(p)]
    counts: dict[str, int] = {}
    for b, _ in records:
        counts[b] = counts.get(b, 0) + 1
    dups = {b for b, n in counts.items() if n > 1}
    victim_first = {b: t for b, t in reversed(_read(paths[0]))}
    survivors_first: dict[str, float] = {}
    for p in paths[1:]:
        for b, t in _read(p):
            survivors_first[b] = min(t, survivors_first.get(b, t))
    # In flight when the victim hung: what it consumed after its last offset persist (every
    # PERSIST_INTERVAL s, the last one up to that long before the hang) -- plus what a survivor
    # had consumed but not committed when the rebalance moved a queue between survivors.
    moved_at = stopped_at + expired
    uncommitted_victim = {b for b, t in victim_first.items()
                          if t >= stopped_at - PERSIST_INTERVAL - 0.5}
    uncommitted_moves = {b for b, t in survivors_first.items() if abs(t - moved_at) <= 1.0}
    in_flight = uncommitted_victim | uncommitted_moves
    print(f"sent {len(sent)}, consumed {len(records)}, duplicates {len(dups)} "
          f"(bound: {len(uncommitted_victim)} consumed by the victim since its last offset "
          f"persist + {len(uncommitted_moves)} consumed by survivors around the move); "
          f"queues moved {expired:.2f} s after SIGSTOP (expiry {EXPIRY_MS / 1000:g} s)")
    assert set(counts) == set(sent)
    # By expiry (the last heartbeat was up to 1 s before the hang), not by a closed connection.
    assert expired >= EXPIRY_MS / 1000 - 1.2
    assert dups <= in_flight, sorted(dups - in_flight)[:10]
