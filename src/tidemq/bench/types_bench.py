"""`tidemq bench delay-index|txn|dedup`: the message-type targets of ref BR8/BR9/BR12, each
against a fresh `tidemq dev` (name server + broker in one process) that the bench starts in a
temporary directory and stops afterwards, so the numbers are the broker's alone.

- delay-index: COUNT single messages with a ``deliver_at`` spread over a day, starting an hour
  ahead (every one pending, one timer-index entry each). Reports the broker process's RSS
  before and after (whole process, and split into anonymous memory -- Python objects, the
  index's arrays -- and file-backed pages -- the CommitLog and timer mappings), the index's
  own estimate of its memory, and the time to restart the broker with all of them pending,
  after a clean stop and after a kill -9 (process start to "ready", Python start-up included).
- txn: COUNT transactions (``send_in_transaction`` committing at once), WINDOW in flight.
- dedup: the same auto-batched produce run with and without a producer name (BR12 on/off),
  ROUNDS times each, alternating; reports the best of each and the cost in percent.

Each returns a dict the CLI prints as one JSON object.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from typing import Any

from tidemq.bench.client_bench import bench_produce, ensure_topic, run_loop
from tidemq.bench.dev_process import DevProcess
from tidemq.client.connection import ConnectionPool
from tidemq.client.message import Message
from tidemq.client.producer import Producer
from tidemq.client.transaction_producer import LocalTransactionState, TransactionProducer
from tidemq.protocol.codes import RequestCode
from tidemq.protocol.headers import BrokerRuntimeInfo, EmptyHeader

__all__ = ["bench_delay_index", "bench_txn", "bench_dedup"]


async def runtime_info(broker: str) -> dict[str, Any]:
    pool = ConnectionPool()
    try:
        conn = await pool.get(broker)
        frame = await conn.request(RequestCode.GET_BROKER_RUNTIME_INFO, EmptyHeader(), timeout=10)
        assert isinstance(frame.header, BrokerRuntimeInfo)
        return dict(frame.header.table)
    finally:
        pool.close()


# -- delay index -------------------------------------------------------------------------------


async def _send_timed(namesrv: str, topic: str, count: int, window: int) -> float:
    """Send ``count`` single timed messages; returns the seconds it took."""
    await ensure_topic(namesrv, topic, 4)
    now = time.time_ns() // 1_000_000
    spread = 86_400_000 / max(count, 1)
    body = b"d" * 100
    async with Producer(namesrv, auto_batch=False, max_pending_messages=window + 1) as p:
        t0 = time.monotonic()
        inflight: set[asyncio.Future[Any]] = set()
        for i in range(count):
            at = now + 3_600_000 + int(i * spread)
            inflight.add(p.send_async(Message(topic, body, deliver_at=at)))
            if len(inflight) >= window:
                done, inflight = await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
                for f in done:
                    f.result()
        if inflight:
            for out in await asyncio.gather(*inflight, return_exceptions=True):
                if isinstance(out, BaseException):
                    raise out
        return time.monotonic() - t0


def bench_delay_index(*, count: int = 1_000_000, window: int = 2000,
                      data_dir: str | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tidemq-bench-delay-", dir=data_dir) as d:
        dev = DevProcess(d).start()
        try:
            time.sleep(2.0)  # let start-up settle (segment warming reads, imports)
            before = dev.memory()
            maps_before = dev.rss_by_mapping()
            info0 = run_loop(runtime_info(dev.broker))
            send_s = run_loop(_send_timed(dev.namesrv, "bench-delay", count, window))
            time.sleep(2.5)  # a timer checkpoint and a CommitLog flush (and its page trim)
            after = dev.memory()
            maps_after = dev.rss_by_mapping()
            info1 = run_loop(runtime_info(dev.broker))
            dev.stop()
            clean = DevProcess(d).start()
            info2 = run_loop(runtime_info(clean.broker))
            clean.kill9()
            crashed = DevProcess(d).start()
            info3 = run_loop(runtime_info(crashed.broker))
            crashed.stop()
        finally:
            dev.kill9()
    mib = 1 << 20
    return {
        "workload": "delay-index",
        "count": count,
        "send_seconds": round(send_s, 2),
        "sends_per_s": round(count / max(send_s, 1e-9)),
        "timer_added": info1.get("timer_added", 0) - info0.get("timer_added", 0),
        "timer_bucket_files": info1.get("timer_bucket_files"),
        "index_memory_mb": round(info1.get("timer_index_bytes", 0) / mib, 2),
        "rss_before_mb": round(before["VmRSS"] / mib, 1),
        "rss_after_mb": round(after["VmRSS"] / mib, 1),
        "rss_added_mb": round((after["VmRSS"] - before["VmRSS"]) / mib, 1),
        "rss_anon_added_mb": round((after["RssAnon"] - before["RssAnon"]) / mib, 1),
        "rss_file_added_mb": round((after["RssFile"] - before["RssFile"]) / mib, 1),
        "rss_added_by_mapping_mb": {
            k: round((maps_after.get(k, 0) - maps_before.get(k, 0)) / mib, 1)
            for k in sorted(set(maps_after) | set(maps_before))
        },
        "commitlog_mb": round(info1["commitlog_max_offset"] / mib, 1),
        "restart_seconds": round(clean.start_seconds, 2),
        "restart_after_kill9_seconds": round(crashed.start_seconds, 2),
        "bucket_files_after_restart": info2.get("timer_bucket_files"),
        "bucket_files_after_kill9": info3.get("timer_bucket_files"),
        "delivered_after_restarts": info3.get("timer_delivered", 0),
    }


# -- transactions ------------------------------------------------------------------------------


async def _txn(namesrv: str, topic: str, count: int, window: int) -> float:
    await ensure_topic(namesrv, topic, 4)

    def commit(msg: Message, arg: Any) -> LocalTransactionState:
        return LocalTransactionState.COMMIT_MESSAGE

    p = TransactionProducer(
        namesrv, "bench-txn", checker=lambda m: LocalTransactionState.COMMIT_MESSAGE
    )
    async with p:
        await p.send_in_transaction(Message(topic, b"warm"), commit)
        body = b"t" * 100
        t0 = time.monotonic()

        async def worker(n: int) -> None:  # ``window`` of these: that many in flight
            for _ in range(n):
                await p.send_in_transaction(Message(topic, body), commit)

        share, extra = divmod(count, window)
        await asyncio.gather(*(worker(share + (i < extra)) for i in range(window)))
        return time.monotonic() - t0


def bench_txn(*, count: int = 50_000, window: int = 64, flush: str = "async",
              data_dir: str | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tidemq-bench-txn-", dir=data_dir) as d:
        dev = DevProcess(d, f"flush_mode={flush}").start()
        try:
            secs = run_loop(_txn(dev.namesrv, "bench-txn", count, window))
            time.sleep(0.5)
            info = run_loop(runtime_info(dev.broker))
        finally:
            dev.stop()
    return {
        "workload": "txn",
        "count": count,
        "window": window,
        "flush": flush,
        "seconds": round(secs, 3),
        "txn_per_s": round(count / max(secs, 1e-9)),
        "committed": info.get("txn_committed"),
        "prepared": info.get("txn_prepared"),
    }


# -- dedup -------------------------------------------------------------------------------------


def bench_dedup(*, count: int = 1_000_000, size: int = 100, rounds: int = 3,
                auto_batch: bool = True, data_dir: str | None = None) -> dict[str, Any]:
    plain: list[int] = []
    named: list[int] = []
    with tempfile.TemporaryDirectory(prefix="tidemq-bench-dedup-", dir=data_dir) as d:
        dev = DevProcess(d).start()
        try:
            # one unmeasured run: the store's first segment is still being warmed after start
            bench_produce(namesrv=dev.namesrv, topic="bench-dedup", size=size,
                          count=count // 4, auto_batch=auto_batch, queues=4)
            for r in range(rounds):
                for name, out in ((None, plain), (f"bench-dedup-{r}", named)):
                    res = bench_produce(namesrv=dev.namesrv, topic="bench-dedup", size=size,
                                        count=count, auto_batch=auto_batch, queues=4,
                                        producer_name=name)
                    out.append(res["msgs_per_s"])
            info = run_loop(runtime_info(dev.broker))
        finally:
            dev.stop()
    best_plain, best_named = max(plain), max(named)
    return {
        "workload": "dedup",
        "count": count,
        "size": size,
        "auto_batch": auto_batch,
        "rounds": rounds,
        "without_name_msgs_per_s": plain,
        "with_name_msgs_per_s": named,
        "best_without": best_plain,
        "best_with": best_named,
        "cost_percent": round((best_plain - best_named) / best_plain * 100, 1),
        "dedup_producers": info.get("dedup_producers"),
    }
