"""`tidemq bench hostile`: a broker and a name server under many hostile connections.

One run, in a temporary directory:

1. a name server and a broker (separate processes, default settings plus ``-o`` options) and a
   topic with 10,000 messages of 1 KiB;
2. *unloaded*: a well-behaved client measures request latency for ``--unloaded-seconds``: a
   one-message send and a 32-message pull on the broker, a route query on the name server,
   each at ``--rate`` per second;
3. *under attack*: two hostile driver processes (``bench/hostile_driver.py``) open
   ``--connections`` connections to each server -- half never read the answers to the requests
   they write, half send frames that never complete. The client keeps measuring: first through
   the *ramp* (until every connection is open, every non-reader blocked and both servers have
   used under a quarter of a core for two seconds: their one-time work of filling each new
   non-reader's socket buffers with answers), then ``--settle-seconds`` more, then *loaded*
   for ``--seconds``. Both servers' RSS is sampled every 0.25 s from the first hostile
   connection on.

The result: p50/p99 per server unloaded and loaded (and their ratio), each server's peak RSS
against the documented bound (docs/operations.md)::

    bound = idle RSS + max_partial_frame_bytes
            + connections x (write_buffer_high_water + largest response + 64 KiB read + 16 KiB)

and the servers' counters (refused connections, dropped partial frames, timeouts).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from tidemq.bench.client_bench import ensure_topic, run_loop
from tidemq.bench.types_bench import runtime_info

__all__ = ["bench_hostile"]

#: Largest response a hostile non-reader gets: a 32-message pull of 1 KiB messages (its batch
#: may hold more: the broker answers whole stored batches of up to 100 messages).
_LARGEST_RESPONSE = 128 * 1024
_PER_CONNECTION = 64 * 1024 + 16 * 1024


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _quiet(pids: list[int], *, below: float = 0.25, seconds: int = 2,
                 limit: float = 180.0) -> None:
    """Return once every process of ``pids`` used less than ``below`` of a core in each of
    ``seconds`` consecutive seconds (or after ``limit`` seconds)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    calm = 0
    while calm < seconds and loop.time() < deadline:
        before = [_cpu_seconds(p) for p in pids]
        await asyncio.sleep(1.0)
        busy = max(_cpu_seconds(p) - b for p, b in zip(pids, before, strict=True))
        calm = calm + 1 if busy < below else 0


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class _Server:
    """``tidemq namesrv`` / ``tidemq broker`` as a child process on a free port."""

    def __init__(self, args: list[str], log_path: str) -> None:
        self.log = open(log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tidemq.cli.main", *args, "--log-level", "warning"],
            stdout=subprocess.PIPE, stderr=self.log, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if " ready " not in line:
            self.proc.kill()
            raise RuntimeError(f"{args[0]} did not start: {line!r} (log: {log_path})")
        self.addr = line.split()[3]

    def rss(self) -> int:
        return _rss(self.proc.pid)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _pct(vals: list[float], p: float) -> float:
    if not vals:
        return float("nan")
    s = sorted(vals)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


async def _measure(pool: Any, namesrv: str, broker: str, topic: str, done: asyncio.Event,
                   rate: int, tick: Callable[[], None]) -> dict[str, list[float]]:
    """Latencies (ms) of sends, pulls and route queries, each at ``rate`` per second, until
    ``done`` is set, on the connections of ``pool`` (open before the attack, as a well-behaved
    client's are)."""
    from tidemq.protocol.codes import RequestCode
    from tidemq.protocol.headers import (
        GetRouteInfoRequestHeader,
        PullMessageRequestHeader,
        SendMessageRequestHeader,
    )
    from tidemq.protocol.record import MessageData, encode_batch

    lat: dict[str, list[float]] = {"send": [], "pull": [], "route": []}
    errors: list[str] = []
    loop = asyncio.get_running_loop()
    period = 1.0 / rate

    async def paced(name: str, op: Callable[[], Any]) -> None:
        nxt = loop.time()
        while not done.is_set():
            t0 = time.perf_counter()
            try:
                await op()
                lat[name].append((time.perf_counter() - t0) * 1000)
            except Exception as exc:  # counted: a failure is a result here
                errors.append(f"{name}: {exc}")
                lat[name].append((time.perf_counter() - t0) * 1000)
            nxt += period
            await asyncio.sleep(max(0.0, nxt - loop.time()))

    batch = bytes(encode_batch(topic, [MessageData(b"x" * 1024)], queue_id=0))
    send_header = SendMessageRequestHeader(producer_group="bench-hostile-ok", topic=topic,
                                           queue_id=0)
    offsets = [0]

    async def send() -> None:
        # Raw requests, not a Producer: the broker's latency alone, no route lookups.
        await pool.request(broker, RequestCode.SEND_MESSAGE, send_header, batch, timeout=10.0)

    async def pull() -> None:
        h = PullMessageRequestHeader(consumer_group="bench-hostile-ok", topic=topic,
                                     queue_id=1, queue_offset=offsets[0] % 2400,
                                     max_msg_nums=32)
        offsets[0] += 32
        await pool.request(broker, RequestCode.PULL_MESSAGE, h, timeout=10.0)

    async def route() -> None:
        await pool.request(namesrv, RequestCode.GET_ROUTEINFO_BY_TOPIC,
                           GetRouteInfoRequestHeader(topic=topic), timeout=10.0)

    async def ticker() -> None:
        while not done.is_set():
            await asyncio.sleep(1.0)
            tick()

    await asyncio.gather(paced("send", send), paced("pull", pull), paced("route", route),
                         ticker())
    lat["errors"] = errors  # type: ignore[assignment]
    return lat


async def _fill(namesrv: str, topic: str, count: int) -> None:
    from tidemq.client.message import Message
    from tidemq.client.producer import Producer

    await ensure_topic(namesrv, topic, 4)
    async with Producer(namesrv) as p:
        for q in range(4):
            for _ in range(count // 4 // 100):
                await p.send_batch([Message(topic=topic, body=b"m" * 1024)] * 100, queue_id=q)


def _summary(lat: dict[str, list[float]]) -> dict[str, Any]:
    broker = lat["send"] + lat["pull"]
    out: dict[str, Any] = {}
    for name, vals in (("broker", broker), ("namesrv", lat["route"])):
        out[f"{name}_p50_ms"] = round(_pct(vals, 50), 3)
        out[f"{name}_p90_ms"] = round(_pct(vals, 90), 3)
        out[f"{name}_p99_ms"] = round(_pct(vals, 99), 3)
        out[f"{name}_max_ms"] = round(max(vals, default=float("nan")), 3)
    for op in ("send", "pull"):
        out[f"{op}_p99_ms"] = round(_pct(lat[op], 99), 3)
    out["requests"] = len(broker) + len(lat["route"])
    out["errors"] = len(lat.get("errors", []))
    return out


def bench_hostile(
    *,
    connections: int = 1000,
    seconds: float = 40.0,
    unloaded_seconds: float = 10.0,
    rate: int = 100,
    partial_rate: int = 64 * 1024,
    settle_seconds: float = 2.0,
    driver_nice: int = 10,
    options: tuple[str, ...] = (),
    data_dir: str | None = None,
    progress: Callable[[int], None] = lambda n: None,
) -> dict[str, Any]:
    """Run the benchmark (module docstring); ``progress`` gets one call per second.
    ``options`` (``KEY=VALUE``) are given to both servers: connection settings.

    The hostile drivers run ``driver_nice`` steps below this process's CPU priority: on one
    machine they share the cores with the servers they attack, which attackers on other machines
    would not; what they still sent is in the result (``drivers``: bytes and requests written),
    so a starved attack shows. ``driver_nice=0`` measures the shared-core case."""
    from tidemq.broker.config import apply_setting_overrides
    from tidemq.namesrv.server import NamesrvConfig

    topic = "bench-hostile"
    opts = [a for o in options for a in ("-o", o)]
    ns_cfg = NamesrvConfig()
    apply_setting_overrides(ns_cfg, list(options), "name server")  # ValueError: bad option
    limits = ns_cfg.connection_limits()
    with tempfile.TemporaryDirectory(prefix="tidemq-bench-hostile-", dir=data_dir) as d:
        ns = _Server(["namesrv", "--port", "0", *opts], os.path.join(d, "namesrv.log"))
        br = None
        drivers: list[subprocess.Popen[str]] = []
        try:
            br = _Server(["broker", "--port", "0", "--namesrv", ns.addr, "--data-dir",
                          os.path.join(d, "broker"), *opts], os.path.join(d, "broker.log"))
            run_loop(_fill(ns.addr, topic, 10_000))
            idle = {"broker": br.rss(), "namesrv": ns.rss()}
            peak = dict(idle)
            ready: list[str] = []
            attack_started = 0.0

            async def sample(stop: asyncio.Event) -> None:
                while not stop.is_set():
                    peak["broker"] = max(peak["broker"], br.rss())
                    peak["namesrv"] = max(peak["namesrv"], ns.rss())
                    await asyncio.sleep(0.25)

            async def phases() -> tuple[dict[str, list[float]], ...]:
                nonlocal ready, attack_started
                from tidemq.client.connection import ConnectionPool

                loop = asyncio.get_running_loop()
                pool = ConnectionPool()

                async def measure_while(wait: Any, tick: bool = True) -> dict[str, list[float]]:
                    done = asyncio.Event()
                    m = loop.create_task(_measure(pool, ns.addr, br.addr, topic, done, rate,
                                                  (lambda: progress(1)) if tick else
                                                  (lambda: None)))
                    try:
                        await wait
                    finally:
                        done.set()
                    return await m

                try:
                    unloaded = await measure_while(asyncio.sleep(unloaded_seconds))
                    t_attack = time.monotonic()
                    for kind, srv in (("broker", br), ("namesrv", ns)):
                        driver = subprocess.Popen(
                            [sys.executable, "-m", "tidemq.bench.hostile_driver", "--target",
                             srv.addr, "--kind", kind, "--connections", str(connections),
                             "--topic", topic, "--partial-rate", str(partial_rate)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                        )
                        if driver_nice:  # lower than ours (no preexec_fn: this process has threads)
                            os.setpriority(os.PRIO_PROCESS, driver.pid, min(
                                19, os.getpriority(os.PRIO_PROCESS, 0) + driver_nice))
                        drivers.append(driver)
                    stop = asyncio.Event()
                    sampler = loop.create_task(sample(stop))
                    try:
                        async def ramp() -> None:
                            nonlocal ready
                            ready = await asyncio.gather(*(
                                loop.run_in_executor(None, p.stdout.readline)  # type: ignore
                                for p in drivers))
                            await _quiet([br.proc.pid, ns.proc.pid])
                            await asyncio.sleep(settle_seconds)

                        ramping = await measure_while(ramp(), tick=False)
                        attack_started = time.monotonic() - t_attack
                        loaded = await measure_while(asyncio.sleep(seconds))
                    finally:
                        stop.set()
                        await sampler
                    return unloaded, ramping, loaded
                finally:
                    pool.close()

            unloaded, ramping, loaded = run_loop(phases())
            alive = {"broker": br.alive(), "namesrv": ns.alive()}
            info = run_loop(runtime_info(br.addr)) if alive["broker"] else {}
        finally:
            for p in drivers:
                p.terminate()
            last = []
            for p in drivers:
                try:
                    out, _ = p.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    out, _ = p.communicate()
                lines = [ln for ln in (out or "").splitlines() if ln.startswith("{")]
                last.append(lines[-1] if lines else "{}")
            if br is not None:
                br.stop()
            ns.stop()
    import json

    bound_extra = limits.max_partial_frame_bytes + connections * (
        limits.write_buffer_high_water + _LARGEST_RESPONSE + _PER_CONNECTION
    )
    u, ra, lo = _summary(unloaded), _summary(ramping), _summary(loaded)
    mib = 1 << 20
    return {
        "workload": "hostile",
        "connections_per_server": connections,
        "nonreaders_per_server": connections // 2,
        "partial_senders_per_server": connections - connections // 2,
        "partial_rate_bytes_per_s": partial_rate,
        "seconds": seconds,
        "rate_per_op": rate,
        "settle_seconds": settle_seconds,
        "driver_nice": driver_nice,
        "seconds_from_attack_to_loaded": round(attack_started, 1),
        "unloaded": u,
        "ramp": ra,
        "loaded": lo,
        "broker_p99_ratio": round(lo["broker_p99_ms"] / max(u["broker_p99_ms"], 1e-9), 2),
        "namesrv_p99_ratio": round(lo["namesrv_p99_ms"] / max(u["namesrv_p99_ms"], 1e-9), 2),
        "broker_rss_idle_mib": round(idle["broker"] / mib, 1),
        "broker_rss_peak_mib": round(peak["broker"] / mib, 1),
        "broker_rss_bound_mib": round((idle["broker"] + bound_extra) / mib, 1),
        "namesrv_rss_idle_mib": round(idle["namesrv"] / mib, 1),
        "namesrv_rss_peak_mib": round(peak["namesrv"] / mib, 1),
        "namesrv_rss_bound_mib": round((idle["namesrv"] + bound_extra) / mib, 1),
        "within_bound": peak["broker"] <= idle["broker"] + bound_extra
        and peak["namesrv"] <= idle["namesrv"] + bound_extra,
        "servers_alive": alive,
        "drivers_ready": [json.loads(r or "{}") for r in ready],
        "drivers": [json.loads(x) for x in last],
        "broker_counters": {k: info.get(k) for k in (
            "connections", "connections_refused", "frames_dropped_busy",
            "partial_frame_timeouts", "connections_overflowed", "partial_frame_bytes")},
        "loaded_errors_sample": loaded.get("errors", [])[:5],
    }
