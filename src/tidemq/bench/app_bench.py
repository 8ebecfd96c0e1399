"""`tidemq bench app`: what applications really write, against Redis Streams through redis-py in
the same run.

The six workloads (varied messages, ``app_messages.py``), each run against tidemq and then
against Redis before the next one starts, so both see the same machine load:

==================  ===============================================  ============================
workload            tidemq                                           redis-py / redis.asyncio
==================  ===============================================  ============================
``send_1_thread``   one thread, blocking ``tidemq.Producer.send``    ``Redis.xadd`` in a loop
                    in a loop
``send_16_threads`` 16 threads share one blocking Producer, each     16 threads share one
                    calls ``send`` in a loop                         ``Redis`` client
``await_send_64``   64 coroutines share one ``tidemq.aio.Producer``, 64 coroutines share one
                    each ``await send`` in a loop                    ``redis.asyncio.Redis``
``send_async``      ``send_async`` of every message, then            pipelines of 1000 ``XADD``
                    ``flush()``
``push_consume``    a blocking ``PushConsumer`` (thread pool, one    ``XREADGROUP COUNT 100``,
                    message per listener call) drains the            the listener per entry,
                    ``send_async`` backlog                           then ``XACK`` of the page
``poll_consume``    a blocking ``PullConsumer`` (new group, auto     the same as for
                    commit) drains the same backlog: ``poll()`` in   ``push_consume`` (a new
                    a loop, a function called per message            consumer group)
==================  ===============================================  ============================

Per side: ``msgs_per_s``, ``us_per_call`` (wall time per message of one sender),
``send_errors`` (``send_async``: futures that failed; not counted as sent),
``client_cpu_us_per_msg`` (this process's CPU time per message: the client's cost, whatever the
server and the rest of the machine do). ``ratio`` is tidemq's rate over Redis'. tidemq runs
against its own fresh ``tidemq dev`` (default ASYNC_FLUSH), Redis with AOF and fsync every
second (bench/peers/servers.py). The Redis side runs in a child process
(bench/peers/redis_app.py), one per workload.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tidemq.bench.app_messages import fields, mean_size
from tidemq.bench.client_bench import ensure_topic, run_loop
from tidemq.bench.dev_process import DevProcess
from tidemq.client.message import Message

__all__ = ["WORKLOADS", "bench_app", "peers_dir"]

Progress = Callable[[int], None]

WORKLOADS = ("send_1_thread", "send_16_threads", "await_send_64", "send_async", "push_consume",
             "poll_consume")
DEFAULT_COUNTS = {"send_1_thread": 10_000, "send_16_threads": 32_000, "await_send_64": 64_000,
                  "send_async": 200_000, "push_consume": 200_000, "poll_consume": 200_000}
#: the workloads that drain the send_async backlog
_CONSUMERS = ("push_consume", "poll_consume")
_TOPIC_QUEUES = 8


def _msg(topic: str, i: int) -> Message:
    body, tag, key, props = fields(i)
    return Message(topic, body, tags=tag, keys=key, properties=props)


def _side(count: int, seconds: float, cpu: float, senders: int = 1) -> dict[str, Any]:
    return {
        "count": count,
        "seconds": round(seconds, 3),
        "msgs_per_s": round(count / seconds) if seconds > 0 else 0,
        "us_per_call": round(seconds * senders / count * 1e6, 1) if count else None,
        "client_cpu_us_per_msg": round(cpu / count * 1e6, 2) if count else None,
    }


def _tick(progress: Progress | None, n: int) -> None:
    if progress is not None:
        progress(n)


# -- tidemq workloads --------------------------------------------------------------------------


def _blocking_sends(namesrv: str, topic: str, count: int, threads: int,
                    progress: Progress | None) -> dict[str, Any]:
    import tidemq

    with tidemq.Producer(namesrv) as producer:
        producer.send(_msg(topic, 0))  # warm: route and connection
        per = count // threads
        step = max(1, per // 20)

        def run(t: int) -> None:
            send = producer.send
            base = t * per
            for i in range(base, base + per):
                send(_msg(topic, i))
                if (i - base) % step == step - 1:
                    _tick(progress, step)

        t0, c0 = time.perf_counter(), time.process_time()
        if threads == 1:
            run(0)
        else:
            ts = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
            for th in ts:
                th.start()
            for th in ts:
                th.join()
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return _side(per * threads, seconds, cpu, threads)


def _await_sends(namesrv: str, topic: str, count: int, coroutines: int,
                 progress: Progress | None) -> dict[str, Any]:
    from tidemq.client.producer import Producer

    async def main() -> dict[str, Any]:
        async with Producer(namesrv) as producer:
            await producer.send(_msg(topic, 0))
            per = count // coroutines
            step = max(1, per // 5)

            async def run(t: int) -> None:
                send = producer.send
                base = t * per
                for i in range(base, base + per):
                    await send(_msg(topic, i))
                    if (i - base) % step == step - 1:
                        _tick(progress, step)

            t0, c0 = time.perf_counter(), time.process_time()
            await asyncio.gather(*(run(t) for t in range(coroutines)))
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        return _side(per * coroutines, seconds, cpu, coroutines)

    return run_loop(main())  # type: ignore[no-any-return]


def _send_async(namesrv: str, topic: str, count: int, progress: Progress | None
                ) -> dict[str, Any]:
    from tidemq.client.producer import Producer

    async def main() -> dict[str, Any]:
        # The pending bound must hold the whole run: every message is handed over before the
        # first flush() (the workload as the issue measures it).
        async with Producer(namesrv, max_pending_messages=max(count, 100_000)) as producer:
            await producer.send(_msg(topic, 0))
            step = 10_000
            futs: list[asyncio.Future[Any]] = []
            keep = futs.append
            t0, c0 = time.perf_counter(), time.process_time()
            send_async = producer.send_async
            for lo in range(0, count, step):
                for i in range(lo, min(count, lo + step)):
                    keep(send_async(_msg(topic, i)))
                _tick(progress, min(step, count - lo))
                await asyncio.sleep(0)  # an application yields now and then
            await producer.flush()
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        # A send that failed is not counted as sent (and its error is retrieved here).
        errors = sum(1 for f in futs if f.done() and not f.cancelled()
                     and f.exception() is not None)
        return {**_side(count - errors, seconds, cpu), "send_errors": errors}

    return run_loop(main())  # type: ignore[no-any-return]


def _push_consume(namesrv: str, topic: str, count: int, progress: Progress | None
                  ) -> dict[str, Any]:
    import tidemq
    from tidemq.client.listener import ConsumeStatus

    counter = itertools.count()  # next() is atomic under the GIL: listener threads share it
    done = threading.Event()
    step = max(1, count // 20)

    def listener(msgs: list[Any], ctx: Any) -> ConsumeStatus:
        for _ in msgs:
            n = next(counter) + 1
            if n % step == 0:
                _tick(progress, step)
            if n >= count:
                done.set()
        return ConsumeStatus.SUCCESS

    group = f"app-{uuid.uuid4().hex[:8]}"
    c = tidemq.PushConsumer(namesrv, group, listener, consume_from="first")
    c.subscribe(topic)
    t0, c0 = time.perf_counter(), time.process_time()
    c.start()
    try:
        if not done.wait(300):
            raise RuntimeError(f"push consumer got {next(counter)} of {count} in 300 s")
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        c.close()
    return _side(count, seconds, cpu)


def _poll_consume(namesrv: str, topic: str, count: int, progress: Progress | None
                  ) -> dict[str, Any]:
    import tidemq

    got = 0
    step = max(1, count // 20)
    ticked = 0

    def handle(m: Any) -> None:  # what the application does with a message
        nonlocal got
        got += 1

    group = f"app-poll-{uuid.uuid4().hex[:8]}"
    with tidemq.PullConsumer(namesrv, group, consume_from="first") as c:
        c.subscribe(topic)
        t0, c0 = time.perf_counter(), time.process_time()
        deadline = time.monotonic() + 300
        while got < count:
            msgs = c.poll(timeout=1.0)
            for m in msgs:
                handle(m)
                if got >= count:  # the backlog also holds send_async's warm-up message
                    break
            if got - ticked >= step:
                _tick(progress, got - ticked)
                ticked = got
            if not msgs and time.monotonic() > deadline:
                raise RuntimeError(f"pull consumer got {got} of {count} in 300 s")
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    _tick(progress, min(got, count) - ticked)
    return _side(got, seconds, cpu)


def _tidemq(workload: str, namesrv: str, topics: dict[str, str], count: int,
            progress: Progress | None) -> dict[str, Any]:
    if workload == "send_1_thread":
        return _blocking_sends(namesrv, topics["send"], count, 1, progress)
    if workload == "send_16_threads":
        return _blocking_sends(namesrv, topics["send"], count, 16, progress)
    if workload == "await_send_64":
        return _await_sends(namesrv, topics["send"], count, 64, progress)
    if workload == "send_async":
        return _send_async(namesrv, topics["backlog"], count, progress)
    if workload == "poll_consume":
        return _poll_consume(namesrv, topics["backlog"], count, progress)
    return _push_consume(namesrv, topics["backlog"], count, progress)


# -- the Redis side ------------------------------------------------------------------------------


def peers_dir() -> Path | None:
    """bench/peers of this checkout (the peer scripts are not part of the package)."""
    here = Path(__file__).resolve().parents[3] / "bench" / "peers"
    return here if (here / "redis_app.py").exists() else None


def _redis_missing() -> str | None:
    import shutil

    if shutil.which("redis-server") is None:
        return "redis-server is not installed (bench/peers/install.sh installs it)"
    try:
        import redis  # noqa: F401
    except ImportError:
        return "redis-py is not installed (bench/peers/install.sh installs it)"
    return None


def _redis(peers: Path, port: int, workload: str, count: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, str(peers / "redis_app.py"), workload, "--port", str(port),
         "--count", str(count)],
        capture_output=True, text=True, timeout=600,
    )
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout).strip()[-500:]}
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


# -- the run -------------------------------------------------------------------------------------


def bench_app(*, workloads: tuple[str, ...] = WORKLOADS, counts: dict[str, int] | None = None,
              redis: bool = True, progress: Progress | None = None) -> dict[str, Any]:
    """Run ``workloads`` against a fresh ``tidemq dev`` and (``redis``) a fresh redis-server;
    one dict for the CLI to print."""
    n = {**DEFAULT_COUNTS, **(counts or {})}
    for w in _CONSUMERS:
        if w in workloads and "send_async" not in workloads:
            raise ValueError(f"{w} drains the send_async backlog: run send_async too")
    result: dict[str, Any] = {
        "bench": "app",
        "message": {"body_bytes": "100..2000", "mean_body_bytes": round(mean_size()),
                    "tags": 8, "keys": "one each", "properties": 2},
        "load1_before": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "workloads": {},
    }
    why_not = _redis_missing() if redis else "--no-redis"
    peers = peers_dir()
    if why_not is None and peers is None:
        why_not = "bench/peers/redis_app.py not found (run from a checkout of tidemq)"
    result["redis"] = why_not or "redis-server, AOF, appendfsync everysec"
    run_id = uuid.uuid4().hex[:6]
    topics = {"send": f"app-send-{run_id}", "backlog": f"app-backlog-{run_id}"}
    with tempfile.TemporaryDirectory(prefix="tidemq-bench-app-") as d:
        dev = DevProcess(os.path.join(d, "dev")).start()
        server_cm: Any = None
        try:
            for t in topics.values():
                run_loop(ensure_topic(dev.namesrv, t, _TOPIC_QUEUES))
            port = 0
            if why_not is None:
                assert peers is not None
                sys.path.insert(0, str(peers))
                try:
                    import servers  # bench/peers/servers.py
                finally:
                    sys.path.remove(str(peers))
                server_cm = servers.redis_server()
                port = server_cm.__enter__().port
            for w in workloads:
                row: dict[str, Any] = {"tidemq": _tidemq(w, dev.namesrv, topics, n[w], progress)}
                if why_not is None:
                    assert peers is not None
                    row["redis"] = _redis(peers, port, w, n[w])
                    _tick(progress, n[w])
                    r = row["redis"].get("msgs_per_s")
                    if r:
                        row["ratio"] = round(row["tidemq"]["msgs_per_s"] / r, 2)
                result["workloads"][w] = row
        finally:
            if server_cm is not None:
                server_cm.__exit__(None, None, None)
            dev.stop()
    return result
