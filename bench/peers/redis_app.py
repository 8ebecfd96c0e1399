"""The Redis side of `tidemq bench app`: one workload per run, against a running redis-server,
with the same varied messages (tidemq.bench.app_messages) as an application would write them
through redis-py, printing one JSON line.

    python bench/peers/redis_app.py WORKLOAD --port PORT [--count N]

Workloads (each message one ``XADD key * d <body> tag <tag> key <key> region <..> attempt <..>``):

- ``send_1_thread``: ``Redis.xadd`` in a loop.
- ``send_16_threads``: 16 threads share one ``Redis`` client (its connection pool), each
  ``xadd`` in a loop.
- ``await_send_64``: 64 coroutines share one ``redis.asyncio.Redis``, each ``await xadd``.
- ``send_async``: pipelines (non-transactional) of 1000 ``XADD``, one ``execute()`` each, into
  the stream ``push_consume`` then reads.
- ``push_consume`` and ``poll_consume`` (tidemq's push consumer and ``poll()`` loop; one Redis
  counterpart for both): a new consumer group drains that stream from the start:
  ``XREADGROUP COUNT 100``, the listener called once per entry, then ``XACK`` of the page's
  ids.

The keys printed: ``msgs_per_s``, ``us_per_call``, ``client_cpu_us_per_msg`` (this process's CPU
time per message), ``count``, ``seconds``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from typing import Any

import redis
import redis.asyncio as aioredis

from tidemq.bench.app_messages import fields

SEND_KEY = "app-send"
BACKLOG_KEY = "app-backlog"


def _entry(i: int) -> dict[str, Any]:
    body, tag, key, props = fields(i)
    return {"d": body, "tag": tag, "key": key, **props}


def _side(count: int, seconds: float, cpu: float, senders: int = 1) -> dict[str, Any]:
    return {"count": count, "seconds": round(seconds, 3),
            "msgs_per_s": round(count / seconds) if seconds > 0 else 0,
            "us_per_call": round(seconds * senders / count * 1e6, 1),
            "client_cpu_us_per_msg": round(cpu / count * 1e6, 2)}


def blocking(port: int, count: int, threads: int) -> dict[str, Any]:
    r = redis.Redis(port=port, max_connections=threads + 1)
    r.xadd(SEND_KEY, _entry(0))
    per = count // threads

    def run(t: int) -> None:
        xadd = r.xadd
        for i in range(t * per, (t + 1) * per):
            xadd(SEND_KEY, _entry(i))

    t0, c0 = time.perf_counter(), time.process_time()
    if threads == 1:
        run(0)
    else:
        ts = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
        for th in ts:
            th.start()
        for th in ts:
            th.join()
    return _side(per * threads, time.perf_counter() - t0, time.process_time() - c0, threads)


def coroutines(port: int, count: int, n: int) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        r = aioredis.Redis(port=port, max_connections=n + 1)
        await r.xadd(SEND_KEY, _entry(0))
        per = count // n

        async def run(t: int) -> None:
            for i in range(t * per, (t + 1) * per):
                await r.xadd(SEND_KEY, _entry(i))

        t0, c0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(run(t) for t in range(n)))
        out = _side(per * n, time.perf_counter() - t0, time.process_time() - c0, n)
        await r.aclose()
        return out

    return asyncio.run(main())


def pipelines(port: int, count: int, batch: int = 1000) -> dict[str, Any]:
    r = redis.Redis(port=port)
    r.delete(BACKLOG_KEY)
    t0, c0 = time.perf_counter(), time.process_time()
    for lo in range(0, count, batch):
        p = r.pipeline(transaction=False)
        for i in range(lo, min(count, lo + batch)):
            p.xadd(BACKLOG_KEY, _entry(i))
        p.execute()
    return _side(count, time.perf_counter() - t0, time.process_time() - c0)


def consume(port: int, count: int, page: int = 100) -> dict[str, Any]:
    r = redis.Redis(port=port)
    group = f"g{time.monotonic_ns()}"
    r.xgroup_create(BACKLOG_KEY, group, id="0")
    got = 0

    def listener(fields: dict[bytes, bytes]) -> None:
        nonlocal got
        got += 1

    t0, c0 = time.perf_counter(), time.process_time()
    while got < count:
        resp = r.xreadgroup(group, "c1", {BACKLOG_KEY: ">"}, count=page, block=1000)
        if not resp:
            raise RuntimeError(f"the backlog ran dry after {got} of {count} entries")
        entries = resp[0][1]
        for _id, f in entries:
            listener(f)
        r.xack(BACKLOG_KEY, group, *[e[0] for e in entries])
    return _side(got, time.perf_counter() - t0, time.process_time() - c0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workload", choices=("send_1_thread", "send_16_threads", "await_send_64",
                                         "send_async", "push_consume", "poll_consume"))
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--count", type=int, default=10_000)
    a = p.parse_args()
    run = {"send_1_thread": lambda: blocking(a.port, a.count, 1),
           "send_16_threads": lambda: blocking(a.port, a.count, 16),
           "await_send_64": lambda: coroutines(a.port, a.count, 64),
           "send_async": lambda: pipelines(a.port, a.count),
           "push_consume": lambda: consume(a.port, a.count),
           "poll_consume": lambda: consume(a.port, a.count)}[a.workload]
    print(json.dumps({"peer": "redis-streams", "client": f"redis-py {redis.__version__}",
                      "workload": a.workload, **run()}), flush=True)


if __name__ == "__main__":
    main()
