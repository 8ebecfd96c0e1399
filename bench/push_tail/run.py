"""Where the push consumer's slow messages wait at 10,000 queues (diagnostic, not a benchmark).

The push phase of `tidemq bench scale` alone (a fresh `tidemq dev`, N queues in topics of 8,
each touched once; one push consumer of a new group subscribed to every topic; a producer in a
process of its own sending RATE msgs/s of 1 KiB to random topics for SECONDS), with every
message's stages stamped on one wall clock:

  send call (body) -> born (producer's encode, ms) -> stored (broker, ms) -> the consumer's read
  of the answer that carried it (``PullDriver._answered``) -> handed to the consume service
  (``submit``) -> the listener's call.

and, in the consumer's process, a 1 ms loop tick that records every stall over 2 ms (wall, the
thread's CPU during it) plus every garbage collection (``gc.callbacks``).

    PYTHONPATH=src python bench/push_tail/run.py OUT.json [--queues 10000] [--rate 10000]
    python bench/push_tail/report.py OUT.json [OUT2.json ...]
"""

from __future__ import annotations

import argparse
import array
import asyncio
import gc
import json
import multiprocessing
import os
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

from tidemq.bench import scale_bench as sb
from tidemq.bench.client_bench import run_loop
from tidemq.bench.dev_process import DevProcess
from tidemq.client import pull_driver
from tidemq.client.consumer_options import PushConsumerOptions
from tidemq.client.listener import ConsumeStatus
from tidemq.client.push_consumer import PushConsumer

RX: dict[int, int] = {}  # id(message) -> ns the answer carrying it was handed over
ANSWERS: list[tuple[int, ...]] = []  # (ns handled, queues in it, ns done, queues asked)
STALLS: list[tuple[int, float, float]] = []  # (ns at end, wall ms, thread cpu ms)
DRAINS: list[tuple[int, int, int]] = []  # (ns start, queue results handled, ns end)
GCS: list[tuple[int, int, float, float, int]] = []  # (ns start, generation, ms, cpu ms, collected)


def _patch() -> None:
    orig_answered = pull_driver.PullDriver._answered

    def answered(self: Any, items: Any, h: Any, body: Any) -> None:
        t = time.time_ns()
        orig_answered(self, items, h, body)
        ANSWERS.append((t, len(h.woken) + len(items), time.time_ns(), len(items)))

    pull_driver.PullDriver._answered = answered  # type: ignore[method-assign]

    orig_drain = getattr(pull_driver.PullDriver, "_drain", None)
    if orig_drain is not None:  # sliced answers: each stretch of their handling

        def drain(self: Any) -> None:
            t = time.time_ns()
            n = len(self._work)
            orig_drain(self)
            DRAINS.append((t, n - len(self._work), time.time_ns()))

        pull_driver.PullDriver._drain = drain  # type: ignore[method-assign]

    t0 = [0, 0.0, 0.0]

    def cb(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            t0[0] = time.time_ns()
            t0[1] = time.perf_counter()
            t0[2] = time.thread_time()
        else:
            GCS.append((t0[0], info["generation"], (time.perf_counter() - t0[1]) * 1e3,
                        (time.thread_time() - t0[2]) * 1e3, info["collected"]))

    gc.callbacks.append(cb)


LONG: list[tuple[int, float, float, str]] = []  # (ns, cpu ms, wall ms, callback): over 2 ms CPU


def _census() -> None:
    """On asyncio's own loop (PUSHTAIL_CENSUS=1): every callback that ran over 2 ms of the
    thread's CPU, named (what holds the consumer's loop in one stretch)."""
    import asyncio.events as ev  # noqa: PLC0415

    orig = ev.Handle._run

    def _run(self: Any) -> Any:
        t = time.perf_counter()
        c = time.thread_time()
        try:
            return orig(self)
        finally:
            dc = time.thread_time() - c
            if dc > 0.002:
                cb = self._callback
                name = getattr(cb, "__qualname__", None) or repr(cb)
                try:
                    name = "task:" + cb.__self__.get_coro().__qualname__
                except Exception:  # noqa: BLE001, S110 - not a task's step
                    pass
                LONG.append((time.time_ns(), dc * 1e3, (time.perf_counter() - t) * 1e3, name))

    ev.Handle._run = _run  # type: ignore[method-assign]


def _patch_submit(consumer: PushConsumer) -> None:
    svc = consumer.consume_service
    orig = svc.submit

    def submit(msgs: Any, pq: Any, mq: Any, dispatch: Any) -> None:
        now = time.time_ns()
        for m in msgs:
            RX[id(m)] = now
        orig(msgs, pq, mq, dispatch)

    svc.submit = submit  # type: ignore[method-assign]


LAST = [0.0]  # perf_counter of the ticker's last turn
STACKS: dict[str, int] = {}  # the loop thread's stack (innermost frames) while it is late


def _watch(stop: threading.Event, ident: int) -> None:
    """Every ms: while the loop's ticker is over 3 ms late, count the loop thread's stack."""
    while not stop.is_set():
        time.sleep(0.001)
        if LAST[0] and time.perf_counter() - LAST[0] > 0.003:
            f = sys._current_frames().get(ident)
            parts = []
            while f is not None and len(parts) < 7:
                parts.append(f"{os.path.basename(f.f_code.co_filename)}:{f.f_code.co_name}")
                f = f.f_back
            k = " < ".join(parts)
            STACKS[k] = STACKS.get(k, 0) + 1


async def _ticker(stop: asyncio.Event) -> None:
    last = time.perf_counter()
    lastc = time.thread_time()
    wstop = threading.Event()
    threading.Thread(target=_watch, args=(wstop, threading.get_ident()), daemon=True).start()
    while not stop.is_set():
        LAST[0] = last
        await asyncio.sleep(0.001)
        now = time.perf_counter()
        nowc = time.thread_time()
        if now - last > 0.002:
            STALLS.append((time.time_ns(), (now - last) * 1e3, (nowc - lastc) * 1e3))
        last, lastc = now, nowc
    wstop.set()
    LAST[0] = 0.0


async def push_phase(namesrv: str, topics: list[tuple[str, int]], rate: int,
                     seconds: float, dev: DevProcess | None = None) -> dict[str, Any]:
    names = [t for t, _ in topics]
    n_queues = sum(q for _, q in topics)
    # five flat arrays, not a tuple per message: 10,000 tuples a second are tracked objects
    # that make young collections happen the plain bench does not have
    rec = [array.array("q") for _ in range(5)]

    async def listener(msgs: list[Any], ctx: Any) -> ConsumeStatus:
        now = time.time_ns()
        for m in msgs:
            rec[0].append(sb._TS.unpack_from(m.body)[0])
            rec[1].append(m.born_timestamp)
            rec[2].append(m.store_timestamp)
            rec[3].append(RX.pop(id(m), 0))
            rec[4].append(now)
        return ConsumeStatus.SUCCESS

    consumer = PushConsumer(namesrv, f"tail-{uuid.uuid4().hex[:10]}", listener,
                            consume_from="last", consume_message_batch_max_size=32,
                            multi_queue_min=PushConsumerOptions.multi_queue_min)
    for t in names:
        consumer.subscribe(t)
    stop = asyncio.Event()
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=sb._push_producer_main, daemon=True,
                        args=(namesrv, names, 1024, rate, seconds, there))
    child.start()
    try:
        await consumer.start()
        _patch_submit(consumer)
        for _ in range(600):
            if len(consumer.assignment()) >= n_queues:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(2.0)
        for a in rec:
            del a[:]
        RX.clear()
        ANSWERS.clear()
        DRAINS.clear()
        GCS.clear()
        if await asyncio.to_thread(here.recv) != "ready":
            raise RuntimeError("producer did not start")
        tick = asyncio.ensure_future(_ticker(stop))
        prof = None
        if os.environ.get("PUSHTAIL_PROF"):
            import cProfile  # noqa: PLC0415

            prof = cProfile.Profile(time.thread_time)  # CPU: not the waits for a core
            prof.enable()
        # the collector's generations at the go: a young collection walks gen 0 (+ gen 1 at
        # every 10th), so what the start left there is walked again in the phase
        gc_go = {"count": gc.get_count(), "frozen": gc.get_freeze_count(),
                 "objects": [len(gc.get_objects(g)) for g in range(3)]}
        t_go = time.time_ns()
        cpu_go = (time.process_time(), dev.cpu_seconds() if dev is not None else 0.0)
        here.send("go")
        sent, errors = await asyncio.to_thread(here.recv)
        deadline = time.perf_counter() + 5
        while len(rec[0]) < sent - errors and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)
        # CPU from the go to the last delivery (the tail of the wait above: up to 10 ms)
        cpu_done = (time.process_time(), dev.cpu_seconds() if dev is not None else 0.0)
        stop.set()
        if prof is not None:
            prof.disable()
            prof.dump_stats(os.environ["PUSHTAIL_PROF"])
        await tick
        drv = consumer.pull_service._drivers
        stats = {"pulls": consumer.pull_service.pulls,
                 "multi_requests": consumer.pull_service.multi_requests,
                 "jobs": getattr(consumer.consume_service, "jobs", -1),
                 "drivers": len(drv)}
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
        await consumer.close()
    return {"sent": sent, "errors": errors, "t_go": t_go,
            "rec": [list(t) for t in zip(*rec, strict=True)], "answers": ANSWERS,
            "stalls": STALLS, "gcs": GCS, "gc_go": gc_go, "drains": DRAINS,
            "phase_cpu": {"consumer": cpu_done[0] - cpu_go[0], "broker": cpu_done[1] - cpu_go[1],
                          "received": len(rec[0])}, "stacks": STACKS, "long": LONG, "stats": stats}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--queues", type=int, default=10_000)
    ap.add_argument("--rate", type=int, default=10_000)
    ap.add_argument("--seconds", type=float, default=5.0)
    a = ap.parse_args()
    _patch()
    topics = sb._topics(a.queues, 8)
    with tempfile.TemporaryDirectory(prefix="tidemq-pushtail-") as d:
        dev = DevProcess(d).start()
        try:
            time.sleep(1.0)
            run_loop(sb._create(dev.namesrv, topics, None))
            run_loop(sb._touch(dev.namesrv, topics, 1024, None))
            time.sleep(3.0)
            c0 = (dev.cpu_seconds(), time.process_time())
            if os.environ.get("PUSHTAIL_CENSUS"):
                _census()
                out = asyncio.run(push_phase(dev.namesrv, topics, a.rate, a.seconds, dev))
            else:
                out = run_loop(push_phase(dev.namesrv, topics, a.rate, a.seconds, dev))
            c1 = (dev.cpu_seconds(), time.process_time())
            out["cpu"] = {"broker": c1[0] - c0[0], "consumer": c1[1] - c0[1]}
        finally:
            dev.kill9()
    out["load"] = os.getloadavg()
    out["src"] = sys.modules["tidemq"].__file__
    with open(a.out, "w") as f:
        json.dump(out, f)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from report import summary  # noqa: PLC0415

    print(summary(out))


if __name__ == "__main__":
    main()
