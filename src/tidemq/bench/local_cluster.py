"""A whole tidemq cluster on this machine, as separate processes on loopback: name servers and
broker groups (a master and its slaves). What ``tidemq cluster up|down`` runs, and what the
cluster tests and benchmarks start (one launcher for all of them).

::

    c = LocalCluster("/tmp/c").up(groups=2, slaves=1)   # 2 name servers, broker-a/b + slaves
    c.namesrv                                            # "127.0.0.1:P1;127.0.0.1:P2"
    m = c.broker("broker-a", 0); c.kill9(m); c.restart(m)
    c.down()

Every process is a ``python -m tidemq.cli.main namesrv|broker ...`` child in its own session
(so it outlives ``tidemq cluster up``), stdout in ``<root>/logs/<name>.out`` (its ready line),
stderr in ``<root>/logs/<name>.log``; brokers keep their data in ``<root>/<broker>-<id>``.
``<root>/cluster.json`` records every process (pid and its start time, so ``down`` never
signals a process that merely reused the pid), address and arguments.

With ``election=True`` (``tidemq cluster up --election``) an etcd process comes first (one
member, its own data dir ``<root>/etcd`` and ports on 127.0.0.1, never the system's service) and
every broker gets ``-o etcd_endpoints=...``: masters are elected there (docs/cluster.md).

Threads: one caller.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

__all__ = ["LocalCluster", "Proc", "find_etcd"]

STATE = "cluster.json"


def find_etcd() -> str | None:
    """The etcd binary: $TIDEMQ_ETCD, else etcd on PATH, else Debian's /usr/bin/etcd (the
    ``etcd-server`` package, which ``make setup`` installs)."""
    env = os.environ.get("TIDEMQ_ETCD")
    if env:
        return env if os.access(env, os.X_OK) else None
    found = shutil.which("etcd")
    if found:
        return found
    return "/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK) else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    kind: str  # "namesrv", "broker" or "etcd"
    name: str  # unique in the cluster: namesrv-0, broker-a-0 (broker name and id)
    args: list[str]
    broker_name: str = ""
    broker_id: int = 0
    role: str = ""
    data_dir: str = ""
    pid: int = 0
    started: int = 0  # the process's start time (/proc/<pid>/stat field 22)
    addr: str = ""
    ha: str = ""
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False, compare=False)

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return _same_process(self.pid, self.started)

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "popen"}


def _start_time(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def _same_process(pid: int, started: int) -> bool:
    return pid > 0 and started > 0 and _start_time(pid) == started


class LocalCluster:
    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        log_level: str = "info",
        broker_options: tuple[str, ...] = (),
        python: str = sys.executable,
        etcd_in_memory: bool = False,
    ) -> None:
        self.root = Path(root).resolve()
        #: tests and benchmarks: etcd's data on tmpfs (/dev/shm), so the fsyncs of a disk
        #: shared with other work never delay a lease renewal past its TTL
        self.etcd_in_memory = etcd_in_memory
        self.log_level = log_level
        self.broker_options = tuple(broker_options)
        self.python = python
        self.procs: list[Proc] = []

    # -- state -----------------------------------------------------------------------------
    @property
    def namesrv_addrs(self) -> list[str]:
        return [p.addr for p in self.procs if p.kind == "namesrv" and p.addr]

    @property
    def namesrv(self) -> str:
        return ";".join(self.namesrv_addrs)

    @property
    def etcd(self) -> str:
        """etcd's client address ("" without election)."""
        return next((p.addr for p in self.procs if p.kind == "etcd"), "")

    def brokers(self, name: str | None = None) -> list[Proc]:
        return [p for p in self.procs if p.kind == "broker"
                and (name is None or p.broker_name == name)]

    def broker(self, name: str, broker_id: int) -> Proc:
        for p in self.brokers(name):
            if p.broker_id == broker_id:
                return p
        raise KeyError(f"no broker {name} id {broker_id} in this cluster")

    def save(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        data = {"root": str(self.root), "processes": [p.to_json() for p in self.procs]}
        tmp = self.root / (STATE + ".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.root / STATE)

    @classmethod
    def load(cls, root: str | os.PathLike[str]) -> LocalCluster:
        c = cls(root)
        path = c.root / STATE
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{path} does not exist: no cluster was started in {c.root} "
                "(tidemq cluster up --dir DIR)"
            ) from None
        c.procs = [Proc(**p) for p in data["processes"]]
        return c

    def ready_line(self) -> str:
        brokers = ",".join(
            f"{p.broker_name}/{p.broker_id}={p.addr}" for p in self.brokers() if p.addr
        )
        etcd = f" etcd={self.etcd}" if self.etcd else ""
        return f"tidemq cluster ready namesrv={self.namesrv} brokers={brokers}{etcd}"

    # -- starting ----------------------------------------------------------------------------
    def _spawn(self, p: Proc) -> None:
        logs = self.root / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        out = logs / f"{p.name}.out"
        out.write_bytes(b"")
        argv = (p.args if p.kind == "etcd" else
                [self.python, "-m", "tidemq.cli.main", *p.args, "--log-level", self.log_level])
        with open(out, "wb") as o, open(logs / f"{p.name}.log", "ab") as e:
            p.popen = subprocess.Popen(
                argv, stdout=o, stderr=e, stdin=subprocess.DEVNULL, start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        p.pid = p.popen.pid
        p.started = _start_time(p.pid)
        if p.kind != "etcd":
            p.addr = p.ha = ""

    def _await_etcd(self, p: Proc, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://{p.addr}/health", timeout=1) as r:
                    if b"true" in r.read():
                        break
            except OSError:
                pass
            if not p.alive() or time.monotonic() > deadline:
                tail = (self.root / "logs" / f"{p.name}.log").read_text()[-3000:]
                if p.alive():
                    self._signal(p, signal.SIGKILL)
                raise RuntimeError(f"etcd did not start on {p.addr}:\n{tail}")
            time.sleep(0.05)
        if not p.started:
            p.started = _start_time(p.pid)

    def start_etcd(self, timeout: float = 30.0) -> Proc:
        """One etcd member on 127.0.0.1 (its own data dir and ports; short raft timeouts)."""
        binary = find_etcd()
        if binary is None:
            raise RuntimeError(
                "etcd is not installed: election needs it (Debian: apt-get install etcd-server, "
                "which `make setup` does; or set TIDEMQ_ETCD to the etcd binary)"
            )
        client, peer = _free_port(), _free_port()
        c_url, p_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
        data = self.root / "etcd"
        if self.etcd_in_memory and os.path.isdir("/dev/shm"):
            data = Path(f"/dev/shm/tidemq-etcd-{os.getpid()}-{client}")
        p = Proc("etcd", "etcd-0", [
            binary, "--name", "etcd-0", "--data-dir", str(data),
            "--listen-client-urls", c_url, "--advertise-client-urls", c_url,
            "--listen-peer-urls", p_url, "--initial-advertise-peer-urls", p_url,
            "--initial-cluster", f"etcd-0={p_url}", "--initial-cluster-state",
            "existing" if (data / "member").exists() else "new",
            "--heartbeat-interval", "100", "--election-timeout", "1000",
            "--auto-compaction-retention", "1",
        ], data_dir=str(data))
        p.addr = f"127.0.0.1:{client}"
        self._spawn(p)
        self.procs.append(p)
        try:
            self._await_etcd(p, timeout)
        finally:
            self.save()
        return p

    def _await_ready(self, p: Proc, timeout: float) -> None:
        out = self.root / "logs" / f"{p.name}.out"
        deadline = time.monotonic() + timeout
        while True:
            line = out.read_text().strip()
            if "ready" in line:
                break
            if not p.alive() or time.monotonic() > deadline:
                log_tail = (self.root / "logs" / f"{p.name}.log").read_text()[-3000:]
                if p.alive():
                    self._signal(p, signal.SIGKILL)
                raise RuntimeError(f"{p.name} did not start ({line!r}):\n{log_tail}")
            time.sleep(0.02)
        parts = line.split()
        p.addr = parts[3]
        for part in parts[4:]:
            k, _, v = part.partition("=")
            if k == "ha":
                p.ha = v
            elif k == "role":
                p.role = v
        if not p.started:
            p.started = _start_time(p.pid)

    def start_namesrvs(self, n: int = 2, timeout: float = 30.0) -> list[Proc]:
        base = sum(1 for p in self.procs if p.kind == "namesrv")
        new = [Proc("namesrv", f"namesrv-{base + i}", ["namesrv", "--port", "0"])
               for i in range(n)]
        for p in new:
            self._spawn(p)
            self.procs.append(p)
        try:
            for p in new:
                self._await_ready(p, timeout)
        finally:
            self.save()
        return new

    def add_broker(
        self, name: str, broker_id: int = 0, role: str = "ASYNC_MASTER", *,
        options: tuple[str, ...] = (), flush: str = "async", data_dir: str | None = None,
    ) -> Proc:
        """Describe a broker (not started: :meth:`start` / :meth:`restart`)."""
        data = data_dir or str(self.root / f"{name}-{broker_id}")
        args = ["broker", "--namesrv", ",".join(self.namesrv_addrs), "--port", "0",
                "--ha-port", "0", "--name", name, "--role", role, "--broker-id",
                str(broker_id), "--data-dir", data, "--flush", flush]
        if self.etcd:
            args += ["-o", f"etcd_endpoints={self.etcd}"]
        for o in (*self.broker_options, *options):
            args += ["-o", o]
        p = Proc("broker", f"{name}-{broker_id}", args, broker_name=name, broker_id=broker_id,
                 role=role, data_dir=data)
        self.procs.append(p)
        return p

    def start(self, *procs: Proc, timeout: float = 60.0) -> None:
        for p in procs:
            self._spawn(p)
        try:
            for p in procs:
                if p.kind == "etcd":
                    self._await_etcd(p, timeout)
                else:
                    self._await_ready(p, timeout)
        finally:
            self.save()

    def start_broker(self, name: str, broker_id: int = 0, role: str = "ASYNC_MASTER",
                     **kw: Any) -> Proc:
        p = self.add_broker(name, broker_id, role, **kw)
        self.start(p)
        return p

    def up(
        self, *, namesrvs: int = 2, groups: int = 2, slaves: int = 1,
        role: str = "ASYNC_MASTER", flush: str = "async", options: tuple[str, ...] = (),
        timeout: float = 60.0, election: bool = False,
    ) -> LocalCluster:
        """Name servers (and etcd with ``election``), then ``groups`` broker groups (broker-a,
        broker-b, ...) of one master (``role``) and ``slaves`` slaves each."""
        try:
            if election and not self.etcd:
                self.start_etcd(timeout)
            if namesrvs:
                self.start_namesrvs(namesrvs, timeout)
        except BaseException:
            self.down(5)
            raise
        masters, slaves_ = [], []
        for g in range(groups):
            name = f"broker-{chr(ord('a') + g)}"
            masters.append(self.add_broker(name, 0, role, options=options, flush=flush))
            for i in range(1, slaves + 1):
                slaves_.append(self.add_broker(name, i, "SLAVE", options=options, flush=flush))
        try:
            if election:
                # the masters create their groups in etcd first (a slave started first would
                # only wait for them)
                self.start(*masters, timeout=timeout)
                self.start(*slaves_, timeout=timeout)
            else:
                self.start(*masters, *slaves_, timeout=timeout)
        except BaseException:
            self.down(5)
            raise
        return self

    # -- faults and stopping -------------------------------------------------------------------
    def _signal(self, p: Proc, sig: int) -> None:
        if p.popen is not None:
            if p.popen.poll() is None:
                p.popen.send_signal(sig)
        elif _same_process(p.pid, p.started):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, sig)

    def _wait(self, p: Proc, timeout: float) -> bool:
        if p.popen is not None:
            try:
                p.popen.wait(timeout)
                return True
            except subprocess.TimeoutExpired:
                return False
        deadline = time.monotonic() + timeout
        while _same_process(p.pid, p.started):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def kill9(self, p: Proc) -> None:
        self._signal(p, signal.SIGKILL)
        self._wait(p, 10)

    def pause(self, p: Proc) -> None:
        self._signal(p, signal.SIGSTOP)

    def resume(self, p: Proc) -> None:
        self._signal(p, signal.SIGCONT)

    def stop(self, p: Proc, timeout: float = 20.0) -> None:
        """SIGTERM (a clean stop), SIGKILL after ``timeout``."""
        self._signal(p, signal.SIGTERM)
        if not self._wait(p, timeout):
            self._signal(p, signal.SIGKILL)
            self._wait(p, 10)

    def restart(self, p: Proc, timeout: float = 60.0) -> None:
        """Start ``p`` again (a stopped or killed broker: same data, a new port)."""
        if p.alive():
            self.stop(p)
        self.start(p, timeout=timeout)

    def wipe(self, p: Proc) -> None:
        """Remove a (stopped) broker's data directory: a lost disk."""
        if p.alive():
            raise RuntimeError(f"{p.name} is running; stop it before wiping its disk")
        shutil.rmtree(p.data_dir, ignore_errors=True)

    def down(self, timeout: float = 20.0) -> list[str]:
        """Stop every process (brokers first, then name servers); names of those stopped."""
        stopped = []
        order = [p for p in self.procs if p.kind == "broker"] + \
                [p for p in self.procs if p.kind == "namesrv"] + \
                [p for p in self.procs if p.kind == "etcd"]
        live = [p for p in order if p.alive()]
        for p in live:
            if p.kind == "broker":
                self._signal(p, signal.SIGCONT)  # a paused one could not stop
                self._signal(p, signal.SIGTERM)
        for p in live:
            if p.kind == "broker" and not self._wait(p, timeout):
                self._signal(p, signal.SIGKILL)
                self._wait(p, 10)
        for kind in ("namesrv", "etcd"):
            for p in live:
                if p.kind == kind:
                    self._signal(p, signal.SIGCONT)
                    self._signal(p, signal.SIGTERM)
                    if not self._wait(p, timeout):
                        self._signal(p, signal.SIGKILL)
                        self._wait(p, 10)
        stopped = [p.name for p in live]
        for p in self.procs:
            if p.kind == "etcd" and p.data_dir.startswith("/dev/shm/") and not p.alive():
                shutil.rmtree(p.data_dir, ignore_errors=True)
        if (self.root / STATE).exists():
            self.save()
        return stopped

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down(10)
