"""`tidemq bench produce|consume|e2e`: the Python client against a running cluster.

- produce: COUNT messages of SIZE bytes in batches of BATCH through ``aio.Producer.send_batch``,
  INFLIGHT batches pipelined per producer; PRODUCERS > 1 runs that many producer processes
  (each sends COUNT / PRODUCERS) and adds their rates over the common wall time. AUTO_BATCH
  sends every message alone through ``send_async`` and lets the producer's automatic batching
  (PR3, up to BATCH messages per batch) build the batches; PRODUCER_NAME makes the producer a
  deduplicated one (BR12; process i of several is named ``<name>-<i>``); VARIED gives every
  message what applications send besides a body -- a tag (one of 8), a key and 2 properties --
  which is what the broker's door checks message by message (UTF-8, sizes).
- consume: a fresh consumer group reads COUNT messages of the topic's backlog from the earliest
  offset (``consume_from="first"``, pull batches of BATCH); every body is touched. Timed from
  before the first ``poll`` (the start offsets' lookups and the first pulls included) to the
  poll that completes COUNT, as the Redis peer times from before its first XRANGE.
- e2e: one producer sends single messages at RATE per second for SECONDS while a consumer in the
  same process long-polls; each body starts with the send time (``time.time_ns``), so latency is
  send -> poll return.

Each returns a dict that the CLI prints as one JSON object: ``msgs_per_s`` and ``mb_per_s``
(MB = 10^6 bytes of message bodies), e2e also ``p50_ms``, ``p99_ms``, ``p999_ms``; and
``client_cpu_us_per_msg``, the client process's CPU time per message, which (unlike the rates)
does not depend on what else the machine is running.
Runs its own event loop (uvloop when installed); call from a thread without a running loop.
"""

from __future__ import annotations

import asyncio
import collections
import multiprocessing
import os
import struct
import time
import uuid
from collections.abc import Callable
from typing import Any

from tidemq.client.admin import Admin
from tidemq.client.connection import ConnectionPool
from tidemq.client.consumer import PullConsumer
from tidemq.client.errors import NoRouteError
from tidemq.client.message import Message
from tidemq.client.producer import Producer

__all__ = ["bench_produce", "bench_consume", "bench_e2e", "run_loop"]

Progress = Callable[[int], None]
_TS = struct.Struct("<q")


def run_loop(coro: Any) -> Any:
    """Run ``coro`` on a fresh loop (uvloop when installed)."""
    try:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)
    except ImportError:  # pragma: no cover
        return asyncio.run(coro)


async def ensure_topic(namesrv: str, topic: str, queues: int) -> None:
    """Create ``topic`` on every broker unless the name server already routes it."""
    async with Admin(namesrv) as admin:
        try:
            await admin.routes.get(topic)
            return
        except NoRouteError:
            await admin.create_topic(topic, queues)
        for _ in range(100):  # the brokers re-register; wait until the route shows the topic
            try:
                await admin.routes.get(topic, refresh=True)
                return
            except NoRouteError:
                await asyncio.sleep(0.05)
        raise NoRouteError(f"created topic {topic!r} but the name server never routed it")


def _pct(sorted_vals: list[float], p: float) -> float:
    if not sorted_vals:
        return 0.0
    k = min(len(sorted_vals) - 1, max(0, int(round(p * len(sorted_vals))) - 1))
    return sorted_vals[k]


# -- produce ---------------------------------------------------------------------------------------


def _messages(topic: str, size: int, n: int, varied: bool) -> list[Message]:
    body = os.urandom(size)
    if not varied:
        return [Message(topic, body) for _ in range(n)]
    return [Message(topic, body, tags=f"Tag{i % 8}", keys=f"order-{i}",
                    properties={"region": "eu-west-1", "attempt": str(i % 3)})
            for i in range(n)]


async def _produce(
    namesrv: str, topic: str, size: int, count: int, batch: int, inflight: int,
    progress: Progress | None, auto_batch: bool = False, producer_name: str | None = None,
    varied: bool = False,
) -> tuple[float, float, int, float]:
    """(start, end, sent, client CPU seconds), times in time.time() seconds."""
    msgs = _messages(topic, size, batch, varied)
    async with Producer(namesrv, producer_name=producer_name,
                        batch_max_messages=batch) as producer:
        await producer.send_batch(msgs[:1])  # warm: route and connection
        t0 = time.time()
        c0 = time.process_time()
        if auto_batch:
            sent = await _produce_auto(producer, msgs[0], count, batch, inflight, progress)
        else:
            sent = await _produce_batches(producer, msgs, count, batch, inflight, progress)
        t1 = time.time()
        cpu = time.process_time() - c0
    return t0, t1, sent, cpu


async def _produce_batches(
    producer: Producer, msgs: list[Message], count: int, batch: int, inflight: int,
    progress: Progress | None,
) -> int:
    """``inflight`` coroutines, each awaiting one ``send_batch`` after another (an
    application's send loop). Not ``asyncio.wait`` over a set of pending sends: that adds and
    removes a callback on every pending future per completion, O(inflight) work per batch,
    which with ``--batch 1 --inflight 64`` cost more than the send itself."""
    todo = iter(range(0, count, batch))
    send_batch = producer.send_batch

    async def sender() -> int:
        n_sent = 0
        for start in todo:
            n = min(batch, count - start)
            r = await send_batch(msgs if n == batch else msgs[:n])
            n_sent += n
            if progress is not None:
                progress(r.count)
        return n_sent

    return sum(await asyncio.gather(*(sender() for _ in range(max(1, inflight)))))


async def _produce_auto(
    producer: Producer, msg: Message, count: int, batch: int, inflight: int,
    progress: Progress | None,
) -> int:
    """Single-message ``send_async`` calls; about ``inflight`` batches outstanding."""
    window: collections.deque[tuple[asyncio.Future[Any], int]] = collections.deque()
    sent = 0
    send = producer.send_async
    while sent < count:
        n = min(batch, count - sent)
        for _ in range(n - 1):
            send(msg)
        # n sends fill exactly one batch (batch_max_messages = n), and a batch's futures are
        # resolved together: waiting for its last one waits for all.
        window.append((send(msg), n))
        sent += n
        if len(window) >= inflight:
            f, k = window.popleft()
            await f
            if progress is not None:
                progress(k)
    for f, k in window:
        await f
        if progress is not None:
            progress(k)
    return sent


def _produce_worker(
    args: tuple[str, str, int, int, int, int, bool, str | None, bool],
) -> tuple[float, float, int, float]:
    namesrv, topic, size, count, batch, inflight, auto_batch, name, varied = args
    result: tuple[float, float, int, float] = run_loop(
        _produce(namesrv, topic, size, count, batch, inflight, None, auto_batch, name, varied)
    )
    return result


def bench_produce(
    *,
    namesrv: str,
    topic: str,
    size: int = 1024,
    count: int = 1_000_000,
    batch: int = 1000,
    producers: int = 1,
    inflight: int = 4,
    queues: int = 8,
    progress: Progress | None = None,
    auto_batch: bool = False,
    producer_name: str | None = None,
    varied: bool = False,
) -> dict[str, Any]:
    run_loop(ensure_topic(namesrv, topic, queues))
    if producers <= 1:
        t0, t1, sent, cpu = run_loop(
            _produce(namesrv, topic, size, count, batch, inflight, progress, auto_batch,
                     producer_name, varied)
        )
    else:
        share = count // producers
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(producers) as pool:
            parts = pool.map(
                _produce_worker,
                [(namesrv, topic, size, share, batch, inflight, auto_batch,
                  f"{producer_name}-{i}" if producer_name else None, varied)
                 for i in range(producers)],
            )
        t0 = min(p[0] for p in parts)
        t1 = max(p[1] for p in parts)
        sent = sum(p[2] for p in parts)
        cpu = sum(p[3] for p in parts)
        if progress is not None:
            progress(sent)
    secs = max(t1 - t0, 1e-9)
    return {
        "workload": "produce",
        "size": size,
        "count": sent,
        "batch": batch,
        "producers": producers,
        "inflight": inflight,
        "auto_batch": auto_batch,
        "dedup": bool(producer_name),
        "varied": varied,
        "seconds": round(secs, 3),
        "msgs_per_s": round(sent / secs),
        "mb_per_s": round(sent * size / secs / 1e6, 1),
        "client_cpu_us_per_msg": round(cpu / max(sent, 1) * 1e6, 3),
    }


# -- consume ---------------------------------------------------------------------------------------


async def _consume(
    namesrv: str, topic: str, count: int, batch: int, idle: float, progress: Progress | None
) -> dict[str, Any]:
    group = f"bench-{uuid.uuid4().hex[:12]}"
    consumer = PullConsumer(namesrv, group, consume_from="first", auto_commit=False,
                            pull_batch_size=batch, max_poll_records=max(batch, 1000))
    consumer.subscribe(topic)
    got = 0
    nbytes = 0
    async with consumer:
        await consumer.fetch_queues(topic)  # NoRouteError now rather than an empty result
        # The clock starts before the first poll, as the Redis peer's starts before its first
        # XRANGE (bench/peers/redis_streams.py): the first pulls' round trip and the start
        # offsets' lookups are inside the timed window. The group join (``async with``) and the
        # route lookup are outside, as the Redis client's connect and PING are.
        t0 = time.perf_counter()
        c0 = time.process_time()
        msgs = await consumer.poll(timeout=idle)
        while msgs:
            got += len(msgs)
            nbytes += sum([len(m.body) for m in msgs])
            if progress is not None:
                progress(len(msgs))
            if got >= count:
                break
            msgs = await consumer.poll(timeout=idle)
        t1 = time.perf_counter()
        cpu = time.process_time() - c0
    secs = max(t1 - t0, 1e-9)
    return {
        "workload": "consume",
        "count": got,
        "batch": batch,
        "complete": got >= count,
        "seconds": round(secs, 3),
        "msgs_per_s": round(got / secs),
        "mb_per_s": round(nbytes / secs / 1e6, 1),
        "client_cpu_us_per_msg": round(cpu / max(got, 1) * 1e6, 3),
    }


def bench_consume(
    *,
    namesrv: str,
    topic: str,
    count: int = 1_000_000,
    batch: int = 1000,
    idle: float = 5.0,
    progress: Progress | None = None,
) -> dict[str, Any]:
    return run_loop(_consume(namesrv, topic, count, batch, idle, progress))  # type: ignore[no-any-return]


# -- end to end ------------------------------------------------------------------------------------


async def _e2e(
    namesrv: str, topic: str, size: int, rate: int, seconds: float, queues: int,
    batch_delay: float, progress: Progress | None,
) -> dict[str, Any]:
    await ensure_topic(namesrv, topic, queues)
    group = f"bench-e2e-{uuid.uuid4().hex[:12]}"
    latencies: list[int] = []
    pad = b"\0" * max(0, size - _TS.size)
    stop = asyncio.Event()
    # Producer and consumer share connections, as RocketMQ's client instance does: a send and
    # the re-issued pulls of one loop iteration then leave in one write.
    pool = ConnectionPool()
    consumer = PullConsumer(namesrv, group, consume_from="last", auto_commit=False,
                            pull_batch_size=256, pool=pool)
    consumer.subscribe(topic)
    async with consumer, Producer(namesrv, pool=pool, batch_max_delay=batch_delay) as producer:
        # Wait until every queue has its start offset, so nothing sent is skipped.
        await consumer.poll(timeout=0.01)
        for _ in range(200):
            if all(consumer.position(mq) is not None for mq in consumer.assignment()):
                break
            await asyncio.sleep(0.01)
        await producer.send(Message(topic, _TS.pack(time.time_ns()) + pad))  # warm the path
        await asyncio.sleep(0.2)
        await consumer.poll(timeout=0.01)

        async def receive() -> None:
            while not stop.is_set():
                msgs = await consumer.poll(timeout=0.2)
                now = time.time_ns()
                for m in msgs:
                    latencies.append(now - _TS.unpack_from(m.body)[0])
                if progress is not None and msgs:
                    progress(len(msgs))

        rx = asyncio.ensure_future(receive())
        total = int(rate * seconds)
        sent = 0
        errors = 0
        pending: set[asyncio.Future[Any]] = set()
        t0 = time.perf_counter()
        c0 = time.process_time()
        while sent < total:
            due = min(total, int((time.perf_counter() - t0) * rate) + 1)
            while sent < due:
                f = producer.send_async(Message(topic, _TS.pack(time.time_ns()) + pad))
                pending.add(f)
                f.add_done_callback(pending.discard)
                sent += 1
            # 1 ms: libuv timers have millisecond resolution (a shorter sleep busy-spins).
            await asyncio.sleep(0.001)
        if pending:
            res = await asyncio.gather(*pending, return_exceptions=True)
            errors = sum(isinstance(r, BaseException) for r in res)
        send_secs = time.perf_counter() - t0
        cpu = time.process_time() - c0
        deadline = time.perf_counter() + 5
        while len(latencies) < sent - errors and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)
        stop.set()
        await rx
    pool.close()
    lat = sorted(v / 1e6 for v in latencies)
    secs = max(send_secs, 1e-9)
    return {
        "workload": "e2e",
        "size": size,
        "rate": rate,
        "batch_delay_ms": batch_delay * 1000,
        "seconds": round(send_secs, 3),
        "sent": sent,
        "received": len(lat),
        "send_errors": errors,
        "msgs_per_s": round(len(lat) / secs),
        "mb_per_s": round(len(lat) * size / secs / 1e6, 2),
        "p50_ms": round(_pct(lat, 0.50), 3),
        "p99_ms": round(_pct(lat, 0.99), 3),
        "p999_ms": round(_pct(lat, 0.999), 3),
        "max_ms": round(lat[-1], 3) if lat else 0.0,
        "client_cpu_us_per_msg": round(cpu / max(sent, 1) * 1e6, 3),
    }


def bench_e2e(
    *,
    namesrv: str,
    topic: str,
    size: int = 1024,
    rate: int = 10_000,
    seconds: float = 10.0,
    queues: int = 8,
    batch_delay: float = 0.0,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Send ``rate`` msgs/s for ``seconds`` through ``send_async`` (auto-batched, the producer
    waiting ``batch_delay`` s for more before a batch leaves) and receive them with a long-polling
    PullConsumer on the same client connections; latency is send call -> poll return."""
    if size < _TS.size:
        raise ValueError(f"e2e messages carry an 8-byte timestamp: --size must be >= {_TS.size}")
    return run_loop(_e2e(namesrv, topic, size, rate, seconds, queues, batch_delay, progress))  # type: ignore[no-any-return]
