"""Codes: RocketMQ's numbers, a message for every error, pull statuses, BrokerError."""

from __future__ import annotations

import pytest

from tidemq.protocol.codes import (
    PullStatus,
    RequestCode,
    ResponseCode,
    describe,
    is_retryable,
    pull_status,
)
from tidemq.protocol.errors import BrokerError, TidemqError


def test_codes_fit_the_u16_field_and_are_unique():
    for enum in (RequestCode, ResponseCode):
        values = [c.value for c in enum]
        assert len(values) == len(set(values))
        assert all(0 <= v <= 0xFFFF for v in values)


@pytest.mark.parametrize(
    ("code", "value"),
    [
        (RequestCode.SEND_MESSAGE, 10), (RequestCode.PULL_MESSAGE, 11),
        (RequestCode.QUERY_CONSUMER_OFFSET, 14), (RequestCode.HEART_BEAT, 34),
        (RequestCode.REGISTER_BROKER, 103), (RequestCode.GET_ROUTEINFO_BY_TOPIC, 105),
        (RequestCode.SEND_BATCH, 320), (ResponseCode.SYSTEM_BUSY, 2),
        (ResponseCode.TOPIC_NOT_EXIST, 17), (ResponseCode.PULL_NOT_FOUND, 19),
        (ResponseCode.PULL_OFFSET_MOVED, 21), (ResponseCode.CONSUMER_NOT_ONLINE, 206),
    ],
)
def test_values_are_rocketmqs(code, value):
    assert code == value


@pytest.mark.parametrize("code", [c for c in ResponseCode if c != ResponseCode.SUCCESS])
def test_every_response_code_has_a_message_saying_what_to_do(code):
    text = describe(code)
    assert not text.startswith("unknown") and len(text) > 30


def test_unknown_code_description():
    assert "4242" in describe(4242) and "unknown" in describe(4242)


def test_pull_status_from_response_code():
    assert pull_status(ResponseCode.SUCCESS) is PullStatus.FOUND
    assert pull_status(ResponseCode.PULL_NOT_FOUND) is PullStatus.NO_NEW_MSG
    assert pull_status(ResponseCode.PULL_RETRY_IMMEDIATELY) is PullStatus.NO_MATCHED_MSG
    assert pull_status(ResponseCode.PULL_OFFSET_MOVED) is PullStatus.OFFSET_ILLEGAL
    assert pull_status(ResponseCode.SUBSCRIPTION_NOT_EXIST) is None


def test_stored_but_not_durable_is_not_retryable():
    assert is_retryable(ResponseCode.SYSTEM_BUSY)
    assert is_retryable(ResponseCode.RETRY_LATER)
    for code in (ResponseCode.FLUSH_DISK_TIMEOUT, ResponseCode.FLUSH_SLAVE_TIMEOUT,
                 ResponseCode.SLAVE_NOT_AVAILABLE, ResponseCode.MESSAGE_ILLEGAL,
                 ResponseCode.DUPLICATE):
        assert not is_retryable(code)


def test_broker_error_from_response():
    err = BrokerError.from_response(ResponseCode.TOPIC_NOT_EXIST, "topic orders is unknown")
    assert isinstance(err, TidemqError)
    assert err.response_code == 17 and err.code == "TOPIC_NOT_EXIST"
    assert str(err) == "[TOPIC_NOT_EXIST] topic orders is unknown"
    assert not err.retryable
    busy = BrokerError.from_response(ResponseCode.SYSTEM_BUSY, "")
    assert busy.message == describe(ResponseCode.SYSTEM_BUSY) and busy.retryable
    newer = BrokerError.from_response(4242)
    assert newer.code == "RESPONSE_4242" and newer.response_code == 4242
    with pytest.raises(ValueError):
        BrokerError.from_response(ResponseCode.SUCCESS)
