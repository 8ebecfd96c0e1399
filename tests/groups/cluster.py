"""Helpers of the group tests: a real `tidemq dev` (name server + broker) with test-sized
group timings: silent consumers expire after 3 s (scanned every 0.3 s) and the delay schedule
is in tens of milliseconds so sixteen retries take seconds, not hours."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

#: Test-sized RocketMQ schedule: level L waits TEST_LEVELS_MS[L - 1] ms.
TEST_LEVELS_MS = [10, 20] + [100 + 20 * i for i in range(16)]
EXPIRY_MS = 3000

GROUP_OPTIONS = (
    f"client_channel_expired_ms={EXPIRY_MS}",
    "client_scan_interval_ms=300",
    "message_delay_level=" + " ".join(f"{ms}ms" for ms in TEST_LEVELS_MS),
)


@dataclass
class DevCluster:
    proc: subprocess.Popen[str]
    namesrv: str
    broker: str
    data_dir: str


def start_dev(data_dir: str, *options: str) -> DevCluster:
    cmd = [sys.executable, "-m", "tidemq.cli.main", "dev", "--data-dir", data_dir,
           "--namesrv-port", "0", "--broker-port", "0", "--log-level", "warning"]
    for o in options:
        cmd += ["-o", o]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    deadline = time.monotonic() + 20
    line = ""
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("tidemq dev ready") or not line:
            break
    if not line.startswith("tidemq dev ready"):
        proc.kill()
        raise RuntimeError(f"tidemq dev did not start: {line!r}")
    fields = dict(part.split("=", 1) for part in line.split()[3:])
    return DevCluster(proc, fields["namesrv"], fields["broker"], data_dir)


def stop_dev(c: DevCluster) -> None:
    if c.proc.poll() is None:
        c.proc.send_signal(signal.SIGTERM)
        try:
            c.proc.wait(10)
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()


def wait_until(pred, timeout: float, step: float = 0.02) -> float:  # noqa: ANN001
    """Seconds until ``pred()`` held; raises AssertionError after ``timeout``."""
    t0 = time.monotonic()
    while True:
        if pred():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(step)
