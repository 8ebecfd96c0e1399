"""The client's decoders skip what they cannot decode (issue 13): one message whose tag, keys or
properties are not UTF-8 is left out and reported, its batch's other messages delivered; a
decompression bomb or a CRC mismatch drops its batch; the end offset always covers the whole
body, so a consumer moves past. Without ``on_corrupt`` the same inputs raise
CorruptBatchError (never UnicodeDecodeError)."""

from __future__ import annotations

import pytest

from hostile_records import bomb, poison
from tidemq.client.codec import decode_pull_body
from tidemq.client.range_reader import decode_columns
from tidemq.protocol.errors import CorruptBatchError
from tidemq.protocol.record import (
    STORE_FIELDS,
    STORE_FIELDS_OFFSET,
    BatchView,
    Compression,
    MessageData,
    encode_batch,
    seal_store_header,
)

T = "t-hostile"


def _stored(batch: bytearray, queue_offset: int) -> bytes:
    """``batch`` as the broker serves it: its queue offset stamped, its header resealed."""
    STORE_FIELDS.pack_into(batch, STORE_FIELDS_OFFSET, 1000 + queue_offset, queue_offset, 5)
    seal_store_header(batch, 0, BatchView(batch).producer_start)
    return bytes(batch)


def _body() -> tuple[bytes, list[bytes], dict[int, str]]:
    """A pull body mixing good and hostile batches: (body, good bodies in order, offset ->
    what is wrong with the message there)."""
    parts: list[bytes] = []
    good: list[bytes] = []
    bad: dict[int, str] = {}
    off = 0

    def add(batch: bytearray, n: int, bodies: list[bytes], wrong: dict[int, str]) -> None:
        nonlocal off
        parts.append(_stored(batch, off))
        good.extend(bodies)
        bad.update({off + i: w for i, w in wrong.items()})
        off += n

    add(encode_batch(T, [MessageData(b"g0", tags="a")]), 1, [b"g0"], {})
    add(poison(encode_batch(T, [MessageData(b"x", tags="TAGZ")]), "TAGZ"), 1, [],
        {0: "tags of message 0"})
    add(poison(encode_batch(T, [MessageData(b"x", properties={"PZ": "v"})]), "PZ"), 1, [],
        {0: "properties of message 0"})
    small = [MessageData(b"s0", keys="KEYZ"), MessageData(b"s1", keys="ok1"),
             MessageData(b"s2", tags="TAGQ"), MessageData(b"s3", properties={"q": "r"})]
    add(poison(poison(encode_batch(T, small), "KEYZ"), "TAGQ"), 4, [b"s1", b"s3"],
        {0: "keys of message 0", 2: "tags of message 2"})
    big = [MessageData(f"b{i}".encode(), tags=f"t{i}", properties={"n": f"v{i:03d}"})
           for i in range(60)]
    add(poison(poison(encode_batch(T, big), "t40"), "v050"), 60,
        [f"b{i}".encode() for i in range(60) if i not in (40, 50)],
        {40: "tags of message 40", 50: "properties of message 50"})
    add(bomb(T, Compression.ZLIB, 64 << 20, declared=1 << 20), 1, [], {0: "zlib"})
    crc = bytearray(_stored(encode_batch(T, [MessageData(b"c0"), MessageData(b"c1")]), off))
    crc[-1] ^= 1
    parts.append(bytes(crc))
    bad.update({off: "CRC", off + 1: "CRC"})
    off += 2
    add(encode_batch(T, [MessageData(b"last", keys="fine")]), 1, [b"last"], {})
    return b"".join(parts), good, bad


def test_pull_body_skips_each_undecodable_record_and_reports_where():
    body, good, bad = _body()
    seen: list[tuple[int, int, str]] = []
    msgs, end = decode_pull_body(body, from_offset=0, on_corrupt=lambda *a: seen.append(a))
    assert [m.body for m in msgs] == good
    assert end == 71  # past the last batch: the consumer moves on
    reported = {}
    for qo, n, why in seen:
        for o in range(qo, qo + n):
            reported[o] = why
    assert sorted(reported) == sorted(bad)
    for o, what in bad.items():
        assert what in reported[o], (o, reported[o])
    # what was handed out decodes completely, lazily too
    for m in msgs:
        m.to_dict()


def test_pull_body_with_the_topic_known_skips_the_same():
    body, good, _bad = _body()
    msgs, _end = decode_pull_body(body, from_offset=0, topic=T, on_corrupt=lambda *a: None)
    assert [m.body for m in msgs] == good and all(m.topic == T for m in msgs)


def test_without_on_corrupt_it_raises_corrupt_batch_not_unicode_errors():
    body, _good, _bad = _body()
    with pytest.raises(CorruptBatchError, match="tags of message 0: not UTF-8"):
        decode_pull_body(body, from_offset=0)


def test_the_consumers_decompression_limit_is_its_own():
    b = _stored(bomb(T, Compression.ZSTD, 8 << 20), 0)
    seen: list = []
    assert decode_pull_body(b, from_offset=0, on_corrupt=lambda *a: seen.append(a))[0] == []
    assert "over this reader's limit" in seen[0][2]
    [m] = decode_pull_body(b, from_offset=0, max_uncompressed=8 << 20)[0]
    assert len(m.body) == (8 << 20) - 28


def test_columns_leave_out_what_does_not_decode_and_count_it():
    body, good, bad = _body()
    seen: list = []
    chunk, after = decode_columns(body, T, 0, 0, 1000, on_corrupt=lambda *a: seen.append(a))
    assert chunk.bodies() == good and after == 71
    assert chunk.corrupt == len(bad) and chunk.covered_from == 0
    assert len(chunk.tags) == len(chunk.properties) == len(chunk.keys) == len(good)
    # the range [2, 5) starts at a skipped record: still covered, not lost
    chunk, _ = decode_columns(body, T, 0, 2, 5, on_corrupt=lambda *a: None)
    assert chunk.covered_from == 2 and chunk.bodies() == [b"s1"]
    with pytest.raises(CorruptBatchError):
        decode_columns(body, T, 0, 0, 1000)
