"""protocol/batch_rules.py: the door's rule against a plain reference model, and the contract it
exists for -- every batch it accepts decodes in every reader."""

from __future__ import annotations

import zlib

import lz4.block
import pytest
import zstandard
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tests.broker.forge import Rec, compress, forge

from tidemq.client.codec import decode_pull_body
from tidemq.client.message import Message
from tidemq.protocol.batch.fast import encode_messages
from tidemq.protocol.batch_rules import BatchLimits, validate_batch
from tidemq.protocol.errors import CorruptBatchError, MessageTooLargeError
from tidemq.protocol.record import (
    INDEX_ENTRY,
    KEYS_ENTRY,
    RECORD_HEADER,
    BatchView,
    Compression,
    MessageData,
    encode_batch,
)

LIMITS = BatchLimits(max_batch_bytes=1 << 20, max_properties_size=300)


def reference(b: bytes, limits: BatchLimits) -> str | None:
    """Why the batch must be refused, in the plainest code; None when it may be stored."""
    v = BatchView(b)
    codec = v.attributes & 7
    if codec > 3 or v.attributes & 0xFC00:
        return "attributes"
    if v.raw_size < 28 * v.count:
        return "raw_size"
    data = bytes(b[v.records_start : v.total_size])
    if codec == 0:
        if v.raw_size != len(data):
            return "raw_size"
        raw = data
    else:
        if v.total_size - len(data) + v.raw_size > limits.max_batch_bytes:
            return "too large"
        try:
            if codec == 1:
                raw = lz4.block.decompress(data, uncompressed_size=v.raw_size)
            elif codec == 2:
                raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=v.raw_size)
            else:
                d = zlib.decompressobj()
                raw = d.decompress(data, v.raw_size)
                if not d.eof:
                    return "decompress"
        except Exception:
            return "decompress"
        if len(raw) != v.raw_size:
            return "decompress"
    pos = 0
    for i in range(v.count):
        rel = INDEX_ENTRY.unpack_from(b, v.index_start + 12 * i)[1]
        if rel != pos or pos + 28 > len(raw):
            return "tiling"
        size, _, _, tl, _, pl, bl = RECORD_HEADER.unpack_from(raw, pos)
        if size + 4 != 28 + tl + pl + bl or pos + size + 4 > len(raw):
            return "sizes"
        if pl > limits.max_properties_size:
            return "properties"
        try:
            raw[pos + 28 : pos + 28 + tl].decode()
            raw[pos + 28 + tl : pos + 28 + tl + pl].decode()
        except UnicodeDecodeError:
            return "utf-8"
        pos += size + 4
    if pos != len(raw):
        return "tiling"
    q, end, last = v.keys_start, v.keys_start + v.keys_size, -1
    while q < end:
        if q + 6 > end:
            return "keys"
        i, n = KEYS_ENTRY.unpack_from(b, q)
        q += 6
        if q + n > end or i >= v.count or i <= last:
            return "keys"
        try:
            b[q : q + n].decode()
        except UnicodeDecodeError:
            return "keys"
        last, q = i, q + n
    return None


def door(b: bytes, limits: BatchLimits = LIMITS) -> str | None:
    try:
        validate_batch(BatchView(b), limits)
    except MessageTooLargeError as exc:
        return "too large: " + exc.message
    except CorruptBatchError as exc:
        return exc.message
    return None


def every_reader_decodes(b: bytes) -> None:
    msgs = list(BatchView(b).messages())
    assert len(msgs) == BatchView(b).count
    got, _ = decode_pull_body(b, from_offset=0)
    assert len(got) == len(msgs)
    for m in got:
        m.properties, m.keys, m.tags, m.body  # noqa: B018 -- lazily decoded fields


# -- generated batches ---------------------------------------------------------------------------

text = st.text(alphabet=st.characters(blacklist_categories=("Cs",),
                                      blacklist_characters="\x01\x02 "), max_size=12)
hostile = st.binary(max_size=8) | st.sampled_from(
    [b"\xff", b"\xc3", b"ok\xe2\x82", b"\xed\xa0\x80", b"\xc0\xaf", b"\x80abc"])
field_bytes = text.map(str.encode) | hostile


@st.composite
def recs(draw):
    return Rec(
        body=draw(st.binary(max_size=20)),
        tag=draw(st.just(b"") | text.map(str.encode)),
        props=draw(st.just(b"") | text.map(str.encode)),
        keys=draw(st.none() | text.filter(bool).map(str.encode)),
    )


LIES = ["none", "tag", "props", "keys", "props_size", "size_fix", "extra", "rels", "raw_size",
        "reserved", "codec"]


@st.composite
def batches(draw):
    """A clean batch, or one with a single lie in a random message or header field."""
    rs = draw(st.lists(recs(), min_size=1, max_size=40))
    codec = draw(st.sampled_from([0, 0, 1, 2, 3]))
    kw: dict = {"compression": codec}
    lie = draw(st.sampled_from(LIES[:1] * 6 + LIES[1:]))
    r = rs[draw(st.integers(0, len(rs) - 1))]
    if lie in ("tag", "props", "keys"):
        setattr(r, lie, draw(hostile))
    elif lie == "props_size":
        r.props = b"p" * draw(st.integers(299, 302))
    elif lie == "size_fix":
        r.size_fix = draw(st.sampled_from([-3, -1, 1, 2]))
    elif lie == "extra":
        r.extra = b"\0" * draw(st.integers(1, 3))
    elif lie == "rels" and len(rs) > 1:
        kw["rels"] = [0] * len(rs)  # every message claims to start at byte 0
    elif lie == "raw_size":
        kw["raw_size"] = draw(st.integers(0, 4000))
    elif lie == "reserved":
        kw["attributes"] = codec | (1 << draw(st.integers(10, 15)))
    elif lie == "codec":
        kw["attributes"] = draw(st.integers(4, 7))
    event(f"lie: {lie}")
    return forge("t", rs, **kw)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(b=batches())
def test_the_door_agrees_with_the_reference_model(b):
    want = reference(b, LIMITS)
    event(f"reference: {want}")
    got = door(b)
    assert (got is None) == (want is None), (want, got)
    if got is None:
        every_reader_decodes(b)


# -- each rule, by example ----------------------------------------------------------------------

def many(n=40, **kw):
    return [Rec(body=b"b%d" % i, tag=b"T", props=b"a\x01b\x02", keys=b"k%d" % i, **kw)
            for i in range(n)]


@pytest.mark.parametrize("n", [1, 40], ids=["small", "numpy"])
@pytest.mark.parametrize("codec", [0, 1, 2, 3], ids=["none", "lz4", "zstd", "zlib"])
@pytest.mark.parametrize("where,bad,expect", [
    ("tag", b"\xff", "tag of message"),
    ("props", b"a\x01\xc3\x02", "properties of message"),
    ("keys", b"k\xe2\x82", "keys of message"),
    ("props", b"p" * 301, "bytes of properties, over the limit of 300"),
])
def test_each_message_of_every_batch_is_checked(n, codec, where, bad, expect):
    rs = many(n)
    setattr(rs[-1], where, bad)  # the last message: all of them are checked, not the first
    msg = door(forge("t", rs, compression=codec))
    assert msg is not None and expect in msg and f"message {n - 1}" in msg


def test_what_a_client_encodes_passes():
    msgs = [Message("t", b"x" * i, tags=f"标签{i % 3}", keys=[f"k{i}", "键"],
                    properties={"a": "é" * i, "b": "x"}) for i in range(50)]
    for compression in (0, 1, 2, 3):
        b = encode_messages("t", msgs, queue_id=0, producer_id=1, base_seq=0, born_ts=1,
                            compression=compression)
        assert door(bytes(b)) is None
        b = encode_messages("t", msgs[:3], queue_id=0, producer_id=1, base_seq=0, born_ts=1,
                            compression=compression)
        assert door(bytes(b)) is None


def test_compression_lies_are_refused_without_decompressing_past_the_claim():
    raw_one = RECORD_HEADER.pack(24 + 1, 1, 0, 0, 0, 0, 1) + b"x"
    # a zlib bomb: 256 MiB of zeros behind a raw_size of 29 bytes
    bomb = zlib.compress(raw_one + bytes(256 << 20), 9)
    msg = door(forge("t", [Rec()], compression=Compression.ZLIB, records=bomb, raw_size=29))
    assert "does not end within the batch's raw_size of 29 bytes" in msg
    # a zstd frame that declares 2 GiB
    big = zstandard.ZstdCompressor(level=1).compress(bytes(1 << 20))
    msg = door(forge("t", [Rec()], compression=Compression.ZSTD, records=big, raw_size=29))
    assert "zstd frame says 1048576 bytes uncompressed, the batch 29" in msg
    # short: the records decompress to less than declared
    for codec in (1, 2, 3):
        msg = door(forge("t", [Rec()], compression=codec, raw_size=40,
                         records=compress(codec, raw_one)))
        assert msg is not None and "40" in msg and "29" in msg, msg
    # the declared raw size is what the size limit counts
    msg = door(forge("t", [Rec()], compression=Compression.ZLIB, raw_size=2 << 20,
                     records=zlib.compress(bytes(2 << 20))))
    assert msg.startswith("too large: the batch holds") and "limit of 1048576" in msg


def test_framing_lies():
    assert "raw_size 10 cannot hold" in door(forge("t", [Rec()], raw_size=10))
    assert "raw_size says 999" in door(forge("t", [Rec()], raw_size=999))
    assert "unknown compression codec 5" in door(forge("t", [Rec()], attributes=5))
    assert "reserved bits" in door(forge("t", [Rec()], attributes=1 << 12))
    assert "record sizes are inconsistent" in door(forge("t", [Rec(size_fix=2)]))
    for n in (2, 40):
        rs = [Rec() for _ in range(n)]
        assert "record" in door(forge("t", rs, rels=[0] * n))
        rs[0].extra = b"\0\0"
        assert door(forge("t", rs)) is not None  # a gap between two records
    dup = KEYS_ENTRY.pack(0, 1) + b"a" + KEYS_ENTRY.pack(0, 1) + b"b"
    assert "increasing message order" in door(forge("t", [Rec()], keys_section=dup))


def test_properties_limit_is_the_brokers():
    rs = [Rec(props=b"p" * 5000)]
    assert door(forge("t", rs), BatchLimits(1 << 20, 4096)) is not None
    assert door(forge("t", rs), BatchLimits(1 << 20, 8192)) is None


def test_client_encoders_apply_the_same_properties_limit():
    m = Message("t", b"x", properties={"big": "p" * 40_000})
    for compression in (0, 1):
        with pytest.raises(ValueError, match="over the limit of 32768"):
            encode_messages("t", [m], queue_id=0, producer_id=1, base_seq=0, born_ts=1,
                            compression=compression)
    with pytest.raises(ValueError, match="over the limit of 32768"):
        encode_messages("t", [Message("t", b"y")] * 40 + [m], queue_id=0, producer_id=1,
                        base_seq=0, born_ts=1)
    b = encode_messages("t", [m], queue_id=0, producer_id=1, base_seq=0, born_ts=1,
                        max_properties_size=64_000)
    assert door(bytes(b), BatchLimits(1 << 20, 64_000)) is None
    with pytest.raises(ValueError, match="over the limit of 100"):
        encode_batch("t", [MessageData(b"x", properties={"a": "b" * 200})],
                     max_properties_size=100)


def test_delay_levels():
    with pytest.raises(ValueError, match="delay_level must be >= 0"):
        Message("t", b"x", delay_level=-1)
    assert Message("t", b"x", delay_level=99).delay_level == 31
    m = Message("t", b"x")
    m.delay_level = -5  # set after construction: the encoder refuses it too
    with pytest.raises(ValueError, match="delay_level must be >= 0"):
        encode_messages("t", [m], queue_id=0, producer_id=1, base_seq=0, born_ts=1)


@pytest.mark.parametrize("length", [3, 200, 1000], ids=["short", "window", "long"])
def test_utf8_of_texts_of_any_length(length):
    """Texts up to 256 bytes are checked through a fixed window, longer ones gathered."""
    limits = BatchLimits(1 << 22, 1 << 15)
    rs = [Rec(body=b"\xff" * 30, props=b"a\x01" + b"v" * length + b"\x02") for _ in range(40)]
    assert door(forge("t", rs), limits) is None  # the bodies' high bytes are not text
    rs[-1].props = b"a\x01" + b"v" * length + b"\xc3\x02"
    assert "properties of message 39" in door(forge("t", rs), limits)
    rs[-1].props = b"a\x01" + "é".encode() * (length // 2) + b"\x02"
    assert door(forge("t", rs), limits) is None  # non-ASCII, valid


# -- a whole SEND_MULTI_QUEUE frame at once (plain_batches) -------------------------------------

def _frame_columns(bs: list[bytes]):
    from tidemq.protocol.batch.columns import read_columns
    from tidemq.protocol.multi_queue import split_offsets

    body = b"".join(bs)
    starts, sizes = split_offsets(body, len(bs), 1 << 20)
    return body, read_columns(body, starts, sizes)


@st.composite
def frame_batches(draw):
    """Batches of a frame: mostly one-message ones (clean, or with one of the lies above, or
    a byte of the headers flipped), some larger or compressed ones."""
    out = []
    for _ in range(draw(st.integers(1, 12))):
        if draw(st.booleans()):
            b = draw(batches())
        else:
            b = forge("t", [draw(recs())], queue_id=draw(st.integers(0, 7)))
        if draw(st.integers(0, 3)) == 0:
            at = draw(st.integers(4, min(len(b), 220) - 1))  # not total_size: that frames
            b = b[:at] + bytes([b[at] ^ (1 << draw(st.integers(0, 7)))]) + b[at + 1 :]
        out.append(b)
    return out


def _plain_model(b: bytes) -> bool:
    """The door passes the batch, and it is plain: no keys, attributes 0, no delivery time,
    every tag and properties section ASCII."""
    if door(b) is not None:
        return False
    v = BatchView(b)
    if v.keys_size or v.attributes or v.deliver_at:
        return False
    raw = b[len(b) - v.records_size :]
    pos = 0
    while pos < len(raw):
        h = RECORD_HEADER.unpack_from(raw, pos)  # record_size, ..., tags_len 3, props_len 5
        if not raw[pos + 28 : pos + 28 + h[3] + h[5]].isascii():
            return False
        pos += h[0] + 4
    return True


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bs=frame_batches())
def test_a_frames_plain_batches_are_exactly_what_the_door_passes_one_by_one(bs):
    """plain_batches answers "certainly valid, and plain" for whole columns: every batch it
    passes must pass the per-batch door (validate_batch stays the rule's owner), and every
    plain batch the door passes must be passed (else the frame's fast path would not be
    taken)."""
    from tidemq.protocol.batch_rules import plain_batches

    body, cols = _frame_columns(bs)
    got = plain_batches(body, cols, LIMITS).tolist()
    for b, ok in zip(bs, got, strict=True):
        try:
            BatchView(b)
        except CorruptBatchError:
            assert not ok
            continue
        want = _plain_model(b)
        event(f"plain {ok}")
        assert ok == want, (door(b), BatchView(b).count)


def test_plain_batches_leave_non_ascii_text_keys_and_lies_to_the_door():
    from tidemq.protocol.batch_rules import plain_batches

    bs = [forge("t", [Rec(body=b"a", tag="é".encode())]),       # valid UTF-8, not ASCII
          forge("t", [Rec(body=b"b", props=b"k\x01" + b"v" * 290 + b"\x02")]),  # long
          forge("t", [Rec(body=b"c", tag=b"\xc3(")]),            # not UTF-8
          forge("t", [Rec(body=b"d", tag=b"ok", props=b"a\x01b\x02")]),
          forge("t", [Rec(body=b"e"), Rec(body=b"f", tag=b"g")]),  # two messages
          forge("t", [Rec(body=b"e"), Rec(body=b"f", tag="é".encode())]),
          forge("t", [Rec(body=b"h", keys=b"k1")]),                 # keys
          forge("t", [Rec(body=b"e"), Rec(body=b"f")], rels=[0, 0])]  # records overlap
    body, cols = _frame_columns(bs)
    assert plain_batches(body, cols, LIMITS).tolist() == [
        False, True, False, True, True, False, False, False]
