"""PushConsumerOptions: one typed options value; keywords still accepted (no broker needed:
nothing here connects)."""

from __future__ import annotations

import pytest

from tidemq.aio import PushConsumer, PushConsumerOptions
from tidemq.client.listener import MessageModel


def _listener(msgs, ctx):  # pragma: no cover - never called
    return None


def test_options_value_and_keywords_agree():
    a = PushConsumer("127.0.0.1:1", "g", _listener, PushConsumerOptions(pull_batch_size=64))
    b = PushConsumer("127.0.0.1:1", "g", _listener, pull_batch_size=64)
    assert a.options == b.options
    assert a.pull_batch_size == b.pull_batch_size == 64


def test_keywords_override_the_options_value():
    o = PushConsumerOptions(pull_batch_size=64, message_model="BROADCASTING")
    c = PushConsumer("127.0.0.1:1", "g", _listener, o, pull_batch_size=8)
    assert (c.pull_batch_size, c.message_model, c.broadcasting) == (
        8, MessageModel.BROADCASTING, True)
    assert o.pull_batch_size == 64  # the value given is not changed


def test_bad_names_and_values_are_refused_when_built():
    with pytest.raises(TypeError, match="pull_bach_size"):
        PushConsumer("127.0.0.1:1", "g", _listener, pull_bach_size=8)
    with pytest.raises(ValueError, match="batch sizes"):
        PushConsumerOptions(pull_batch_size=0)
    with pytest.raises(ValueError, match="consume_timestamp"):
        PushConsumerOptions(consume_from="timestamp")
