"""Run tidemq's produce / consume / e2e workloads against every peer in one go.

For each peer: start its server (servers.py: temp dir, 127.0.0.1, free ports), run for each
size a produce of ``--count`` messages then a consume of that backlog from the start, then one
e2e run at ``--rate`` for ``--seconds``, stop the server. Every run is a fresh interpreter
(``redis_streams.py`` / ``rabbitmq_streams.py``) whose JSON line is echoed to stdout as it
arrives; a table of all runs goes to stderr at the end.

Peer ``tidemq`` (run only when this checkout's CLI has ``tidemq bench produce``) starts
``tidemq dev`` and runs ``tidemq bench produce|consume|e2e`` with the same parameters, so the
comparison comes from one run on one machine state.

Single-threaded; every child has a timeout and every server is stopped in a finally block.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import servers

HERE = Path(__file__).resolve().parent
PEERS = ("redis", "rabbitmq", "tidemq")
SCRIPTS = {"redis": HERE / "redis_streams.py", "rabbitmq": HERE / "rabbitmq_streams.py"}
TIDEMQ = [sys.executable, "-m", "tidemq.cli.main"]
TIDEMQ_READY_TIMEOUT_S = 30.0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--peers", default=",".join(PEERS), help="comma-separated subset of redis,rabbitmq,tidemq"
    )
    p.add_argument("--sizes", default="1024,100", help="message sizes for produce/consume")
    p.add_argument("--count", type=int, default=200_000)
    p.add_argument("--batch", type=int, default=1000)
    p.add_argument("--e2e-size", type=int, default=1024)
    p.add_argument("--rate", type=int, default=10_000)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--run-timeout", type=float, default=300.0, help="per workload run")
    p.add_argument("--repeat", type=int, default=1, help="run every workload this many times")
    args = p.parse_args(argv)
    args.peers = [x.strip() for x in args.peers.split(",") if x.strip()]
    bad = [x for x in args.peers if x not in PEERS]
    if bad:
        p.error(f"unknown peer(s) {bad}; choose from {PEERS}")
    args.sizes = [int(x) for x in args.sizes.split(",")]
    return args


FAILED_RUNS: list[str] = []


def _run_child(
    cmd: list[str], timeout: float, label: str, defaults: dict | None = None
) -> dict | None:
    """Run one workload; print and return its JSON record (the last stdout line, completed
    with ``defaults`` for keys it lacks), or None on failure."""
    rec = _try_child(cmd, timeout, label, defaults or {})
    if rec is None:
        FAILED_RUNS.append(label)
    return rec


def _try_child(cmd: list[str], timeout: float, label: str, defaults: dict) -> dict | None:
    load_before = round(os.getloadavg()[0], 2)
    try:
        proc = subprocess.run(
            cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        print(f"[{label}] timed out after {timeout:.0f} s", file=sys.stderr, flush=True)
        return None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-15:])
        print(f"[{label}] failed (exit {proc.returncode}):\n{tail}", file=sys.stderr, flush=True)
        return None
    record = {**defaults, **json.loads(lines[-1])}
    # Other work on this (shared, 2-core) machine moves every number: keep the load with it.
    record["load1_before"] = load_before
    print(json.dumps(record), flush=True)
    return record


def _peer_runs(args, script: Path, port: int, name: str) -> list[dict]:
    base = [sys.executable, str(script)]
    common = ["--port", str(port), "--batch", str(args.batch)]
    runs: list[tuple[str, list[str]]] = []
    for size in args.sizes:
        sz = ["--size", str(size), "--count", str(args.count), "--stream", f"bench-{size}"]
        runs.append((f"{name} produce {size}", [*base, "produce", *common, *sz]))
        runs.append((f"{name} consume {size}", [*base, "consume", *common, *sz]))
    e2e = ["--size", str(args.e2e_size), "--rate", str(args.rate), "--seconds", str(args.seconds)]
    runs.append((f"{name} e2e {args.e2e_size}", [*base, "e2e", *common, *e2e]))
    out = []
    for label, cmd in runs * args.repeat:
        print(f"[{label}] ...", file=sys.stderr, flush=True)
        rec = _run_child(cmd + ["--timeout", str(args.run_timeout)], args.run_timeout + 30, label)
        if rec is not None:
            out.append(rec)
    return out


def run_redis(args) -> list[dict]:
    with servers.redis_server() as srv:
        print(
            f"[redis] redis-server {srv.info['version']} on 127.0.0.1:{srv.port}",
            file=sys.stderr,
            flush=True,
        )
        return _peer_runs(args, SCRIPTS["redis"], srv.port, "redis")


def run_rabbitmq(args) -> list[dict]:
    with servers.rabbitmq_server() as srv:
        where = f"stream port 127.0.0.1:{srv.port}, booted in {srv.info['boot_s']} s"
        print(f"[rabbitmq] rabbitmq-server {srv.info['version']} {where}", file=sys.stderr)
        return _peer_runs(args, SCRIPTS["rabbitmq"], srv.port, "rabbitmq")


def _tidemq_has_bench() -> bool:
    probe = subprocess.run(
        [*TIDEMQ, "bench", "produce", "--help"],
        capture_output=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )
    return probe.returncode == 0


@contextlib.contextmanager
def _tidemq_dev():
    data = Path(tempfile.mkdtemp(prefix="peer-tidemq-"))
    log = open(data / "dev.log", "wb")  # noqa: SIM115 - closed in the finally below
    proc = subprocess.Popen(
        [
            *TIDEMQ,
            "dev",
            "--data-dir",
            str(data / "data"),
            "--namesrv-port",
            "0",
            "--broker-port",
            "0",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + TIDEMQ_READY_TIMEOUT_S
        namesrv = None
        # readline blocks; the dev server prints its ready line within a second or dies.
        while namesrv is None and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
            if line.startswith("tidemq dev ready"):
                namesrv = line.split("namesrv=")[1].split()[0]
        if namesrv is None:
            raise RuntimeError(f"tidemq dev did not start; see {data / 'dev.log'}")
        yield namesrv
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(15)
        log.close()
        shutil.rmtree(data, ignore_errors=True)


def _tidemq_run(args, out: list[dict], what: str, opts: list[str], defaults: dict) -> None:
    workload = what.split()[0]
    label = f"tidemq {what}"
    print(f"[{label}] ...", file=sys.stderr, flush=True)
    cmd = [*TIDEMQ, "bench", workload, *opts, "--json"]
    rec = _run_child(cmd, args.run_timeout + 30, label,
                     {"peer": "tidemq", "workload": workload, **defaults})  # fmt: skip
    if rec is not None:
        out.append(rec)


def run_tidemq(args) -> list[dict]:
    if not _tidemq_has_bench():
        print(
            "[tidemq] skipped: this checkout has no `tidemq bench produce` yet",
            file=sys.stderr,
            flush=True,
        )
        return []
    out = []
    with _tidemq_dev() as namesrv:
        print(f"[tidemq] tidemq dev, name server {namesrv}", file=sys.stderr, flush=True)
        for rep in range(args.repeat):
            for size in args.sizes:
                # A fresh topic per repeat: consume reads from the earliest offset.
                topic = ["--namesrv", namesrv, "--topic", f"bench-{size}-{rep}"]
                n = ["--count", str(args.count), "--batch", str(args.batch)]
                _tidemq_run(args, out, f"produce {size}", [*topic, "--size", str(size), *n],
                            {"size": size})  # fmt: skip
                _tidemq_run(args, out, f"consume {size}", [*topic, *n], {"size": size})
            e2e = ["--namesrv", namesrv, "--topic", f"e2e-{rep}", "--size", str(args.e2e_size),
                   "--rate", str(args.rate), "--seconds", str(args.seconds)]  # fmt: skip
            _tidemq_run(args, out, f"e2e {args.e2e_size}", e2e, {"size": args.e2e_size})
    return out


def table(records: list[dict]) -> str:
    cols = (
        "peer",
        "workload",
        "size",
        "count",
        "batch",
        "msgs_per_s",
        "mb_per_s",
        "p50_ms",
        "p99_ms",
        "p999_ms",
    )
    rows = [[str(r.get(c, "")) for c in cols] for r in records]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    fmt = "  ".join(f"{{:{'<' if i < 2 else '>'}{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*cols), *(fmt.format(*row) for row in rows)])


def ratios(records: list[dict]) -> list[str]:
    """tidemq's rate over each peer's, per workload and size (the peers' targets, e.g.
    consume 1 KiB >= 2.3x Redis XRANGE pages of 1000); a mean when --repeat ran several."""
    rates: dict[tuple[str, str, object], list[float]] = {}
    for r in records:
        if r.get("msgs_per_s") and r.get("workload") in ("produce", "consume"):
            rates.setdefault((r["peer"], r["workload"], r.get("size")), []).append(
                r["msgs_per_s"])
    lines = []
    for (peer, workload, size), vals in sorted(rates.items(), key=str):
        mine = rates.get(("tidemq", workload, size))
        if peer == "tidemq" or not mine:
            continue
        ratio = (sum(mine) / len(mine)) / (sum(vals) / len(vals))
        lines.append(f"tidemq / {peer}: {workload} {size} B {ratio:.2f}x")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    runners = {"redis": run_redis, "rabbitmq": run_rabbitmq, "tidemq": run_tidemq}
    records: list[dict] = []
    failed = []
    for peer in args.peers:
        try:
            records += runners[peer](args)
        except Exception as exc:  # one broken peer must not hide the others' numbers
            print(f"[{peer}] failed: {exc}", file=sys.stderr, flush=True)
            failed.append(peer)
    if records:
        print("\n" + table(records), file=sys.stderr, flush=True)
        for line in ratios(records):
            print(line, file=sys.stderr, flush=True)
    if failed or FAILED_RUNS:
        print(f"failed: {failed + FAILED_RUNS}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
