"""Start and stop the peer servers (redis-server, rabbitmq-server + rabbitmq_stream) for the peer
benchmarks: each in its own temp dir, listening on 127.0.0.1 only, on free ports.

Both servers are child processes of the caller, started in their own session so that stopping
them (SIGTERM, then SIGKILL after a grace period) reaches every process they forked and nothing
else. Used from one thread; the context managers stop the server even when the body raises.

Run as a script to keep one server up for manual runs of the workload scripts:

    python bench/peers/servers.py redis        # prints: redis ready 127.0.0.1:<port> dir=<tmp>
    python bench/peers/servers.py rabbitmq     # prints: rabbitmq ready 127.0.0.1:<stream port> ...
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

RABBITMQ_SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"
REDIS_START_TIMEOUT_S = 15.0
# Erlang boot on 2 shared cores takes 5-15 s; give it room but stay bounded.
RABBITMQ_START_TIMEOUT_S = 90.0
STOP_GRACE_S = 15.0


def free_port() -> int:
    """A port the kernel just handed out on 127.0.0.1 (racy by nature, good enough for a bench)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@dataclass
class Server:
    """A running peer server: its client port, its temp dir and the processes we own."""

    name: str
    port: int
    workdir: Path
    procs: list[subprocess.Popen] = field(default_factory=list)
    info: dict = field(default_factory=dict)

    def stop(self) -> None:
        # Newest first: the broker before the epmd it registered with.
        for proc in reversed(self.procs):
            _stop_process(proc)
        self.procs.clear()


def _stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    # start_new_session=True made proc.pid the process group id of everything it forked.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=STOP_GRACE_S)


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return f"(no {path})"


@contextlib.contextmanager
def redis_server(keep_dir: bool = False) -> Iterator[Server]:
    """redis-server with AOF on and fsync every second (RDB snapshots off, so the AOF is the
    only persistence and the numbers measure it alone)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server not found: apt-get install -y redis-server")
    workdir = Path(tempfile.mkdtemp(prefix="peer-redis-"))
    port = free_port()
    log = workdir / "redis.log"
    cmd = [
        exe,
        "--bind",
        "127.0.0.1",
        "--port",
        str(port),
        "--dir",
        str(workdir),
        "--daemonize",
        "no",
        "--protected-mode",
        "yes",
        "--appendonly",
        "yes",
        "--appendfsync",
        "everysec",
        "--save",
        "",
        "--logfile",
        str(log),
    ]
    server = Server("redis", port, workdir)
    try:
        server.procs.append(
            subprocess.Popen(
                cmd,
                cwd=workdir,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        deadline = time.monotonic() + REDIS_START_TIMEOUT_S
        while not _redis_ping(port):
            if server.procs[0].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start; log:\n{_tail(log)}")
            time.sleep(0.05)
        server.info["version"] = (
            subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10)
            .stdout.split()[2]
            .removeprefix("v=")
        )
        yield server
    finally:
        server.stop()
        if not keep_dir:
            shutil.rmtree(workdir, ignore_errors=True)


def _redis_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextlib.contextmanager
def rabbitmq_server(keep_dir: bool = False) -> Iterator[Server]:
    """rabbitmq-server with only the rabbitmq_stream plugin, its own epmd, every listener
    (AMQP, stream, Erlang distribution, epmd) on 127.0.0.1 and a free port, all state under one
    temp dir. ``port`` is the stream protocol port; ``info['amqp_port']`` the AMQP one."""
    if not os.access(RABBITMQ_SERVER, os.X_OK):
        raise RuntimeError(f"{RABBITMQ_SERVER} not found: apt-get install -y rabbitmq-server")
    epmd = shutil.which("epmd") or "/usr/bin/epmd"
    workdir = Path(tempfile.mkdtemp(prefix="peer-rabbitmq-"))
    stream_port, amqp_port, dist_port, epmd_port = (free_port() for _ in range(4))
    for sub in ("home", "mnesia", "log"):
        (workdir / sub).mkdir()
    (workdir / "enabled_plugins").write_text("[rabbitmq_stream].\n")
    (workdir / "rabbitmq.conf").write_text(
        f"listeners.tcp.1 = 127.0.0.1:{amqp_port}\n"
        f"stream.listeners.tcp.1 = 127.0.0.1:{stream_port}\n"
        # Clients connect to the host the broker advertises for a stream's leader: make it
        # loopback, not this machine's hostname.
        "stream.advertised_host = 127.0.0.1\n"
        f"stream.advertised_port = {stream_port}\n"
        "loopback_users.guest = true\n"
    )
    node = f"peerbench{os.getpid()}@localhost"
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "HOME": str(workdir / "home"),
        "ERL_EPMD_PORT": str(epmd_port),
        "ERL_EPMD_ADDRESS": "127.0.0.1",
        "RABBITMQ_NODENAME": node,
        "RABBITMQ_USE_LONGNAME": "false",
        "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
        "RABBITMQ_NODE_PORT": str(amqp_port),
        # The default (node port + 20000) overflows 65535 for ephemeral ports.
        "RABBITMQ_DIST_PORT": str(dist_port),
        "RABBITMQ_MNESIA_BASE": str(workdir / "mnesia"),
        "RABBITMQ_LOG_BASE": str(workdir / "log"),
        "RABBITMQ_ENABLED_PLUGINS_FILE": str(workdir / "enabled_plugins"),
        "RABBITMQ_CONFIG_FILE": str(workdir / "rabbitmq.conf"),
        # Keep the system's /etc/rabbitmq/rabbitmq-env.conf out of it.
        "RABBITMQ_CONF_ENV_FILE": str(workdir / "rabbitmq-env.conf"),
        "RABBITMQ_ADVANCED_CONFIG_FILE": str(workdir / "advanced.config"),
        # PEER_RABBITMQ_ERL_ARGS adds emulator flags for experiments (e.g. "+sbwt none").
        "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1} "
        + os.environ.get("PEER_RABBITMQ_ERL_ARGS", ""),
    }
    server = Server("rabbitmq", stream_port, workdir)
    server.info.update(amqp_port=amqp_port, node=node)
    out = workdir / "log" / "stdout.log"
    try:
        with open(workdir / "log" / "epmd.log", "wb") as epmd_log:
            server.procs.append(
                subprocess.Popen(
                    [epmd, "-port", str(epmd_port), "-address", "127.0.0.1"],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=epmd_log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + 10
        while not _port_open(epmd_port):
            if server.procs[0].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("epmd did not start")
            time.sleep(0.05)
        with open(out, "wb") as out_f:
            server.procs.append(
                subprocess.Popen(
                    [RABBITMQ_SERVER],
                    env=env,
                    cwd=workdir,
                    stdin=subprocess.DEVNULL,
                    stdout=out_f,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        t0 = time.monotonic()
        deadline = t0 + RABBITMQ_START_TIMEOUT_S
        # The stream listener opens only once the node and the plugin have booted.
        while not _port_open(stream_port):
            if server.procs[1].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"rabbitmq-server did not start; output:\n{_tail(out)}")
            time.sleep(0.2)
        server.info["boot_s"] = round(time.monotonic() - t0, 1)
        server.info["version"] = _rabbitmq_version()
        yield server
    finally:
        server.stop()
        if not keep_dir:
            shutil.rmtree(workdir, ignore_errors=True)


def _rabbitmq_version() -> str:
    lib = Path(RABBITMQ_SERVER).parent.parent / "lib"
    for d in sorted(lib.glob("rabbitmq_server-*")):
        return d.name.removeprefix("rabbitmq_server-")
    return "unknown"


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in ("redis", "rabbitmq"):
        print("usage: servers.py redis|rabbitmq", file=sys.stderr)
        return 2
    starter = redis_server if argv[0] == "redis" else rabbitmq_server
    with starter() as server:
        extra = " ".join(f"{k}={v}" for k, v in server.info.items())
        where = f"127.0.0.1:{server.port} dir={server.workdir}"
        print(f"{server.name} ready {where} {extra}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                signal.pause()
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    sys.exit(main(sys.argv[1:]))
