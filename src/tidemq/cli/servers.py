"""``tidemq namesrv``, ``tidemq broker`` and ``tidemq dev``: the server processes.

Each prints exactly one line on stdout when it is ready to serve, then runs until SIGINT or
SIGTERM and stops cleanly (store closed, offsets and topics persisted)::

    tidemq namesrv ready 127.0.0.1:<port>
    tidemq broker ready 127.0.0.1:<port>
    tidemq dev ready namesrv=127.0.0.1:<port> broker=127.0.0.1:<port>

With ``--metrics-port`` the broker's line ends with `` metrics=http://HOST:PORT/metrics``.

Port 0 means "any free port"; the line shows the port actually bound. Logs go to stderr.
``tidemq dev`` runs a name server and a broker in one process on one event loop (uvloop when
installed) -- the single command a user needs for a first minute with tidemq.

Heavy modules (the store, numpy) are imported inside the commands, so ``tidemq --help`` and the
admin commands stay fast.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import click

__all__ = ["register", "namesrv_cmd", "broker_cmd", "dev_cmd"]


def _setup_logging(level: str) -> None:
    import logging

    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _raise_fd_limit(want: int = 1 << 20) -> None:
    """A broker keeps two descriptors per consume queue file (the file's and the one mmap
    duplicates): 10 000 queues need 20 000. Raise the limit as far as we are allowed."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not Linux
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        with open("/proc/sys/fs/nr_open") as f:
            want = min(want, int(f.read()))
    except (OSError, ValueError):
        pass
    if hard != resource.RLIM_INFINITY and hard < want:
        try:  # needs CAP_SYS_RESOURCE; fine to fail
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
            return
        except (ValueError, OSError):
            pass
    try:
        if soft < hard or hard == resource.RLIM_INFINITY:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        pass


def _run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    import asyncio

    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())


async def _serve(
    start: Callable[[], Awaitable[None]],
    stop: Callable[[], Awaitable[None]],
    ready_line: Callable[[], str],
) -> None:
    """Start, print the ready line, wait for SIGINT/SIGTERM, stop."""
    import asyncio
    import signal

    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    try:
        await start()
    except BaseException:
        await stop()
        raise
    click.echo(ready_line())
    sys.stdout.flush()
    try:
        await stopping.wait()
    finally:
        await stop()


def _broker_config(
    *, namesrv, host, port, data_dir, name, cluster, flush, auto_create, long_polling, options,
    role=None, broker_id=None, ha_port=None,
):
    from tidemq.broker.config import BrokerConfig, apply_overrides

    cfg = BrokerConfig(
        broker_name=name,
        cluster_name=cluster,
        listen_host=host,
        listen_port=port,
        data_dir=data_dir,
        flush_mode=flush,
        namesrv_addrs=[a for a in (namesrv or "").replace(";", ",").split(",") if a],
    )
    if role is not None:
        cfg.broker_role = role.upper()
    if broker_id is not None:
        cfg.broker_id = broker_id
    elif role is not None and role.upper() == "SLAVE":
        cfg.broker_id = 1
    if ha_port is not None:
        cfg.ha_port = ha_port
    if auto_create is not None:
        cfg.auto_create_topic = auto_create
    if long_polling is not None:
        cfg.long_polling_enable = long_polling
    try:
        apply_overrides(cfg, list(options))
        cfg.validate()
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="-o/--option") from None
    return cfg


def _namesrv_config(options, **fields):
    """NamesrvConfig from the command's flags and ``-o KEY=VALUE`` options."""
    from tidemq.broker.config import apply_setting_overrides
    from tidemq.namesrv.server import NamesrvConfig

    cfg = NamesrvConfig(**fields)
    try:
        apply_setting_overrides(cfg, list(options), "name server")
        cfg.validate()
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="-o/--option") from None
    return cfg


def _split_namesrv_options(options) -> tuple[list[str], list[str]]:
    """``tidemq dev``'s options: (broker options, name server options without "namesrv.")."""
    broker, namesrv = [], []
    for o in options:
        if o.strip().startswith("namesrv."):
            namesrv.append(o.strip()[len("namesrv."):])
        else:
            broker.append(o)
    return broker, namesrv


def _fail_on_start_errors(fn: Callable[[], None]) -> None:
    from tidemq.protocol.errors import TidemqError

    try:
        fn()
    except TidemqError as exc:
        raise click.ClickException(exc.message) from None
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"cannot start: {exc}") from None


_log_level = click.option(
    "--log-level",
    default="info",
    show_default=True,
    type=click.Choice(["debug", "info", "warning", "error"]),
    help="Log level (logs go to stderr).",
)
_options = click.option(
    "-o",
    "--option",
    "options",
    multiple=True,
    metavar="KEY=VALUE",
    help="Set any broker setting (see tidemq.broker.config), e.g. -o long_polling_check_ms=500 "
    "or -o store.segment_size=67108864; in `tidemq dev`, -o namesrv.KEY=VALUE sets a name "
    "server setting. Repeatable.",
)
_metrics_port = click.option(
    "--metrics-port",
    type=int,
    default=None,
    help="Serve Prometheus metrics at http://HOST:PORT/metrics (0 = any free port) [off].",
)


def _metrics_suffix(broker) -> str:
    return f" metrics=http://{broker.addr.rsplit(':', 1)[0]}:{broker.metrics.port}/metrics" \
        if broker.metrics is not None else ""


def _ha_suffix(broker) -> str:
    ha = broker.ha
    return f" role={ha.role} id={ha.broker_id}" + (f" ha={ha.ha_addr}" if ha.ha_addr else "")


_flush = click.option(
    "--flush",
    type=click.Choice(["async", "sync"]),
    default="async",
    show_default=True,
    help="ASYNC_FLUSH (fsync every 500 ms) or SYNC_FLUSH (acknowledge after fsync).",
)


@click.command("namesrv")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=9876, show_default=True, help="Port (0 = any free port).")
@click.option(
    "--scan-interval-ms",
    default=10_000,
    show_default=True,
    help="Look for dead brokers this often.",
)
@click.option(
    "--broker-expire-ms",
    default=0,
    show_default=True,
    help="Drop a broker after this long without a registration (0 = the broker's own 120 s).",
)
@click.option(
    "-o",
    "--option",
    "options",
    multiple=True,
    metavar="KEY=VALUE",
    help="Set any name server setting (see tidemq.namesrv.server.NamesrvConfig), e.g. "
    "-o max_connections=20000. Repeatable.",
)
@_log_level
def namesrv_cmd(host, port, scan_interval_ms, broker_expire_ms, options, log_level) -> None:
    """Run a name server: brokers register with it, clients ask it for routes."""
    _setup_logging(log_level)
    _raise_fd_limit()
    from tidemq.namesrv.server import NameServer

    ns = NameServer(
        _namesrv_config(
            options,
            listen_host=host,
            listen_port=port,
            scan_interval_ms=scan_interval_ms,
            broker_expire_ms=broker_expire_ms,
        )
    )
    _fail_on_start_errors(
        lambda: _run(lambda: _serve(ns.start, ns.stop, lambda: f"tidemq namesrv ready {ns.addr}"))
    )


@click.command("broker")
@click.option("--namesrv", default="", help="Name server address(es), host:port[,host:port].")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=10911, show_default=True, help="Port (0 = any free port).")
@click.option(
    "--data-dir",
    default="./data/broker",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Store directory (CommitLog, consume queues, config).",
)
@click.option("--name", default="broker-a", show_default=True, help="Broker name.")
@click.option("--cluster", default="DefaultCluster", show_default=True, help="Cluster name.")
@click.option(
    "--role",
    type=click.Choice(["ASYNC_MASTER", "SYNC_MASTER", "SLAVE"], case_sensitive=False),
    default=None,
    help="Replication role in its group (broker_role) [ASYNC_MASTER]; see docs/cluster.md.",
)
@click.option(
    "--broker-id", type=int, default=None,
    help="0 = the master of the group, 1, 2, ... = slaves [0; 1 with --role SLAVE].",
)
@click.option(
    "--ha-port", type=int, default=None,
    help="A master's replication port (0 = any free port) [--port + 1; any when --port is 0].",
)
@_flush
@click.option(
    "--auto-create/--no-auto-create", default=None, help="Create unknown topics on send [on]."
)
@click.option("--long-polling/--no-long-polling", default=None, help="Hold empty pulls [on].")
@_metrics_port
@_options
@_log_level
def broker_cmd(
    namesrv, host, port, data_dir, name, cluster, role, broker_id, ha_port, flush, auto_create,
    long_polling, metrics_port, options, log_level,
) -> None:
    """Run a broker: stores messages and serves producers and consumers."""
    _setup_logging(log_level)
    _raise_fd_limit()
    cfg = _broker_config(
        namesrv=namesrv, host=host, port=port, data_dir=data_dir, name=name, cluster=cluster,
        flush=flush, auto_create=auto_create, long_polling=long_polling, options=options,
        role=role, broker_id=broker_id, ha_port=ha_port,
    )
    if metrics_port is not None:
        cfg.metrics_port = metrics_port
    from tidemq.broker.broker import Broker

    broker = Broker(cfg)
    restart: list[str] = []

    def restart_as_slave(why: str) -> None:
        # election: this master was replaced; stop cleanly, then start again in place (same
        # pid, same port): the new process reads etcd and joins as a slave (docs/cluster.md)
        restart.append(why)
        os.kill(os.getpid(), signal.SIGTERM)

    broker.restart_hook = restart_as_slave
    _fail_on_start_errors(
        lambda: _run(
            lambda: _serve(broker.start, broker.stop, lambda: f"tidemq broker ready {broker.addr}"
                           + _metrics_suffix(broker) + _ha_suffix(broker))
        )
    )
    if restart and broker.port:
        argv = [sys.executable, "-m", "tidemq.cli.main", *sys.argv[1:], "--port", str(broker.port)]
        logging.getLogger("tidemq.cli").warning("restarting in place as a slave: %s", restart[0])
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, argv)


@click.command("dev")
@click.option(
    "--data-dir",
    default="./data/dev",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Store directory of the embedded broker.",
)
@click.option("--namesrv-port", default=9876, show_default=True, help="0 = any free port.")
@click.option("--broker-port", default=10911, show_default=True, help="0 = any free port.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@_flush
@_metrics_port
@_options
@_log_level
def dev_cmd(
    data_dir, namesrv_port, broker_port, host, flush, metrics_port, options, log_level
) -> None:
    """Run a name server and a broker in one process: a whole cluster for development."""
    _setup_logging(log_level)
    _raise_fd_limit()
    from tidemq.namesrv.server import NameServer

    broker_options, namesrv_options = _split_namesrv_options(options)
    ns = NameServer(_namesrv_config(namesrv_options, listen_host=host, listen_port=namesrv_port))
    cfg = _broker_config(
        namesrv="", host=host, port=broker_port, data_dir=data_dir, name="broker-a",
        cluster="DefaultCluster", flush=flush, auto_create=None, long_polling=None,
        options=broker_options,
    )
    if metrics_port is not None:
        cfg.metrics_port = metrics_port
    if cfg.ha_port == -1:
        cfg.ha_port = 0  # a dev broker has no slave: its replication port need not be fixed
    from tidemq.broker.broker import Broker

    broker = Broker(cfg)

    async def start() -> None:
        await ns.start()
        cfg.namesrv_addrs = [ns.addr]
        await broker.start()

    async def stop() -> None:
        await broker.stop()
        await ns.stop()

    _fail_on_start_errors(
        lambda: _run(
            lambda: _serve(
                start, stop, lambda: f"tidemq dev ready namesrv={ns.addr} broker={broker.addr}"
                + _metrics_suffix(broker)
            )
        )
    )


def register(cli_group: click.Group) -> None:
    """Add the server commands to the ``tidemq`` group."""
    cli_group.add_command(namesrv_cmd)
    cli_group.add_command(broker_cmd)
    cli_group.add_command(dev_cmd)
