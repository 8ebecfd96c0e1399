"""Quick throughput probe of the broker through the test wire helper (not a test).

    .venv/bin/python tests/broker/probe_throughput.py [--size 1024] [--batch 1000] [--count N]

Starts a broker subprocess, sends pre-encoded batches with a window of requests in flight
(client-side encoding is excluded: this measures the broker), then pulls the backlog back from
offset 0 with large pulls. Prints one JSON line per phase.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.wire import RequestCode, Wire, batch, start  # noqa: E402
from tidemq.protocol.headers import SendMessageRequestHeader  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--count", type=int, default=500_000)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--flush", default="async")
    ap.add_argument("--segment-size", type=int, default=1 << 30)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tidemq-probe-"))
    srv = start(
        ["broker", "--port", "0", "--data-dir", str(tmp / "data"), "--flush", args.flush,
         "--log-level", "warning", "-o", f"store.segment_size={args.segment_size}"],
        str(tmp / "broker.log"),
    )
    try:
        w = Wire(srv.addr, timeout=60)
        w.create_topic("probe", 1)
        body = bytes(batch("probe", [b"x" * args.size] * args.batch))
        header = SendMessageRequestHeader(producer_group="p", topic="probe", queue_id=0,
                                          batch=True)
        n_batches = max(1, args.count // args.batch)
        inflight: list[int] = []
        t0 = time.perf_counter()
        for _ in range(n_batches):
            inflight.append(w.send(RequestCode.SEND_BATCH, header, body))
            if len(inflight) >= args.window:
                assert w.recv(inflight.pop(0)).code == 0
        for o in inflight:
            assert w.recv(o).code == 0
        dt = time.perf_counter() - t0
        msgs = n_batches * args.batch
        print(json.dumps({"phase": "send", "msgs": msgs, "msgs_per_s": round(msgs / dt),
                          "mb_per_s": round(msgs * args.size / dt / 1e6, 1),
                          "batch": args.batch, "size": args.size, "flush": args.flush}))
        t0 = time.perf_counter()
        got = 0
        offset = 0
        nbytes = 0
        while offset < msgs:
            f = w.pull("probe", offset, max_msgs=32_000, timeout=30)
            assert f.code == 0, f
            nbytes += len(f.body)
            got = f.header.next_begin_offset - offset
            offset = f.header.next_begin_offset
        dt = time.perf_counter() - t0
        print(json.dumps({"phase": "pull", "msgs": offset, "msgs_per_s": round(offset / dt),
                          "mb_per_s": round(nbytes / dt / 1e6, 1), "last_pull_msgs": got}))
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
