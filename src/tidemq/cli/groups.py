"""Consumer-group commands: `tidemq group describe|update|reset-offset` (next to `group lag`)
and `tidemq dlq list|resend` (ref BR7, BR11, OP1).

- ``group describe``: the members each broker knows, message model, subscriptions, the group's
  config (retry_max_times, ...) and its backlog per topic.
- ``group update``: change the group's config on every master broker (``--retry-max-times``).
- ``group reset-offset --topic T --to-offset N | --to-timestamp TS``: set the group's offset of
  every queue of T (clamped to what each queue holds; a timestamp moves to the first message
  stored at or after it). Running members keep their own offsets in memory and would write
  them back, so the command refuses while the group has members, unless ``--force``.
- ``dlq list``: the messages in ``%DLQ%<group>`` with their origin (topic, message id).
- ``dlq resend``: send dead-lettered messages (``--msg-id``, repeatable: DLQ or origin ids; or
  ``--all``) again to their origin topic. The DLQ keeps its copies (an archive).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from typing import Any

import click
import msgspec

from tidemq.client.blocking import Admin
from tidemq.client.message import MessageExt

__all__ = ["register"]


def _timestamp_ms(text: str) -> int:
    """Milliseconds since the epoch, or an ISO 8601 time (local time unless it has a zone)."""
    if text.isdigit():
        return int(text)
    try:
        t = dt.datetime.fromisoformat(text)
    except ValueError:
        raise click.BadParameter(
            f"{text!r} is neither milliseconds since the epoch nor an ISO time like "
            "2026-01-31T12:00:00", param_hint="--to-timestamp") from None
    return int(t.timestamp() * 1000)


def _dlq_json(m: MessageExt) -> dict[str, Any]:
    p = m.properties
    return {
        "dlq_msg_id": m.msg_id, "queue_offset": m.queue_offset,
        "origin_topic": p.get("RETRY_TOPIC", ""), "origin_msg_id": p.get("ORIGIN_MESSAGE_ID", ""),
        "reconsume_times": m.reconsume_times, "store_timestamp": m.store_timestamp,
        "tags": m.tags, "keys": m.keys, "body": _text(m.body),
    }


def _text(body: bytes) -> str:
    try:
        return body.decode()
    except UnicodeDecodeError:
        return "0x" + body.hex()


Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]

_KIND = {"PUSH": "push consumers", "PULL": "lite pull consumers",
         "POP": "SimpleConsumers (server-side dispatch)"}


def register(cli: click.Group, group_group: click.Group, namesrv_option: Decorator,
             friendly: Decorator) -> None:
    """Add describe/update/reset-offset to `tidemq group` and the `tidemq dlq` group."""

    @group_group.command("describe")
    @namesrv_option
    @click.option("--group", required=True)
    @click.option("--json", "as_json", is_flag=True)
    @friendly
    def group_describe(namesrv: str, group: str, as_json: bool) -> None:
        """Members, subscriptions, config and backlog of GROUP."""
        with Admin(namesrv) as admin:
            info = admin.group_info(group)
            lag = admin.group_lag(group)
        per_topic: dict[str, int] = {}
        for q in lag.queues:
            per_topic[q.queue.topic] = per_topic.get(q.queue.topic, 0) + q.lag
        cfg = msgspec.structs.asdict(info.config) if info.config is not None else None
        subs = {s.topic: s.expression for s in info.subscriptions}
        if as_json:
            click.echo(json.dumps({
                "group": group, "members": info.members, "brokers": info.brokers,
                "message_model": info.message_model, "consume_from": info.consume_from,
                "consume_type": info.consume_type,
                "subscriptions": subs, "config": cfg, "lag": per_topic,
                "total_lag": lag.total_lag,
            }))
            return
        click.echo(f"group {group}: {len(info.members)} members"
                   + (f", {info.message_model.lower()}, consume from {info.consume_from}"
                      if info.members else "")
                   + (f", {_KIND.get(info.consume_type, info.consume_type)}"
                      if info.consume_type else ""))
        for m in info.members:
            on = [b for b, ids in info.brokers.items() if m in ids]
            click.echo(f"  member {m} (on {', '.join(on)})")
        for t, e in sorted(subs.items()):
            click.echo(f"  subscribes {t} {e}")
        if cfg is not None:
            click.echo("  config " + " ".join(f"{k}={v}" for k, v in cfg.items()
                                              if k != "group_name"))
        else:
            click.echo("  config: none (the broker does not know this group)")
        for t, n in sorted(per_topic.items()):
            click.echo(f"  lag {t} {n}")

    @group_group.command("update")
    @namesrv_option
    @click.option("--group", required=True)
    @click.option("--retry-max-times", type=click.IntRange(0), default=None,
                  help="Retries before a message goes to %DLQ%<group> (16).")
    @click.option("--retry-queues", type=click.IntRange(1, 64), default=None,
                  help="Queues of %RETRY%<group> (1).")
    @click.option("--consume-enable/--consume-disable", default=None)
    @click.option("--broadcast-enable/--broadcast-disable", default=None)
    @friendly
    def group_update(namesrv: str, group: str, retry_max_times: int | None,
                     retry_queues: int | None, consume_enable: bool | None,
                     broadcast_enable: bool | None) -> None:
        """Create GROUP or change its config on every master broker."""
        changes = {k: v for k, v in {
            "retry_max_times": retry_max_times, "retry_queue_nums": retry_queues,
            "consume_enable": consume_enable, "consume_broadcast_enable": broadcast_enable,
        }.items() if v is not None}
        with Admin(namesrv) as admin:
            cfg = admin.update_group(group, **changes)
        click.echo(f"group {group}: " + " ".join(
            f"{k}={v}" for k, v in msgspec.structs.asdict(cfg).items() if k != "group_name"))

    @group_group.command("reset-offset")
    @namesrv_option
    @click.option("--group", required=True)
    @click.option("--topic", required=True)
    @click.option("--to-offset", type=click.IntRange(0), default=None,
                  help="This queue offset in every queue (clamped to [min, max]).")
    @click.option("--to-timestamp", default=None,
                  help="The first message stored at or after this time: ms since the epoch "
                       "or ISO 8601.")
    @click.option("--force", is_flag=True,
                  help="Reset although members are online (they may overwrite it).")
    @click.option("--json", "as_json", is_flag=True)
    @friendly
    def group_reset_offset(namesrv: str, group: str, topic: str, to_offset: int | None,
                           to_timestamp: str | None, force: bool, as_json: bool) -> None:
        """Move GROUP's offsets of TOPIC (stop the group's consumers first)."""
        if (to_offset is None) == (to_timestamp is None):
            raise click.UsageError("give exactly one of --to-offset and --to-timestamp")
        ts = _timestamp_ms(to_timestamp) if to_timestamp is not None else None
        with Admin(namesrv) as admin:
            members = admin.group_info(group).members
            if members and not force:
                raise click.ClickException(
                    f"group {group} has {len(members)} members online ({', '.join(members)}); "
                    "they keep their offsets in memory and would overwrite the reset: stop "
                    "them first, or pass --force")
            new = admin.reset_group_offsets(group, topic, offset=to_offset, timestamp_ms=ts)
        rows = [{"topic": mq.topic, "broker": mq.broker_name, "queue_id": mq.queue_id,
                 "offset": off} for mq, off in new.items()]
        if as_json:
            click.echo(json.dumps({"group": group, "topic": topic, "queues": rows}))
            return
        for r in rows:
            click.echo(f"{r['topic']} {r['broker']}:{r['queue_id']} -> {r['offset']}")

    @click.group("dlq")
    def dlq_group() -> None:
        """Dead-letter queues (%DLQ%<group>): list and resend."""

    @dlq_group.command("list")
    @namesrv_option
    @click.option("--group", required=True)
    @click.option("--max", "max_num", type=click.IntRange(1), default=100, show_default=True)
    @click.option("--from-offset", type=click.IntRange(0), default=0, show_default=True)
    @click.option("--json", "as_json", is_flag=True, help="One JSON object per message.")
    @friendly
    def dlq_list(namesrv: str, group: str, max_num: int, from_offset: int,
                 as_json: bool) -> None:
        """Messages in GROUP's dead-letter queue, with where they came from."""
        with Admin(namesrv) as admin:
            msgs = admin.dlq_messages(group, max_num=max_num, from_offset=from_offset)
        for m in msgs:
            d = _dlq_json(m)
            if as_json:
                click.echo(json.dumps(d))
            else:
                click.echo(f"@{d['queue_offset']} {d['dlq_msg_id']} from {d['origin_topic']} "
                           f"{d['origin_msg_id']} after {d['reconsume_times'] - 1} retries: "
                           f"{d['body']}")
        if not as_json:
            click.echo(f"{len(msgs)} messages in %DLQ%{group}", err=True)

    @dlq_group.command("resend")
    @namesrv_option
    @click.option("--group", required=True)
    @click.option("--msg-id", "msg_ids", multiple=True,
                  help="A DLQ or origin message id (repeatable).")
    @click.option("--all", "resend_all", is_flag=True, help="Every message in the DLQ.")
    @click.option("--json", "as_json", is_flag=True)
    @friendly
    def dlq_resend(namesrv: str, group: str, msg_ids: tuple[str, ...], resend_all: bool,
                   as_json: bool) -> None:
        """Send dead-lettered messages again to their origin topic."""
        if bool(msg_ids) == resend_all:
            raise click.UsageError("give --msg-id (repeatable) or --all")
        with Admin(namesrv) as admin:
            done = admin.resend_dlq(group, list(msg_ids) or None)
        for dlq_id, topic, new_id in done:
            if as_json:
                click.echo(json.dumps({"dlq_msg_id": dlq_id, "topic": topic,
                                       "msg_id": new_id}))
            else:
                click.echo(f"{dlq_id} -> {topic} as {new_id}")

    cli.add_command(dlq_group)
