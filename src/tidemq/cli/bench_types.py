"""`tidemq bench delay-index|txn|dedup` (tidemq/bench/types_bench.py): each starts its own
fresh `tidemq dev` in a temporary directory."""

from __future__ import annotations

import click

from tidemq.cli.output import emit_result

__all__ = ["register"]




_data_dir = click.option("--data-dir", type=click.Path(file_okay=False), default=None,
                         help="Parent of the temporary broker directory (default: the temp dir).")


@click.command("delay-index")
@click.option("--count", default=1_000_000, show_default=True,
              help="Pending timed messages (one index entry each).")
@click.option("--window", default=2000, show_default=True, help="Sends in flight.")
@_data_dir
@click.option("--json", "as_json", is_flag=True)
def bench_delay_index_cmd(count: int, window: int, data_dir: str | None, as_json: bool) -> None:
    """RSS a fresh broker adds for COUNT pending deliver_at messages, and its restart time
    (clean and after kill -9) with all of them pending."""
    from tidemq.bench.types_bench import bench_delay_index

    if count < 1 or window < 1:
        raise click.BadParameter("count and window must be >= 1")
    emit_result(bench_delay_index(count=count, window=window, data_dir=data_dir), as_json)


@click.command("txn")
@click.option("--count", default=50_000, show_default=True, help="Transactions.")
@click.option("--window", default=64, show_default=True, help="Transactions in flight.")
@click.option("--flush", type=click.Choice(["async", "sync"]), default="async",
              show_default=True, help="The broker's flush mode.")
@_data_dir
@click.option("--json", "as_json", is_flag=True)
def bench_txn_cmd(count: int, window: int, flush: str, data_dir: str | None,
                  as_json: bool) -> None:
    """COUNT transactions (half message, local commit, END_TRANSACTION) through one
    TransactionProducer; print transactions per second."""
    from tidemq.bench.types_bench import bench_txn

    if count < 1 or window < 1:
        raise click.BadParameter("count and window must be >= 1")
    emit_result(bench_txn(count=count, window=window, flush=flush, data_dir=data_dir), as_json)


@click.command("dedup")
@click.option("--count", default=1_000_000, show_default=True, help="Messages per run.")
@click.option("--size", default=100, show_default=True, help="Body bytes per message.")
@click.option("--rounds", default=3, show_default=True, help="Runs with and without a name.")
@click.option("--auto-batch/--batches", default=True, show_default=True,
              help="send_async single messages (auto-batched) or send_batch of 1000.")
@_data_dir
@click.option("--json", "as_json", is_flag=True)
def bench_dedup_cmd(count: int, size: int, rounds: int, auto_batch: bool,
                    data_dir: str | None, as_json: bool) -> None:
    """Produce throughput with and without a producer name (deduplication on/off)."""
    from tidemq.bench.types_bench import bench_dedup

    if count < 1 or size < 0 or rounds < 1:
        raise click.BadParameter("count, rounds >= 1; size >= 0")
    emit_result(bench_dedup(count=count, size=size, rounds=rounds, auto_batch=auto_batch,
                      data_dir=data_dir), as_json)


def register(cli: click.Group) -> None:
    bench = cli.commands.get("bench")
    if isinstance(bench, click.Group):
        bench.add_command(bench_delay_index_cmd)
        bench.add_command(bench_txn_cmd)
        bench.add_command(bench_dedup_cmd)
