"""What the peer workload scripts share: the command line, the result record (the same keys as
``tidemq bench``), payloads stamped with a send time, percentiles and the fixed-rate pacer.

Plain functions and one class used from a single thread of one process.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import time
from collections.abc import Sequence

# Every e2e payload starts with the sender's CLOCK_MONOTONIC in ns: the clock is system-wide
# on Linux, so a consumer in another process on this machine can subtract it.
STAMP = struct.Struct("<q")
DEFAULT_TIMEOUT_S = 300.0


def parse_args(peer: str, argv: Sequence[str] | None, extra=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=f"{peer}.py", description=f"produce / consume / e2e workloads against {peer}"
    )
    p.add_argument("workload", choices=("produce", "consume", "e2e"))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--stream", default=None, help="stream / key name (default: per workload)")
    p.add_argument("--size", type=int, default=1024, help="message body bytes")
    p.add_argument("--count", type=int, default=200_000, help="messages (produce, consume)")
    p.add_argument("--batch", type=int, default=1000, help="messages per batch / page")
    p.add_argument("--rate", type=int, default=10_000, help="e2e: messages per second")
    p.add_argument("--seconds", type=float, default=10.0, help="e2e: how long to send")
    p.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="give up after this long"
    )
    if extra is not None:
        extra(p)
    args = p.parse_args(argv)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        p.error("these benchmarks only talk to a server on this machine (loopback)")
    if args.size < STAMP.size:
        p.error(f"--size must be >= {STAMP.size} (e2e stamps the send time into the body)")
    if min(args.count, args.batch, args.rate) <= 0 or args.seconds <= 0:
        p.error("--count, --batch, --rate and --seconds must be positive")
    return args


def result(
    peer: str, workload: str, *, size: int, count: int, batch: int, seconds: float, **extra
) -> dict:
    """The record every run prints; ``mb_per_s`` counts message bodies only (10**6 bytes)."""
    out = {
        "peer": peer,
        "workload": workload,
        "size": size,
        "count": count,
        "batch": batch,
        "msgs_per_s": round(count / seconds) if seconds > 0 else 0,
        "mb_per_s": round(count * size / seconds / 1e6, 1) if seconds > 0 else 0.0,
        "seconds": round(seconds, 3),
    }
    out.update(extra)
    return out


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def latency_summary(latencies_ns: list[int]) -> dict:
    """p50/p99/p999/max in ms by nearest rank over every received message."""
    if not latencies_ns:
        return {"p50_ms": None, "p99_ms": None, "p999_ms": None, "max_ms": None}
    xs = sorted(latencies_ns)
    n = len(xs)

    def pct(q: float) -> float:
        i = min(n - 1, max(0, int(q * n + 0.999999) - 1))
        return round(xs[i] / 1e6, 3)

    return {
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
        "p999_ms": pct(0.999),
        "max_ms": round(xs[-1] / 1e6, 3),
    }


def stamped(payload: bytearray) -> bytes:
    """The payload with the current monotonic time in its first 8 bytes."""
    STAMP.pack_into(payload, 0, time.monotonic_ns())
    return bytes(payload)


def latency_ns(body: bytes, now_ns: int) -> int:
    return now_ns - STAMP.unpack_from(body, 0)[0]


class Pacer:
    """Release messages at a fixed rate for a fixed time: ``due()`` says how many are owed now
    (more than one only when the sender fell behind), ``wait()`` sleeps until the next one.
    Sending whatever is owed at once keeps the average rate even when a sleep overshoots."""

    def __init__(self, rate: int, seconds: float) -> None:
        self.rate = rate
        self.total = int(rate * seconds)
        self.sent = 0
        self.t0 = time.monotonic()

    def done(self) -> bool:
        return self.sent >= self.total

    def due(self) -> int:
        owed = int((time.monotonic() - self.t0) * self.rate) + 1
        return max(0, min(owed, self.total) - self.sent)

    def delay(self) -> float:
        return self.t0 + self.sent / self.rate - time.monotonic()

    def wait(self) -> None:
        d = self.delay()
        if d > 0:
            time.sleep(d)
