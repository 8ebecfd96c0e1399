"""Message's construction: the one-test fast path of ``__post_init__`` must still send every
message that needs a field fixed through the checks -- each such field on its own."""

from __future__ import annotations

import datetime
import time

import pytest

from tidemq.client.message import Message


def test_a_plain_message_keeps_its_fields() -> None:
    body = b"x" * 10
    m = Message("t", body, tags="T", keys="k", properties={"a": "b"})
    assert m.body is body and m.delay_level == 0 and m.deliver_at == 0 and m.deliver_after == 0


@pytest.mark.parametrize("body", ["héllo", bytearray(b"h\xc3\xa9llo"), memoryview(b"h\xc3\xa9llo")])
def test_a_body_that_is_not_bytes_becomes_bytes(body: object) -> None:
    m = Message("t", body)  # type: ignore[arg-type]
    assert type(m.body) is bytes and m.body == "héllo".encode()


def test_the_delay_level_alone_is_checked_and_clamped() -> None:
    assert Message("t", b"x", delay_level=40).delay_level == 31
    with pytest.raises(ValueError, match="delay_level"):
        Message("t", b"x", delay_level=-1)


def test_deliver_at_alone_is_resolved() -> None:
    at = datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC)
    m = Message("t", b"x", deliver_at=at)  # type: ignore[arg-type]
    assert m.deliver_at == int(at.timestamp() * 1000)
    assert Message("t", b"x", deliver_at=1.9e12).deliver_at == 1_900_000_000_000  # type: ignore[arg-type]


def test_deliver_after_alone_becomes_a_delivery_time() -> None:
    before = time.time_ns() // 1_000_000
    m = Message("t", b"x", deliver_after=2.0)
    assert m.deliver_after == 0 and before + 2000 <= m.deliver_at <= before + 2000 + 5000
    with pytest.raises(ValueError, match="deliver_after"):
        Message("t", b"x", deliver_after=-1.0)


def test_a_delay_level_and_a_delivery_time_together_are_refused() -> None:
    with pytest.raises(ValueError, match="not both"):
        Message("t", b"x", delay_level=3, deliver_after=1.0)
