"""How long a broker of N queues takes for one UPDATE_CONSUMER_OFFSETS of K queues (the push
consumer's 5 s persist; diagnostic): round trips of such a request against an idle fresh
`tidemq dev`, and the broker's CPU for them.

    PYTHONPATH=src python bench/push_tail/uco.py [--queues 10000] [--per 4096 1024 256]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

from tidemq.bench import scale_bench as sb
from tidemq.bench.client_bench import run_loop
from tidemq.bench.dev_process import DevProcess
from tidemq.client.admin import Admin
from tidemq.client.message import MessageQueue
from tidemq.client.offsets import update_consumer_offsets


async def measure(namesrv: str, topics: list[tuple[str, int]], per: list[int]) -> None:
    async with Admin(namesrv) as admin:
        route = await admin.routes.get(topics[0][0])
        addr = next(iter(route.read_addrs.values()))
        bname = next(iter(route.read_addrs))
        mqs = [MessageQueue(t, bname, q) for t, n in topics for q in range(n)]
        for k in per:
            for rnd in range(5):
                offs = {mq: 1 + rnd for mq in mqs[:k]}
                t0 = time.perf_counter()
                await update_consumer_offsets(admin.pool, addr, "uco-g", offs)
                print(f"{k} queues: {(time.perf_counter() - t0) * 1e3:.1f} ms", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--queues", type=int, default=10_000)
    ap.add_argument("--per", type=int, nargs="*", default=[4096, 1024, 256])
    a = ap.parse_args()
    topics = sb._topics(a.queues, 8)
    with tempfile.TemporaryDirectory(prefix="tidemq-pushtail-") as d:
        dev = DevProcess(d).start()
        try:
            run_loop(sb._create(dev.namesrv, topics, None))
            c0 = dev.cpu_seconds()
            run_loop(measure(dev.namesrv, topics, a.per))
            print(f"broker cpu {dev.cpu_seconds() - c0:.2f} s")
        finally:
            dev.kill9()


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    main()
