"""What the next collections of a push consumer of N queues cost once its assignment is made
(diagnostic, issue 17): a fresh `tidemq dev` with N queues, one push consumer of every topic,
2 s after the last queue is assigned the collector's generations are listed and a collection of
generation 1, then a full one, is run and timed (thread CPU and wall) -- the pauses the
consumer's next collections of those generations would make in the middle of its work.

    PYTHONPATH=src python bench/push_tail/gc_walk.py [--queues 10000] [--rounds 3]

Compare the session start on PYTHONPATH (alternated): a branch that freezes the long-lived
objects after the rebalance (tidemq.base.gc_tune.freeze_long_lived) walks only what is young.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import tempfile
import time
import uuid

from tidemq.bench import scale_bench as sb
from tidemq.bench.client_bench import run_loop
from tidemq.bench.dev_process import DevProcess
from tidemq.client.listener import ConsumeStatus
from tidemq.client.push_consumer import PushConsumer


def _timed(gen: int) -> tuple[float, float]:
    w, c = time.perf_counter(), time.thread_time()
    gc.collect(gen)
    return (time.thread_time() - c) * 1e3, (time.perf_counter() - w) * 1e3


async def walk(namesrv: str, topics: list[tuple[str, int]], rounds: int) -> None:
    n = sum(q for _, q in topics)

    async def listener(msgs: list, ctx: object) -> ConsumeStatus:
        return ConsumeStatus.SUCCESS

    c = PushConsumer(namesrv, f"gcw-{uuid.uuid4().hex[:10]}", listener, consume_from="last")
    for t, _ in topics:
        c.subscribe(t)
    await c.start()
    try:
        for _ in range(600):
            if len(c.assignment()) >= n:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(2.0)
        print(f"{sys.modules['tidemq'].__file__}: {len(c.assignment())} queues; gc counts "
              f"{gc.get_count()}, objects per generation "
              f"{[len(gc.get_objects(g)) for g in range(3)]}, frozen {gc.get_freeze_count()}")
        for r in range(rounds):
            g1 = _timed(1)
            g2 = _timed(2)
            print(f"  round {r + 1}: collection of gen 1 {g1[0]:.1f} ms CPU ({g1[1]:.1f} wall), "
                  f"full {g2[0]:.1f} ms CPU ({g2[1]:.1f} wall)")
            await asyncio.sleep(0.5)
    finally:
        await c.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--queues", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    topics = sb._topics(a.queues, 8)
    with tempfile.TemporaryDirectory(prefix="tidemq-gcwalk-") as d:
        dev = DevProcess(d).start()
        try:
            time.sleep(1.0)
            run_loop(sb._create(dev.namesrv, topics, None))
            run_loop(walk(dev.namesrv, topics, a.rounds))
        finally:
            dev.kill9()


if __name__ == "__main__":
    main()
