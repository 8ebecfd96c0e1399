"""`tidemq bench scale` (tidemq/bench/scale_bench.py): produce, consume, RSS and restart time of
a fresh `tidemq dev` from 8 to 100,000 queues."""

from __future__ import annotations

import sys
from typing import Any

import click

from tidemq.cli.output import emit_result

__all__ = ["register"]


class _Bars:
    """One click progress bar per phase of each size, on stderr."""

    def __init__(self) -> None:
        self.bar: Any = None
        self.key: tuple[str, int] | None = None
        self.shown = 0

    def __call__(self, phase: str, done: int, total: int) -> None:
        if self.key != (phase, total):
            self.close()
            self.key = (phase, total)
            self.bar = click.progressbar(length=total, label=f"{phase:>8}", file=sys.stderr)
            self.bar.__enter__()
            self.shown = 0
        step = min(done, total) - self.shown
        if step > 0:
            self.bar.update(step)
            self.shown += step

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


@click.command("scale")
@click.option("--queues", "sizes", default="8,64,512,2048,10000,100000", show_default=True,
              help="Comma-separated queue counts to run, in order (the first is the reference).")
@click.option("--max-queues", default=None, type=int,
              help="Skip the sizes above this (a quick run).")
@click.option("--queues-per-topic", default=8, show_default=True)
@click.option("--size", default=1024, show_default=True, help="Body bytes per message.")
@click.option("--messages", default=100_000, show_default=True,
              help="Messages produced (and then consumed) per size.")
@click.option("--window", default=20_000, show_default=True, help="Sends in flight.")
@click.option("--restart/--no-restart", default=True, show_default=True,
              help="Measure restart time (clean and after kill -9).")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Parent of the temporary broker directories (default: the temp dir).")
@click.option("--push-max-queues", default=10_000, show_default=True,
              help="Measure a push consumer's end-to-end latency at sizes up to this.")
@click.option("--push-rate", default=10_000, show_default=True,
              help="Messages per second of the push end-to-end phase (0: skip it).")
@click.option("--push-seconds", default=5.0, show_default=True)
@click.option("--push-multi-queue-min", type=int, default=None,
              help="The push consumer's multi_queue_min (standing multi-queue pulls from this "
                   "many queues on; 0: one pull per queue; default: the consumer's, 256).")
@click.option("--push-producer-process/--push-producer-same", default=False, show_default=True,
              help="Run the push phase's producer in a process of its own (else on the "
                   "consumer's event loop, as the earlier figures).")
@click.option("--progress/--no-progress", default=True, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def bench_scale_cmd(sizes: str, max_queues: int | None, queues_per_topic: int, size: int,
                    messages: int, window: int, restart: bool, data_dir: str | None,
                    push_max_queues: int, push_rate: int, push_seconds: float,
                    push_multi_queue_min: int | None, push_producer_process: bool,
                    progress: bool, as_json: bool) -> None:
    """Produce and consume msgs/s, broker RSS per idle queue and restart time (clean and after
    kill -9) of a fresh broker holding each number of queues; one producer sends single 1 KiB
    messages to random queues (send_async)."""
    from tidemq.bench.scale_bench import bench_scale

    try:
        ns = tuple(int(x) for x in sizes.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter("--queues takes comma-separated integers") from None
    if max_queues is not None:
        ns = tuple(n for n in ns if n <= max_queues)
    if not ns or min(ns) < 1 or queues_per_topic < 1 or messages < 1 or window < 1:
        raise click.BadParameter("sizes, --queues-per-topic, --messages, --window must be >= 1")
    bars = _Bars() if progress else None
    try:
        result = bench_scale(sizes=ns, queues_per_topic=queues_per_topic, size=size,
                             messages=messages, window=window, restart=restart,
                             data_dir=data_dir, progress=bars, push_max_queues=push_max_queues,
                             push_rate=push_rate, push_seconds=push_seconds,
                             push_multi_queue_min=push_multi_queue_min,
                             push_producer_process=push_producer_process)
    finally:
        if bars is not None:
            bars.close()
    emit_result(result, as_json)


def register(cli: click.Group) -> None:
    bench = cli.commands["bench"]
    assert isinstance(bench, click.Group)
    bench.add_command(bench_scale_cmd)
