"""A real `tidemq dev` (name server + broker in one process) per test module."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest


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


@pytest.fixture(scope="module")
def dev() -> Iterator[DevCluster]:
    with tempfile.TemporaryDirectory(prefix="tidemq-client-") as d:
        c = start_dev(d)
        try:
            yield c
        finally:
            stop_dev(c)
