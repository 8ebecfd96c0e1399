"""Two brokers behind one name server: the producer keeps sending when one is killed -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import tidemq


def _start(args: list[str], ready: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "tidemq.cli.main", *args,
                             "--log-level", "warning"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith(ready), f"{args[0]} did not start: {line!r}"
    return proc, line.split()[-1]


def test_producer_fails_over_when_a_broker_is_killed():
    procs: list[subprocess.Popen[str]] = []
    with tempfile.TemporaryDirectory(prefix="tidemq-failover-") as d:
        try:
            ns_proc, ns = _start(["namesrv", "--port", "0"], "tidemq namesrv ready")
            procs.append(ns_proc)
            brokers = {}
            for name in ("broker-a", "broker-b"):
                p, addr = _start(["broker", "--namesrv", ns, "--port", "0", "--name", name,
                                  "--data-dir", os.path.join(d, name)], "tidemq broker ready")
                procs.append(p)
                brokers[name] = (p, addr)
            with tidemq.Admin(ns) as admin:
                deadline = time.monotonic() + 10
                while len(admin.brokers()) < 2:
                    assert time.monotonic() < deadline, "brokers never registered"
                    time.sleep(0.05)
                admin.create_topic("fo", 2)
            with tidemq.Producer(ns, send_timeout=3) as producer:
                first = [producer.send(tidemq.Message("fo", b"x")) for _ in range(8)]
                assert {r.broker_name for r in first} == {"broker-a", "broker-b"}
                brokers["broker-a"][0].send_signal(signal.SIGKILL)
                brokers["broker-a"][0].wait()
                t0 = time.monotonic()
                after = [producer.send(tidemq.Message("fo", b"y")) for _ in range(20)]
                took = time.monotonic() - t0
            # The route still lists broker-a (the name server expires it after 120 s): every
            # send still succeeded, on broker-b, and the dead broker was avoided after it
            # failed rather than retried for each message.
            assert {r.broker_name for r in after} == {"broker-b"}
            assert took < 3.0, f"20 sends took {took:.2f} s after the kill"
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
