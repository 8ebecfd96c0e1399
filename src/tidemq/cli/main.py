"""The one `tidemq` command: servers, admin and benchmarks (click)."""

from __future__ import annotations

import sys

import click

from tidemq.cli.admin import register as register_admin
from tidemq.cli.bench_app import register as register_bench_app
from tidemq.cli.bench_consumers import register as register_bench_consumers
from tidemq.cli.bench_hostile import register as register_bench_hostile
from tidemq.cli.bench_request import register as register_bench_request
from tidemq.cli.bench_scale import register as register_bench_scale
from tidemq.cli.bench_types import register as register_bench_types
from tidemq.cli.cluster import register as register_cluster
from tidemq.cli.demo import demo
from tidemq.cli.output import emit_result
from tidemq.cli.servers import register as register_servers
from tidemq.cli.spark_bench import register as register_spark_bench


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tidemq")
def cli() -> None:
    """tidemq: a message queue on RocketMQ's storage design, in Python."""


@cli.group()
def bench() -> None:
    """Benchmarks; each prints one JSON object with --json."""




def _bar(total: int, label: str, enabled: bool):
    return click.progressbar(length=total, label=label, file=sys.stderr) if enabled else None


@bench.command("store")
@click.option("--size", default=1024, show_default=True, help="Body bytes per message.")
@click.option("--count", default=1_000_000, show_default=True, help="Messages to write.")
@click.option(
    "--batch", default=100, show_default=True, help="Messages per batch (1 = single puts)."
)
@click.option("--flush", type=click.Choice(["async", "sync"]), default="async", show_default=True)
@click.option("--writers", default=64, show_default=True, help="Concurrent writers (sync flush).")
@click.option("--segment-size", default=1 << 30, show_default=True, help="CommitLog segment bytes.")
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Where to write (default: a temp dir). Removed afterwards.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_store_cmd(size, count, batch, flush, writers, segment_size, data_dir, as_json) -> None:
    """Write COUNT messages to a fresh store, then read them all back by queue offset."""
    from tidemq.bench.store_bench import bench_store

    if size < 0 or count <= 0 or batch <= 0 or writers <= 0:
        raise click.BadParameter("size must be >= 0; count, batch and writers must be > 0")
    puts = (count + batch - 1) // batch
    with click.progressbar(length=puts, label="writing", file=sys.stderr) as bar:
        result = bench_store(
            data_dir=data_dir,
            size=size,
            count=count,
            batch=batch,
            flush=flush,
            writers=writers,
            segment_size=segment_size,
            progress=bar.update,
        )
    emit_result(result, as_json)


@bench.command("recovery")
@click.option("--gib", default=1.0, show_default=True, help="GiB to write before the crash.")
@click.option("--segment-size", default=1 << 30, show_default=True)
@click.option("--data-dir", type=click.Path(file_okay=False), default=None)
@click.option("--json", "as_json", is_flag=True)
def bench_recovery_cmd(gib, segment_size, data_dir, as_json) -> None:
    """Write GIB of batches, kill -9 the writer, time the recovery."""
    from tidemq.bench.store_bench import bench_recovery

    emit_result(bench_recovery(data_dir=data_dir, gib=gib, segment_size=segment_size), as_json)


@bench.command("door")
@click.option("--size", default=1024, show_default=True, help="Body bytes per message.")
@click.option("--batch", default=1000, show_default=True, help="Messages per batch.")
@click.option("--sends", default=100, show_default=True, help="Batches per mode per round.")
@click.option("--rounds", default=7, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def bench_door_cmd(size, batch, sends, rounds, as_json) -> None:
    """Broker CPU per message of the send path with the door's checks on and off
    (protocol/batch_rules.py), for identical and for varied messages."""
    from tidemq.bench.door_bench import bench_door

    emit_result(bench_door(size=size, batch=batch, sends=sends, rounds=rounds), as_json)


cli.add_command(demo)
register_servers(cli)
register_admin(cli)
register_bench_types(cli)
register_bench_scale(cli)
register_bench_hostile(cli)
register_bench_request(cli)
register_bench_consumers(cli)
register_spark_bench(cli)
register_bench_app(cli)
register_cluster(cli)


def main() -> None:  # pragma: no cover - console entry
    cli()


if __name__ == "__main__":  # python -m tidemq.cli.main ...
    cli()
