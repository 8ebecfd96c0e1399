"""Golden bytes of the POP headers (protocol/pop.py): a change to their wire form fails here."""

from __future__ import annotations

import pytest

from tidemq.protocol.codes import RequestCode, ResponseCode
from tidemq.protocol.frame import decode_header, encode_header
from tidemq.protocol.headers import request_header_type, response_header_type
from tidemq.protocol.pop import (
    AckMessageRequestHeader,
    AckMessageResponseHeader,
    ChangeInvisibleRequestHeader,
    ChangeInvisibleResponseHeader,
    PopMessageRequestHeader,
    PopMessageResponseHeader,
    PoppedBatch,
    receipt_handles,
)

CASES = [
    (PopMessageRequestHeader(consumer_group="g", topic="t", queue_id=2, max_msg_nums=16,
                             invisible_ms=5000, poll_ms=100, subscription="A",
                             init_mode="EARLIEST"),
     "88ae636f6e73756d65725f67726f7570a167a5746f706963a174a871756575655f696402ac6d61785f6d73"
     "675f6e756d7310ac696e76697369626c655f6d73cd1388a7706f6c6c5f6d7364ac737562736372697074"
     "696f6ea141a9696e69745f6d6f6465a84541524c49455354"),
    (PopMessageResponseHeader(broker="b", pop_time=1700000000000, invisible_ms=5000,
                              batches=[PoppedBatch(1, b"\x0f", [1, 2, 1, 1])]),
     "84a662726f6b6572a162a8706f705f74696d65cf0000018bcfe56800ac696e76697369626c655f6d73cd13"
     "88a762617463686573919301c4010f9401020101"),
    (AckMessageRequestHeader(consumer_group="g", handles=["v1 b t 0 5 1 2 0 1"]),
     "82ae636f6e73756d65725f67726f7570a167a768616e646c657391b2763120622074203020352031203220"
     "302031"),
    (AckMessageResponseHeader(results=[0, 208]), "81a7726573756c74739200ccd0"),
    (ChangeInvisibleRequestHeader(consumer_group="g", handle="h", invisible_ms=7),
     "83ae636f6e73756d65725f67726f7570a167a668616e646c65a168ac696e76697369626c655f6d7307"),
    (ChangeInvisibleResponseHeader(handle="h"), "81a668616e646c65a168"),
]


@pytest.mark.parametrize(("header", "golden"), CASES, ids=lambda c: type(c).__name__)
def test_golden_bytes(header, golden):
    assert encode_header(header).hex() == golden
    assert decode_header(bytes.fromhex(golden), type(header)) == header


def test_grouped_invisible_time_change_round_trips():
    h = ChangeInvisibleRequestHeader(consumer_group="g", handles=["a", "b"], invisible=[5, 9])
    assert decode_header(encode_header(h), ChangeInvisibleRequestHeader) == h
    r = ChangeInvisibleResponseHeader(handles=["a2", ""], results=[0, 208])
    assert decode_header(encode_header(r), ChangeInvisibleResponseHeader) == r
    with pytest.raises(Exception):  # noqa: B017 -- msgspec's validation error
        decode_header(encode_header(ChangeInvisibleRequestHeader(
            consumer_group="g", handles=["a"], invisible=[0])), ChangeInvisibleRequestHeader)


def test_codes_and_registration():
    assert (RequestCode.POP_MESSAGE, RequestCode.ACK_MESSAGE,
            RequestCode.CHANGE_INVISIBLE_TIME) == (360, 361, 362)
    assert ResponseCode.NO_MESSAGE == 208  # RocketMQ's number
    assert request_header_type(RequestCode.POP_MESSAGE) is PopMessageRequestHeader
    assert response_header_type(RequestCode.POP_MESSAGE, ResponseCode.PULL_NOT_FOUND) \
        is PopMessageResponseHeader
    assert response_header_type(RequestCode.ACK_MESSAGE, 0) is AckMessageResponseHeader


def test_receipt_handles_of_an_answer():
    h = PopMessageResponseHeader(broker="b", pop_time=10, invisible_ms=5,
                                 batches=[PoppedBatch(3, b"\x05", [1, 4])])
    out = receipt_handles(h, "t", 0, 100)
    assert [(r.queue_id, r.offset, r.attempt, r.pop_time) for r in out] == [
        (3, 100, 1, 10), (3, 102, 4, 10)]
    with pytest.raises(ValueError):
        receipt_handles(PopMessageResponseHeader(
            broker="b", pop_time=1, invisible_ms=1,
            batches=[PoppedBatch(0, b"\x03", [1])]), "t", 0, 0)


def test_out_of_range_fields_do_not_decode():
    import msgspec
    bad = encode_header({"consumer_group": "g", "topic": "t", "invisible_ms": 0})
    with pytest.raises(Exception) as exc:
        decode_header(bad, PopMessageRequestHeader)
    assert isinstance(exc.value, (msgspec.ValidationError, ValueError)) or "invisible" in str(
        exc.value)


def test_receipt_strings_equal_the_encoded_handles():
    from tidemq.protocol.pop import receipt_strings
    from tidemq.protocol.receipt import encode_receipt
    h = PopMessageResponseHeader(broker="broker-a", pop_time=1700000000123, invisible_ms=30000,
                                 batches=[PoppedBatch(3, b"\x05\x01", [1, 4, 2])])
    fast = receipt_strings(h, "orders", 0, 100)
    slow = receipt_handles(h, "orders", 0, 100)
    assert [t for _q, _o, t, _a in fast] == [encode_receipt(r) for r in slow]
    assert [(q, o, a) for q, o, _t, a in fast] == [(r.queue_id, r.offset, r.attempt)
                                                   for r in slow]
