"""The one launcher of name servers and brokers for the tests. Three shapes, one module:

- :func:`start_namesrv` / :func:`start_broker` (a :class:`Server`): one ``tidemq namesrv`` or
  ``tidemq broker`` process each, on ports the OS picks, data and log under a temp dir -- for
  tests that talk to one broker's wire (tests/broker, tests/namesrv, tests/fuzz);
- :func:`start_dev` / :func:`dev_cluster` (a :class:`DevCluster`): ``tidemq dev``, a name
  server and a broker in one process (the product's ``DevProcess``) -- for client, group,
  producer-path and Spark tests;
- :func:`start_cluster` (a :class:`LocalCluster`): the product's own LocalCluster (``tidemq
  cluster up`` runs it too): name servers, broker groups with slaves, and with
  ``election=True`` an etcd of its own (one member, 127.0.0.1, its own data dir) and short
  leases; test-sized settings -- small segments, so replication crosses segment ends, and fast
  replication heartbeats, so a lost link is noticed in seconds.

Import it as ``support.cluster`` (``tests/`` is on the path). New shapes (a dev process with
a slave, an etcd for a plain broker) belong here too.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tidemq.bench.dev_process import DevProcess
from tidemq.bench.local_cluster import LocalCluster, Proc, find_etcd
from tidemq.client.blocking import Admin

__all__ = ["TEST_OPTIONS", "ELECTION_OPTIONS", "LocalCluster", "Proc", "start_cluster",
           "wait_until", "info", "same_commitlog", "needs_etcd", "Server", "start",
           "start_namesrv", "start_broker", "DevCluster", "start_dev", "stop_dev",
           "dev_cluster"]

SRC = str(Path(__file__).resolve().parents[2] / "src")

TEST_OPTIONS = (
    "store.segment_size=1048576",
    "store.index_slots=4096",
    "store.index_max_entries=16384",
    "store.cq_units_per_file=4096",
    "store.flush_interval_ms=100",
    "ha_heartbeat_interval_ms=500",
    "ha_housekeeping_interval_ms=4000",
    "ha_sync_metadata_interval_ms=1000",
    "ha_max_catchup_ms=3000",
    "offset_persist_interval_ms=500",
    # the machine's disk is shared with other test runs: retention must not delete segments
    # (or refuse writes) because of disk space the tests do not use
    "store.disk_max_used_ratio=0.97",
    "store.disk_clean_forcibly_ratio=0.98",
    "store.disk_refuse_writes_ratio=0.99",
)


#: election tests: a dead master is replaced about 3 s after its death
ELECTION_OPTIONS = (
    "election_lease_ttl_ms=3000",
    "election_poll_interval_ms=250",
    "etcd_timeout_ms=1500",
)

#: `make setup` installs Debian's etcd-server; only a machine where it cannot (no apt) skips
needs_etcd = pytest.mark.skipif(
    find_etcd() is None,
    reason="etcd is not installed and `make setup` could not install it (Debian package "
           "etcd-server; or set TIDEMQ_ETCD to an etcd binary)",
)


def start_cluster(root: Path, *, groups: int = 1, slaves: int = 1, namesrvs: int = 1,
                  role: str = "ASYNC_MASTER", options: tuple[str, ...] = (),
                  election: bool = False) -> LocalCluster:
    opts = TEST_OPTIONS + (ELECTION_OPTIONS if election else ()) + tuple(options)
    c = LocalCluster(root, log_level="info", broker_options=opts, etcd_in_memory=True)
    return c.up(namesrvs=namesrvs, groups=groups, slaves=slaves, role=role, election=election)


def wait_until(pred, timeout: float, step: float = 0.05, what: str = "condition") -> Any:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout} s")
        time.sleep(step)


def info(c: LocalCluster, p: Proc) -> dict[str, Any]:
    """Runtime info of one broker (GET_BROKER_RUNTIME_INFO)."""
    with Admin(c.namesrv_addrs or p.addr) as admin:
        return admin.runtime_info(p.addr)


def same_commitlog(a: Proc, b: Proc) -> bool:
    """Every segment both brokers hold is byte-identical (the shorter log's last segment up to
    its end, the rest of both zeros)."""
    da, db = Path(a.data_dir) / "commitlog", Path(b.data_dir) / "commitlog"
    names = sorted(set(p.name for p in da.iterdir()) & set(p.name for p in db.iterdir()))
    assert names, "no common segment"
    return all((da / n).read_bytes() == (db / n).read_bytes() for n in names)


# -- one name server or broker process ---------------------------------------------------------


@dataclass
class Server:
    proc: subprocess.Popen
    ready: str
    log_path: str
    addrs: dict[str, str] = field(default_factory=dict)

    @property
    def addr(self) -> str:
        return self.addrs.get("broker") or self.addrs.get("namesrv") or ""

    def kill9(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, sig=signal.SIGTERM, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def log(self) -> str:
        try:
            return Path(self.log_path).read_text()
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    return env


def start(args: list[str], log_path: str, timeout: float = 20.0) -> Server:
    """Start ``python -m tidemq.cli.main ARGS`` and wait for its ready line."""
    log = open(log_path, "ab")  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "tidemq.cli.main", *args],
        stdout=subprocess.PIPE,
        stderr=log,
        env=_env(),
    )
    deadline = time.monotonic() + timeout
    line = b""
    # poll, not select: a long test session can hold more than FD_SETSIZE (1024) descriptors
    poller = select.poll()
    poller.register(proc.stdout, select.POLLIN | select.POLLHUP)
    while time.monotonic() < deadline:
        if poller.poll(100):
            line = proc.stdout.readline()
            break
        if proc.poll() is not None:
            break
    text = line.decode().strip()
    if "ready" not in text:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"server did not start: {text!r}\n{Path(log_path).read_text()}")
    addrs: dict[str, str] = {}
    parts = text.split()
    if parts[1] == "dev":
        for p in parts[3:]:
            k, _, v = p.partition("=")
            addrs[k] = v
    else:
        addrs[parts[1]] = parts[3]
    return Server(proc, text, log_path, addrs)


def start_namesrv(tmp: Path, *extra: str) -> Server:
    return start(["namesrv", "--port", "0", *extra], str(tmp / "namesrv.log"))


def start_broker(tmp: Path, namesrv: str = "", *extra: str, name: str = "broker-a",
                 data_dir: Path | None = None) -> Server:
    data = data_dir or (tmp / f"data-{name}")
    args = ["broker", "--port", "0", "--data-dir", str(data), "--name", name,
            "-o", "store.segment_size=67108864", "-o", "store.index_slots=4096",
            "-o", "store.index_max_entries=16384", "-o", "store.cq_units_per_file=4096"]
    if namesrv:
        args += ["--namesrv", namesrv]
    return start([*args, *extra], str(tmp / f"{name}.log"))



# -- `tidemq dev`: name server and broker in one process -----------------------------------------

#: The tests' dev cluster is the product's own child-process helper (also used by benchmarks).
DevCluster = DevProcess


def start_dev(data_dir: str, *options: str) -> DevCluster:
    """A started ``tidemq dev`` on ``data_dir``; ``options`` are broker settings (KEY=VALUE)."""
    return DevProcess(data_dir, *options).start(20)


def stop_dev(c: DevCluster) -> None:
    c.stop(10)


def dev_cluster(prefix: str, *options: str) -> Iterator[DevCluster]:
    """Body of a module fixture: a ``tidemq dev`` in a temp dir, stopped and removed after."""
    with tempfile.TemporaryDirectory(prefix=prefix) as d:
        c = start_dev(d, *options)
        try:
            yield c
        finally:
            stop_dev(c)
