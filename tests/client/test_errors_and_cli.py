"""Bad input gives clear errors; the CLI works end to end (real `tidemq dev` processes)."""

from __future__ import annotations

import json
import tempfile
import time

import pytest
from click.testing import CliRunner

import tidemq
from tidemq.cli.main import cli
from tidemq.protocol.codes import ResponseCode

from .conftest import start_dev, stop_dev


@pytest.fixture(scope="module")
def strict():
    """A cluster with topic auto-create off and a 64 KiB message limit."""
    with tempfile.TemporaryDirectory(prefix="tidemq-strict-") as d:
        c = start_dev(d, "auto_create_topic=false", "max_message_size=65536")
        try:
            yield c
        finally:
            stop_dev(c)


def test_unknown_topic_with_auto_create_off_is_a_clear_error(strict):
    with tidemq.Producer(strict.namesrv) as p:
        with pytest.raises(tidemq.BrokerError, match="tidemq topic create") as ei:
            p.send(tidemq.Message("nope", b"x"))
        assert ei.value.response_code == ResponseCode.TOPIC_NOT_EXIST
    with tidemq.Admin(strict.namesrv) as a, pytest.raises(tidemq.NoRouteError,
                                                          match="does not exist"):
        a.topic_route("nope")


def test_unknown_topic_with_auto_create_on_is_created(dev):
    with tidemq.Producer(dev.namesrv) as p:
        r = p.send(tidemq.Message("auto-made", b"x"))
    assert r.status is tidemq.SendStatus.SEND_OK
    with tidemq.Admin(dev.namesrv) as a:
        deadline = time.monotonic() + 5
        while "auto-made" not in a.list_topics():
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_oversize_messages_are_refused_and_the_connection_stays_usable(strict):
    with tidemq.Admin(strict.namesrv) as a:
        a.create_topic("big", 1)
    time.sleep(0.2)
    # Client-side limit first: nothing is sent.
    with tidemq.Producer(strict.namesrv, max_message_size=1000) as p, pytest.raises(
        tidemq.MessageRejectedError, match="over the 1000-byte limit"
    ):
        p.send(tidemq.Message("big", b"x" * 2000))
    # The broker's own limit (64 KiB here) with a client that allows more.
    with tidemq.Producer(strict.namesrv, max_message_size=1 << 20) as p:
        with pytest.raises(tidemq.BrokerError) as ei:
            p.send(tidemq.Message("big", b"x" * 200_000))
        assert ei.value.response_code in (ResponseCode.MESSAGE_TOO_LARGE,
                                          ResponseCode.MESSAGE_ILLEGAL)
        assert p.send(tidemq.Message("big", b"small")).status is tidemq.SendStatus.SEND_OK


def test_consumer_and_admin_argument_errors(dev):
    with pytest.raises(ValueError, match="group"):
        tidemq.PullConsumer(dev.namesrv, "")
    with tidemq.PullConsumer(dev.namesrv, "g") as c, pytest.raises(ValueError, match="subscribe"):
        c.poll(0.01)
    with pytest.raises(ValueError, match="host:port"):
        tidemq.Producer("localhost")
    with tidemq.Admin(dev.namesrv) as a, pytest.raises(ValueError, match="32 hex"):
        a.view_message("abc")


def test_cli_end_to_end(dev):
    run = CliRunner().invoke
    ns = ["--namesrv", dev.namesrv]
    r = run(cli, ["topic", "create", *ns, "--topic", "cli-t", "--queues", "2"])
    assert r.exit_code == 0, r.output
    time.sleep(0.2)
    r = run(cli, ["topic", "list", *ns, "--json"])
    assert "cli-t" in json.loads(r.output)
    r = run(cli, ["send", *ns, "--topic", "cli-t", "--body", "hi {i}", "--count", "3",
                  "--tags", "T", "--keys", "k{i}", "--json"])
    assert r.exit_code == 0, r.output
    sent = [json.loads(line) for line in r.output.splitlines()]
    assert len(sent) == 3 and all(s["status"] == "SEND_OK" for s in sent)
    r = run(cli, ["send", *ns, "--topic", "cli-t", "--queue-id", "0", "--json"],
            input="body from stdin")
    assert r.exit_code == 0, r.output
    sent.append(json.loads(r.output))
    r = run(cli, ["consume", *ns, "--topic", "cli-t", "--group", "cli-g", "--from-beginning",
                  "--count", "2", "--timeout", "3", "--json"])
    assert r.exit_code == 0, r.output
    got = [json.loads(line) for line in r.output.splitlines() if line.startswith("{")]
    assert len(got) == 2 and all(
        (g["body"].startswith("hi ") and g["tags"] == "T") or g["body"] == "body from stdin"
        for g in got)
    r = run(cli, ["group", "lag", *ns, "--group", "cli-g", "--topic", "cli-t", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["total_lag"] == 2  # exactly the 2 printed were committed
    r = run(cli, ["consume", *ns, "--topic", "cli-t", "--group", "cli-g", "--timeout", "1",
                  "--json"])
    rest = [json.loads(line) for line in r.output.splitlines() if line.startswith("{")]
    assert len(rest) == 2 and {g["msg_id"] for g in got + rest} == {s["msg_id"] for s in sent}
    assert "body from stdin" in {g["body"] for g in got + rest}
    r = run(cli, ["topic", "describe", *ns, "--topic", "cli-t", "--json"])
    assert sum(q["messages"] for q in json.loads(r.output)["queues"]) == 4
    r = run(cli, ["topic", "delete", *ns, "--topic", "cli-t"])
    assert r.exit_code == 0, r.output


def test_cli_errors_are_one_line_without_traceback(strict):
    r = CliRunner().invoke(cli, ["send", "--namesrv", strict.namesrv, "--topic", "missing",
                                 "--body", "x"])
    assert r.exit_code == 1
    assert "Error: [TOPIC_NOT_EXIST]" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(cli, ["topic", "describe", "--namesrv", "127.0.0.1:1", "--topic",
                                 "x"])
    assert r.exit_code == 1 and "[NO_ROUTE] no name server answered" in r.output


def test_cli_benchmarks_print_one_json_object(dev):
    run = CliRunner().invoke
    ns = ["--namesrv", dev.namesrv]
    r = run(cli, ["bench", "produce", *ns, "--topic", "bench-t", "--size", "100", "--count",
                  "5000", "--batch", "500", "--json"])
    assert r.exit_code == 0, r.output
    p = json.loads(r.output.splitlines()[-1])
    assert p["count"] == 5000 and p["msgs_per_s"] > 0 and p["mb_per_s"] > 0
    # Single sends from many senders, a count the batch does not divide: every message once.
    r = run(cli, ["bench", "produce", *ns, "--topic", "bench-one", "--size", "10", "--count",
                  "1003", "--batch", "2", "--inflight", "64", "--json"])
    assert r.exit_code == 0, r.output
    one = json.loads(r.output.splitlines()[-1])
    assert one["count"] == 1003 and one["inflight"] == 64
    with tidemq.Admin(dev.namesrv) as a:
        # + the one message the bench sends first to warm the route and connection
        assert sum(q.max_offset for q in a.topic_status("bench-one")) == 1003 + 1
    r = run(cli, ["bench", "consume", *ns, "--topic", "bench-t", "--count", "5000", "--batch",
                  "500", "--json"])
    c = json.loads(r.output.splitlines()[-1])
    assert c["complete"] and c["count"] >= 5000
    r = run(cli, ["bench", "e2e", *ns, "--topic", "bench-e2e", "--size", "64", "--rate", "500",
                  "--seconds", "1", "--json"])
    e = json.loads(r.output.splitlines()[-1])
    assert e["received"] == e["sent"] == 500 and 0 < e["p50_ms"] <= e["p99_ms"] <= e["p999_ms"]


def test_bench_app_runs_every_workload_and_prints_one_json_object():
    """`tidemq bench app` (its own `tidemq dev`; Redis left out): every workload reports its
    count and rate."""
    r = CliRunner().invoke(cli, ["bench", "app", "--scale", "0.01", "--no-redis", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output.splitlines()[-1])
    assert out["redis"] == "--no-redis"
    w = out["workloads"]
    assert list(w) == ["send_1_thread", "send_16_threads", "await_send_64", "send_async",
                       "push_consume", "poll_consume"]
    assert w["send_16_threads"]["tidemq"]["count"] == 320
    assert (w["send_async"]["tidemq"]["count"] == w["push_consume"]["tidemq"]["count"]
            == w["poll_consume"]["tidemq"]["count"] == 2000)
    assert w["send_async"]["tidemq"]["send_errors"] == 0
    assert all(row["tidemq"]["msgs_per_s"] > 0 for row in w.values())
