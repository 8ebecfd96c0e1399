"""The client's fast codecs produce and read exactly record.py's batch format."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidemq.client.codec import (
    decode_batches,
    decode_pull_body,
    encode_messages,
    parse_tag_expression,
    set_queue_id,
)
from tidemq.client.message import Message
from tidemq.protocol.errors import CorruptBatchError
from tidemq.protocol.record import BatchView, MessageData, encode_batch, pack_host

TEXT = st.text(alphabet=st.characters(blacklist_characters="\x01\x02 ", min_codepoint=33,
                                      max_codepoint=0x2FF), min_size=1, max_size=8)
MESSAGE = st.builds(
    lambda body, tags, keys, props: Message("topic-a", body, tags, keys, props),
    st.binary(max_size=64),
    st.none() | TEXT,
    st.none() | TEXT | st.lists(TEXT, min_size=1, max_size=3),
    st.none() | st.dictionaries(TEXT, TEXT, max_size=3),
)


def reference(msgs: list[Message], **kw) -> bytearray:
    data = [MessageData(m.body, m.tags, m.keys_string, m.properties, 0, 1234) for m in msgs]
    return encode_batch("topic-a", data, born_host="10.0.0.7", born_port=4321, **kw)


@settings(max_examples=150, deadline=None)
@given(st.lists(MESSAGE, min_size=1, max_size=12), st.integers(0, 20))
def test_encode_matches_reference_and_decode_matches_batchview(msgs, start):
    got = encode_messages("topic-a", msgs, queue_id=3, producer_id=99, base_seq=7, born_ts=1234,
                          born_host=pack_host("10.0.0.7"), born_port=4321)
    ref = reference(msgs, queue_id=3, producer_id=99, base_seq=7)
    assert got == ref
    decoded = decode_batches(bytes(got), from_offset=start)
    expected = list(BatchView(ref).messages(min(start, len(msgs))))
    assert len(decoded) == len(expected)
    for d, e in zip(decoded, expected, strict=True):
        assert d.body == e.body and d.tags == e.tags and d.queue_offset == e.queue_offset
        assert d.msg_id == e.msg_id and d.properties == e.properties
        assert (" ".join(d.keys) or None) == e.keys
        assert d.born_timestamp == 1234 and d.born_host == "10.0.0.7:4321"
        assert d.topic == "topic-a" and d.queue_id == 3


def test_fixed_size_fast_path_matches_reference():
    msgs = [Message("topic-a", os.urandom(100)) for _ in range(50)]
    got = encode_messages("topic-a", msgs, queue_id=0, producer_id=1, base_seq=0, born_ts=1234,
                          born_host=pack_host("10.0.0.7"), born_port=4321)
    assert got == reference(msgs, queue_id=0, producer_id=1, base_seq=0)


def test_compressed_batch_round_trips():
    msgs = [Message("topic-a", b"abc" * 500, tags="t") for _ in range(20)]
    got = encode_messages("topic-a", msgs, queue_id=0, producer_id=1, base_seq=0, born_ts=1,
                          compression=1, compress_min=0)
    assert BatchView(got).compression == 1
    assert [m.body for m in decode_batches(bytes(got), from_offset=0)] == [m.body for m in msgs]


def test_pull_body_of_several_batches_skips_before_offset_and_filters_tags():
    b1 = bytearray(encode_messages("t", [Message("t", b"a", "x"), Message("t", b"b", "y")],
                                   queue_id=0, producer_id=1, base_seq=0, born_ts=1))
    b2 = bytearray(encode_messages("t", [Message("t", b"c", "x"), Message("t", b"d", "z")],
                                   queue_id=0, producer_id=1, base_seq=2, born_ts=1))
    # As stored: the broker fills queue offsets 10..11 and 12..13.
    b1[20:28] = (10).to_bytes(8, "little")
    b2[20:28] = (12).to_bytes(8, "little")
    from tidemq.protocol.record import seal_store_header

    seal_store_header(b1, 0, 73)
    seal_store_header(b2, 0, 73)
    body = bytes(b1 + b2)
    msgs, end = decode_pull_body(body, from_offset=11)
    assert [(m.queue_offset, m.body) for m in msgs] == [(11, b"b"), (12, b"c"), (13, b"d")]
    assert end == 14
    only_x = decode_batches(body, from_offset=10, tags=parse_tag_expression("x || q"))
    assert [m.body for m in only_x] == [b"a", b"c"]


def test_set_queue_id_reseals_the_header():
    b = encode_messages("t", [Message("t", b"a")], queue_id=1, producer_id=1, base_seq=0,
                        born_ts=1)
    set_queue_id(b, 5)
    v = BatchView(b)
    v.verify()
    assert v.queue_id == 5


def test_corrupt_batch_is_reported():
    b = encode_messages("t", [Message("t", b"hello")], queue_id=1, producer_id=1, base_seq=0,
                        born_ts=1)
    b[-1] ^= 0xFF
    with pytest.raises(CorruptBatchError):
        decode_batches(bytes(b), from_offset=0)
    assert decode_batches(bytes(b), from_offset=0, check_crc=False)[0].body == b"hellp"[:4] + bytes(
        [ord("o") ^ 0xFF])


def test_tag_expression():
    assert parse_tag_expression("*") is None
    assert parse_tag_expression(" a || b ") == frozenset({"a", "b"})
    with pytest.raises(ValueError):
        parse_tag_expression("||")


def test_message_keys_and_body_conversion():
    m = Message("t", "héllo", keys=["a", "b"])
    assert m.body == "héllo".encode() and m.keys_string == "a b"
    with pytest.raises(ValueError):
        _ = Message("t", b"", keys=["a b"]).keys_string


def test_large_mixed_batch_uses_the_vectorised_paths_and_matches_reference():
    msgs = [Message("topic-a", os.urandom(i % 7 * 10), tags=f"t{i % 3}" if i % 2 else None,
                    keys=f"k{i}" if i % 5 == 0 else None) for i in range(300)]
    plain = [Message("topic-a", os.urandom(i % 50)) for i in range(300)]
    for batch in (msgs, plain):
        got = encode_messages("topic-a", batch, queue_id=0, producer_id=5, base_seq=9,
                              born_ts=1234, born_host=pack_host("10.0.0.7"), born_port=4321)
        assert got == reference(batch, queue_id=0, producer_id=5, base_seq=9)
        # Decoded from inside a larger received buffer, as a frame body is.
        framed = memoryview(b"prefix" + bytes(got) + b"suffix")[6:-6]
        dec = decode_batches(framed, from_offset=40)
        assert [(m.body, m.tags, m.queue_offset) for m in dec] == [
            (m.body, m.tags, 40 + i) for i, m in enumerate(batch[40:])]
        assert BatchView(got).unique_id(299) == dec[-1].msg_id
        assert [m.keys for m in dec] == [[m.keys] if m.keys else [] for m in batch[40:]]
        assert all(m.born_timestamp == 1234 and m.properties == {} for m in dec)
