"""`tidemq bench sql-filter` (tidemq/bench/sql_bench.py): consumer-side broker costs."""

from __future__ import annotations

import click

from tidemq.cli.output import emit_result

__all__ = ["register"]


@click.command("sql-filter")
@click.option("--count", default=100_000, show_default=True, help="Messages in the queue.")
@click.option("--batch", default=16, show_default=True, help="Messages per stored batch.")
@click.option("--size", default=100, show_default=True, help="Body bytes per message.")
@click.option("--rounds", default=3, show_default=True, help="Passes; the fastest is kept.")
@click.option("--json", "as_json", is_flag=True)
def bench_sql_filter_cmd(count: int, batch: int, size: int, rounds: int, as_json: bool) -> None:
    """Broker CPU per message examined by an SQL92 subscription selecting 10 %, against a
    plain read of the same queue (in-process broker, pulls handled directly)."""
    from tidemq.bench.sql_bench import bench_sql_filter

    if count < 1 or batch < 1 or size < 0 or rounds < 1:
        raise click.BadParameter("count, batch and rounds must be >= 1, size >= 0")
    emit_result(bench_sql_filter(count=count, batch=batch, size=size, rounds=rounds), as_json)


def register(cli: click.Group) -> None:
    bench = cli.commands.get("bench")
    if isinstance(bench, click.Group):
        bench.add_command(bench_sql_filter_cmd)
