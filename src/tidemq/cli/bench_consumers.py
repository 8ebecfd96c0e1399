"""`tidemq bench sql-filter` (tidemq/bench/sql_bench.py): consumer-side broker costs;
`tidemq bench pop` (tidemq/bench/pop_bench.py): SimpleConsumers draining a backlog."""

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


@click.command("pop")
@click.option("--namesrv", "-n", default="127.0.0.1:9876", show_default=True)
@click.option("--topic", default="bench_pop", show_default=True)
@click.option("--group", default=None, help="Consumer group (default: a fresh one).")
@click.option("--consumers", default=4, show_default=True, help="SimpleConsumer processes.")
@click.option("--count", default=200_000, show_default=True, help="Backlog to drain.")
@click.option("--size", default=128, show_default=True, help="Body bytes per message.")
@click.option("--pop-batch", default=256, show_default=True, help="receive(max) per call.")
@click.option("--queues", default=8, show_default=True)
@click.option("--no-produce", is_flag=True, help="Drain the existing backlog of the group.")
@click.option("--subscription-type", "subscription_types", multiple=True,
              type=click.Choice(["SimpleConsumer", "Shared", "Key_Shared", "Failover"]),
              help="Drain the same keyed backlog once per type, with Pulsar-style Consumers "
                   "(repeat: --subscription-type Shared --subscription-type Key_Shared).")
@click.option("--json", "as_json", is_flag=True)
def bench_pop_cmd(namesrv: str, topic: str, group: str | None, consumers: int, count: int,
                  size: int, pop_batch: int, queues: int, no_produce: bool,
                  subscription_types: tuple[str, ...], as_json: bool) -> None:
    """SimpleConsumers (POP) of one group drain a backlog with per-message acks: msgs/s."""
    from tidemq.bench.pop_bench import bench_pop

    emit_result(bench_pop(namesrv=namesrv, topic=topic, group=group, consumers=consumers,
                          count=count, size=size, pop_batch=pop_batch, queues=queues,
                          produce=not no_produce,
                          subscription_types=list(subscription_types) or None), as_json)


def register(cli: click.Group) -> None:
    bench = cli.commands.get("bench")
    if isinstance(bench, click.Group):
        bench.add_command(bench_sql_filter_cmd)
        bench.add_command(bench_pop_cmd)
