"""A `tidemq dev` (name server + broker in one process) as a child process: what the
benchmarks, the example pipeline and the tests start when they need a whole cluster.

``DevProcess(data_dir, "KEY=VALUE", ...)`` -- options are broker settings, each passed as
``-o``; ports 0 = chosen by the OS. ``start()`` waits for the ready line and fills ``namesrv``
and ``broker``; ``stop()`` is a clean SIGTERM stop, ``kill9()`` a crash.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

__all__ = ["DevProcess"]


class DevProcess:
    """A `tidemq dev` child process on ports chosen by the OS, data in ``data_dir``."""

    def __init__(self, data_dir: str, *options: str, namesrv_port: int = 0,
                 broker_port: int = 0, log_path: str | None = None) -> None:
        self.data_dir = data_dir
        self.options = options
        self.namesrv_port = namesrv_port
        self.broker_port = broker_port
        #: stderr of the process goes here (appended); None = discarded
        self.log_path = log_path
        self.proc: subprocess.Popen[str] | None = None
        self.namesrv = self.broker = ""
        self.start_seconds = 0.0

    def start(self, timeout: float = 120.0) -> DevProcess:
        cmd = [sys.executable, "-m", "tidemq.cli.main", "dev", "--data-dir", self.data_dir,
               "--namesrv-port", str(self.namesrv_port), "--broker-port", str(self.broker_port),
               "--log-level", "warning"]
        for o in self.options:
            cmd += ["-o", o]
        t0 = time.monotonic()
        # stderr to a file or nowhere: an unread pipe would block the broker once it filled.
        err = open(self.log_path, "a") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        finally:
            if not isinstance(err, int):
                err.close()
        assert proc.stdout is not None
        deadline = t0 + timeout
        line = ""
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.startswith("tidemq dev ready") or not line:
                break
        if not line.startswith("tidemq dev ready"):
            proc.kill()
            proc.wait()
            raise RuntimeError(f"tidemq dev did not start: {line!r}")
        self.start_seconds = time.monotonic() - t0
        fields = dict(part.split("=", 1) for part in line.split()[3:])
        self.namesrv, self.broker = fields["namesrv"], fields["broker"]
        return self

    def memory(self) -> dict[str, int]:
        """VmRSS, RssAnon and RssFile of the process, in bytes (Linux)."""
        assert self.proc is not None
        out = {}
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile"):
                    out[key] = int(rest.split()[0]) * 1024
        return out

    def cpu_seconds(self) -> float:
        """User + system CPU seconds the process used so far (Linux /proc/<pid>/stat)."""
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_by_mapping(self) -> dict[str, int]:
        """Resident bytes per kind of mapping (/proc/<pid>/smaps): the store's files by
        directory (commitlog, consumequeue, index, ...), anonymous memory, other files."""
        assert self.proc is not None
        out: dict[str, int] = {}
        kind = "anon"
        root = os.path.realpath(self.data_dir) + os.sep
        with open(f"/proc/{self.proc.pid}/smaps") as f:
            for line in f:
                head = line.split()
                if head and "-" in head[0] and not head[0].endswith(":"):
                    path = head[5] if len(head) >= 6 else ""
                    if path.startswith(root):
                        kind = path[len(root):].split(os.sep)[0]
                    elif path.startswith("/"):
                        kind = "other files"
                    else:
                        kind = "anon"
                elif head and head[0] == "Rss:":
                    out[kind] = out.get(kind, 0) + int(head[1]) * 1024
        return out

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM (a clean stop), SIGKILL after ``timeout`` seconds."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
