"""Issue 13's low rows on the client side (a real `tidemq dev`): a refusal no retry can fix
reaches the user as an error, never as polls that return [] forever with a log warning."""

from __future__ import annotations

import time

import pytest
from click.testing import CliRunner

import tidemq
from tidemq.cli.main import cli
from tidemq.protocol.codes import ResponseCode


def test_a_consumer_of_a_queue_the_topic_lacks_raises(dev):
    with tidemq.Admin(dev.namesrv) as a:
        a.create_topic("two-queues", 2)
    with tidemq.PullConsumer(dev.namesrv, "q99-g", consume_from="first") as c:
        deadline = time.monotonic() + 10
        while True:  # until the name server routes the new topic
            try:
                broker = c.fetch_queues("two-queues")[0].broker_name
                break
            except tidemq.NoRouteError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        c.assign([tidemq.MessageQueue("two-queues", broker, 99),
                  tidemq.MessageQueue("two-queues", broker, 0)])
        with pytest.raises(tidemq.BrokerError, match="queue id 99 is out of range") as ei:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                c.poll(0.5)
        assert ei.value.response_code == ResponseCode.INVALID_ARGUMENT
        assert "two-queues@" in ei.value.message and ":99" in ei.value.message
        # Raised once; the good queue keeps being consumed.
        with tidemq.Producer(dev.namesrv) as p:
            p.send(tidemq.Message("two-queues", b"still flowing"), queue_id=0)
        got = []
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            got = c.poll(0.5)
        assert [m.body for m in got] == [b"still flowing"]


@pytest.mark.parametrize("group", ["a b", "", "g" * 121, "grp/1"])
def test_a_consumer_group_name_outside_the_rule_is_refused_at_once(dev, group):
    with pytest.raises(ValueError, match="consumer group name"):
        tidemq.PullConsumer(dev.namesrv, group)
    with pytest.raises(ValueError, match="consumer group name"):
        tidemq.PushConsumer(dev.namesrv, group, listener=lambda msgs, ctx: None)


def test_producer_refuses_what_the_broker_would(dev):
    with pytest.raises(ValueError, match="producer group name"):
        tidemq.Producer(dev.namesrv, group="a b")
    with pytest.raises(ValueError, match="delay_level must be >= 0"):
        tidemq.Message("t", b"x", delay_level=-1)
    with tidemq.Producer(dev.namesrv) as p:
        m = tidemq.Message("door-t", b"x")
        m.delay_level = -1  # set after construction: refused with a clear error, no struct.error
        with pytest.raises(tidemq.MessageRejectedError, match="delay_level must be >= 0"):
            p.send(m)
        with pytest.raises(tidemq.MessageRejectedError, match="over the limit of 32768"):
            p.send(tidemq.Message("door-t", b"x", properties={"big": "p" * 40_000}))
        with pytest.raises(tidemq.MessageRejectedError, match="contains ' '"):
            p.send(tidemq.Message("no such topic", b"x"))
        assert p.send(tidemq.Message("door-t", b"ok", delay_level=99)).status is (
            tidemq.SendStatus.SEND_OK)  # clamped to the highest level, as RocketMQ


def test_cli_consume_of_a_missing_topic_exits_non_zero(dev):
    r = CliRunner().invoke(cli, ["consume", "--namesrv", dev.namesrv, "--topic", "missing",
                                 "--group", "g", "--timeout", "1"])
    assert r.exit_code == 1, r.output
    assert "missing" in r.output and "Traceback" not in r.output
