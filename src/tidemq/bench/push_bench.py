"""`tidemq bench consume --group G --consumers N`: push consumers of one group drain a backlog.

1. COUNT messages of SIZE bytes are produced to TOPIC in batches of ``produce_batch`` (1000)
   unless ``produce=False``; the backlog is what the group has not consumed yet (everything, for
   a new group: it starts from the first offset). A pull answers whole stored batches, so the
   batch size the backlog was produced with shapes the result (docs/consumer-groups.md).
2. N consumer processes (spawned; one ``aio.PushConsumer`` each, clustering) join the group
   *paused*; once the group's rebalance has given every queue of TOPIC to exactly one member
   they resume together. Their listener does nothing and returns SUCCESS:
   ``listener_batch`` messages per call (``consume_message_batch_max_size``; 1 is RocketMQ's
   default) on the consumer's thread pool, or on its event loop with ``async_listener``.
3. The rate is the backlog over the time from the resume (the parent's ``go``; members see it
   within 1 ms and pull at once) to the last message consumed (members report every 5 ms
   through shared memory, so the window is accurate to about that: use a backlog that takes
   seconds). CPU time is counted from the resume too.
4. Rebalance settle time (``settle``): while the N members are still up, one more member joins
   (in this process) and later leaves cleanly; each time, the milliseconds from the join (the
   ``start()`` call) or the leave (``close()``) until the members' reported assignments again
   cover every queue exactly once with the new member owning its share (or none).

Returns a dict printed as one JSON object by the CLI: ``msgs_per_s``, ``mb_per_s``,
``client_cpu_us_per_msg`` (the members' CPU time per message) and ``join_settle_ms`` /
``leave_settle_ms``.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
import uuid
from typing import Any

from tidemq.bench.client_bench import Progress, bench_produce, ensure_topic, run_loop
from tidemq.client.admin import Admin
from tidemq.client.listener import ConsumeStatus
from tidemq.client.push_consumer import PushConsumer

__all__ = ["bench_push_consume"]

_SLOTS = 5  # per member: consumed, topic queues owned, first time, last time, cpu seconds
_REPORT = 0.005


def _noop(msgs: list[Any], ctx: Any) -> ConsumeStatus:
    return ConsumeStatus.SUCCESS


async def _anoop(msgs: list[Any], ctx: Any) -> ConsumeStatus:
    return ConsumeStatus.SUCCESS


def _options(listener_batch: int, pull_batch: int) -> dict[str, Any]:
    return dict(consume_from="first", consume_message_batch_max_size=listener_batch,
                pull_batch_size=pull_batch, persist_interval=1.0)


async def _member(namesrv: str, group: str, topic: str, i: int, opts: dict[str, Any],
                  async_listener: bool, arr: Any, go: Any, stop: Any) -> None:
    c = PushConsumer(namesrv, group, _anoop if async_listener else _noop, **opts)
    c.subscribe(topic)
    c.pause()  # pulls wait until every member is in and the queues are spread
    await c.start()
    base = i * _SLOTS
    cpu0 = time.process_time()
    consumed = 0

    def report() -> None:
        nonlocal consumed
        n = c.consume_service.consumed
        now = time.monotonic()
        if n != consumed:
            if consumed == 0:
                arr[base + 2] = now
            arr[base + 3] = now
            consumed = n
        arr[base] = n
        arr[base + 1] = sum(1 for mq in c.rebalance.table if mq.topic == topic)
        arr[base + 4] = time.process_time() - cpu0

    try:
        while not go.is_set():
            report()
            await asyncio.sleep(0.001)
        cpu0 = time.process_time()
        c.resume()
        while not stop.is_set():
            report()
            await asyncio.sleep(_REPORT)
        report()
    finally:
        await c.close()


def _member_process(args: tuple[Any, ...]) -> None:
    run_loop(_member(*args))


async def _expected(namesrv: str, topic: str, group: str) -> tuple[int, int]:
    """(messages the group has yet to consume, queues of the topic)."""
    async with Admin(namesrv) as admin:
        mqs = await admin.topic_queues(topic)
        total = 0
        for mq in mqs:
            lo, hi = await admin.min_offset(mq), await admin.max_offset(mq)
            off = await admin.consumer_offset(group, mq)
            total += hi - max(lo, off if off is not None else lo)
    return total, len(mqs)


def _owned(arr: Any, n: int) -> list[int]:
    return [int(arr[i * _SLOTS + 1]) for i in range(n)]


async def _settle(namesrv: str, group: str, topic: str, opts: dict[str, Any], arr: Any,
                  members: int, queues: int) -> tuple[float, float]:
    """Milliseconds until a join, then a clean leave, of one more member have settled."""
    extra = PushConsumer(namesrv, group, _noop, **opts)
    extra.subscribe(topic)

    def mine() -> int:
        return sum(1 for mq in extra.rebalance.table if mq.topic == topic)

    share = queues // (members + 1)  # the newcomer sorts anywhere: at least this share
    t0 = time.monotonic()
    await extra.start()
    while not (sum(_owned(arr, members)) + mine() == queues and mine() >= max(share, 0)
               and (share == 0 or mine() > 0)):
        if time.monotonic() - t0 > 30:
            raise RuntimeError("the group did not settle within 30 s of a join")
        await asyncio.sleep(0.002)
    join = time.monotonic() - t0
    await asyncio.sleep(4 * _REPORT)  # let the members report the settled state
    t0 = time.monotonic()
    await extra.close()
    while sum(_owned(arr, members)) != queues:
        if time.monotonic() - t0 > 30:
            raise RuntimeError("the group did not settle within 30 s of a leave")
        await asyncio.sleep(0.002)
    return join * 1000, (time.monotonic() - t0) * 1000


def bench_push_consume(
    *,
    namesrv: str,
    topic: str,
    group: str | None = None,
    consumers: int = 1,
    count: int = 1_000_000,
    size: int = 1024,
    listener_batch: int = 1,
    pull_batch: int = 32,
    queues: int = 8,
    produce: bool = True,
    produce_batch: int = 1000,
    async_listener: bool = False,
    settle: bool = True,
    progress: Progress | None = None,
) -> dict[str, Any]:
    if consumers < 1 or listener_batch < 1 or pull_batch < 1:
        raise ValueError("consumers, listener_batch and pull_batch must be >= 1")
    run_loop(ensure_topic(namesrv, topic, queues))
    if produce:
        bench_produce(namesrv=namesrv, topic=topic, size=size, count=count,
                      batch=produce_batch, queues=queues, inflight=8)
    group = group or f"bench-push-{uuid.uuid4().hex[:12]}"
    expected, nq = run_loop(_expected(namesrv, topic, group))
    if expected <= 0:
        raise ValueError(f"group {group} has nothing left to consume on {topic}")
    ctx = multiprocessing.get_context("spawn")
    arr = ctx.Array("d", _SLOTS * consumers, lock=False)
    go, stop = ctx.Event(), ctx.Event()
    opts = _options(listener_batch, pull_batch)
    procs = [ctx.Process(target=_member_process, daemon=True,
                         args=((namesrv, group, topic, i, opts, async_listener, arr, go, stop),))
             for i in range(consumers)]
    for p in procs:
        p.start()
    join_ms = leave_ms = None
    try:
        deadline = time.monotonic() + 60
        while sum(_owned(arr, consumers)) != nq or min(_owned(arr, consumers)) == 0 \
                and consumers <= nq:
            if time.monotonic() > deadline or not all(p.is_alive() for p in procs):
                raise RuntimeError("the consumers did not join the group and spread the queues")
            time.sleep(0.01)
        t_go = time.monotonic()
        go.set()
        done = 0
        last_progress = time.monotonic()
        while done < expected:
            time.sleep(0.05)
            now_done = int(sum(arr[i * _SLOTS] for i in range(consumers)))
            if progress is not None and now_done > done:
                progress(now_done - done)
            if now_done > done:
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > 30:
                break  # stalled: report what was consumed
            done = now_done
        if settle:
            join_ms, leave_ms = run_loop(_settle(namesrv, group, topic, opts, arr, consumers,
                                                 nq))
    finally:
        stop.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    lasts = [arr[i * _SLOTS + 3] for i in range(consumers)]
    cpu = sum(arr[i * _SLOTS + 4] for i in range(consumers))
    secs = max(max(lasts) - t_go, _REPORT)
    return {
        "workload": "push-consume",
        "group": group,
        "consumers": consumers,
        "listener_batch": listener_batch,
        "pull_batch": pull_batch,
        "listener": "async" if async_listener else "thread pool",
        "size": size,
        "produce_batch": produce_batch if produce else None,
        "count": done,
        "complete": done >= expected,
        "seconds": round(secs, 3),
        "msgs_per_s": round(done / secs),
        "mb_per_s": round(done * size / secs / 1e6, 1),
        "client_cpu_us_per_msg": round(cpu / max(done, 1) * 1e6, 3),
        "join_settle_ms": None if join_ms is None else round(join_ms, 1),
        "leave_settle_ms": None if leave_ms is None else round(leave_ms, 1),
    }
