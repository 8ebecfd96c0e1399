"""`tidemq bench pop`: SimpleConsumers (server-side dispatch, POP) of one group drain a backlog,
acking every message.

1. COUNT messages of SIZE bytes are produced to TOPIC in batches of ``produce_batch`` (1000),
   unless ``produce=False``.
2. N consumer processes (spawned; one ``aio.SimpleConsumer`` each, ``init_mode="earliest"``)
   start together on the parent's ``go``; each loops ``receive(pop_batch)`` and acks every
   message it got, one ``ack`` per message (the client groups the acks of a receive into one
   ACK_MESSAGE frame, as it groups any concurrent acks) -- per-message acks, not cumulative.
3. The rate is the messages received and acked over the time from ``go`` to the last ack
   answered (members report every 5 ms through shared memory). A message is counted when
   its ack succeeded; ``redelivered`` counts deliveries with attempt > 1, ``stale`` acks refused
   as stale (neither should happen with the default 60 s invisible time).

Returns one dict (JSON from the CLI): ``msgs_per_s``, ``mb_per_s``, ``client_cpu_us_per_msg``
(the member processes' CPU over the messages) and ``broker_cpu_us_per_msg`` (the CPU --
utime + stime, every thread -- of the brokers of the topic over the drain, from their runtime
info ``process_cpu_s``, over the messages; the broker is another process, so this includes
whatever else it did meanwhile).

With ``subscription_types`` (``--subscription-type Shared --subscription-type Key_Shared``) the
backlog is produced once, with keys (``order-<i>``, 1000 distinct per produced batch), tags and
properties, and drained once per type by a fresh group of N Pulsar-style ``aio.Consumer``
processes (``initial_position="earliest"``, default receiver queue of 1000). Each joins the
subscription paused (``start_paused``) and resumes on ``go``, once every member has joined:
the drain is timed with the whole membership, as the SimpleConsumer run is -- a member whose
process started late would otherwise join mid-drain, which a key-shared subscription pays for
(its keys were routed to the others meanwhile, and the recently-joined rule holds it back
until what was read before it joined is acked) and a shared one does not. Each loops
``batch_receive(pop_batch)`` and acks every message with its own ``acknowledge`` (grouped into
frames by the client). "SimpleConsumer" drains it with SimpleConsumers as above. The result
holds one entry per run and ``key_shared_vs_shared``, the ratio of their rates (same backlog,
same run).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
import uuid
from typing import Any

from tidemq.bench.client_bench import Progress, bench_produce, ensure_topic, run_loop
from tidemq.client.admin import Admin
from tidemq.client.simple_consumer import SimpleConsumer
from tidemq.client.subscription_consumer import Consumer

__all__ = ["bench_pop"]

_SLOTS = 7  # per member: acked, redelivered, stale, last time, cpu seconds, first time, ready
_REPORT = 0.005


async def _receive_loop(receive: Any, ack: Any, stale: Any, arr: Any, base: int, stop: Any) -> None:
    """Receive and ack until ``stop``, publishing this member's counters in ``arr[base:]``:
    ``receive()`` gives a list of messages, ``ack(m)`` a future (one per message; the client
    sends one loop turn's acks as one frame), ``stale()`` the client's stale-ack count."""
    cpu0 = time.process_time()
    acked = redelivered = 0
    last_report = 0.0
    while not stop.is_set():
        msgs = await receive()
        if not msgs:
            continue
        if not acked:
            arr[base + 5] = time.monotonic()
        redelivered += sum(1 for m in msgs if m.delivery_attempt > 1)
        results = await asyncio.gather(*[ack(m) for m in msgs], return_exceptions=True)
        acked += sum(1 for r in results if r is None)
        now = time.monotonic()
        arr[base], arr[base + 1], arr[base + 2] = acked, redelivered, stale()
        arr[base + 3] = now
        if now - last_report > _REPORT:
            arr[base + 4] = time.process_time() - cpu0
            last_report = now
    arr[base + 4] = time.process_time() - cpu0


async def _member(namesrv: str, group: str, topic: str, pop_batch: int, invisible: float,
                  arr: Any, i: int, go: Any, stop: Any) -> None:
    async with SimpleConsumer(namesrv, group, await_duration=0.5, init_mode="earliest") as c:
        c.subscribe(topic)
        await c.routes.get(topic)
        arr[i * _SLOTS + 6] = 1  # ready: the parent sets ``go`` once every member is
        while not go.is_set():
            await asyncio.sleep(0.001)
        await _receive_loop(lambda: c.receive(pop_batch, invisible), c.ack_nowait,
                     lambda: c.stale, arr, i * _SLOTS, stop)


async def _typed_member(namesrv: str, group: str, topic: str, pop_batch: int,
                        invisible: float, arr: Any, i: int, go: Any, stop: Any,
                        sub_type: str) -> None:
    # every member joins the subscription (paused: no pop yet) before ``go``, so the drain
    # starts with the whole membership, whatever each process's start-up took
    async with Consumer(namesrv, topic, group, subscription_type=sub_type,
                        consumer_name=f"bench-{i}", initial_position="earliest",
                        ack_timeout=invisible, await_duration=0.5, start_paused=True) as c:
        arr[i * _SLOTS + 6] = 1
        while not go.is_set():
            await asyncio.sleep(0.001)
        c.resume()
        await _receive_loop(lambda: c.batch_receive(pop_batch, timeout=0.2), c.acknowledge_nowait,
                     lambda: c.stats()["stale_acks"], arr, i * _SLOTS, stop)


def _member_process(args: tuple[Any, ...]) -> None:
    if len(args) > 9:
        run_loop(_typed_member(*args))
    else:
        run_loop(_member(*args))


def bench_pop(
    *,
    namesrv: str,
    topic: str,
    group: str | None = None,
    consumers: int = 4,
    count: int = 200_000,
    size: int = 128,
    pop_batch: int = 256,
    queues: int = 8,
    produce: bool = True,
    produce_batch: int = 1000,
    invisible: float = 60.0,
    progress: Progress | None = None,
    subscription_types: list[str] | None = None,
) -> dict[str, Any]:
    if consumers < 1 or pop_batch < 1 or count < 1:
        raise ValueError("consumers, pop_batch and count must be >= 1")
    run_loop(ensure_topic(namesrv, topic, queues))
    if produce:
        bench_produce(namesrv=namesrv, topic=topic, size=size, count=count,
                      batch=produce_batch, queues=queues, inflight=8,
                      varied=bool(subscription_types))
    args: dict[str, Any] = dict(namesrv=namesrv, topic=topic, consumers=consumers,
                                count=count, size=size, pop_batch=pop_batch,
                                invisible=invisible, progress=progress)
    if not subscription_types:
        out = _drain(group=group, kind=SIMPLE, **args)
        out["produce_batch"] = produce_batch if produce else None
        return out
    runs = [_drain(group=None, kind=t, **args) for t in subscription_types]
    rate = {r["subscription_type"]: r["msgs_per_s"] for r in runs}
    result: dict[str, Any] = {
        "workload": "pop-subscription-types", "consumers": consumers, "count": count,
        "size": size, "pop_batch": pop_batch,
        "produce_batch": produce_batch if produce else None,
        "messages": "keys order-<i>, tags, properties (the same backlog for every run)",
        "runs": runs,
    }
    if rate.get("Shared") and "Key_Shared" in rate:
        result["key_shared_vs_shared"] = round(rate["Key_Shared"] / rate["Shared"], 3)
    return result


SIMPLE = "SimpleConsumer"


_BROKER_COUNTERS = ("process_cpu_s", "pop_requests", "pop_answers", "pop_held_tries")


async def _brokers_counters(namesrv: str, topic: str) -> dict[str, float]:
    """CPU seconds (utime + stime) and POP counters summed over the brokers serving
    ``topic`` (0 when one does not tell)."""
    async with Admin(namesrv) as admin:
        route = await admin.routes.get(topic)
        total = dict.fromkeys(_BROKER_COUNTERS, 0.0)
        for addr in sorted(set(route.read_addrs.values())):
            info = await admin.runtime_info(addr)
            for k in _BROKER_COUNTERS:
                total[k] += float(info.get(k, 0.0))
        return total


def _drain(*, namesrv: str, topic: str, group: str | None, kind: str, consumers: int,
           count: int, size: int, pop_batch: int, invisible: float,
           progress: Progress | None) -> dict[str, Any]:
    """N member processes of one fresh group drain ``count`` messages of ``topic``."""
    group = group or f"bench-pop-{uuid.uuid4().hex[:12]}"
    ctx = multiprocessing.get_context("spawn")
    arr = ctx.Array("d", _SLOTS * consumers, lock=False)
    go, stop = ctx.Event(), ctx.Event()
    extra = () if kind == SIMPLE else (kind,)
    procs = [ctx.Process(target=_member_process, daemon=True,
                         args=((namesrv, group, topic, pop_batch, invisible, arr, i, go, stop,
                                *extra),))
             for i in range(consumers)]
    for p in procs:
        p.start()
    # spawned interpreters import tidemq, connect and join (each sets its ready slot)
    deadline = time.monotonic() + 60
    while not all(arr[i * _SLOTS + 6] for i in range(consumers)):
        if time.monotonic() > deadline or not all(p.is_alive() for p in procs):
            break
        time.sleep(0.01)
    time.sleep(0.5)
    before = run_loop(_brokers_counters(namesrv, topic))
    t_go = time.monotonic()
    go.set()
    done = 0
    last_progress = time.monotonic()
    try:
        while done < count:
            time.sleep(0.05)
            now_done = int(sum(arr[i * _SLOTS] for i in range(consumers)))
            if progress is not None and now_done > done:
                progress(now_done - done)
            if now_done > done:
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > 20:
                break  # stalled: report what was consumed
            done = now_done
    finally:
        stop.set()
        after = run_loop(_brokers_counters(namesrv, topic))
        moved = {k: after[k] - before[k] for k in _BROKER_COUNTERS}
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    lasts = [arr[i * _SLOTS + 3] for i in range(consumers)]
    secs = max(max(lasts) - t_go, _REPORT)
    cpu = sum(arr[i * _SLOTS + 4] for i in range(consumers))
    return {
        "workload": "pop",
        "subscription_type": kind,
        "group": group,
        "consumers": consumers,
        "pop_batch": pop_batch,
        "acks": "per message (grouped into one ACK_MESSAGE frame per receive)",
        "size": size,
        "count": done,
        "complete": done >= count,
        "seconds": round(secs, 3),
        "msgs_per_s": round(done / secs),
        "mb_per_s": round(done * size / secs / 1e6, 1),
        "redelivered": int(sum(arr[i * _SLOTS + 1] for i in range(consumers))),
        "stale_acks": int(sum(arr[i * _SLOTS + 2] for i in range(consumers))),
        "client_cpu_us_per_msg": round(cpu / max(done, 1) * 1e6, 3),
        "broker_cpu_us_per_msg": round(moved["process_cpu_s"] / max(done, 1) * 1e6, 3),
        # per 1000 messages: POP requests, answers with messages, tries of held pops
        "pops_per_1k": round(moved["pop_requests"] * 1000 / max(done, 1), 2),
        "answers_per_1k": round(moved["pop_answers"] * 1000 / max(done, 1), 2),
        "held_tries_per_1k": round(moved["pop_held_tries"] * 1000 / max(done, 1), 2),
        # per member: messages acked, seconds from go to its first and its last message
        "member_acked": [int(arr[i * _SLOTS]) for i in range(consumers)],
        "member_first_s": [round(max(arr[i * _SLOTS + 5] - t_go, 0.0), 3)
                           for i in range(consumers)],
        "member_last_s": [round(max(x - t_go, 0.0), 3) for x in lasts],
    }
