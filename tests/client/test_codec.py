"""The client's fast codecs produce and read exactly record.py's batch format."""

from __future__ import annotations

import os

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidemq.client.codec import decode_batches, decode_pull_body
from tidemq.client.message import Message
from tidemq.protocol.batch.fast import encode_messages, encode_small_plain
from tidemq.protocol.batch.fields import set_queue_id
from tidemq.protocol.batch.tags import parse_tag_expression
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


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(["topic-a", "t", "tøpic-ü", "x" * 300]),
    st.integers(0, 2**32 - 1),
    st.builds(
        lambda body, tags, keys, props: Message("ignored", body, tags, keys, props),
        st.binary(max_size=300), st.none() | TEXT,
        st.none() | TEXT | st.lists(TEXT, min_size=1, max_size=3),
        st.none() | st.dictionaries(TEXT, TEXT, max_size=3),
    ),
    st.integers(0, 2**63 - 1),
    st.integers(0, 2**64 - 1),
)
def test_single_message_fast_path_matches_reference(topic, queue_id, msg, pid, seq):
    """What Producer.send(msg) encodes: the one-message path (store header cached per queue,
    one pack and one CRC; keys in their section between the index and the record) must give
    record.encode_batch's bytes, for any topic and queue."""
    for _ in range(2):  # the second encode of a queue uses the cached store header
        got = encode_messages(topic, [msg], queue_id=queue_id, producer_id=pid, base_seq=seq,
                              born_ts=1234, born_host=pack_host("10.0.0.7"), born_port=4321)
        data = [MessageData(msg.body, msg.tags, msg.keys_string, msg.properties, 0, 1234)]
        ref = encode_batch(topic, data, queue_id=queue_id, producer_id=pid, base_seq=seq,
                           born_host="10.0.0.7", born_port=4321)
        assert got == ref
        assert len(list(BatchView(got).messages(0))) == 1  # CRCs check out
    set_queue_id(got, (queue_id + 1) % 2**32)  # a retry re-targets the batch in place
    ref2 = encode_batch(topic, data, queue_id=(queue_id + 1) % 2**32, producer_id=pid,
                        base_seq=seq, born_host="10.0.0.7", born_port=4321)
    assert got == ref2


def test_single_message_fast_path_refuses_what_the_format_cannot_hold():
    with pytest.raises(ValueError):
        encode_messages("", [Message("t", b"x")], queue_id=0, producer_id=1, base_seq=0,
                        born_ts=1)
    with pytest.raises(ValueError, match="keys"):
        encode_messages("t", [Message("t", b"x", keys="k" * 70_000)], queue_id=0,
                        producer_id=1, base_seq=0, born_ts=1)
    with pytest.raises(ValueError):
        encode_messages("t", [Message("t", b"x", properties={"a": "b\x01"})], queue_id=0,
                        producer_id=1, base_seq=0, born_ts=1)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(max_size=300), min_size=2, max_size=40))
def test_small_plain_batches_match_reference(bodies):
    """A few messages with no tags, keys nor properties (spread traffic's batches) take their
    own path up to 32 messages, and the numpy path above: both give the reference bytes."""
    msgs = [Message("topic-a", b) for b in bodies]
    got = encode_messages("topic-a", msgs, queue_id=5, producer_id=11, base_seq=3, born_ts=1234,
                          born_host=pack_host("10.0.0.7"), born_port=4321)
    assert got == reference(msgs, queue_id=5, producer_id=11, base_seq=3)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=300), min_size=2, max_size=32))
def test_a_frames_small_plain_batch_encodes_as_encode_messages(bodies):
    """encode_small_plain (a SEND_MULTI_QUEUE frame's batches of a few plain messages, without
    the encoder's dispatch) gives encode_messages' bytes."""
    msgs = [Message("topic-a", b) for b in bodies]
    host = pack_host("10.0.0.7")
    got = encode_small_plain("topic-a", 5, bodies, 11, 3, 1234, host, 4321)
    assert got == encode_messages("topic-a", msgs, queue_id=5, producer_id=11, base_seq=3,
                                  born_ts=1234, born_host=host, born_port=4321)
    with pytest.raises(ValueError, match="2..32 messages, not 1"):
        encode_small_plain("topic-a", 5, bodies[:1], 11, 3, 1234, host, 4321)
    with pytest.raises(ValueError, match="1..65535 bytes of UTF-8, not 0"):
        encode_small_plain("", 5, bodies, 11, 3, 1234, host, 4321)


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
    assert parse_tag_expression("a || *") == frozenset({"a", "*"})
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


# -- the per-batch fast paths of decode_pull_body (single-message batches and the general path)
# checked field by field against record.BatchView.messages, the reference decoder.

TOPICS = ("topic-a", "%RETRY%a-much-longer-group-name")


def stored(batch: bytearray, queue_offset: int, *, phys: int = 0, reconsume: int = 0,
           topic_len: int = 7) -> bytearray:
    """``batch`` as the broker stores it: store fields stamped, header CRC resealed."""
    from tidemq.protocol.record import STORE_TAIL, pack_host, seal_store_header

    STORE_TAIL.pack_into(batch, 12, phys, queue_offset, 1_700_000_000_123 + queue_offset, -1,
                         5, reconsume, topic_len, 10911, pack_host("10.1.2.3"))
    seal_store_header(batch, 0, 72 + topic_len)
    return batch


def reference_messages(body: bytes, from_offset: int, tags: frozenset[str] | None) -> list:
    out, pos = [], 0
    while pos < len(body):
        v = BatchView(body, pos)
        pos += v.total_size
        start = max(0, from_offset - v.queue_offset)
        if start < v.count:
            out += [m for m in v.messages(start) if tags is None or m.tags in tags]
    return out


BATCH = st.tuples(st.lists(MESSAGE, min_size=1, max_size=3), st.sampled_from((0, 0, 1, 3)),
                  st.sampled_from(TOPICS), st.integers(0, 3))


@settings(max_examples=200, deadline=None)
@given(st.lists(BATCH, min_size=1, max_size=8), st.integers(0, 12), st.booleans(),
       st.none() | st.frozensets(TEXT, min_size=1, max_size=3))
def test_pull_body_of_mixed_batches_decodes_as_batchview(batches, from_offset, framed, tags):
    parts, qo = [], 0
    for msgs, compression, topic, reconsume in batches:
        data = [MessageData(m.body, m.tags, m.keys_string, m.properties, 0, 1234) for m in msgs]
        b = encode_batch(topic, data, queue_id=5, producer_id=77, base_seq=qo,
                         born_host="10.0.0.7", born_port=4321, compression=compression,
                         compress_min=0, delay_level=2 if reconsume == 3 else 0)
        parts.append(stored(b, qo, phys=1000 + qo, reconsume=reconsume,
                            topic_len=len(topic)))
        qo += len(msgs)
    body = b"".join(parts)
    # A frame body is a memoryview into a larger received chunk; a bytes body is whole.
    got, end = decode_pull_body(memoryview(b"xyz" + body + b"!")[3:-1] if framed else body,
                                from_offset=from_offset, broker_name="bk", tags=tags)
    want = reference_messages(body, from_offset, tags)
    assert end == max(qo, from_offset)
    assert len(got) == len(want)
    for d, e in zip(got, want, strict=True):
        assert (d.body, d.tags, d.queue_offset, d.msg_id) == (e.body, e.tags, e.queue_offset,
                                                               e.msg_id)
        assert d.properties == e.properties and (" ".join(d.keys) or None) == e.keys
        assert (d.topic, d.queue_id, d.broker_name) == (e.topic, 5, "bk")
        assert d.born_timestamp == e.born_ts and d.born_host == "10.0.0.7:4321"
        assert d.store_timestamp == e.store_ts and d.store_host == "10.1.2.3:10911"
        assert d.commit_log_offset == e.phys_offset and d.reconsume_times == e.reconsume_times
        assert d.delay_level == e.delay_level and d.flag == e.flag


def single(body: bytes, qo: int, tags: str | None = None) -> bytearray:
    b = encode_messages("topic-a", [Message("topic-a", body, tags)], queue_id=5,
                        producer_id=1, base_seq=qo, born_ts=1)
    return stored(b, qo)


class _Reports(list):
    def append_args(self, *r: object) -> None:
        self.append(r)


def test_damage_to_a_single_message_batch_is_detected_and_contained():
    from tidemq.protocol.record import crc32c

    batches = [single(b"m%d" % i, i) for i in range(4)]
    for where in (-1, 30, 100):  # the body, the store time (store CRC), the producer header
        damaged = [bytearray(b) for b in batches]
        damaged[2][where] ^= 0x40
        body = b"".join(damaged)
        with pytest.raises(CorruptBatchError, match="CRC32C mismatch"):
            decode_pull_body(body, from_offset=0)
        reports = _Reports()
        msgs, end = decode_pull_body(body, from_offset=0, on_corrupt=reports.append_args)
        assert [m.body for m in msgs] == [b"m0", b"m1", b"m3"] and end == 4
        assert [(q, n) for q, n, _ in reports] == [(2, 1)]
    # Record sizes that disagree, under a valid CRC: caught by the checks, not by the CRC.
    p = 72 + len("topic-a")
    for fields in ((24,), (0, 24)):  # body_len alone; record_size and body_len past the end
        bad = bytearray(batches[1])
        for f in fields:
            bad[p + 76 + f] += 1
        bad[p : p + 4] = crc32c(memoryview(bad)[p + 4 :]).to_bytes(4, "little")
        body = bytes(batches[0] + bad + batches[2])
        with pytest.raises(CorruptBatchError, match="record sizes are inconsistent"):
            decode_pull_body(body, from_offset=0)
        assert [m.body for m in decode_pull_body(body, from_offset=0,
                                                 on_corrupt=lambda *r: None)[0]] == [b"m0", b"m2"]
    # A torn last batch ends the body and is reported with count -1.
    body = b"".join(batches)[:-3]
    reports = []
    msgs, end = decode_pull_body(body, from_offset=0, on_corrupt=lambda *r: reports.append(r))
    assert [m.body for m in msgs] == [b"m0", b"m1", b"m2"] and [r[:2] for r in reports] == [
        (3, -1)]
    with pytest.raises(CorruptBatchError):
        decode_pull_body(body, from_offset=0)


def test_single_message_batches_filter_tags_and_skip_before_offset():
    body = b"".join(single(b"m%d" % i, i, tags=("x", "y", None)[i % 3]) for i in range(9))
    got = decode_batches(body, from_offset=2, tags=parse_tag_expression("x || y"))
    assert [(m.queue_offset, m.tags, m.body) for m in got] == [
        (i, ("x", "y")[i % 3], b"m%d" % i) for i in range(3, 9) if i % 3 != 2]
    assert decode_pull_body(body, from_offset=20)[0] == []
    assert decode_pull_body(body, from_offset=20)[1] == 20


@settings(max_examples=60, deadline=None)
@given(st.lists(MESSAGE, min_size=1, max_size=80), st.data())
def test_members_hint_decodes_exactly_the_members(batch, data):
    """A POP answer's member indices (decode_pull_body(members=...)) give the same messages as
    a full decode filtered to them, on the small and the vectorised paths."""
    body = bytes(stored(bytearray(encode_messages("topic-a", batch, queue_id=5, producer_id=3,
                                                  base_seq=0, born_ts=1)), 100))
    members = sorted(data.draw(st.sets(st.integers(0, len(batch) - 1), min_size=1)))
    full, _ = decode_pull_body(body, from_offset=100 + members[0], topic="topic-a")
    want = [(m.queue_offset, m.body, m.tags, m.keys, m.properties) for m in full
            if m.queue_offset - 100 in members]
    got, end = decode_pull_body(body, from_offset=100 + members[0], topic="topic-a",
                                members=members)
    assert [(m.queue_offset, m.body, m.tags, m.keys, m.properties) for m in got] == want
    assert end == 100 + len(batch)


@settings(max_examples=60, deadline=None)
@given(st.integers(33, 120), st.integers(0, 64), st.integers(0, 130), st.booleans(),
       st.none() | st.integers(0, 119))
def test_batch_of_alike_messages_decodes_as_batchview(n, size, start, framed, odd):
    """Equal bodies without tags or properties take the strided path (_decode_uniform); one
    message of another size (``odd``) sends the batch down the general path: both decode as
    BatchView does."""
    msgs = [Message("topic-a", bytes([i % 251]) * (size + (1 if i == odd else 0)))
            for i in range(n)]
    b = bytes(stored(encode_messages("topic-a", msgs, queue_id=5, producer_id=3, base_seq=11,
                                     born_ts=1234), 1000))
    got, end = decode_pull_body(memoryview(b"ab" + b + b"c")[2:-1] if framed else b,
                                from_offset=1000 + start, topic="topic-a")
    want = reference_messages(b, 1000 + start, None)
    assert end == 1000 + max(n, start)
    assert [(m.body, m.queue_offset, m.msg_id, m.tags) for m in got] == [
        (e.body, e.queue_offset, e.msg_id, e.tags) for e in want]


def test_alike_records_with_a_bad_record_header_are_refused_not_misread():
    """Without the CRC check (check_crc=False) a damaged body length in one record of a
    batch of alike messages is still caught by the record-size checks."""
    from tidemq.protocol.record import RECORD_HEADER_SIZE

    msgs = [Message("topic-a", b"x" * 20) for _ in range(50)]
    b = bytearray(stored(encode_messages("topic-a", msgs, queue_id=5, producer_id=3,
                                         base_seq=0, born_ts=1), 0))
    v = BatchView(bytes(b))
    rec = v.records_start + 7 * (RECORD_HEADER_SIZE + 20)  # record 7's header
    b[rec + RECORD_HEADER_SIZE - 4 : rec + RECORD_HEADER_SIZE] = (21).to_bytes(4, "little")
    with pytest.raises(CorruptBatchError):
        decode_pull_body(bytes(b), from_offset=0, topic="topic-a", check_crc=False)
    reports = _Reports()
    got, _ = decode_pull_body(bytes(b), from_offset=0, topic="topic-a", check_crc=False,
                              on_corrupt=reports.append_args)
    assert got == [] and reports and reports[0][:2] == (0, 50)


def test_single_message_heads_past_the_cache_bound_match_reference(monkeypatch):
    """A producer spread over more queues than the per-queue head cache holds (65,536) builds
    the heads of the others from a per-topic tail with an incremental CRC: same bytes."""
    from tidemq.protocol.batch import fast

    monkeypatch.setattr(fast, "_ONE_HEADS_MAX", 0)
    monkeypatch.setattr(fast, "_one_heads", {})
    monkeypatch.setattr(fast, "_one_tails", {})
    msg = Message("ignored", b"body", "tag")
    for topic in ("topic-a", "tøpic-ü", "x" * 300):
        for queue_id in (0, 7, 65_537, 2**32 - 1):
            got = encode_messages(topic, [msg], queue_id=queue_id, producer_id=5, base_seq=9,
                                  born_ts=1234, born_host=pack_host("10.0.0.7"), born_port=1)
            data = [MessageData(msg.body, msg.tags, msg.keys_string, msg.properties, 0, 1234)]
            assert got == encode_batch(topic, data, queue_id=queue_id, producer_id=5,
                                       base_seq=9, born_host="10.0.0.7", born_port=1)
    assert not fast._one_heads


# -- the column-wise encoder of varied messages (protocol/batch/varied.py): batches of more
# than fast._SMALL messages, each of its own tags, keys and properties, and the irregular
# inputs that send it back to the per-message loop

ODD_TEXT = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x2FF)
                   | st.sampled_from("é€\x01\x02 "), max_size=6)
VARIED = st.builds(
    lambda body, tags, keys, props: Message("topic-a", body, tags, keys, props),
    st.binary(max_size=40),
    st.none() | st.sampled_from(["", "a", "TagB", "é"]) | TEXT,
    st.none() | st.just("") | TEXT | st.lists(TEXT, min_size=1, max_size=2),
    st.none() | st.dictionaries(TEXT, TEXT, max_size=3),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(VARIED, min_size=33, max_size=90))
def test_varied_batch_matches_the_reference_encoder(msgs):
    got = encode_messages("topic-a", msgs, queue_id=3, producer_id=99, base_seq=7, born_ts=1234,
                          born_host=pack_host("10.0.0.7"), born_port=4321)
    assert got == reference(msgs, queue_id=3, producer_id=99, base_seq=7)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.dictionaries(ODD_TEXT, ODD_TEXT | st.integers(), max_size=2),
                min_size=33, max_size=40))
def test_varied_batch_refuses_or_encodes_odd_properties_as_the_reference(props):
    msgs = [Message("topic-a", b"x", "t", f"k{i}", p) for i, p in enumerate(props)]
    try:
        want = reference(msgs, queue_id=3, producer_id=99, base_seq=7)
    except ValueError as exc:
        with pytest.raises(ValueError) as got_exc:
            encode_messages("topic-a", msgs, queue_id=3, producer_id=99, base_seq=7,
                            born_ts=1234, born_host=pack_host("10.0.0.7"), born_port=4321)
        assert type(got_exc.value) is type(exc)
        return
    got = encode_messages("topic-a", msgs, queue_id=3, producer_id=99, base_seq=7, born_ts=1234,
                          born_host=pack_host("10.0.0.7"), born_port=4321)
    assert got == want


# Properties as JSON (varied._properties_json): every message with at least one property;
# names and values drawn around the characters JSON escapes or the path counts on
JSONISH = st.text(alphabet=st.sampled_from('ab"\\:,{}[] é€\x01\x02\x1f\x7f\u2028'),
                  max_size=5)


CLEAN = st.text(alphabet=st.sampled_from("ab0 é€-_.\u2028/"), max_size=5)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.dictionaries(CLEAN, CLEAN, min_size=1, max_size=3), min_size=33,
                max_size=60),
       st.none() | st.tuples(st.integers(0, 32),
                             st.dictionaries(JSONISH, JSONISH | CLEAN, max_size=3)))
def test_varied_batch_properties_through_json_match_the_reference(props, odd):
    if odd is not None:  # one message's properties may send the batch to the general path
        props[odd[0]] = odd[1]
    msgs = [Message("topic-a", b"x", "t", f"k{i}", p) for i, p in enumerate(props)]
    try:
        want = reference(msgs, queue_id=3, producer_id=99, base_seq=7)
    except ValueError:  # a separator byte in a name or value: refused either way
        with pytest.raises(ValueError):
            encode_messages("topic-a", msgs, queue_id=3, producer_id=99, base_seq=7,
                            born_ts=1234, born_host=pack_host("10.0.0.7"), born_port=4321)
        return
    got = encode_messages("topic-a", msgs, queue_id=3, producer_id=99, base_seq=7, born_ts=1234,
                          born_host=pack_host("10.0.0.7"), born_port=4321)
    assert got == want


def test_varied_properties_take_the_json_path_only_when_it_is_exact():
    import datetime
    import enum

    from tidemq.protocol.batch.codec import encode_properties
    from tidemq.protocol.batch.varied import _properties_json

    plain = [{"region": "eu-west-1", "attempt": str(i % 3), "é": "€"} for i in range(40)]
    got = _properties_json(plain)
    assert got is not None
    assert got[0] == [encode_properties(p) for p in plain]
    assert got[1] == [len(encode_properties(p)) for p in plain]

    class Color(enum.Enum):
        RED = "red"

    # each of these would come out of JSON unlike str() (or not at all): the general path
    for odd in ({"t": "12:00"}, {"a": "x,y"}, {"a": "{}"}, {"l": "[1]"}, {"q": 'say "hi"'},
                {"n": 1}, {1: "one"}, {"d": datetime.date(2026, 11, 27)}, {"c": Color.RED},
                {"b": b"bytes"}, {}, {"a": "\x01"}):
        assert _properties_json([*plain, odd]) is None, odd


def test_varied_batch_names_the_message_whose_properties_are_too_large():
    msgs = [Message("topic-a", b"x", "t", f"k{i}", {"a": "b"}) for i in range(40)]
    msgs[37] = Message("topic-a", b"x", "t", "k", {"big": "v" * 100})
    with pytest.raises(ValueError, match="37"):
        encode_messages("topic-a", msgs, queue_id=0, producer_id=1, base_seq=0, born_ts=1,
                        max_properties_size=64)


# Keys the ASCII way (varied._keys_section builds them as one str) next to ones that are not;
# bodies past 64 KiB (offsets and lengths above 16 bits) and any born_ts (the record header's
# born_ts is two u32 words): what the word-wise record headers and index must get right
ASCII = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=127,
                                       blacklist_characters="\x01\x02 "), min_size=1, max_size=8)
VARIED_ASCII = st.builds(
    lambda body, tags, keys, props: Message("topic-a", body, tags, keys, props),
    st.binary(max_size=40) | st.sampled_from([b"b" * 70_000, b"", b"\x00" * 65_536]),
    st.none() | st.sampled_from(["", "a", "TagB", "é"]) | ASCII,
    st.none() | st.sampled_from(["", "k" * 200, "\x7f" * 300]) | ASCII
    | st.lists(ASCII, min_size=1, max_size=2),
    st.none() | st.dictionaries(ASCII, ASCII, max_size=2),
)


@settings(max_examples=40, deadline=None)
@given(st.lists(VARIED_ASCII, min_size=33, max_size=70), st.integers(-2**63, 2**63 - 1),
       st.none() | st.integers(0, 69))
def test_varied_batch_with_ascii_keys_big_bodies_and_any_born_ts_matches_reference(
        msgs, born_ts, odd):
    if odd is not None and odd < len(msgs):  # one message whose key is not ASCII
        msgs[odd] = Message("topic-a", b"x", "t", "ké€", None)
    data = [MessageData(m.body, m.tags, m.keys_string, m.properties, 0, born_ts) for m in msgs]
    want = encode_batch("topic-a", data, queue_id=3, producer_id=99, base_seq=7,
                        born_host="10.0.0.7", born_port=4321)
    got = encode_messages("topic-a", msgs, queue_id=3, producer_id=99, base_seq=7,
                          born_ts=born_ts, born_host=pack_host("10.0.0.7"), born_port=4321)
    assert got == want


class _Reordered(msgspec.Struct):
    """A Struct with the Message's fields in another order: read by name, not by position."""

    keys: str | list[str] | None
    body: bytes
    properties: dict[str, str] | None
    tags: str | None
    topic: str = "topic-a"
    delay_level: int = 0
    deliver_at: int = 0

    @property
    def keys_string(self) -> str | None:
        return " ".join(self.keys) if isinstance(self.keys, list) else self.keys or None


@settings(max_examples=30, deadline=None)
@given(st.lists(VARIED_ASCII, min_size=33, max_size=50), st.data())
def test_varied_batch_of_other_message_types_matches_reference(msgs, data):
    want = reference(msgs, queue_id=3, producer_id=99, base_seq=7)
    # all of another Struct type, or Messages mixed with it
    mixed = [_Reordered(m.keys, m.body, m.properties, m.tags)
             if data.draw(st.booleans()) else m for m in msgs]
    for batch in (mixed, [_Reordered(m.keys, m.body, m.properties, m.tags) for m in msgs]):
        got = encode_messages("topic-a", batch, queue_id=3, producer_id=99, base_seq=7,
                              born_ts=1234, born_host=pack_host("10.0.0.7"), born_port=4321)
        assert got == want


def test_a_small_plain_batch_with_a_record_outside_its_section_is_caught():
    """A batch of a few plain messages whose last index entry points where its record header
    would run past the records section (under valid CRCs): the whole batch is reported,
    whether the header still lies inside the body (another batch follows) or past its end."""
    from tidemq.protocol.batch.layout import PRODUCER_HEADER_SIZE
    from tidemq.protocol.record import crc32c

    p = 72 + len("topic-a")
    plain = encode_messages("topic-a", [Message("topic-a", b"b%d" % i) for i in range(3)],
                            queue_id=5, producer_id=1, base_seq=10, born_ts=1)
    after = single(b"after", 13)
    for rel_from_end in (1, 20):  # the last record's header: past the end by 27 / by 8 bytes
        bad = stored(bytearray(plain), 10)
        records = len(bad) - (p + PRODUCER_HEADER_SIZE + 3 * 12)
        at = p + PRODUCER_HEADER_SIZE + 2 * 12 + 8
        bad[at : at + 4] = (records - rel_from_end).to_bytes(4, "little")
        bad[p : p + 4] = crc32c(memoryview(bad)[p + 4 :]).to_bytes(4, "little")
        for body, tail in ((bytes(bad), []), (bytes(bad + after), [b"after"])):
            with pytest.raises(CorruptBatchError, match="message 2 starts outside"):
                decode_pull_body(body, from_offset=10)
            reports = _Reports()
            msgs, end = decode_pull_body(body, from_offset=10, on_corrupt=reports.append_args)
            assert [m.body for m in msgs] == tail
            assert [(q, n) for q, n, _ in reports] == [(10, 3)]
            assert end == 13 + len(tail)


@settings(max_examples=80, deadline=None)
@given(st.integers(2, 32), st.integers(0, 40), st.integers(0, 33),
       st.sampled_from([None, "x"]), st.integers(-1, 31))
def test_small_batches_of_alike_records_decode_as_batchview(count, size, start, tag, odd):
    """A few equal plain messages (records checked at once) and the same with one message
    ``odd`` carrying a tag or properties (checked record by record): BatchView's messages,
    from ``start``, and none through a tag filter unless they match it."""
    msgs = [Message("topic-a", bytes([i]) * size) for i in range(count)]
    if 0 <= odd < count:
        msgs[odd] = Message("topic-a", msgs[odd].body, tag, properties=None if tag else {"p": "q"})
    body = bytes(stored(encode_messages("topic-a", msgs, queue_id=5, producer_id=1, base_seq=0,
                                        born_ts=1), 100))
    for tags in (None, parse_tag_expression("x")):
        got = decode_batches(body, from_offset=100 + start, tags=tags)
        want = reference_messages(body, 100 + start, tags)
        assert [(m.body, m.queue_offset, m.tags, m.properties, m.msg_id) for m in got] == [
            (m.body, m.queue_offset, m.tags, m.properties, m.msg_id) for m in want]
        assert all(m.born_timestamp == 1 for m in got)


def test_varied_batch_with_one_key_or_one_new_tag_matches_the_reference():
    # the column passes pick by index in one call; a batch where exactly one message has a
    # key (one pick) or a tag never seen before must encode as the per-message reference
    msgs = [Message("topic-a", bytes([i]) * i, "TagB", None, {"a": str(i)}) for i in range(40)]
    msgs[17] = Message("topic-a", b"x", "never-seen-before-tag-17", "the-only-key", {"b": "c"})
    got = encode_messages("topic-a", msgs, queue_id=3, producer_id=99, base_seq=7, born_ts=1234,
                          born_host=pack_host("10.0.0.7"), born_port=4321)
    assert got == reference(msgs, queue_id=3, producer_id=99, base_seq=7)
