"""`tidemq group describe|update|lag|reset-offset` and `tidemq dlq list|resend` against a real
broker (click's runner in this process; the consumers are real push consumers)."""

from __future__ import annotations

import json
import threading
import time

import pytest
from click.testing import CliRunner

import tidemq
from tidemq.cli.main import cli

from .cluster import wait_until

GROUP, TOPIC = "cli-g", "cli-gt"


def _run(dev, *args: str, ok: bool = True):  # noqa: ANN202
    r = CliRunner().invoke(cli, [*args, "--namesrv", dev.namesrv])
    if ok:
        assert r.exit_code == 0, r.output
    return r


def _json(dev, *args: str) -> dict:
    return json.loads(_run(dev, *args, "--json").output)


def test_group_commands_and_dead_letter_resend(dev) -> None:
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(TOPIC, 2)
    out = _run(dev, "group", "update", "--group", GROUP, "--retry-max-times", "0").output
    assert "retry_max_times=0" in out  # the first failure goes straight to the DLQ
    seen: list[bytes] = []
    lock = threading.Lock()
    fail = {b"bad"}

    def handle(msgs, ctx):
        with lock:
            seen.extend(m.body for m in msgs)
        if any(m.body in fail for m in msgs):
            return tidemq.ConsumeStatus.RECONSUME_LATER
        return tidemq.ConsumeStatus.SUCCESS

    with tidemq.Producer(dev.namesrv) as p:
        for i in range(20):
            p.send(tidemq.Message(TOPIC, b"ok%d" % i))
        bad = p.send(tidemq.Message(TOPIC, b"bad", keys="k-bad"))
    opts = dict(consume_from="first", heartbeat_interval=1.0, persist_interval=0.2)
    c = tidemq.PushConsumer(dev.namesrv, GROUP, handle, **opts)
    c.subscribe(TOPIC)
    c.start()
    try:
        wait_until(lambda: len(seen) >= 21, 10)
        d = _json(dev, "group", "describe", "--group", GROUP)
        assert d["members"] == [c.client_id]
        assert d["message_model"] == "CLUSTERING"
        assert d["subscriptions"] == {TOPIC: "*", "%RETRY%" + GROUP: "*"}
        assert d["config"]["retry_max_times"] == 0
        assert "member " + c.client_id in _run(dev, "group", "describe", "--group", GROUP).output
        # A reset while members are online is refused (they would overwrite it).
        r = _run(dev, "group", "reset-offset", "--group", GROUP, "--topic", TOPIC,
                 "--to-offset", "0", ok=False)
        assert r.exit_code == 1 and "members online" in r.output
        with tidemq.Admin(dev.namesrv) as admin:
            wait_until(lambda: len(admin.dlq_messages(GROUP)) == 1, 5)
    finally:
        c.close()
    assert seen.count(b"bad") == 1
    rows = [json.loads(line) for line in
            _run(dev, "dlq", "list", "--group", GROUP, "--json").output.splitlines()]
    assert len(rows) == 1
    assert rows[0]["origin_topic"] == TOPIC and rows[0]["origin_msg_id"] == bad.msg_id
    assert rows[0]["body"] == "bad" and rows[0]["keys"] == ["k-bad"]
    assert f"from {TOPIC} {bad.msg_id}" in _run(dev, "dlq", "list", "--group", GROUP).output
    lag = _json(dev, "group", "lag", "--group", GROUP, "--topic", TOPIC)
    assert lag["total_lag"] == 0
    # Back to the start of the topic: the whole topic is backlog again.
    reset = _json(dev, "group", "reset-offset", "--group", GROUP, "--topic", TOPIC,
                  "--to-offset", "0")
    assert {q["offset"] for q in reset["queues"]} == {0}
    assert _json(dev, "group", "lag", "--group", GROUP, "--topic", TOPIC)["total_lag"] == 21
    # Resend the dead letter (by its origin id) to its topic; a consumer gets it again.
    _run(dev, "group", "reset-offset", "--group", GROUP, "--topic", TOPIC, "--to-offset",
         "1000000")  # clamped to the end of each queue
    r = _json(dev, "dlq", "resend", "--group", GROUP, "--msg-id", bad.msg_id)
    assert r["topic"] == TOPIC and r["dlq_msg_id"] == rows[0]["dlq_msg_id"]
    fail.clear()
    seen.clear()
    with tidemq.PushConsumer(dev.namesrv, GROUP, handle, **opts) as c2:
        c2.subscribe(TOPIC)
        wait_until(lambda: b"bad" in seen, 10)
    assert seen == [b"bad"]


def test_reset_offset_to_a_timestamp(dev) -> None:
    topic, group = "cli-ts", "cli-ts-g"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 2)
    with tidemq.Producer(dev.namesrv) as p:
        for i in range(6):
            p.send(tidemq.Message(topic, b"old%d" % i))
        time.sleep(0.05)
        cut = int(time.time() * 1000)
        time.sleep(0.05)
        for i in range(4):
            p.send(tidemq.Message(topic, b"new%d" % i))
    _run(dev, "group", "reset-offset", "--group", group, "--topic", topic, "--to-offset", "0")
    assert _json(dev, "group", "lag", "--group", group, "--topic", topic)["total_lag"] == 10
    _run(dev, "group", "reset-offset", "--group", group, "--topic", topic,
         "--to-timestamp", str(cut))
    assert _json(dev, "group", "lag", "--group", group, "--topic", topic)["total_lag"] == 4


@pytest.mark.parametrize("args,message", [
    (["group", "reset-offset", "--group", "g", "--topic", "t"], "exactly one of"),
    (["group", "reset-offset", "--group", "g", "--topic", "t", "--to-timestamp", "soon"],
     "neither milliseconds"),
    (["dlq", "resend", "--group", "g"], "--msg-id (repeatable) or --all"),
    (["dlq", "resend", "--group", "nobody-g", "--msg-id", "x"], "not in %DLQ%nobody-g"),
])
def test_bad_arguments_are_clear_errors(dev, args, message) -> None:
    r = _run(dev, *args, ok=False)
    assert r.exit_code != 0 and message in r.output, r.output


def test_bench_consume_push_mode_runs_and_reports(dev) -> None:
    """A smoke run of `tidemq bench consume --group G --consumers N` (not a timed test)."""
    r = _run(dev, "bench", "consume", "--topic", "cli-bench", "--group", "cli-bench-g",
             "--consumers", "2", "--count", "2000", "--listener-batch", "8", "--json")
    out = json.loads(r.output.strip().splitlines()[-1])
    assert out["complete"] and out["count"] >= 2000 and out["consumers"] == 2
    assert out["msgs_per_s"] > 0 and out["join_settle_ms"] is not None
    assert out["leave_settle_ms"] is not None
    with tidemq.Admin(dev.namesrv) as admin:
        assert admin.group_lag("cli-bench-g", "cli-bench").total_lag == 0
