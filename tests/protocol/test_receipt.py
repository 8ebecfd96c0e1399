"""Receipt handles of POP (protocol/receipt.py): round trip, and every malformed handle refused
with ReceiptError (a ValueError), never decoded to something else by accident."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tidemq.protocol.receipt import (
    MAX_INVISIBLE_MS,
    ReceiptError,
    ReceiptHandle,
    decode_receipt,
    encode_receipt,
)

names = st.from_regex(r"[%|A-Za-z0-9_@.:-]{1,40}", fullmatch=True)
handles = st.builds(
    ReceiptHandle, broker=names, topic=names, queue_id=st.integers(0, 2**31 - 1),
    offset=st.integers(0, 2**63 - 1), pop_time=st.integers(0, 2**63 - 1),
    invisible_ms=st.integers(1, MAX_INVISIBLE_MS), revive_queue_id=st.integers(0, 2**31 - 1),
    attempt=st.integers(1, 2**31 - 1), message_group=st.none() | st.integers(0, 2**64 - 1))


@given(handles)
def test_round_trip(h):
    text = encode_receipt(h)
    assert text.isascii() and "  " not in text
    assert decode_receipt(text) == h


@given(handles, st.data())
def test_a_mutated_handle_is_refused_or_another_handle(h, data):
    text = encode_receipt(h)
    i = data.draw(st.integers(0, len(text) - 1))
    c = data.draw(st.sampled_from(" x9-\x00é"))
    mutated = text[:i] + c + text[i + 1 :]
    try:
        other = decode_receipt(mutated)
    except ReceiptError as exc:
        assert str(exc)
        return
    assert mutated == text or other != h


@pytest.mark.parametrize(("text", "why"), [
    ("", "version"),
    ("v2 b t 0 0 0 1 0 1", "version"),
    ("v1 b t 0 0 0 1 0", "9 or 10 fields"),
    ("v1 b t -1 0 0 1 0 1", "queue_id"),
    ("v1 b t 0 01 0 1 0 1", "offset"),
    ("v1 b t 0 0 0 0 0 1", "invisible_ms"),
    (f"v1 b t 0 0 0 {MAX_INVISIBLE_MS + 1} 0 1", "invisible_ms"),
    ("v1 b t 0 0 0 1 0 0", "attempt"),
    ("v1 b t 0 99999999999999999999 0 1 0 1", "offset"),
    ("v1 b t 0 0 0 1 0 1 XYZ", "message group"),
    ("v1 b  t 0 0 0 1 0 1", "topic '' is not a valid name"),
    ("v1 b t\u00e9 0 0 0 1 0 1", "ASCII"),
    ("v1 " + "b" * 300 + " t 0 0 0 1 0 1", "name"),
])
def test_bad_handles_say_what_is_wrong(text, why):
    with pytest.raises(ReceiptError, match=why):
        decode_receipt(text)


def test_encode_refuses_fields_out_of_range():
    with pytest.raises(ReceiptError, match="invisible_ms"):
        encode_receipt(ReceiptHandle("b", "t", 0, 0, 0, 0))
    with pytest.raises(ReceiptError, match="topic"):
        encode_receipt(ReceiptHandle("b", "a topic", 0, 0, 0, 1))
    h = ReceiptHandle("broker-a", "orders", 3, 42, 1_700_000_000_000, 30_000, 1, 2, 0xABC)
    assert encode_receipt(h) == "v1 broker-a orders 3 42 1700000000000 30000 1 2 0000000000000abc"
    assert h.visible_at == 1_700_000_030_000
