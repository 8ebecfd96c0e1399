"""SEND_MULTI_QUEUE (protocol/multi_queue.py, headers.py): golden header bytes, and the body's
framing -- split exactly into the declared batches, or a clear error naming where it breaks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tidemq.protocol.codes import RequestCode
from tidemq.protocol.errors import CorruptBatchError
from tidemq.protocol.frame import decode_header, encode_header
from tidemq.protocol.headers import (
    MultiQueueSendResult,
    SendMultiQueueRequestHeader,
    SendMultiQueueResponseHeader,
    request_header_type,
    response_header_type,
)
from tidemq.protocol.multi_queue import split_batches
from tidemq.protocol.record import MessageData, encode_batch


def test_golden_header_bytes():
    req = SendMultiQueueRequestHeader(producer_group="pg", batches=2,
                                      born_timestamp=1_700_000_000_000)
    assert encode_header(req).hex() == (
        "83ae70726f64756365725f67726f7570a27067a76261746368657302ae626f726e5f74696d657374616d70"
        "cf0000018bcfe56800")
    resp = SendMultiQueueResponseHeader(results=[MultiQueueSendResult(0, 5, 2),
                                                 MultiQueueSendResult(16, message="no")])
    raw = encode_header(resp)
    assert raw.hex() == "81a7726573756c74739295000502ffa09510ff00ffa26e6f"
    assert decode_header(raw, SendMultiQueueResponseHeader) == resp
    assert request_header_type(RequestCode.SEND_MULTI_QUEUE) is SendMultiQueueRequestHeader
    assert response_header_type(RequestCode.SEND_MULTI_QUEUE, 0) is SendMultiQueueResponseHeader
    assert int(RequestCode.SEND_MULTI_QUEUE) == 321


def _batches(n: int) -> list[bytes]:
    return [bytes(encode_batch(f"t{i}", [MessageData(b"x" * i)], queue_id=i)) for i in range(n)]


@given(st.integers(1, 6))
def test_split_gives_back_the_batches(n):
    bs = _batches(n)
    parts = split_batches(b"".join(bs), n, 1 << 20)
    assert [bytes(p) for p in parts] == bs


@given(st.integers(1, 4), st.integers(0, 400))
def test_any_cut_is_a_clear_error(n, cut):
    body = b"".join(_batches(n))
    cut = min(cut, len(body) - 1)
    with pytest.raises(CorruptBatchError) as e:
        split_batches(body[:cut], n, 1 << 20)
    assert e.value.message


def test_limits_and_counts():
    body = b"".join(_batches(2))
    with pytest.raises(CorruptBatchError, match="says it is"):
        split_batches(body, 2, 50)
    with pytest.raises(CorruptBatchError, match="header says 3"):
        split_batches(body, 3, 1 << 20)
    with pytest.raises(CorruptBatchError, match="holds more"):
        split_batches(body, 1, 1 << 20)
