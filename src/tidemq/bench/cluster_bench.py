"""`tidemq bench replication|replication-lag|failover`: replicated broker groups measured
against a lone broker, each in fresh processes on loopback (bench/local_cluster.py).

- replication: the same produce run (``bench produce``: COUNT messages of SIZE bytes, BATCH per
  batch, INFLIGHT in flight) against a lone broker and against a master + slave group; the
  ratio is the price of replication. ``--mode batched``: both ASYNC_FLUSH, the master
  SYNC_MASTER (each batch acknowledged once the slave has it). ``--mode single``: one message
  per send from 64 concurrent senders; the lone broker in SYNC_FLUSH (acknowledged after
  fsync), the master SYNC_MASTER with ASYNC_FLUSH (acknowledged once the slave has it).
- replication-lag: an ASYNC_MASTER + slave, a producer at RATE messages/s for SECONDS
  (automatic batching); the master's replication lag -- from a message's store time to the
  slave's acknowledgement covering it, one sample per acknowledgement -- p50/p99/max, and the
  lag in bytes and ms polled every 20 ms.
- failover: two groups, one producer sending single messages in a loop; the master of
  broker-a is killed -9; the measured gap is the longest time without a successful send
  around the kill, and the time until the first send acknowledged by broker-b after it. With
  ``election`` (an etcd, masters elected there) a second producer sends to a queue of broker-a
  only: the time from the kill until broker-a takes a write again (its slave elected, the
  route followed through the name servers) is the group's failover gap (target 10 s).

Every result is one JSON object; the processes' CPU is shared with the client here (2 cores).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from tidemq.bench.client_bench import bench_produce, run_loop
from tidemq.bench.local_cluster import LocalCluster

__all__ = ["bench_replication", "bench_replication_lag", "bench_failover"]

Progress = Callable[[int], None]

#: Settings of every broker the benchmarks start (segments of the default 1 GiB would need
#: the disk space of a real deployment).
BENCH_OPTIONS = ("store.segment_size=268435456",)


def _cluster(root: str, *, slaves: int, role: str, flush: str, groups: int = 1,
             options: tuple[str, ...] = (), election: bool = False) -> LocalCluster:
    c = LocalCluster(root, log_level="warning", broker_options=BENCH_OPTIONS + options,
                     etcd_in_memory=True)
    c.up(namesrvs=1, groups=groups, slaves=slaves, role=role, flush=flush, election=election)
    if slaves:
        from tidemq.client.blocking import Admin

        with Admin(c.namesrv) as admin:
            deadline = time.monotonic() + 20
            for p in c.brokers():
                if p.broker_id:
                    continue
                while admin.runtime_info(p.addr).get("ha_in_sync_slaves", 0) < slaves:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the slaves of {p.broker_name} never got in sync")
                    time.sleep(0.1)
    return c


def _info(c: LocalCluster) -> dict[str, Any]:
    from tidemq.client.blocking import Admin

    with Admin(c.namesrv) as admin:
        info: dict[str, Any] = admin.runtime_info(c.broker("broker-a", 0).addr)
        return info


def bench_replication(*, mode: str = "batched", size: int = 1024, count: int = 0,
                      rounds: int = 3, batch: int = 0, inflight: int = 0,
                      data_dir: str | None = None, options: tuple[str, ...] = (),
                      progress: Progress | None = None) -> dict[str, Any]:
    """Both clusters run side by side (the idle one costs nothing); the produce runs
    alternate lone / replicated ``rounds`` times, so the machine's noise hits both alike;
    the ratio is of the medians."""
    if mode == "batched":
        count = count or 300_000
        batch, inflight = batch or 100, inflight or 8
        lone = ("ASYNC_MASTER", "async")
        repl = ("SYNC_MASTER", "async")
        target = 0.7
    elif mode == "single":
        count = count or 40_000
        batch, inflight = 1, inflight or 64
        lone = ("ASYNC_MASTER", "sync")
        repl = ("SYNC_MASTER", "async")
        target = 0.5
    else:
        raise ValueError("mode is batched or single")
    runs: dict[str, list[dict[str, Any]]] = {"lone": [], "replicated": []}
    with tempfile.TemporaryDirectory(prefix="tidemq-bench-ha-", dir=data_dir) as d:
        ca = _cluster(os.path.join(d, "lone"), slaves=0, role=lone[0], flush=lone[1],
                      options=options)
        try:
            cb = _cluster(os.path.join(d, "repl"), slaves=1, role=repl[0], flush=repl[1],
                          options=options)
            try:
                for i in range(rounds):
                    for key, c in (("lone", ca), ("replicated", cb)):
                        r = bench_produce(namesrv=c.namesrv, topic=f"bench-repl-{i}",
                                          size=size, count=count, batch=batch,
                                          inflight=inflight, queues=8, progress=progress)
                        runs[key].append(r)
                info = _info(cb)
            finally:
                cb.down(20)
        finally:
            ca.down(20)

    def med(key: str) -> float:
        rates: list[float] = sorted(r["msgs_per_s"] for r in runs[key])
        return rates[len(rates) // 2]

    ratio = med("replicated") / max(med("lone"), 1)
    return {
        "workload": f"replication-{mode}",
        "size": size, "count": count, "batch": batch, "inflight": inflight, "rounds": rounds,
        "lone": {"role": lone[0], "flush": lone[1], "slaves": 0,
                 "msgs_per_s": [r["msgs_per_s"] for r in runs["lone"]],
                 "median_msgs_per_s": med("lone")},
        "replicated": {"role": repl[0], "flush": repl[1], "slaves": 1,
                       "msgs_per_s": [r["msgs_per_s"] for r in runs["replicated"]],
                       "median_msgs_per_s": med("replicated"),
                       "slave_not_available": info.get("ha_slave_not_available", 0),
                       "replica_wait_rounds": info.get("ha_wait_rounds", 0),
                       "replica_waited_sends": info.get("ha_waited_sends", 0),
                       "ack_lag_ms_p50": info.get("ha_ack_lag_ms_p50"),
                       "ack_lag_ms_p99": info.get("ha_ack_lag_ms_p99")},
        "ratio": round(ratio, 3), "target": target, "meets_target": ratio >= target,
    }


def _pct(vals: Sequence[float], p: float) -> float:
    if not vals:
        return 0.0
    s = sorted(vals)
    return s[min(len(s) - 1, int(len(s) * p))]


async def _paced(namesrv: str, topic: str, rate: int, seconds: float, size: int,
                 progress: Progress | None) -> tuple[int, int]:
    from tidemq.client.message import Message
    from tidemq.client.producer import Producer

    body = os.urandom(size)
    sent = failed = 0
    async with Producer(namesrv, batch_max_messages=1000, batch_max_delay=0.002,
                        max_pending_messages=max(100_000, rate)) as p:
        await p.send(Message(topic, body))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        tick = 0.005
        futs = []
        n_tick = 0
        while True:
            now = loop.time()
            if now - t0 >= seconds:
                break
            due = int((now - t0) * rate)
            k = due - sent
            for _ in range(k):
                futs.append(p.send_async(Message(topic, body)))
            sent += k
            n_tick += 1
            if progress is not None and k:
                progress(k)
            await asyncio.sleep(tick)
        for f in futs:
            try:
                await f
            except Exception:
                failed += 1
    return sent, failed


def bench_replication_lag(*, rate: int = 100_000, seconds: float = 10.0, size: int = 100,
                          data_dir: str | None = None, options: tuple[str, ...] = (),
                          progress: Progress | None = None) -> dict[str, Any]:
    from tidemq.client.blocking import Admin

    with tempfile.TemporaryDirectory(prefix="tidemq-bench-lag-", dir=data_dir) as d:
        c = _cluster(d, slaves=1, role="ASYNC_MASTER", flush="async", options=options)
        try:
            master = c.broker("broker-a", 0)
            polled_bytes: list[int] = []
            polled_ms: list[int] = []
            stop = threading.Event()

            def poll() -> None:
                with Admin(c.namesrv) as admin:
                    while not stop.wait(0.02):
                        try:
                            i = admin.runtime_info(master.addr)
                        except Exception:
                            continue
                        polled_bytes.append(int(i.get("ha_max_lag_bytes", 0)))
                        polled_ms.append(int(i.get("ha_max_lag_ms", 0)))

            th = threading.Thread(target=poll, daemon=True)
            run_loop(_warm(c.namesrv))
            th.start()
            t0 = time.monotonic()
            sent, failed = run_loop(_paced(c.namesrv, "bench-lag", rate, seconds, size,
                                           progress))
            took = time.monotonic() - t0
            stop.set()
            th.join()
            with Admin(c.namesrv) as admin:
                info = admin.runtime_info(master.addr)
        finally:
            c.down(20)
    return {
        "workload": "replication-lag",
        "rate": rate, "seconds": seconds, "size": size,
        "sent": sent, "failed": failed, "achieved_msgs_per_s": round(sent / max(took, 1e-9)),
        "ack_lag_ms_p50": info.get("ha_ack_lag_ms_p50"),
        "ack_lag_ms_p99": info.get("ha_ack_lag_ms_p99"),
        "ack_lag_ms_max": info.get("ha_ack_lag_ms_max"),
        "polled_lag_ms_p50": _pct(polled_ms, 0.5), "polled_lag_ms_p99": _pct(polled_ms, 0.99),
        "polled_lag_bytes_p99": _pct(polled_bytes, 0.99),
        "polled_lag_bytes_max": max(polled_bytes, default=0),
        "target_p99_ms": 50, "meets_target": (info.get("ha_ack_lag_ms_p99") or 0) <= 50,
    }


async def _warm(namesrv: str) -> None:
    from tidemq.bench.client_bench import ensure_topic

    await ensure_topic(namesrv, "bench-lag", 8)


def bench_failover(*, seconds: float = 6.0, data_dir: str | None = None,
                   slaves: int = 1, election: bool = False,
                   options: tuple[str, ...] = ()) -> dict[str, Any]:
    from tidemq.bench.client_bench import ensure_topic

    with tempfile.TemporaryDirectory(prefix="tidemq-bench-fo-", dir=data_dir) as d:
        c = _cluster(d, slaves=slaves, role="ASYNC_MASTER", flush="async", groups=2,
                     options=options, election=election)
        try:
            run_loop(ensure_topic(c.namesrv, "bench-failover", 4))
            if election:
                from tidemq.client.blocking import Admin

                with Admin(c.namesrv) as admin:  # the slaves are in the in-sync sets
                    deadline = time.monotonic() + 20
                    while any(admin.runtime_info(c.broker(g, 0).addr).get("group_isr", "[]")
                              .count(",") < 1 for g in ("broker-a", "broker-b")):
                        if time.monotonic() > deadline:
                            raise RuntimeError("the slaves never joined the in-sync sets")
                        time.sleep(0.1)
            victim = c.broker("broker-a", 0)
            r: dict[str, Any] = run_loop(_failover(c, victim, seconds, election))
            if election:
                from tidemq.client.blocking import Admin

                with Admin(c.namesrv) as admin:
                    i = admin.runtime_info(c.broker("broker-a", 1).addr)
                r["elected"] = {k: i.get(k) for k in ("broker_role", "broker_id", "epoch",
                                                      "group_isr")}
        finally:
            c.down(20)
    r["workload"] = "failover-election" if election else "failover"
    return r


async def _pinned_until_writable(c: LocalCluster, killed: asyncio.Event,
                                 stop_at: float) -> dict[str, Any]:
    """Sends to queue 0 of broker-a only; from the kill: when it takes a write again."""
    from tidemq.client.errors import TidemqError
    from tidemq.client.message import Message, MessageQueue
    from tidemq.client.producer import Producer

    loop = asyncio.get_running_loop()
    mq = MessageQueue("bench-failover", "broker-a", 0)
    out: dict[str, Any] = {"group_writable_again_ms": None, "pinned_errors": 0}
    async with Producer(c.namesrv, send_timeout=2, auto_batch=False) as p:
        await p.send(Message("bench-failover", b"p"), queue_id=mq)
        await killed.wait()
        t_kill = loop.time()
        while loop.time() < stop_at:
            try:
                await p.send(Message("bench-failover", b"p" * 100), queue_id=mq)
            except TidemqError as exc:
                out["pinned_errors"] += 1
                out["pinned_last_error"] = str(exc)[:300]
                await asyncio.sleep(0.02)
                continue
            out["group_writable_again_ms"] = round((loop.time() - t_kill) * 1000, 1)
            break
    return out


async def _failover(c: LocalCluster, victim: Any, seconds: float,
                    election: bool = False) -> dict[str, Any]:
    from tidemq.client.errors import TidemqError
    from tidemq.client.message import Message
    from tidemq.client.producer import Producer

    ok: list[tuple[float, str]] = []
    errors = 0
    kill_at = seconds / 3
    killed_t = 0.0
    killed = asyncio.Event()
    loop = asyncio.get_running_loop()
    pinned = (loop.create_task(_pinned_until_writable(c, killed, loop.time() + seconds))
              if election else None)
    async with Producer(c.namesrv, send_timeout=3, auto_batch=False) as p:
        t0 = loop.time()
        while loop.time() - t0 < seconds:
            if not killed_t and loop.time() - t0 >= kill_at:
                await asyncio.to_thread(c.kill9, victim)
                killed_t = loop.time()
                killed.set()
            try:
                r = await p.send(Message("bench-failover", b"x" * 100))
                ok.append((loop.time(), r.broker_name))
            except TidemqError:
                errors += 1
    times = [t for t, _ in ok]
    around = [t for t in times if killed_t - 1 <= t <= killed_t + seconds]
    gaps = [b - a for a, b in zip(around, around[1:], strict=False)]
    first_b = next((t for t, n in ok if t > killed_t and n == "broker-b"), None)
    extra: dict[str, Any] = {}
    if pinned is not None:
        extra = await pinned
        again = extra["group_writable_again_ms"]
        extra["group_target_ms"] = 10_000
        extra["group_meets_target"] = again is not None and again <= 10_000
    return {
        **extra,
        "sends_ok": len(ok), "errors": errors,
        "max_gap_ms": round(max(gaps, default=0.0) * 1000, 1),
        "first_send_to_other_group_ms": (
            round((first_b - killed_t) * 1000, 1) if first_b is not None else None
        ),
        "target_ms": 1000,
        "meets_target": max(gaps, default=0.0) <= 1.0,
    }
