"""`tidemq bench app`: the six everyday workloads against tidemq and Redis (bench/app_bench.py)."""

from __future__ import annotations

import sys

import click

from tidemq.cli.output import emit_result

__all__ = ["register"]


@click.command("app")
@click.option("--workloads", default=None,
              help="Comma-separated subset of send_1_thread, send_16_threads, await_send_64, "
                   "send_async, push_consume, poll_consume (the consumers drain send_async's "
                   "backlog: they need it).")
@click.option("--scale", type=click.FloatRange(0.01), default=1.0, show_default=True,
              help="Multiply every workload's message count (10k, 32k, 64k, 200k, 200k, 200k).")
@click.option("--no-redis", is_flag=True, help="Only tidemq (no redis-server needed).")
@click.option("--json", "as_json", is_flag=True)
def bench_app_cmd(workloads: str | None, scale: float, no_redis: bool, as_json: bool) -> None:
    """Send and consume varied messages the way applications do (blocking send from 1 and 16
    threads, 64 coroutines awaiting send, send_async + flush, a push consumer, a poll() loop),
    each against a fresh `tidemq dev` and then Redis Streams through redis-py in the same
    run."""
    from tidemq.bench.app_bench import DEFAULT_COUNTS, WORKLOADS, bench_app

    chosen = tuple(w.strip() for w in workloads.split(",")) if workloads else WORKLOADS
    bad = [w for w in chosen if w not in WORKLOADS]
    if bad:
        raise click.BadParameter(f"unknown workload(s) {bad}; choose from {list(WORKLOADS)}")
    counts = {w: max(64, int(DEFAULT_COUNTS[w] * scale)) for w in chosen}
    total = sum(counts.values()) * (1 if no_redis else 2)
    with click.progressbar(length=total, label="bench app", file=sys.stderr) as bar:
        try:
            result = bench_app(workloads=chosen, counts=counts, redis=not no_redis,
                               progress=bar.update)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
    emit_result(result, as_json)


def register(cli: click.Group) -> None:
    bench = cli.commands.get("bench")
    if isinstance(bench, click.Group):
        bench.add_command(bench_app_cmd)
