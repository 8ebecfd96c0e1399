"""`tidemq bench scale`: how the cost of a broker grows with the number of queues (issue 17).

For each size N (queues; N / ``queues_per_topic`` topics of ``queues_per_topic`` queues each,
``scale-<i>``), against a fresh `tidemq dev` in a temporary directory:

1. create the topics (``create_seconds``);
2. touch every queue with one message (``touch_seconds``; also warms every route), then let the
   broker settle and read its RSS: ``rss_per_queue_kb`` is (RSS now - RSS of the fresh broker)
   / N, the cost of an idle queue holding one message;
3. produce: MESSAGES ``send_async`` messages of SIZE bytes from one producer, each to a topic
   picked at random (the issue's workload; the producer batches what it can, and sends the
   batches of many topics in SEND_MULTI_QUEUE frames); the producer fetches every route first
   (``route_warmup_seconds``, outside the rate: a long-lived producer has them);
4. consume: one pull consumer subscribed to every topic reads the whole backlog from the start
   (the rate counts from its first messages; ``consume_first_messages_s`` is the time before
   them: routes, rebalance and every queue's start offset);
5. push end to end (sizes up to ``push_max_queues``, 10,000): one push consumer of a new group
   subscribed to every topic (so assigned every queue, starting at their ends) while one
   producer sends ``push_rate`` msgs/s (10,000) of SIZE bytes to random topics for
   ``push_seconds`` (5 s); latency is the send call to the listener's call, from a timestamp in
   the body: ``push_e2e_p50_ms`` / ``push_e2e_p99_ms`` (the issue's target: p99 <= 5 ms with
   10,000 queues), ``push_e2e_received``; ``push_multi_queue_min`` (None: the push
   consumer's default, 256; 0: one pull per queue) sets the consumer's ``multi_queue_min``
   (standing multi-queue pulls). The producer runs in this process and on the consumer's
   event loop (the figures kept since the first runs), or with ``push_producer_process`` in a
   process of its own, as producers and consumers usually are: then the consumer's loop does
   only the consumer's work (``push_e2e_producer``: "same" or "process");
6. restart: a clean stop and start (``restart_clean_s``), then a kill -9 and start
   (``restart_kill9_s``): process start to "ready", Python start-up included.

``*_cpu_us_per_msg``: CPU time (user + system) per message of the broker process and of this
process (the producer, or the consumer) during the produce and consume phases: on a shared,
loaded machine a steadier yardstick than msgs/s.

Returns one dict per size, and ``ratio_to_first`` relative to the first (smallest) size.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import random
import struct
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

from tidemq.bench.client_bench import run_loop
from tidemq.bench.dev_process import DevProcess
from tidemq.client.admin import Admin
from tidemq.client.consumer import PullConsumer
from tidemq.client.consumer_options import PushConsumerOptions
from tidemq.client.listener import ConsumeStatus
from tidemq.client.message import Message
from tidemq.client.producer import Producer
from tidemq.client.push_consumer import PushConsumer

__all__ = ["bench_scale", "DEFAULT_SIZES"]

DEFAULT_SIZES = (8, 64, 512, 2048, 10_000, 100_000)

Progress = Callable[[str, int, int], None]  # (phase, done, total)
_consume_start = [0.0]  # seconds from the consumer's start to its first messages
_route_warmup = [0.0]  # seconds the producer took to fetch every topic's route


def _topics(n_queues: int, per_topic: int) -> list[tuple[str, int]]:
    """(topic, queue count) covering exactly ``n_queues`` queues."""
    out = []
    i = 0
    left = n_queues
    while left > 0:
        q = min(per_topic, left)
        out.append((f"scale-{i}", q))
        left -= q
        i += 1
    return out


async def _gather_limited(coros: list[Any], limit: int, tick: Callable[[], None]) -> None:
    it = iter(coros)

    async def worker() -> None:
        for c in it:
            await c
            tick()

    await asyncio.gather(*(worker() for _ in range(limit)))


async def _create(namesrv: str, topics: list[tuple[str, int]], progress: Progress | None) -> None:
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress is not None and (done % 64 == 0 or done == len(topics)):
            progress("create", done, len(topics))

    async with Admin(namesrv) as admin:
        await _gather_limited(
            [admin.create_topic(t, q, wait=0) for t, q in topics], 16, tick
        )
        # wait until the name server routes the last topic created
        for t, _ in reversed(topics):
            for _ in range(600):
                try:
                    await admin.routes.get(t, refresh=True)
                    break
                except Exception:  # noqa: BLE001 - not routed yet
                    await asyncio.sleep(0.05)
            break


async def _touch(namesrv: str, topics: list[tuple[str, int]], size: int,
                 progress: Progress | None) -> None:
    body = b"t" * size
    total = sum(q for _, q in topics)
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress is not None and (done % 256 == 0 or done == total):
            progress("touch", done, total)

    async with Producer(namesrv, auto_batch=False) as p:
        coros = [p.send_batch([Message(t, body)], queue_id=qid)
                 for t, q in topics for qid in range(q)]
        await _gather_limited(coros, 128, tick)


async def _produce(namesrv: str, topics: list[tuple[str, int]], size: int, count: int,
                   window: int, progress: Progress | None) -> tuple[float, int]:
    body = b"p" * size
    rnd = random.Random(17)
    names = [t for t, _ in topics]
    msgs = [Message(names[rnd.randrange(len(names))], body) for _ in range(min(count, 65_536))]
    errors = 0
    async with Producer(namesrv, max_pending_messages=window + 1) as p:
        # A long-lived producer has its routes: fetch them before the clock starts (timed
        # apart, as route_warmup_seconds).
        w0 = time.perf_counter()
        await _gather_limited([p.routes.get(t) for t in names], 64, lambda: None)
        _route_warmup[0] = time.perf_counter() - w0
        outstanding = 0
        room = asyncio.Event()
        done = 0

        def finished(f: asyncio.Future[Any]) -> None:
            nonlocal outstanding, errors, done
            outstanding -= 1
            done += 1
            if f.cancelled() or f.exception() is not None:
                errors += 1
            if outstanding < window // 2:
                room.set()

        t0 = time.perf_counter()
        for i in range(count):
            f = p.send_async(msgs[i % len(msgs)])
            outstanding += 1
            f.add_done_callback(finished)
            if outstanding >= window:
                room.clear()
                await room.wait()
                if progress is not None:
                    progress("produce", done, count)
        while outstanding:
            room.clear()
            await room.wait()
        secs = time.perf_counter() - t0
    if progress is not None:
        progress("produce", count, count)
    return secs, errors


async def _consume(namesrv: str, topics: list[tuple[str, int]], count: int, idle: float,
                   progress: Progress | None) -> tuple[float, int]:
    consumer = PullConsumer(namesrv, f"scale-{uuid.uuid4().hex[:10]}", consume_from="first",
                            auto_commit=False, pull_batch_size=256, max_poll_records=4096)
    for t, _ in topics:
        consumer.subscribe(t)
    got = 0
    started = time.perf_counter()
    async with consumer:
        first = await consumer.poll(timeout=max(idle, 30.0))
        t0 = time.perf_counter()
        _consume_start[0] = t0 - started
        msgs = first
        while msgs:
            got += len(msgs)
            if progress is not None:
                progress("consume", got, count)
            if got >= count:
                break
            msgs = await consumer.poll(timeout=idle)
        secs = time.perf_counter() - t0
    return secs, got


_TS = struct.Struct("<q")  # send time (ns) at the start of each push e2e message


async def _push_send(producer: Producer, names: list[str], size: int, rate: int,
                     seconds: float, progress: Progress | None) -> tuple[int, int]:
    """``rate`` msgs/s of ``size`` bytes to random topics of ``names`` for ``seconds``, each
    stamped with its send time; (sent, failed) once every send is answered."""
    rnd = random.Random(23)
    pad = b"e" * max(0, size - _TS.size)
    total = int(rate * seconds)
    sent = errors = 0
    pending: set[asyncio.Future[Any]] = set()
    t0 = time.perf_counter()
    while sent < total:
        due = min(total, int((time.perf_counter() - t0) * rate) + 1)
        while sent < due:
            f = producer.send_async(Message(names[rnd.randrange(len(names))],
                                            _TS.pack(time.time_ns()) + pad))
            pending.add(f)
            f.add_done_callback(pending.discard)
            sent += 1
        if progress is not None and sent % 1000 == 0:
            progress("push e2e", sent, total)
        await asyncio.sleep(0.001)
    if pending:
        res = await asyncio.gather(*pending, return_exceptions=True)
        errors = sum(isinstance(r, BaseException) for r in res)
    return sent, errors


def _push_producer_main(namesrv: str, names: list[str], size: int, rate: int, seconds: float,
                        conn: Any) -> None:
    """The push phase's producer in a process of its own: fetches its routes, says "ready",
    sends on "go" and answers (sent, failed)."""

    async def go() -> tuple[int, int]:
        async with Producer(namesrv) as producer:
            await _gather_limited([producer.routes.get(t) for t in names], 64, lambda: None)
            conn.send("ready")
            await asyncio.to_thread(conn.recv)
            return await _push_send(producer, names, size, rate, seconds, None)

    conn.send(run_loop(go()))


async def _push_e2e(namesrv: str, topics: list[tuple[str, int]], size: int, rate: int,
                    seconds: float, progress: Progress | None,
                    multi_queue_min: int | None = None,
                    producer_process: bool = False) -> dict[str, Any]:
    names = [t for t, _ in topics]
    n_queues = sum(q for _, q in topics)
    lat: list[int] = []

    async def listener(msgs: list[Any], ctx: Any) -> ConsumeStatus:
        now = time.time_ns()
        for m in msgs:
            lat.append(now - _TS.unpack_from(m.body)[0])
        return ConsumeStatus.SUCCESS

    consumer = PushConsumer(namesrv, f"scale-push-{uuid.uuid4().hex[:10]}", listener,
                            consume_from="last", consume_message_batch_max_size=32,
                            multi_queue_min=(PushConsumerOptions.multi_queue_min
                                             if multi_queue_min is None else multi_queue_min))
    for t in names:
        consumer.subscribe(t)

    async def started() -> None:
        await consumer.start()
        for _ in range(600):  # every queue assigned, then its start offset resolved
            if len(consumer.assignment()) >= n_queues:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(2.0)
        lat.clear()

    try:
        if producer_process:
            ctx = multiprocessing.get_context("spawn")
            here, there = ctx.Pipe()
            child = ctx.Process(target=_push_producer_main, daemon=True,
                                args=(namesrv, names, size, rate, seconds, there))
            child.start()
            try:
                await started()
                if await asyncio.to_thread(here.recv) != "ready":
                    raise RuntimeError("the push phase's producer process did not start")
                here.send("go")
                sent, errors = await asyncio.to_thread(here.recv)
            finally:
                child.join(timeout=30)
                if child.is_alive():
                    child.kill()
        else:
            async with Producer(namesrv) as producer:
                await _gather_limited([producer.routes.get(t) for t in names], 64,
                                      lambda: None)
                await started()
                sent, errors = await _push_send(producer, names, size, rate, seconds,
                                                progress)
        deadline = time.perf_counter() + 5
        while len(lat) < sent - errors and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)
    finally:
        await consumer.close()
    ms = sorted(v / 1e6 for v in lat)

    def pct(p: float) -> float:
        return round(ms[min(len(ms) - 1, int(p * len(ms)))], 3) if ms else -1.0

    return {"push_e2e_rate": rate, "push_e2e_producer": "process" if producer_process else "same",
            "push_e2e_sent": sent, "push_e2e_received": len(ms),
            "push_e2e_send_errors": errors, "push_e2e_p50_ms": pct(0.50),
            "push_e2e_p99_ms": pct(0.99), "push_e2e_max_ms": pct(1.0)}


def _per_msg(cpu_seconds: float, n: int) -> float:
    return round(cpu_seconds * 1e6 / max(n, 1), 2)


def _one_size(n: int, *, per_topic: int, size: int, messages: int, window: int, restart: bool,
              data_dir: str | None, progress: Progress | None, push_max_queues: int = 10_000,
              push_rate: int = 10_000, push_seconds: float = 5.0,
              push_multi_queue_min: int | None = None,
              push_producer_process: bool = False) -> dict[str, Any]:
    topics = _topics(n, per_topic)
    mib = 1 << 20
    with tempfile.TemporaryDirectory(prefix="tidemq-bench-scale-", dir=data_dir) as d:
        dev = DevProcess(d).start()
        try:
            time.sleep(1.0)
            rss0 = dev.memory()["VmRSS"]
            t0 = time.perf_counter()
            run_loop(_create(dev.namesrv, topics, progress))
            create_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            run_loop(_touch(dev.namesrv, topics, size, progress))
            touch_s = time.perf_counter() - t0
            time.sleep(3.0)  # a flush and a checkpoint of the touched queues
            rss1 = dev.memory()["VmRSS"]
            cpu0 = (dev.cpu_seconds(), time.process_time())
            prod_s, prod_err = run_loop(
                _produce(dev.namesrv, topics, size, messages, window, progress))
            cpu1 = (dev.cpu_seconds(), time.process_time())
            total = messages + n  # the backlog: the touches and the produced messages
            cons_s, got = run_loop(_consume(dev.namesrv, topics, total, 5.0, progress))
            cpu2 = (dev.cpu_seconds(), time.process_time())
            rss2 = dev.memory()["VmRSS"]
            out: dict[str, Any] = {
                "queues": n,
                "topics": len(topics),
                "create_seconds": round(create_s, 2),
                "touch_seconds": round(touch_s, 2),
                "rss_fresh_mb": round(rss0 / mib, 1),
                "rss_idle_mb": round(rss1 / mib, 1),
                "rss_per_queue_kb": round((rss1 - rss0) / n / 1024, 2),
                "rss_after_mb": round(rss2 / mib, 1),
                "produce_msgs_per_s": round(messages / max(prod_s, 1e-9)),
                "produce_errors": prod_err,
                # CPU time per message of the broker and of this (the producer's) process:
                # steadier than msgs/s on a shared machine
                "produce_broker_cpu_us_per_msg": _per_msg(cpu1[0] - cpu0[0], messages),
                "produce_client_cpu_us_per_msg": _per_msg(cpu1[1] - cpu0[1], messages),
                "route_warmup_seconds": round(_route_warmup[0], 2),
                "consume_msgs_per_s": round(got / max(cons_s, 1e-9)),
                # start offsets of every queue are looked up first (a request or two each)
                "consume_first_messages_s": round(_consume_start[0], 2),
                "consume_broker_cpu_us_per_msg": _per_msg(cpu2[0] - cpu1[0], got),
                "consume_client_cpu_us_per_msg": _per_msg(cpu2[1] - cpu1[1], got),
                "consumed": got,
                "consume_complete": got >= total,
            }
            if n <= push_max_queues and push_rate > 0:
                out.update(run_loop(_push_e2e(dev.namesrv, topics, max(size, _TS.size),
                                              push_rate, push_seconds, progress,
                                              push_multi_queue_min, push_producer_process)))
            if restart:
                dev.stop()
                clean = DevProcess(d).start()
                out["restart_clean_s"] = round(clean.start_seconds, 2)
                clean.kill9()
                crashed = DevProcess(d).start()
                out["restart_kill9_s"] = round(crashed.start_seconds, 2)
                crashed.stop()
        finally:
            dev.kill9()
    return out


def bench_scale(
    *,
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    queues_per_topic: int = 8,
    size: int = 1024,
    messages: int = 100_000,
    window: int = 20_000,
    restart: bool = True,
    data_dir: str | None = None,
    progress: Progress | None = None,
    push_max_queues: int = 10_000,
    push_rate: int = 10_000,
    push_seconds: float = 5.0,
    push_multi_queue_min: int | None = None,
    push_producer_process: bool = False,
) -> dict[str, Any]:
    rows = []
    for n in sizes:
        rows.append(_one_size(n, per_topic=queues_per_topic, size=size, messages=messages,
                              window=window, restart=restart, data_dir=data_dir,
                              progress=progress, push_max_queues=push_max_queues,
                              push_rate=push_rate, push_seconds=push_seconds,
                              push_multi_queue_min=push_multi_queue_min,
                              push_producer_process=push_producer_process))
    base = rows[0] if rows else {}
    for r in rows:
        for k in ("produce_msgs_per_s", "consume_msgs_per_s"):
            if base.get(k):
                r[k.replace("msgs_per_s", "ratio_to_first")] = round(r[k] / base[k], 3)
    return {
        "workload": "scale",
        "size": size,
        "messages": messages,
        "queues_per_topic": queues_per_topic,
        "rows": rows,
    }
