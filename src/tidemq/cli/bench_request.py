"""`tidemq bench request` (tidemq/bench/request_bench.py): broker CPU and round trip of one
small send request, over a raw socket."""

from __future__ import annotations

import sys

import click

from tidemq.cli.output import emit_result

__all__ = ["register"]


@click.command("request")
@click.option("--count", default=20_000, show_default=True, help="Requests per round.")
@click.option("--inflight", default=1, show_default=True,
              help="Requests outstanding on the one connection (1: one at a time).")
@click.option("--size", type=int, default=None,
              help="Body bytes of the one message (default: varied messages, ~1 KiB, with a "
              "tag, a key and 2 properties, as `bench app` sends).")
@click.option("--rounds", default=5, show_default=True, help="Rounds; the best is reported.")
@click.option("--broker", default=None, metavar="HOST:PORT",
              help="Measure this running broker (default: start a `tidemq dev` of its own).")
@click.option("--pid", type=int, default=None, help="The running broker's process id.")
@click.option("-o", "--option", "options", multiple=True, metavar="KEY=VALUE",
              help="A broker setting of the `tidemq dev` started (e.g. -o flush=SYNC_FLUSH).")
@click.option("--floor/--no-floor", default=True, show_default=True,
              help="Also measure, in the same run, a bare uvloop server that only answers each "
              "frame with the broker's answer bytes: the floor under the broker's CPU and round "
              "trip on this machine now.")
@click.option("--json", "as_json", is_flag=True)
def bench_request_cmd(count: int, inflight: int, size: int | None, rounds: int,
                      broker: str | None, pid: int | None, options: tuple[str, ...],
                      floor: bool, as_json: bool) -> None:
    """Broker CPU per one-message SEND_MESSAGE request and its round trip, over a raw
    socket (no client library in the measure)."""
    from tidemq.bench.request_bench import bench_request

    if count < 1 or inflight < 1 or rounds < 1:
        raise click.BadParameter("count, inflight and rounds must be >= 1")
    with click.progressbar(length=rounds * (2 if floor else 1), label="request",
                           file=sys.stderr) as bar:
        done = [0]

        def progress(n: int) -> None:
            bar.update(n - done[0])
            done[0] = n

        result = bench_request(count=count, inflight=inflight, size=size, rounds=rounds,
                               broker=broker, pid=pid, options=options, floor=floor,
                               progress=progress)
    emit_result(result, as_json)


def register(cli: click.Group) -> None:
    bench = cli.commands["bench"]
    assert isinstance(bench, click.Group)
    bench.add_command(bench_request_cmd)
