"""`tidemq bench hostile` (tidemq/bench/hostile_bench.py): a name server and a broker of its own
under many hostile connections; latency of a well-behaved client and the servers' RSS."""

from __future__ import annotations

import sys

import click

from tidemq.cli.output import emit_result

__all__ = ["register"]


@click.command("hostile")
@click.option("--connections", default=1000, show_default=True,
              help="Hostile connections per server: half never read, half send partial frames.")
@click.option("--seconds", default=40.0, show_default=True,
              help="Measured seconds under attack (past the 30 s partial-frame timeout).")
@click.option("--unloaded-seconds", default=10.0, show_default=True,
              help="Measured seconds before the attack.")
@click.option("--rate", default=100, show_default=True,
              help="Well-behaved requests per second of each kind (send, pull, route).")
@click.option("--partial-rate", default=64 * 1024, show_default=True,
              help="Bytes per second each partial-frame sender writes.")
@click.option("--settle-seconds", default=2.0, show_default=True,
              help="Seconds between the end of the ramp (servers quiet again) and the loaded "
              "measurement.")
@click.option("--driver-nice", default=10, show_default=True, type=click.IntRange(0, 19),
              help="CPU priority steps the hostile drivers run below the servers: on one "
              "machine they would otherwise take the servers' cores, as attackers elsewhere "
              "would not (0: share the cores).")
@click.option("-o", "--option", "options", multiple=True, metavar="KEY=VALUE",
              help="A connection setting for both servers, e.g. "
              "-o max_partial_frame_bytes=67108864.")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Parent of the temporary directory (default: the temp dir).")
@click.option("--json", "as_json", is_flag=True)
def bench_hostile_cmd(connections: int, seconds: float, unloaded_seconds: float, rate: int,
                      partial_rate: int, settle_seconds: float, driver_nice: int,
                      options: tuple[str, ...],
                      data_dir: str | None, as_json: bool) -> None:
    """Latency of a well-behaved client and both servers' RSS under CONNECTIONS hostile
    connections per server (docs/operations.md, "Memory limits")."""
    from tidemq.bench.hostile_bench import bench_hostile

    if connections < 2 or seconds <= 0 or unloaded_seconds <= 0 or rate < 1:
        raise click.BadParameter("connections >= 2; seconds, unloaded-seconds > 0; rate >= 1")
    total = int(unloaded_seconds) + int(seconds)
    with click.progressbar(length=total, label="hostile", file=sys.stderr) as bar:
        result = bench_hostile(
            connections=connections, seconds=seconds, unloaded_seconds=unloaded_seconds,
            rate=rate, partial_rate=partial_rate, settle_seconds=settle_seconds,
            driver_nice=driver_nice, options=options, data_dir=data_dir,
            progress=bar.update,
        )
    emit_result(result, as_json)


def register(cli: click.Group) -> None:
    bench = cli.commands.get("bench")
    if isinstance(bench, click.Group):
        bench.add_command(bench_hostile_cmd)
