"""``tidemq cluster up|down|status|promote``: replicated broker groups (docs/cluster.md).

- ``up --dir D [--election]``: name servers and broker groups (a master and its slaves) as
  separate processes on loopback, data and logs under D (and an etcd with ``--election``);
  prints one line ``tidemq cluster ready namesrv=HOST:PORT;HOST:PORT brokers=broker-a/0=...
  [etcd=HOST:PORT]``.
- ``down --dir D``: stops them (brokers first, SIGTERM, SIGKILL after a timeout; etcd last).
- ``status``: every broker the name servers know -- name, id, role, pid, epoch, CommitLog
  offsets, replication lag in bytes and ms -- as a table or ``--json``; with election (``--etcd``
  or a ``--dir`` started with ``--election``) also each group's epoch, in-sync set and the
  leader's lease as etcd holds them.
- ``promote --broker-name X``: makes a slave of group X its master (RocketMQ 4.9's manual
  switch; a new epoch); the other slaves then follow it.

``--dir D`` stands for ``--namesrv`` in status and promote (the name servers ``up`` started).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from tidemq.cli.admin import friendly

__all__ = ["register"]


def _namesrv(namesrv: str | None, directory: str | None) -> str:
    if namesrv:
        return namesrv
    if directory:
        from tidemq.bench.local_cluster import LocalCluster

        try:
            ns = LocalCluster.load(directory).namesrv
        except FileNotFoundError as exc:
            raise click.ClickException(str(exc)) from None
        if ns:
            return ns
    import os

    return os.environ.get("TIDEMQ_NAMESRV", "127.0.0.1:9876")


_ns = click.option("--namesrv", default=None,
                   help="Name server address(es) (default: those of --dir, else "
                        "$TIDEMQ_NAMESRV, else 127.0.0.1:9876).")
_dir = click.option("--dir", "directory", type=click.Path(file_okay=False), default=None,
                    help="A cluster started by `tidemq cluster up --dir`.")


@click.group("cluster")
def cluster_group() -> None:
    """Replicated broker groups: start a local cluster, show it, promote a slave."""


@cluster_group.command("up")
@click.option("--dir", "directory", type=click.Path(file_okay=False), required=True,
              help="Where the data, logs and cluster.json go.")
@click.option("--groups", default=2, show_default=True, help="Broker groups.")
@click.option("--slaves", default=1, show_default=True, help="Slaves per group.")
@click.option("--namesrvs", default=2, show_default=True, help="Name servers.")
@click.option("--role", type=click.Choice(["ASYNC_MASTER", "SYNC_MASTER"],
                                          case_sensitive=False),
              default="ASYNC_MASTER", show_default=True, help="Role of the masters.")
@click.option("--flush", type=click.Choice(["async", "sync"]), default="async",
              show_default=True)
@click.option("--election", is_flag=True,
              help="Start an etcd too and elect masters there (a dead master is replaced by "
                   "an in-sync slave automatically).")
@click.option("-o", "--option", "options", multiple=True, metavar="KEY=VALUE",
              help="A broker setting for every broker (repeatable).")
def up_cmd(directory: str, groups: int, slaves: int, namesrvs: int, role: str, flush: str,
           election: bool, options: tuple[str, ...]) -> None:
    """Start name servers and broker groups as separate processes on 127.0.0.1."""
    from tidemq.bench.local_cluster import LocalCluster

    try:
        old = LocalCluster.load(directory)
        if any(p.alive() for p in old.procs):
            raise click.ClickException(
                f"a cluster is already running in {directory}; `tidemq cluster down --dir "
                f"{directory}` first"
            )
    except FileNotFoundError:
        pass
    if groups < 1 or slaves < 0 or namesrvs < 1:
        raise click.BadParameter("need at least one group and one name server")
    c = LocalCluster(directory)
    try:
        c.up(namesrvs=namesrvs, groups=groups, slaves=slaves, role=role.upper(), flush=flush,
             options=options, election=election)
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(c.ready_line())


@cluster_group.command("down")
@click.option("--dir", "directory", type=click.Path(file_okay=False), required=True)
@click.option("--timeout", default=20.0, show_default=True,
              help="Seconds a process has to stop before SIGKILL.")
def down_cmd(directory: str, timeout: float) -> None:
    """Stop the cluster started in DIR."""
    from tidemq.bench.local_cluster import LocalCluster

    try:
        c = LocalCluster.load(directory)
    except FileNotFoundError as exc:
        raise click.ClickException(str(exc)) from None
    stopped = c.down(timeout)
    click.echo(f"stopped {len(stopped)} processes" + (f": {' '.join(stopped)}" if stopped else ""))


def _lag(row: dict[str, Any]) -> tuple[str, str]:
    if "ha_lag_bytes" in row:  # a slave: its own lag
        return str(row["ha_lag_bytes"]), "-"
    if "ha_max_lag_bytes" in row and row.get("ha_slaves"):
        return str(row["ha_max_lag_bytes"]), str(row["ha_max_lag_ms"])
    return "-", "-"


def _etcd_groups(etcd: str | None, directory: str | None, prefix: str) -> dict[str, Any]:
    """Each group's state in etcd ({} without election)."""
    if not etcd and directory:
        from tidemq.bench.local_cluster import LocalCluster

        try:
            etcd = LocalCluster.load(directory).etcd
        except FileNotFoundError:
            etcd = ""
    if not etcd:
        return {}
    import asyncio

    from tidemq.broker.ha.election import read_group

    try:
        return asyncio.run(asyncio.wait_for(read_group(etcd, prefix), 10))
    except Exception as exc:
        raise click.ClickException(f"etcd {etcd} did not answer: {exc}") from None


def _with_etcd(rows: list[dict[str, Any]], groups: dict[str, Any]) -> None:
    for r in rows:
        g = groups.get(f"{r.get('cluster', '')}/{r['broker_name']}")
        if not g:
            continue
        st = g.get("state") or {}
        r["group_epoch"] = st.get("epoch")
        r["in_sync"] = r.get("member") in st.get("isr", [])
        r["leader"] = r.get("member") == (g.get("leader") or {}).get("member")
        if r["leader"]:
            r["leader_lease_ttl_s"] = g.get("leader_lease_ttl_s")


@cluster_group.command("status")
@_ns
@_dir
@click.option("--etcd", default=None,
              help="etcd endpoint (host:port) of an election cluster (default: that of --dir).")
@click.option("--etcd-prefix", default="/tidemq", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per broker, a list.")
@friendly
def status_cmd(namesrv: str | None, directory: str | None, etcd: str | None, etcd_prefix: str,
               as_json: bool) -> None:
    """Every broker: name, id, role, pid, epoch, offsets, replication lag (and with election
    each group's epoch, in-sync set and leader lease in etcd)."""
    from tidemq.client.blocking import Admin

    with Admin(_namesrv(namesrv, directory)) as admin:
        rows = admin.cluster_status()
    groups = _etcd_groups(etcd, directory, etcd_prefix)
    _with_etcd(rows, groups)
    keys = ("cluster", "broker_name", "broker_id", "broker_role", "addr", "pid", "epoch",
            "commitlog_min_offset", "commitlog_max_offset", "ha_addr", "ha_master_addr",
            "ha_connected", "ha_slaves", "ha_in_sync_slaves", "ha_max_lag_bytes",
            "ha_max_lag_ms", "ha_lag_bytes", "ha_master_offset", "ha_slave_links",
            "put_tps", "fenced", "error", "member", "group_epoch", "in_sync", "leader",
            "leader_lease_ttl_s", "etcd_lease_ok")
    if as_json:
        out = []
        for r in rows:
            d = {k: r[k] for k in keys if k in r}
            if isinstance(d.get("ha_slave_links"), str):
                d["ha_slave_links"] = json.loads(d["ha_slave_links"])
            out.append(d)
        click.echo(json.dumps(out, indent=1))
        return
    head = ("BROKER", "ID", "ROLE", "ADDR", "PID", "EPOCH", "MAX_OFFSET", "LAG_BYTES",
            "LAG_MS", "IN_SYNC", "NOTE")
    table = [head]
    for r in rows:
        lb, lm = _lag(r)
        note = r.get("error") or r.get("fenced") or ""
        if not note and "ha_connected" in r and not r["ha_connected"]:
            note = f"not connected to its master ({r.get('ha_master_addr') or 'unknown'})"
        insync = (f"{r.get('ha_in_sync_slaves', 0)}/{r.get('ha_slaves', 0)}"
                  if "ha_slaves" in r else "-")
        table.append((r["broker_name"], str(r["broker_id"]), str(r.get("broker_role", "?")),
                      r["addr"], str(r.get("pid", "?")), str(r.get("epoch", "?")),
                      str(r.get("commitlog_max_offset", "?")), lb, lm, insync, note))
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for row in table:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    for name, g in sorted(groups.items()):
        st = g.get("state") or {}
        members = g.get("members", {})

        def who(m: str, members: dict[str, Any] = members) -> str:
            i = members.get(m)
            return f"{m} ({i.get('addr')}, id {i.get('broker_id')})" if i else f"{m} (down)"

        leader = (g.get("leader") or {}).get("member")
        lease = (f"lease {g.get('leader_lease_ttl_s')} s left" if leader else
                 "no leader: its lease expired, an in-sync slave takes over")
        click.echo(f"etcd {name}: epoch {st.get('epoch')}, {st.get('role')}, master "
                   f"{who(st.get('master', '?'))}, {lease}; in sync: "
                   + ", ".join(who(m) for m in st.get("isr", [])))


@cluster_group.command("promote")
@_ns
@_dir
@click.option("--broker-name", required=True, help="The group whose slave becomes master.")
@click.option("--broker-id", type=int, default=None,
              help="Which slave (default: the live slave with the most data).")
@click.option("--role", type=click.Choice(["ASYNC_MASTER", "SYNC_MASTER"],
                                          case_sensitive=False), default=None,
              help="Role of the new master (default: the old master's).")
@click.option("--force", is_flag=True,
              help="Promote even though the old master still answers (two masters!).")
@click.option("--json", "as_json", is_flag=True)
@friendly
def promote_cmd(namesrv: str | None, directory: str | None, broker_name: str,
                broker_id: int | None, role: str | None, force: bool, as_json: bool) -> None:
    """Make a slave of BROKER_NAME the master of its group (a new epoch; the other slaves
    follow it). Stop the old master first: this is RocketMQ 4.9's manual switch."""
    from tidemq.client.blocking import Admin

    with Admin(_namesrv(namesrv, directory)) as admin:
        rows = [r for r in admin.cluster_status() if r["broker_name"] == broker_name]
        if any(r.get("election") for r in rows) and not force:
            raise click.ClickException(
                f"group {broker_name} elects its master on etcd: a slave of its in-sync set "
                "takes over once the master's lease expires (see `tidemq cluster status`); "
                "--force promotes by hand anyway"
            )
        if not rows:
            raise click.ClickException(f"no broker of group {broker_name!r} is registered")
        master = [r for r in rows if r["broker_id"] == 0 and "error" not in r]
        if master and not force:
            raise click.ClickException(
                f"the master of {broker_name} ({master[0]['addr']}) is alive; stop it first, or "
                "pass --force to run two masters until the old one is stopped"
            )
        slaves = [r for r in rows if r["broker_id"] != 0 and "error" not in r]
        if broker_id is not None:
            slaves = [r for r in slaves if r["broker_id"] == broker_id]
        if not slaves:
            raise click.ClickException(f"no live slave of {broker_name}"
                                       + (f" with id {broker_id}" if broker_id else ""))
        best = max(slaves, key=lambda r: int(r.get("commitlog_max_offset", 0)))
        r = admin.promote(best["addr"], role=(role or "").upper(), force=force)
    result = {"broker_name": r.broker_name, "addr": best["addr"], "was_id": best["broker_id"],
              "epoch": r.epoch, "start_offset": r.start_offset, "role": r.role,
              "unreplicated_bytes": r.unreplicated_bytes, "previous_master": r.previous_master}
    if as_json:
        click.echo(json.dumps(result))
    else:
        click.echo(
            f"promoted {r.broker_name} id {best['broker_id']} ({best['addr']}) to {r.role}, "
            f"epoch {r.epoch} from CommitLog offset {r.start_offset}; the old master had "
            f"{r.unreplicated_bytes} bytes this slave never received"
        )
    sys.stdout.flush()


@click.command("replication")
@click.option("--mode", type=click.Choice(["batched", "single"]), default="batched",
              show_default=True,
              help="batched: SYNC_MASTER vs a lone broker, both ASYNC_FLUSH; single: one "
                   "message per send from 64 senders, SYNC_MASTER vs a lone SYNC_FLUSH broker.")
@click.option("--size", default=1024, show_default=True, help="Body bytes per message.")
@click.option("--count", default=0, help="Messages per run [batched 300000, single 40000].")
@click.option("--rounds", default=3, show_default=True,
              help="Alternating lone / replicated runs; the ratio is of the medians.")
@click.option("--batch", default=0, help="Messages per batch (batched mode) [100].")
@click.option("--inflight", default=0, help="Sends in flight [batched 8, single 64].")
@click.option("-o", "--option", "options", multiple=True, metavar="KEY=VALUE",
              help="A broker setting for every broker of both runs (repeatable).")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Where the brokers' data goes (default: a temp dir).")
@click.option("--json", "as_json", is_flag=True)
def bench_replication_cmd(mode: str, size: int, count: int, rounds: int, batch: int,
                          inflight: int, options: tuple[str, ...], data_dir: str | None,
                          as_json: bool) -> None:
    """Produce against a lone broker and against a master + slave group: the ratio."""
    from tidemq.bench.cluster_bench import bench_replication
    from tidemq.cli.output import emit_result

    n = count or (300_000 if mode == "batched" else 40_000)
    with click.progressbar(length=2 * n * rounds, label=f"producing ({mode})",
                           file=sys.stderr) as bar:
        r = bench_replication(mode=mode, size=size, count=count, rounds=rounds, batch=batch,
                              inflight=inflight, data_dir=data_dir, options=options,
                              progress=bar.update)
    emit_result(r, as_json)


@click.command("replication-lag")
@click.option("--rate", default=100_000, show_default=True, help="Messages per second.")
@click.option("--seconds", default=10.0, show_default=True)
@click.option("--size", default=100, show_default=True, help="Body bytes per message.")
@click.option("-o", "--option", "options", multiple=True, metavar="KEY=VALUE",
              help="A broker setting for the master and the slave (repeatable).")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None)
@click.option("--json", "as_json", is_flag=True)
def bench_lag_cmd(rate: int, seconds: float, size: int, options: tuple[str, ...],
                  data_dir: str | None, as_json: bool) -> None:
    """ASYNC_MASTER + slave at RATE msgs/s: the replication lag's p50/p99/max."""
    from tidemq.bench.cluster_bench import bench_replication_lag
    from tidemq.cli.output import emit_result

    with click.progressbar(length=int(rate * seconds), label="producing",
                           file=sys.stderr) as bar:
        r = bench_replication_lag(rate=rate, seconds=seconds, size=size, data_dir=data_dir,
                                  options=options, progress=bar.update)
    emit_result(r, as_json)


@click.command("failover")
@click.option("--seconds", default=0.0,
              help="Length of the send loop [6; 20 with --election].")
@click.option("--election", is_flag=True,
              help="Masters elected on etcd: also measure until broker-a takes writes again "
                   "(its slave elected), target 10 s.")
@click.option("-o", "--option", "options", multiple=True, metavar="KEY=VALUE",
              help="A broker setting for every broker (repeatable), e.g. "
                   "election_lease_ttl_ms=3000.")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None)
@click.option("--json", "as_json", is_flag=True)
def bench_failover_cmd(seconds: float, election: bool, options: tuple[str, ...],
                       data_dir: str | None, as_json: bool) -> None:
    """Two groups; kill -9 broker-a's master under a send loop: the measured gap (and with
    --election the time until broker-a is writable again)."""
    from tidemq.bench.cluster_bench import bench_failover
    from tidemq.cli.output import emit_result

    seconds = seconds or (20.0 if election else 6.0)
    with click.progressbar(length=1, label="sending through a master kill",
                           file=sys.stderr) as bar:
        r = bench_failover(seconds=seconds, data_dir=data_dir, election=election,
                           options=options)
        bar.update(1)
    emit_result(r, as_json)


def register(cli: click.Group) -> None:
    cli.add_command(cluster_group)
    bench = cli.commands.get("bench")
    if isinstance(bench, click.Group):
        bench.add_command(bench_replication_cmd)
        bench.add_command(bench_lag_cmd)
        bench.add_command(bench_failover_cmd)
