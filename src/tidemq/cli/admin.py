"""Client-side commands: `tidemq topic|send|consume|group|dlq` (group and dlq commands other
than `group lag` are in cli/groups.py) and `tidemq bench produce|consume|e2e`.

Every command takes ``--namesrv`` (default: $TIDEMQ_NAMESRV, else 127.0.0.1:9876). Errors from
the cluster become one-line ClickExceptions carrying the broker's message (exit code 1), never a
traceback.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import click

from tidemq.cli.output import emit_result
from tidemq.client.blocking import Admin, Producer, PullConsumer
from tidemq.client.chunking import first_chunk_offset
from tidemq.client.errors import TidemqError
from tidemq.client.message import Message, MessageExt
from tidemq.protocol.headers import Perm

__all__ = ["register"]

F = TypeVar("F", bound=Callable[..., Any])

namesrv_option = click.option(
    "--namesrv",
    envvar="TIDEMQ_NAMESRV",
    default="127.0.0.1:9876",
    show_default=True,
    help="Name server address(es), host:port separated by ';' (env TIDEMQ_NAMESRV).",
)


def friendly(fn: F) -> F:
    """Turn tidemq and argument errors into a ClickException (message, exit code 1)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except TidemqError as exc:
            raise click.ClickException(str(exc)) from None
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None

    return wrapper  # type: ignore[return-value]


def _body_text(body: bytes) -> str:
    try:
        return body.decode()
    except UnicodeDecodeError:
        return "0x" + body.hex()


def _msg_json(m: MessageExt) -> dict[str, Any]:
    d = m.to_dict()
    d["body"] = _body_text(m.body)
    return d


# -- topic -------------------------------------------------------------------------------------


@click.group("topic")
def topic_group() -> None:
    """Create, list, describe and delete topics."""


_PERMS = {"rw": Perm.READ_WRITE, "r": Perm.READ, "w": Perm.WRITE}


@topic_group.command("create")
@namesrv_option
@click.option("--topic", required=True)
@click.option("--queues", default=8, show_default=True, help="Read and write queue count.")
@click.option("--read-queues", type=int, default=None, help="Overrides --queues for reads.")
@click.option("--write-queues", type=int, default=None, help="Overrides --queues for writes.")
@click.option("--perm", type=click.Choice(sorted(_PERMS)), default="rw", show_default=True)
@click.option("--order", is_flag=True, help="Mark the topic as ordered.")
@click.option("--broker", default=None, help="Only this broker (name or host:port).")
@click.option("--cluster", default=None, help="Only the brokers of this cluster.")
@friendly
def topic_create(namesrv: str, topic: str, queues: int, read_queues: int | None,
                 write_queues: int | None, perm: str, order: bool, broker: str | None,
                 cluster: str | None) -> None:
    """Create or update TOPIC on every broker (or the one given)."""
    with Admin(namesrv) as admin:
        addrs = admin.create_topic(topic, queues, read_queues=read_queues,
                                   write_queues=write_queues, perm=_PERMS[perm], order=order,
                                   broker=broker, cluster=cluster)
    click.echo(f"topic {topic} created with {queues} queues on {', '.join(addrs)}")


@topic_group.command("list")
@namesrv_option
@click.option("--json", "as_json", is_flag=True)
@friendly
def topic_list(namesrv: str, as_json: bool) -> None:
    """Topics the name server knows."""
    with Admin(namesrv) as admin:
        topics = admin.list_topics()
    if as_json:
        click.echo(json.dumps(topics))
    else:
        for t in topics:
            click.echo(t)


@topic_group.command("describe")
@namesrv_option
@click.option("--topic", required=True)
@click.option("--json", "as_json", is_flag=True)
@friendly
def topic_describe(namesrv: str, topic: str, as_json: bool) -> None:
    """Route and per-queue offsets of TOPIC."""
    with Admin(namesrv) as admin:
        route = admin.topic_route(topic)
        status = admin.topic_status(topic)
    brokers = {b.broker_name: b.broker_addrs.get(0, "") for b in route.broker_datas}
    queues = [
        {"broker": s.queue.broker_name, "queue_id": s.queue.queue_id,
         "min_offset": s.min_offset, "max_offset": s.max_offset,
         "messages": s.max_offset - s.min_offset}
        for s in status
    ]
    if as_json:
        click.echo(json.dumps({
            "topic": topic,
            "brokers": brokers,
            "queue_datas": [
                {"broker": q.broker_name, "read_queues": q.read_queue_nums,
                 "write_queues": q.write_queue_nums, "perm": q.perm}
                for q in route.queue_datas
            ],
            "queues": queues,
        }))
        return
    click.echo(f"topic {topic}")
    for q in route.queue_datas:
        click.echo(f"  broker {q.broker_name} at {brokers.get(q.broker_name, '?')}: "
                   f"{q.read_queue_nums} read / {q.write_queue_nums} write queues, "
                   f"perm {q.perm}")
    click.echo(f"  {'broker':<16} {'queue':>5} {'min':>12} {'max':>12} {'messages':>12}")
    for q in queues:
        click.echo(f"  {q['broker']:<16} {q['queue_id']:>5} {q['min_offset']:>12} "
                   f"{q['max_offset']:>12} {q['messages']:>12}")


@topic_group.command("delete")
@namesrv_option
@click.option("--topic", required=True)
@click.option("--broker", default=None, help="Only this broker (name or host:port).")
@friendly
def topic_delete(namesrv: str, topic: str, broker: str | None) -> None:
    """Delete TOPIC from its brokers."""
    with Admin(namesrv) as admin:
        addrs = admin.delete_topic(topic, broker=broker)
    click.echo(f"topic {topic} deleted from {', '.join(addrs)}")


# -- send / consume ----------------------------------------------------------------------------


def _parse_props(values: tuple[str, ...]) -> dict[str, str] | None:
    out = {}
    for v in values:
        k, sep, val = v.partition("=")
        if not sep or not k:
            raise click.BadParameter(f"{v!r} is not NAME=VALUE", param_hint="--property")
        out[k] = val
    return out or None


@click.command("send")
@namesrv_option
@click.option("--topic", required=True)
@click.option("--body", default=None, help="Message body; '{i}' becomes the message number. "
              "Omit to read the body from stdin.")
@click.option("--tags", default=None)
@click.option("--keys", default=None, help="Space-separated keys; '{i}' is substituted.")
@click.option("--property", "props", multiple=True, help="NAME=VALUE (repeatable).")
@click.option("--count", default=1, show_default=True, help="Messages to send.")
@click.option("--batch", default=1, show_default=True, help="Messages per batch.")
@click.option("--queue-id", type=int, default=None, help="Send to this queue only.")
@click.option("--json", "as_json", is_flag=True, help="Print each SendResult as JSON.")
@friendly
def send_cmd(namesrv: str, topic: str, body: str | None, tags: str | None, keys: str | None,
             props: tuple[str, ...], count: int, batch: int, queue_id: int | None,
             as_json: bool) -> None:
    """Send messages to TOPIC."""
    if count < 1 or batch < 1:
        raise click.BadParameter("--count and --batch must be >= 1")
    raw = sys.stdin.buffer.read() if body is None else None
    properties = _parse_props(props)

    def make(i: int) -> Message:
        b: bytes = raw if raw is not None else body.replace("{i}", str(i)).encode()  # type: ignore[union-attr]
        k = keys.replace("{i}", str(i)) if keys else None
        return Message(topic, b, tags=tags, keys=k, properties=properties)

    show_bar = count > 100 and not as_json
    results = []
    t0 = time.perf_counter()
    with Producer(namesrv) as producer:
        bar = click.progressbar(length=count, label="sending", file=sys.stderr) if show_bar \
            else None
        try:
            for start in range(0, count, batch):
                msgs = [make(i) for i in range(start, min(count, start + batch))]
                r = (producer.send(msgs[0], queue_id=queue_id) if len(msgs) == 1
                     else producer.send_batch(msgs, queue_id=queue_id))
                if as_json:
                    click.echo(json.dumps({
                        "status": str(r.status), "msg_id": r.msg_id, "topic": r.topic,
                        "broker": r.broker_name, "queue_id": r.queue_id,
                        "queue_offset": r.queue_offset, "count": r.count,
                    }))
                elif count <= 10:
                    results.append(r)
                if bar is not None:
                    bar.update(len(msgs))
        finally:
            if bar is not None:
                bar.render_finish()
    secs = time.perf_counter() - t0
    for r in results:
        click.echo(f"{r.status} msg_id={r.msg_id} queue={r.broker_name}:{r.queue_id} "
                   f"offset={r.queue_offset}" + (f" count={r.count}" if r.count > 1 else ""))
    if not as_json and count > 10:
        click.echo(f"sent {count} messages in {secs:.2f} s ({count / max(secs, 1e-9):,.0f}/s)")


@click.command("consume")
@namesrv_option
@click.option("--topic", required=True)
@click.option("--group", required=True, help="Consumer group; its offsets are committed.")
@click.option("--tags", "expression", default="*", show_default=True,
              help="Tag filter: '*' or 'TagA || TagB'.")
@click.option("--sql", default=None,
              help="SQL92 property filter instead of tags, e.g. \"region = 'eu' AND n > 3\".")
@click.option("--from-beginning", is_flag=True,
              help="A group without offsets starts at the earliest message (default: latest).")
@click.option("--count", type=int, default=None, help="Stop after this many messages.")
@click.option("--timeout", type=float, default=5.0, show_default=True,
              help="Stop when no message came for this many seconds (0: wait forever).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per message.")
@friendly
def consume_cmd(namesrv: str, topic: str, group: str, expression: str, sql: str | None,
                from_beginning: bool, count: int | None, timeout: float, as_json: bool) -> None:
    """Print messages of TOPIC as GROUP, committing offsets. Chunked messages are printed
    whole."""
    got = 0
    consumer = PullConsumer(namesrv, group, consume_from="first" if from_beginning else "last")
    with consumer:
        # A topic no broker has is an error, not an idle wait (NoRouteError -> exit 1).
        if not consumer.fetch_queues(topic):
            raise click.ClickException(
                f"topic {topic!r} has no readable queue (its permission is write-only); "
                "nothing can be consumed from it"
            )
        try:
            consumer.subscribe(topic, expression, sql=sql)
        except ValueError as exc:  # a bad SQL92 expression, or tags and --sql together
            raise click.BadParameter(str(exc)) from None
        idle_since = time.monotonic()
        while count is None or got < count:
            msgs = consumer.poll(timeout=1.0)
            if not msgs:
                if timeout and time.monotonic() - idle_since >= timeout:
                    break
                continue
            idle_since = time.monotonic()
            if count is not None and got + len(msgs) > count:
                keep = msgs[: count - got]
                # Commit exactly what was printed: the rest is left for the next run.
                last = {}
                for m in keep:
                    last[m.message_queue] = m.queue_offset + 1
                for m in msgs[count - got :]:
                    # a whole chunked message left for the next run: from its first chunk
                    first = first_chunk_offset(m)
                    last.setdefault(m.message_queue, m.queue_offset if first is None else first)
                msgs = keep
                for m in msgs:
                    _print_msg(m, as_json)
                got += len(msgs)
                consumer.commit(last)
                break
            for m in msgs:
                _print_msg(m, as_json)
            got += len(msgs)
        consumer.commit()
        skipped = consumer.stats()["corrupt_skipped"]
    if not as_json:
        click.echo(f"consumed {got} messages", err=True)
    if skipped:
        click.echo(f"skipped {skipped} corrupt records (not decodable; see the log for their "
                   "queues and offsets)", err=True)


def _print_msg(m: MessageExt, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(_msg_json(m)))
    else:
        tags = f" tags={m.tags}" if m.tags else ""
        keys = f" keys={' '.join(m.keys)}" if m.keys else ""
        click.echo(f"[{m.broker_name}:{m.queue_id}@{m.queue_offset}] {m.msg_id}{tags}{keys} "
                   f"{_body_text(m.body)}")


# -- group -------------------------------------------------------------------------------------


@click.group("group")
def group_group() -> None:
    """Consumer groups."""


@group_group.command("lag")
@namesrv_option
@click.option("--group", required=True)
@click.option("--topic", default=None, help="Only this topic.")
@click.option("--json", "as_json", is_flag=True)
@friendly
def group_lag(namesrv: str, group: str, topic: str | None, as_json: bool) -> None:
    """Backlog of GROUP per queue: broker offset - committed offset."""
    with Admin(namesrv) as admin:
        lag = admin.group_lag(group, topic)
    if as_json:
        click.echo(json.dumps({
            "group": group,
            "total_lag": lag.total_lag,
            "queues": [
                {"topic": q.queue.topic, "broker": q.queue.broker_name,
                 "queue_id": q.queue.queue_id, "broker_offset": q.broker_offset,
                 "consumer_offset": q.consumer_offset, "lag": q.lag}
                for q in lag.queues
            ],
        }))
        return
    if not lag.queues:
        click.echo(f"group {group} has no committed offsets" + (f" on {topic}" if topic else ""))
        return
    click.echo(f"{'topic':<20} {'broker':<12} {'queue':>5} {'broker_off':>12} "
               f"{'consumer_off':>12} {'lag':>10}")
    for q in lag.queues:
        click.echo(f"{q.queue.topic:<20} {q.queue.broker_name:<12} {q.queue.queue_id:>5} "
                   f"{q.broker_offset:>12} {q.consumer_offset:>12} {q.lag:>10}")
    click.echo(f"total lag {lag.total_lag}")


# -- bench -------------------------------------------------------------------------------------




@click.command("produce")
@namesrv_option
@click.option("--topic", required=True)
@click.option("--size", default=1024, show_default=True, help="Body bytes per message.")
@click.option("--count", default=1_000_000, show_default=True)
@click.option("--batch", default=1000, show_default=True, help="Messages per batch.")
@click.option("--producers", default=1, show_default=True, help="Producer processes.")
@click.option("--inflight", default=4, show_default=True, help="Batches in flight each.")
@click.option("--queues", default=8, show_default=True, help="Queues if the topic is created.")
@click.option("--auto-batch", is_flag=True,
              help="Send single messages with send_async; the producer batches (up to --batch).")
@click.option("--producer-name", default=None,
              help="Deduplicated producer (BR12) of this name (process i: NAME-i).")
@click.option("--varied", is_flag=True,
              help="Every message with a tag (one of 8), a key and 2 properties.")
@click.option("--json", "as_json", is_flag=True)
@friendly
def bench_produce_cmd(namesrv: str, topic: str, size: int, count: int, batch: int,
                      producers: int, inflight: int, queues: int, auto_batch: bool,
                      producer_name: str | None, varied: bool, as_json: bool) -> None:
    """Send COUNT messages of SIZE bytes in batches; print the rate."""
    from tidemq.bench.client_bench import bench_produce

    if size < 0 or count < 1 or batch < 1 or producers < 1 or inflight < 1:
        raise click.BadParameter("size >= 0; count, batch, producers, inflight >= 1")
    with click.progressbar(length=count, label="producing", file=sys.stderr) as bar:
        result = bench_produce(namesrv=namesrv, topic=topic, size=size, count=count, batch=batch,
                               producers=producers, inflight=inflight, queues=queues,
                               progress=bar.update, auto_batch=auto_batch,
                               producer_name=producer_name, varied=varied)
    emit_result(result, as_json)


@click.command("consume")
@namesrv_option
@click.option("--topic", required=True)
@click.option("--count", default=1_000_000, show_default=True)
@click.option("--batch", default=1000, show_default=True, help="Messages per pull.")
@click.option("--group", default=None,
              help="Push consumers of this group (a new group if only --consumers is given) "
                   "drain the backlog; see the options below.")
@click.option("--consumers", type=click.IntRange(1), default=None,
              help="Push consumer processes in the group (push mode).")
@click.option("--listener-batch", type=click.IntRange(1), default=1, show_default=True,
              help="Push mode: messages per listener call.")
@click.option("--pull-batch", type=click.IntRange(1), default=32, show_default=True,
              help="Push mode: messages per pull.")
@click.option("--size", default=1024, show_default=True,
              help="Push mode: body bytes of the COUNT messages produced first.")
@click.option("--queues", default=8, show_default=True, help="Queues if the topic is created.")
@click.option("--no-produce", is_flag=True, help="Push mode: consume the existing backlog.")
@click.option("--produce-batch", type=click.IntRange(1), default=1000, show_default=True,
              help="Push mode: messages per stored batch of the backlog produced first.")
@click.option("--async-listener", is_flag=True,
              help="Push mode: an async no-op listener (on the loop, not the thread pool).")
@click.option("--no-settle", is_flag=True,
              help="Push mode: skip the rebalance settle-time measure.")
@click.option("--json", "as_json", is_flag=True)
@friendly
def bench_consume_cmd(namesrv: str, topic: str, count: int, batch: int, group: str | None,
                      consumers: int | None, listener_batch: int, pull_batch: int, size: int,
                      queues: int, no_produce: bool, produce_batch: int, async_listener: bool,
                      no_settle: bool, as_json: bool) -> None:
    """Read COUNT messages of TOPIC's backlog from the earliest offset; print the rate.

    With --group or --consumers: produce COUNT messages, then N push consumer processes of
    the group drain the backlog with a no-op listener (bench/push_bench.py); also the time
    the group takes to settle after a member joins and leaves."""
    if group is not None or consumers is not None:
        from tidemq.bench.push_bench import bench_push_consume

        with click.progressbar(length=count, label="push consuming", file=sys.stderr) as bar:
            result = bench_push_consume(
                namesrv=namesrv, topic=topic, group=group, consumers=consumers or 1,
                count=count, size=size, listener_batch=listener_batch, pull_batch=pull_batch,
                queues=queues, produce=not no_produce, produce_batch=produce_batch,
                async_listener=async_listener,
                settle=not no_settle, progress=bar.update)
        emit_result(result, as_json)
        return
    from tidemq.bench.client_bench import bench_consume

    with click.progressbar(length=count, label="consuming", file=sys.stderr) as bar:
        result = bench_consume(namesrv=namesrv, topic=topic, count=count, batch=batch,
                               progress=bar.update)
    emit_result(result, as_json)


@click.command("e2e")
@namesrv_option
@click.option("--topic", required=True)
@click.option("--size", default=1024, show_default=True)
@click.option("--rate", default=10_000, show_default=True, help="Messages per second.")
@click.option("--seconds", default=10.0, show_default=True)
@click.option("--queues", default=8, show_default=True, help="Queues if the topic is created.")
@click.option("--batch-delay-ms", default=0.0, show_default=True,
              help="The producer's batch_max_delay. 0 sends what one loop iteration queued "
                   "at its end (still one batch, no wait); the producer's default is 1 ms.")
@click.option("--json", "as_json", is_flag=True)
@friendly
def bench_e2e_cmd(namesrv: str, topic: str, size: int, rate: int, seconds: float, queues: int,
                  batch_delay_ms: float, as_json: bool) -> None:
    """Send at RATE for SECONDS and consume at once; print send -> receive latency."""
    from tidemq.bench.client_bench import bench_e2e

    total = int(rate * seconds)
    with click.progressbar(length=total, label="end to end", file=sys.stderr) as bar:
        result = bench_e2e(namesrv=namesrv, topic=topic, size=size, rate=rate, seconds=seconds,
                           queues=queues, batch_delay=batch_delay_ms / 1000,
                           progress=bar.update)
    emit_result(result, as_json)


def register(cli: click.Group) -> None:
    """Add the client commands to the `tidemq` group (and to its `bench` group)."""
    cli.add_command(topic_group)
    cli.add_command(send_cmd)
    cli.add_command(consume_cmd)
    cli.add_command(group_group)
    from tidemq.cli.groups import register as register_groups

    register_groups(cli, group_group, namesrv_option, friendly)
    bench = cli.commands.get("bench")
    if isinstance(bench, click.Group):
        bench.add_command(bench_produce_cmd)
        bench.add_command(bench_consume_cmd)
        bench.add_command(bench_e2e_cmd)
