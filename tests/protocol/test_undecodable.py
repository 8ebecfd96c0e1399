"""Records a reader cannot decode (issue 13, "tolerate on the way out"): decompression bombs of
every codec are refused with CorruptBatchError before more than the declared (and capped)
size is ever allocated, and a field that is not UTF-8 is CorruptBatchError naming it -- never
a UnicodeDecodeError, a MemoryError or a stall."""

from __future__ import annotations

import functools
import time
import tracemalloc

import pytest

from hostile_records import NOT_UTF8, bomb, poison
from tidemq.protocol.errors import CorruptBatchError
from tidemq.protocol.record import (
    DEFAULT_MAX_RAW_SIZE,
    BatchView,
    Compression,
    MessageData,
    decode_properties,
    encode_batch,
)

MiB = 1 << 20
CODECS = {"zlib": (Compression.ZLIB, 256 * MiB), "zstd": (Compression.ZSTD, 256 * MiB),
          "lz4": (Compression.LZ4, 64 * MiB)}  # lz4 block compresses 255:1 at most


@functools.cache
def _bomb(name: str, declared: int | None = None, content_size: bool = True) -> bytes:
    codec, size = CODECS[name]
    return bytes(bomb("t", codec, size, declared=declared, content_size=content_size))


def _decode(batch: bytes, limit: int = DEFAULT_MAX_RAW_SIZE) -> tuple[float, int, str]:
    """(seconds, peak bytes allocated, error) of decoding ``batch``'s messages."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(CorruptBatchError) as err:
            list(BatchView(batch).messages(0, limit))
        _cur, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return time.perf_counter() - t0, peak, err.value.message


@pytest.mark.parametrize("name", list(CODECS))
def test_a_bomb_declaring_its_size_is_refused_before_decompressing(name):
    secs, peak, why = _decode(_bomb(name))
    assert "over this reader's limit" in why, why
    assert peak < MiB and secs < 0.1, (peak, secs)


@pytest.mark.parametrize("name", list(CODECS))
def test_a_bomb_lying_about_its_size_never_gets_past_what_it_declared(name):
    declared = 1 * MiB
    secs, peak, why = _decode(_bomb(name, declared))
    assert peak < 3 * declared, peak  # the output buffer of the declared size, no more
    assert secs < 0.5, secs
    assert why, why


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("declared", [0, 1, 27])
def test_a_bomb_declaring_almost_nothing_is_refused(name, declared):
    # zlib's max_length 0 means "no limit": a raw_size of 0 must never reach it
    secs, peak, why = _decode(_bomb(name, declared))
    assert peak < MiB and secs < 0.1, (peak, secs, why)


def test_a_zstd_frame_without_a_content_size_is_capped_at_the_declared_size():
    secs, peak, why = _decode(_bomb("zstd", MiB, content_size=False))
    assert "does not decompress" in why and peak < 3 * MiB, (why, peak)


def test_a_zstd_frame_whose_content_size_disagrees_is_refused_without_allocating_it():
    # python-zstandard sizes its output from the frame header and ignores max_output_size
    # then: the frame's own size is checked first.
    secs, peak, why = _decode(_bomb("zstd", MiB))
    assert "zstd frame says 268435456 bytes" in why and peak < MiB, (why, peak)


@pytest.mark.parametrize("codec", [Compression.ZLIB, Compression.ZSTD, Compression.LZ4])
def test_the_limit_is_the_readers_choice(codec):
    b = bytes(bomb("t", codec, 8 * MiB))
    with pytest.raises(CorruptBatchError, match="over this reader's limit of 4259840"):
        list(BatchView(b).messages())
    [m] = list(BatchView(b).messages(0, 8 * MiB))
    assert len(m.body) == 8 * MiB - 28 and not any(m.body[:4096])


def _batch(**first) -> bytearray:
    return encode_batch("topic-x", [
        MessageData(b"m0", **first),
        MessageData(b"m1", tags="ok", keys="k1", properties={"a": "b"}),
    ], producer_id=1)


@pytest.mark.parametrize("field,kw,placeholder", [
    ("tags of message 0", {"tags": "TAGZ"}, "TAGZ"),
    ("keys of message 0", {"keys": "KEYZ"}, "KEYZ"),
    ("properties", {"properties": {"PROPZ": "v"}}, "PROPZ"),
])
def test_a_field_that_is_not_utf8_is_corrupt_for_that_message_only(field, kw, placeholder):
    b = poison(_batch(**kw), placeholder)
    v = BatchView(b)
    v.verify()  # CRC-valid: only decoding can tell
    it = v.messages()
    with pytest.raises(CorruptBatchError, match=f"{field}.*not UTF-8"):
        next(it)
    [m1] = list(v.messages(1))  # the other message of the batch still decodes
    assert (m1.body, m1.tags, m1.keys, m1.properties) == (b"m1", "ok", "k1", {"a": "b"})


def test_keys_and_topic_that_are_not_utf8_raise_corrupt_batch():
    b = poison(_batch(keys="KEYZ"), "KEYZ")
    with pytest.raises(CorruptBatchError, match="keys of message 0: not UTF-8"):
        BatchView(b).keys()
    assert bytes(BatchView(b).raw_keys()[0]) == NOT_UTF8 + b"YZ"
    t = poison(_batch(), "topic-x", b"topic" + NOT_UTF8)
    with pytest.raises(CorruptBatchError, match="topic: not UTF-8"):
        _ = BatchView(t).topic
    with pytest.raises(CorruptBatchError, match="not UTF-8"):
        decode_properties(b"a\x01" + NOT_UTF8 + b"\x02")
