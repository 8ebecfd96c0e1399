"""What may be stored: the rules a batch must meet before a broker takes it (ref ST9).

"Validate at the door, tolerate on the way out": the broker refuses every batch a reader could
not decode, so that no consumer, timer, recovery or Spark reader ever meets one. This module
owns the rule; the broker's door (``SendProcessor``) calls :func:`validate_batch` on every
send, and the client's encoders apply the per-message parts (``record.properties_over_limit``,
``record.delay_level_for``, ``record.deliver_at_for``) while they build a batch, so a batch a
tidemq client builds passes.

A batch (``batch/layout.py``) that passed ``BatchView`` framing is further refused
(CorruptBatchError -> MESSAGE_ILLEGAL, or MessageTooLargeError -> MESSAGE_TOO_LARGE) when
(its CRC is the store's check, at the put):

- its attributes name an unknown compression codec, or set a reserved bit (10-15);
- ``raw_size`` cannot hold ``count`` record headers; uncompressed, ``raw_size`` differs from
  ``records_size``; compressed, the batch with its records uncompressed would exceed
  ``max_batch_bytes`` (the same limit an uncompressed batch has);
- a compressed records section does not decompress to exactly ``raw_size`` bytes (the
  decompression is capped at ``raw_size``: ``batch.codec._decompress``);
- the records do not tile the records section: record 0 starts at 0, each next one right after
  the one before, the last one ends at its end, and every record's sizes add up
  (``record_size + 4 == 28 + tags_len + props_len + body_len``), so the message index and the
  records agree;
- a message's properties exceed ``max_properties_size`` bytes (every message of the batch,
  compressed or not);
- a tag or properties section is not valid UTF-8 (RocketMQ's properties are a UTF-8 string);
- the keys section is truncated, points outside the batch, is not in message order or is not
  UTF-8 (``BatchView.keys``).

Delay levels: the format holds 0..31 (5 bits), so a negative or larger level cannot be sent;
:func:`delay_level_for` refuses a negative one and clamps anything above 31 to 31, and the
broker clamps a level above its schedule's highest (18 by default) to that highest, as
RocketMQ does (its clients rely on it).

Cost: every check is per batch. Batches of up to ``_SMALL`` messages use ``struct`` (numpy's
per-call overhead of a few microseconds would dominate); larger ones gather the record headers
with one numpy fancy-index, compare whole columns, and check UTF-8 with one decode of every tag
and properties section gathered into one buffer, each followed by a newline: a newline is
ASCII, never a continuation byte, so the joined bytes are valid UTF-8 exactly when every piece
is (a per-message Python loop of decodes cost ~0.5 ms per 1,000 messages, ten times this).
Batches without tags or properties skip the UTF-8 step, and ASCII needs no decode at all.

Many batches at once (a SEND_MULTI_QUEUE frame of one-message batches, issue 17):
:func:`plain_batches` applies the same rules to the header columns of a whole frame
(``batch/columns.py``) with a few numpy operations, and answers only "certainly passes": a batch
it does not pass (several messages, compressed, keys, non-ASCII text, or anything wrong) goes
through :func:`validate_batch`, which stays the one place a refusal is worded.

Pure functions: any thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tidemq.protocol.batch.columns import BatchColumns, gather
from tidemq.protocol.batch.layout import BATCH_MAGIC, FORMAT_VERSION, IDX_DTYPE, REC_DTYPE
from tidemq.protocol.errors import CorruptBatchError, MessageTooLargeError
from tidemq.protocol.record import (
    DEFAULT_MAX_PROPERTIES_SIZE,
    INDEX_ENTRY,
    INDEX_ENTRY_SIZE,
    PRODUCER_HEADER_SIZE,
    RECORD_HEADER,
    RECORD_HEADER_SIZE,
    STORE_HEADER_SIZE,
    BatchView,
    Compression,
    delay_level_for,
    properties_over_limit,
)

__all__ = [
    "DEFAULT_MAX_PROPERTIES_SIZE",
    "BatchLimits",
    "validate_batch",
    "plain_batches",
    "properties_over_limit",
    "delay_level_for",
]

#: Attribute bits no field uses yet (0-2 compression, 3-4 transaction, 5-9 delay level).
RESERVED_ATTRIBUTES = 0xFC00
_CODECS = (Compression.NONE, Compression.LZ4, Compression.ZSTD, Compression.ZLIB)
_SMALL = 16  # batches up to this many messages are checked without numpy

_REC_VOID = np.dtype(f"V{RECORD_HEADER_SIZE}")
_SIZE_WORDS = [0, 4, 5, 6]  # record_size, tags_len | reserved, props_len, body_len
_WINDOW = 256  # texts up to this long are checked through a fixed window (_ascii)
_COLUMNS = np.arange(_WINDOW, dtype=np.int64)
_NEWLINE = 0x0A


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """The broker's limits a batch is checked against."""

    #: Largest batch, its records counted uncompressed (max_message_size + allowance).
    max_batch_bytes: int
    #: Largest properties section of one message.
    max_properties_size: int = DEFAULT_MAX_PROPERTIES_SIZE


def validate_batch(v: BatchView, limits: BatchLimits) -> None:
    """Raise CorruptBatchError (or MessageTooLargeError) unless the framed batch ``v`` may be
    stored; see the module docstring for the rules. Leaves ``v.keys()`` parsed."""
    attrs = v.attributes
    codec = attrs & 0x7
    if codec not in _CODECS:
        raise CorruptBatchError(f"unknown compression codec {codec} in the batch attributes")
    if attrs & RESERVED_ATTRIBUTES:
        raise CorruptBatchError(
            f"batch attributes 0x{attrs:04X} set reserved bits (10-15); they must be 0"
        )
    n = v.count
    raw_size = v.raw_size
    if raw_size < n * RECORD_HEADER_SIZE:
        raise CorruptBatchError(
            f"raw_size {raw_size} cannot hold the {n} record headers of {n} messages"
        )
    if codec == Compression.NONE:
        if raw_size != v.records_size:
            raise CorruptBatchError(
                f"uncompressed records section is {v.records_size} bytes but raw_size says "
                f"{raw_size}"
            )
    else:
        expanded = v.total_size - v.records_size + raw_size
        if expanded > limits.max_batch_bytes:
            raise MessageTooLargeError(
                f"the batch holds {expanded} bytes once its records are decompressed, over "
                f"the broker's limit of {limits.max_batch_bytes}; send fewer or smaller "
                "messages per batch"
            )
    raw = v.raw_records(limits.max_batch_bytes)  # capped: exactly raw_size or CorruptBatchError
    if n <= _SMALL:
        _check_records_small(v, raw, limits.max_properties_size)
    else:
        _check_records(v, raw, limits.max_properties_size)
    if v.keys_size:
        v.keys()


def plain_batches(body: bytes | bytearray | memoryview, cols: BatchColumns,
                  limits: BatchLimits) -> np.ndarray:
    """Which batches of a multi-queue body certainly pass :func:`validate_batch` (and
    ``BatchView``'s framing) *and* are plain: no keys, attributes 0 (uncompressed, no
    transaction type, no delay level), no delivery time, ASCII tags and properties. A bool per
    batch; False says nothing about validity (call :func:`validate_batch` on that batch's view).

    The rules, as columns over every batch and then over every message of the frame: magic,
    version and reserved byte; the sections add up to the batch's size; ``raw_size ==
    records_size``; record 0 starts at 0 and each next one right after the one before, each
    one's sizes add up, the last one ends at the section's end; properties within
    ``max_properties_size``; tags and properties ASCII (valid UTF-8 with no decode; other text
    takes the per-batch path)."""
    s, p = cols.store, cols.producer
    p_start = STORE_HEADER_SIZE + s["topic_len"].astype(np.int64)
    count = p["count"].astype(np.int64)
    records = p["records_size"].astype(np.int64)
    rec_start = p_start + PRODUCER_HEADER_SIZE + INDEX_ENTRY_SIZE * count
    ok: np.ndarray = (
        cols.in_bounds
        & (s["magic"] == BATCH_MAGIC) & (s["version"] == FORMAT_VERSION) & (s["reserved"] == 0)
        & (s["total"] == cols.sizes)
        & (count >= 1) & (p["keys_size"] == 0) & (p["attributes"] == 0)
        & (p["deliver_at"] == 0)
        & (rec_start + records == cols.sizes)
        & (p["raw_size"] == records)
        & (records >= RECORD_HEADER_SIZE * count)
    )
    k = np.flatnonzero(ok)
    if not len(k):
        return ok
    # Every message of the candidate batches: its index entry, then its record header.
    c = count[k]
    first = np.cumsum(c) - c  # each batch's first message among all of them
    m = int(c.sum())
    of = np.repeat(np.arange(len(k)), c)
    i_in = np.arange(m, dtype=np.int64) - first[of]
    arr = np.frombuffer(body, dtype=np.uint8)
    base = cols.starts[k]
    idx = gather(arr, (base + p_start[k] + PRODUCER_HEADER_SIZE)[of]
                        + INDEX_ENTRY_SIZE * i_in, IDX_DTYPE)
    rel = idx["rel"].astype(np.int64)
    size_of = records[k][of]
    inside = rel + RECORD_HEADER_SIZE <= size_of
    rec_at = (base + rec_start[k])[of] + np.where(inside, rel, 0)
    hdr = gather(arr, rec_at, REC_DTYPE)
    rs = hdr["size"].astype(np.int64)
    tl = hdr["tl"].astype(np.int64)
    pl = hdr["pl"].astype(np.int64)
    ends = rel + rs + 4
    expect = np.empty(m, dtype=np.int64)
    expect[1:] = ends[:-1]
    expect[first] = 0
    good = (inside & (rel == expect)
            & (rs + 4 == RECORD_HEADER_SIZE + tl + pl + hdr["bl"].astype(np.int64))
            & (pl <= limits.max_properties_size))
    last = first + c - 1
    batch_ok = np.logical_and.reduceat(good, first) & (ends[last] == records[k])
    text = tl + pl
    has_text = good & (text > 0)
    if has_text.any():
        t = np.flatnonzero(has_text)
        starts = rec_at[t] + RECORD_HEADER_SIZE
        lens = text[t]
        if not _ascii(arr, starts, lens):  # some are not: find which, one by one
            mv = memoryview(body).cast("B")
            for j, at, n in zip(t.tolist(), starts.tolist(), lens.tolist(), strict=True):
                if not mv[at : at + n].tobytes().isascii():
                    batch_ok[of[j]] = False
    ok[k] = batch_ok
    return ok


def _check_records_small(v: BatchView, raw: memoryview, max_props: int) -> None:
    buf = v.buf
    ipos = v.pos + v.index_start
    rlen = len(raw)
    unpack_idx = INDEX_ENTRY.unpack_from
    unpack_rec = RECORD_HEADER.unpack_from
    expect = 0
    for i in range(v.count):
        rel = unpack_idx(buf, ipos + i * INDEX_ENTRY_SIZE)[1]
        if rel != expect:
            raise CorruptBatchError(
                f"message {i} starts at byte {rel} of the records section, not at {expect} "
                "(the records must follow each other from byte 0)"
            )
        if rel + RECORD_HEADER_SIZE > rlen:
            raise CorruptBatchError(f"message {i} starts outside the records section")
        size, _ts, _flag, tl, _res, pl, bl = unpack_rec(raw, rel)
        if size + 4 != RECORD_HEADER_SIZE + tl + pl + bl:
            raise CorruptBatchError(
                f"message {i} record sizes are inconsistent (record_size {size}, tags {tl}, "
                f"properties {pl}, body {bl})"
            )
        expect = rel + size + 4
        if expect > rlen:
            raise CorruptBatchError(f"message {i} runs past the end of the records section")
        if pl > max_props:
            raise CorruptBatchError(properties_over_limit(i, pl, max_props))
        q = rel + RECORD_HEADER_SIZE
        try:  # decoded here, _utf8 only to name what failed (two calls less per message)
            if tl:
                str(raw[q : q + tl], "utf-8")
            if pl:
                str(raw[q + tl : q + tl + pl], "utf-8")
        except UnicodeDecodeError:
            if tl:
                _utf8(raw[q : q + tl], i, "tag")
            _utf8(raw[q + tl : q + tl + pl], i, "properties")
            raise
    if expect != rlen:
        raise CorruptBatchError(
            f"the records section has {rlen - expect} bytes after its last message"
        )


def _check_records(v: BatchView, raw: memoryview, max_props: int) -> None:
    n = v.count
    rlen = len(raw)
    idx = np.frombuffer(v.buf, dtype=IDX_DTYPE, count=n, offset=v.pos + v.index_start)
    rel = idx["rel"].astype(np.int64)
    arr = np.frombuffer(raw, dtype=np.uint8)
    # Record headers gathered through an overlapping view of the records, one 28-byte item
    # starting at every byte: fancy-indexing a plain void dtype copies each header with one
    # memcpy (6 us per 1,000 headers; a 2-D byte index or a structured dtype take ~45 us).
    every = np.ndarray((rlen - RECORD_HEADER_SIZE + 1,), dtype=_REC_VOID, buffer=arr,
                       strides=(1,))
    try:
        hdr = every[rel]
    except IndexError:
        raise CorruptBatchError(
            "a message of the batch starts outside its records section"
        ) from None
    # As 7 u32 words per header: record_size, born_ts (2), flag, tags_len | reserved << 16,
    # props_len, body_len; the 4 size columns in one int64 matrix (few numpy calls: each costs
    # a microsecond or two whatever its size, and there are 1,000 headers, not millions).
    m = hdr.view("<u4").reshape(n, 7)[:, _SIZE_WORDS].astype(np.int64)
    m[:, 1] &= 0xFFFF  # tags_len (the reserved u16 above it is not checked)
    span = m[:, 0] + 4  # bytes of each record, its size field included
    ends = rel + span
    if (
        rel[0] != 0
        or not np.array_equal(ends[:-1], rel[1:])
        or not np.array_equal(span, m[:, 1:].sum(axis=1) + RECORD_HEADER_SIZE)
    ):
        tl, pl, sizes = m[:, 1], m[:, 2], m[:, 0]
        bad = span != m[:, 1:].sum(axis=1) + RECORD_HEADER_SIZE
        bad[0] |= rel[0] != 0
        bad[1:] |= rel[1:] != ends[:-1]
        i = int(np.argmax(bad))
        raise CorruptBatchError(
            f"message {i} record is not where the index and the record sizes put it (starts "
            f"at byte {int(rel[i])}, record_size {int(sizes[i])}, tags {int(tl[i])}, "
            f"properties {int(pl[i])}); the records must follow each other"
        )
    if int(ends[-1]) != rlen:
        raise CorruptBatchError(
            f"the records section is {rlen} bytes but its messages end at {int(ends[-1])}"
        )
    tl, pl = m[:, 1], m[:, 2]
    if int(pl.max()) > max_props:
        i = int(np.argmax(pl > max_props))
        raise CorruptBatchError(properties_over_limit(i, int(pl[i]), max_props))
    text = tl + pl
    if not text.any():
        return
    # Tags and properties are adjacent in a record: gather every record's [tags | properties]
    # into one buffer; all ASCII (the common case) is valid UTF-8 with no decode.
    starts = rel + RECORD_HEADER_SIZE
    if _ascii(arr, starts, text):
        return
    # Else each tag and each properties section on its own, each followed by a newline.
    starts2 = np.empty(2 * n, dtype=np.int64)
    starts2[0::2] = starts
    starts2[1::2] = starts + tl
    lens = np.empty(2 * n, dtype=np.int64)
    lens[0::2] = tl
    lens[1::2] = pl
    joined = _gather(arr, starts2, lens + 1, clip=True)
    out_at = np.cumsum(lens + 1) - (lens + 1)
    joined[out_at + lens] = _NEWLINE
    try:
        joined.tobytes().decode()
    except UnicodeDecodeError as exc:
        k = int(np.searchsorted(out_at, exc.start, side="right")) - 1
        i, what = divmod(k, 2)
        raise CorruptBatchError(
            f"{('the tag', 'the properties')[what]} of message {i} "
            f"{('is', 'are')[what]} not valid UTF-8 ({exc.reason})"
        ) from None


def _ascii(arr: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> bool:
    """True when every ``arr[starts[k] : starts[k] + lens[k]]`` is ASCII.

    Short texts (tags and properties usually are): a window of the longest one is copied from
    each start through an overlapping view (one memcpy per message) and the bytes past each
    text's length are masked; else the texts are gathered byte by byte (:func:`_gather`)."""
    w = int(lens.max())
    if w <= _WINDOW and int(starts[-1]) + w <= len(arr):
        every = np.ndarray((len(arr) - w + 1,), dtype=f"V{w}", buffer=arr, strides=(1,))
        win = every[starts].view(np.uint8).reshape(-1, w)
        high = win >= 0x80
        if not high.any():
            return True
        return not (high & (_COLUMNS[:w] < lens[:, None])).any()
    return int(_gather(arr, starts, lens).max()) < 0x80


def _gather(arr: np.ndarray, starts: np.ndarray, lens: np.ndarray, clip: bool = False
            ) -> np.ndarray:
    """``arr[starts[k] : starts[k] + lens[k]]`` for every k, concatenated (one fancy index;
    with ``clip``, positions past the end of ``arr`` read its last byte)."""
    out_at = np.cumsum(lens) - lens
    index = np.repeat(starts - out_at, lens)
    index += np.arange(len(index), dtype=np.int64)
    if clip:
        np.minimum(index, len(arr) - 1, out=index)
    out: np.ndarray = arr[index]
    return out


def _utf8(data: memoryview, i: int, what: str) -> None:
    try:
        str(data, "utf-8")
    except UnicodeDecodeError as exc:
        verb = "are" if what == "properties" else "is"
        raise CorruptBatchError(
            f"the {what} of message {i} {verb} not valid UTF-8 ({exc.reason} at byte "
            f"{exc.start})"
        ) from None

