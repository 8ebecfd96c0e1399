"""The batch format: golden bytes, round trips, and damage detection."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidemq.protocol.errors import CorruptBatchError
from tidemq.protocol.record import (
    PRODUCER_HEADER_SIZE,
    STORE_HEADER_SIZE,
    BatchView,
    Compression,
    MessageData,
    TxnType,
    encode_batch,
    parse_unique_id,
    tag_hash,
    unique_id,
)

GOLDEN = (
    # store header: size, magic, version, reserved, store_crc, phys, queue offset, store ts,
    # prepared offset, queue id, reconsume, topic len, port, host; topic; producer section;
    # index (tag hash, rel); keys; one record
    "bf000000517d01007077cd3a000000000000000000000000000000000000000000000000ffffffffffffffff"
    "0200000000000000010000000000000000000000000000000000000074e1b729680000070001000000070000"
    "00230000002300000011000000000000000500000000000000000000000000000000000000000000000000ff"
    "ff0a00000140f89e395b66422f000000000000000001006b1f000000e8030000000000000100000001000000"
    "040000000200000061700176026869"
)


def golden_batch() -> bytearray:
    return encode_batch(
        "t",
        [MessageData(b"hi", tags="a", keys="k", properties={"p": "v"}, flag=1, born_ts=1000)],
        queue_id=2,
        producer_id=0x11,
        base_seq=5,
        born_host="10.0.0.1",
        born_port=7,
    )


def test_golden_bytes_pin_the_layout():
    b = golden_batch()
    assert bytes(b).hex() == GOLDEN
    assert len(b) == 0xBF
    v = BatchView(b)
    assert v.producer_start == STORE_HEADER_SIZE + 1
    assert v.index_start == v.producer_start + PRODUCER_HEADER_SIZE
    # message index entry: tag hash then the record's offset in the records section
    assert v.tag_hash_at(0) == tag_hash("a")
    assert bytes(b[v.records_start : v.records_start + 4]) == (28 - 4 + 1 + 4 + 2).to_bytes(
        4, "little"
    )
    assert bytes(b[-2:]) == b"hi"


def test_fields_round_trip():
    v = BatchView(golden_batch())
    v.verify()
    (m,) = list(v.messages())
    assert (m.topic, m.queue_id, m.body, m.tags, m.keys) == ("t", 2, b"hi", "a", "k")
    assert m.properties == {"p": "v"} and m.flag == 1 and m.born_ts == 1000
    assert m.born_host == "10.0.0.1" and m.msg_id == unique_id(0x11, 5)
    assert parse_unique_id(m.msg_id) == (0x11, 5)


message = st.builds(
    MessageData,
    body=st.binary(max_size=300),
    tags=st.one_of(st.none(), st.text(min_size=1, max_size=10)),
    keys=st.one_of(st.none(), st.text(alphabet="abc xyz", min_size=1, max_size=12)),
    properties=st.one_of(
        st.none(),
        st.dictionaries(
            st.text(alphabet="abcdef", min_size=1, max_size=5),
            st.text(alphabet="uvwxyz 0123", max_size=8),
            max_size=3,
        ),
    ),
    flag=st.integers(0, 2**32 - 1),
    born_ts=st.integers(0, 2**62),
)


@settings(max_examples=200, deadline=None)
@given(
    msgs=st.lists(message, min_size=1, max_size=20),
    compression=st.sampled_from(
        [Compression.NONE, Compression.LZ4, Compression.ZSTD, Compression.ZLIB]
    ),
    start=st.integers(0, 19),
    txn=st.sampled_from([TxnType.NOT_TYPE, TxnType.PREPARED]),
    delay=st.integers(0, 18),
)
def test_round_trip_any_batch(msgs, compression, start, txn, delay):
    b = encode_batch(
        "topic-x",
        msgs,
        compression=compression,
        producer_id=9,
        base_seq=100,
        txn=txn,
        delay_level=delay,
        queue_id=3,
    )
    v = BatchView(bytes(b))
    v.verify()
    assert v.count == len(msgs) and v.txn == txn and v.delay_level == delay
    start = min(start, len(msgs) - 1)
    got = list(v.messages(start))
    assert len(got) == len(msgs) - start
    for i, (m, g) in enumerate(zip(msgs[start:], got, strict=True), start):
        assert g.body == m.body and g.index == i
        assert g.tags == (m.tags or None)
        assert g.keys == (m.keys or None)
        assert g.properties == (m.properties or {})
        assert g.flag == m.flag and g.born_ts == m.born_ts
        assert g.msg_id == unique_id(9, 100 + i)
        assert v.tag_hash_at(i) == tag_hash(m.tags)


@settings(max_examples=300, deadline=None)
@given(msgs=st.lists(message, min_size=1, max_size=5), data=st.data())
def test_any_single_bit_flip_is_detected(msgs, data):
    b = bytearray(encode_batch("t", msgs, producer_id=1))
    bit = data.draw(st.integers(0, len(b) * 8 - 1))
    b[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(CorruptBatchError):
        BatchView(b).verify()


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=400))
def test_arbitrary_bytes_only_raise_corrupt_batch(raw):
    try:
        v = BatchView(raw)
        v.verify()
        list(v.messages())
    except CorruptBatchError:
        pass


def test_truncated_batch_is_rejected_at_every_length():
    b = bytes(golden_batch())
    for n in range(len(b)):
        with pytest.raises(CorruptBatchError):
            BatchView(b[:n]).verify()


def test_bad_arguments_have_clear_errors():
    with pytest.raises(ValueError, match="at least one message"):
        encode_batch("t", [])
    with pytest.raises(ValueError, match="delay_level must be >= 0"):
        encode_batch("t", [MessageData(b"")], delay_level=-1)
    with pytest.raises(ValueError, match="deliver_at"):
        encode_batch("t", [MessageData(b"")], deliver_at=1 << 63)
    # above what the format holds: clamped to 31, as RocketMQ clamps to its highest level
    assert BatchView(encode_batch("t", [MessageData(b"")], delay_level=99)).delay_level == 31
    with pytest.raises(ValueError, match="reserved separator"):
        encode_batch("t", [MessageData(b"", properties={"a\x01": "b"})])


def _stored_sample() -> bytearray:
    from tidemq.protocol.record import STORE_FIELDS, STORE_FIELDS_OFFSET, seal_store_header

    b = encode_batch(
        "orders", [MessageData(f"body-{i}".encode(), tags="t", keys=f"k{i}") for i in range(3)],
        producer_id=7, base_seq=40,
    )
    STORE_FIELDS.pack_into(b, STORE_FIELDS_OFFSET, 4096, 1234, 99)
    seal_store_header(b, 0, 72 + len("orders"))
    return b


def test_stored_span_reads_offset_and_count_of_a_stored_batch():
    from tidemq.protocol.record import stored_span

    b = _stored_sample()
    padded = bytearray(16) + b + bytearray(8)
    assert stored_span(b, 0, len(b)) == (1234, 3)
    assert stored_span(memoryview(padded), 16, len(b)) == (1234, 3)


def test_stored_span_detects_every_single_bit_flip():
    """Every byte of a stored batch is covered: bytes 0-12 by the size/magic/version/reserved
    cross-checks and the store CRC field itself, the rest by one of the two CRCs."""
    from tidemq.protocol.record import stored_span

    good = _stored_sample()
    for pos in range(len(good)):
        for bit in (0, 7):
            b = bytearray(good)
            b[pos] ^= 1 << bit
            with pytest.raises(CorruptBatchError):
                stored_span(b, 0, len(good))


def test_stored_span_without_verify_still_checks_the_framing():
    from tidemq.protocol.record import stored_span

    b = _stored_sample()
    with pytest.raises(CorruptBatchError, match="no batch of"):
        stored_span(b, 0, len(b) + 1, verify=False)
    b[100] ^= 0xFF  # inside the records: only a CRC would see it
    assert stored_span(b, 0, len(b), verify=False) == (1234, 3)
