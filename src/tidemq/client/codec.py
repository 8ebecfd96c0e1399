"""The client's hot-path decoder: pulled batches -> MessageExt lists.

It accepts exactly the batch format of ``tidemq.protocol.batch`` (tests compare against
``BatchView.messages``; the layout's offsets and field indexes come from ``batch.layout``, the
encoder is ``batch.fast``). It exists because the generic decoder spends ~3 µs per message in
Python, which caps a client far below the broker. The tricks, each measured:

- the record headers of a batch are gathered by one numpy fancy-index; messages become
  ``MessageExt`` Structs holding body / offset / tags, everything else lazy (``message.py``).

Pure functions: any thread may call them.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Container, Sequence
from typing import Any

import numpy as np

from tidemq.client.message import MessageExt, _BatchMeta
from tidemq.protocol.batch.codec import (
    DEFAULT_MAX_RAW_SIZE,
    BatchView,
    decode_utf8,
)
from tidemq.protocol.batch.layout import (
    ARANGE_REC,
    ATTR_COMPRESSION_MASK,
    BATCH_MAGIC,
    FORMAT_VERSION,
    H_ATTRIBUTES,
    H_BATCH_CRC,
    H_COUNT,
    H_IDX0_REL,
    H_KEYS_SIZE,
    H_MAGIC,
    H_QUEUE_OFFSET,
    H_REC0_BODY_LEN,
    H_REC0_PROPS_LEN,
    H_REC0_SIZE,
    H_REC0_TAGS_LEN,
    H_RECORDS_SIZE,
    H_RESERVED,
    H_STORE_CRC,
    H_TOPIC_LEN,
    H_TOTAL_SIZE,
    H_VERSION,
    HEADS_FIXED,
    IDX_DTYPE,
    INDEX_ENTRY,
    INDEX_ENTRY_SIZE,
    KEYS_ENTRY,
    PRODUCER_HEADER,
    PRODUCER_HEADER_SIZE,
    REC_DTYPE,
    RECORD_HEADER,
    RECORD_HEADER_SIZE,
    STORE_CRC_FROM,
    STORE_HEADER,
    STORE_HEADER_SIZE,
    crc32c,
    heads_struct,
)
from tidemq.protocol.errors import CorruptBatchError

_SMALL = 32  # batches up to this many messages are decoded without numpy
# crc32c's gil_release_mode, passed positionally: keep the GIL (layout.crc32c_held says why).
# ``crc32c(data, 0, _HELD)`` is crc32c_held(data) without functools.partial's keyword call,
# which cost ~0.3 µs of each of a batch's two checks (timeit, 48-byte and 8 KiB buffers).
_HELD = 0

__all__ = [
    "decode_batches",
    "decode_pull_body",
]

# -- decoding ------------------------------------------------------------------------------------


def decode_batches(
    body: bytes | bytearray | memoryview,
    *,
    from_offset: int,
    broker_name: str = "",
    tags: frozenset[str] | None = None,
    check_crc: bool = True,
    topic: str | None = None,
    max_uncompressed: int = DEFAULT_MAX_RAW_SIZE,
) -> list[MessageExt]:
    """Messages with queue offset >= ``from_offset`` in the batches of a pull response body.

    ``tags`` (from :func:`parse_tag_expression`) keeps only messages whose tag is in the set
    (the broker filters by tag hash only). Raises CorruptBatchError for damaged bytes or a
    record that does not decode (strict: readers that must go on use :func:`decode_pull_body`
    with ``on_corrupt``).
    """
    return decode_pull_body(body, from_offset=from_offset, broker_name=broker_name, tags=tags,
                            check_crc=check_crc, topic=topic,
                            max_uncompressed=max_uncompressed)[0]


def decode_pull_body(
    body: bytes | bytearray | memoryview,
    *,
    from_offset: int,
    broker_name: str = "",
    tags: frozenset[str] | None = None,
    check_crc: bool = True,
    topic: str | None = None,
    on_corrupt: Callable[[int, int, str], None] | None = None,
    max_uncompressed: int = DEFAULT_MAX_RAW_SIZE,
    members: Sequence[int] | None = None,
) -> tuple[list[MessageExt], int]:
    """:func:`decode_batches` plus the queue offset right after the last batch of the body
    (``from_offset`` when the body is empty).

    ``members`` (a hint, for a body of one batch: a POP answer's member bitmap as indices):
    decode only these messages of a multi-message batch, not every one from ``from_offset``
    on -- a key-shared consumer owns a scattered quarter of each batch. The caller still picks
    its messages from what is returned (a damaged batch's checked path ignores the hint).

    ``on_corrupt(queue_offset, count, reason)`` (CO9; "tolerate on the way out"): what cannot
    be decoded is reported there and skipped instead of raising, so a consumer moves past it:

    - a batch failing its CRC, or whose records do not decompress (or would decompress to more
      than ``max_uncompressed`` bytes, or to another size than the batch declares), or whose
      record sizes do not add up: the whole batch, ``count`` its messages;
    - one message whose tag, keys or properties are not UTF-8: that message alone, count 1
      (the others of its batch are delivered);
    - a batch whose framing is broken ends the body (its end cannot be known): count -1.

    Each batch's headers -- and for a batch of one message its index entry and record header
    too -- are read by one ``struct.unpack_from`` (:func:`_heads`); a single-message,
    uncompressed, keyless batch then becomes its MessageExt right here. Anything else, and any
    batch failing a check, goes through the general paths (BatchView for what looks damaged, so
    errors read as BatchView words them).
    """
    mv = body if isinstance(body, memoryview) else memoryview(body)
    end = len(mv)
    if not end:
        return [], from_offset
    based = _base_bytes(mv)
    if based is None:
        # One copy of the whole body rather than one per batch: every message slices its body
        # out of this one bytes object.
        buf: bytes = bytes(mv)
        boff = 0
        mv = memoryview(buf)
    else:
        buf, boff = based
    out: list[MessageExt] = []
    append = out.append
    end_offset = from_offset
    heads = heads_struct(len(topic.encode()) if topic else 0)  # the batches of a pull share a topic
    last_tb = b""
    btopic = topic if topic is not None else ""
    bad: list[tuple[int, str]] | None = [] if on_corrupt is not None else None
    pos = 0
    while pos < end:
        a = boff + pos
        avail = end - pos
        h = None
        if avail >= heads.size:
            h = heads.unpack_from(buf, a)
            if heads.size != HEADS_FIXED + h[H_TOPIC_LEN]:  # another topic length than guessed
                heads = heads_struct(h[H_TOPIC_LEN])
                h = heads.unpack_from(buf, a) if avail >= heads.size else None
        if h is not None:
            total = h[H_TOTAL_SIZE]
            p = STORE_HEADER_SIZE + h[H_TOPIC_LEN]
            count = h[H_COUNT]
            # BatchView's framing checks, then verify()'s two CRCs.
            if not (h[H_MAGIC] == BATCH_MAGIC and h[H_VERSION] == FORMAT_VERSION
                    and not h[H_RESERVED]
                    and total <= avail and count
                    and p + PRODUCER_HEADER_SIZE + count * INDEX_ENTRY_SIZE + h[H_KEYS_SIZE]
                    + h[H_RECORDS_SIZE]
                    == total
                    and (not check_crc
                         or (crc32c(mv[pos + p + 4 : pos + total], 0, _HELD) == h[H_BATCH_CRC]
                             and crc32c(mv[pos + STORE_CRC_FROM : pos + p], 0, _HELD)
                             == h[H_STORE_CRC]))):
                h = None
        if h is None:
            # Damaged (or too short for the combined read): BatchView checks and words it.
            nxt, end_offset = _decode_checked(mv, buf, boff, pos, from_offset, end_offset,
                                              broker_name, tags, check_crc, topic, on_corrupt,
                                              out, max_uncompressed)
            if nxt < 0:
                break
            pos = nxt
            continue
        qo = h[H_QUEUE_OFFSET]
        if qo + count > end_offset:
            end_offset = qo + count
        start = from_offset - qo
        if start >= count:
            pos += total
            continue
        if start < 0:
            start = 0
        if topic is None:
            tb = buf[a + STORE_HEADER_SIZE : a + p]
            if tb != last_tb:
                try:
                    btopic = tb.decode()
                except UnicodeDecodeError:
                    if on_corrupt is None:
                        raise CorruptBatchError("topic: not UTF-8") from None
                    on_corrupt(qo + start, count - start, "topic: not UTF-8")
                    pos += total
                    continue
                last_tb = tb
        rec = a + p + PRODUCER_HEADER_SIZE + INDEX_ENTRY_SIZE
        if (count == 1 and not h[H_KEYS_SIZE] and not h[H_ATTRIBUTES] & ATTR_COMPRESSION_MASK
                and not h[H_IDX0_REL]):
            # One message (RocketMQ's send(msg)): its record header was read with the batch's.
            tl, pl, bl = h[H_REC0_TAGS_LEN], h[H_REC0_PROPS_LEN], h[H_REC0_BODY_LEN]
            q = rec + RECORD_HEADER_SIZE
            n = tl + pl + bl
            if (h[H_REC0_SIZE] + 4 == RECORD_HEADER_SIZE + n
                    and n <= h[H_RECORDS_SIZE] - RECORD_HEADER_SIZE):
                try:
                    tag = buf[q : q + tl].decode() if tl else None
                    if pl:
                        buf[q + tl : q + tl + pl].decode()  # properties must decode too
                except UnicodeDecodeError:
                    why = _why_undecodable(buf, q, tl, pl, 0)
                    if on_corrupt is None:
                        raise CorruptBatchError(why) from None
                    on_corrupt(qo, 1, why)
                    pos += total
                    continue
                if tags is None or tag in tags:
                    q += tl + pl
                    append(MessageExt(buf[q : q + bl], qo, tag,
                                      _BatchMeta(btopic, broker_name, h, buf, a, buf, rec), 0))
                pos += total
                continue
        else:
            if (members is None and count <= _SMALL and not h[H_KEYS_SIZE]
                    and not h[H_ATTRIBUTES] & ATTR_COMPRESSION_MASK):
                # A few messages without keys, uncompressed (a backlog spread over many
                # queues): decoded here in one loop; anything that does not add up goes the
                # general way below, which words it.
                got = _decode_plain(buf, a, h, rec, count, start, btopic, broker_name, tags)
                if got is not None:
                    out.extend(got)
                    pos += total
                    continue
            if on_corrupt is None:
                out.extend(_decode_general(mv, buf, a, pos, h, rec, start, btopic, broker_name,
                                           tags, max_uncompressed, None, members))
            else:
                try:
                    out.extend(_decode_general(mv, buf, a, pos, h, rec, start, btopic,
                                               broker_name, tags, max_uncompressed, bad,
                                               members))
                except CorruptBatchError as exc:
                    on_corrupt(qo + start, count - start, exc.message)
                if bad:
                    for i, why in bad:
                        on_corrupt(qo + i, 1, why)
                    bad.clear()
            pos += total
            continue
        # A single-message batch whose record sizes disagree: let the checked path word it.
        nxt, end_offset = _decode_checked(mv, buf, boff, pos, from_offset, end_offset,
                                          broker_name, tags, check_crc, topic, on_corrupt, out,
                                          max_uncompressed)
        if nxt < 0:
            break
        pos = nxt
    return out, end_offset


# the rel offsets of a batch of n messages' index entries, one unpack (the tag hashes skipped)
_RELS_OF = [struct.Struct("<" + "8xI" * n) for n in range(_SMALL + 1)]
# a record header without born_ts, flag and reserved: (size, tags_len, props_len, body_len)
_REC_SIZES = struct.Struct("<I12xH2xII")
assert _REC_SIZES.size == RECORD_HEADER_SIZE


def _decode_plain(
    buf: bytes, a: int, h: tuple[Any, ...], rec: int, count: int, start: int, topic: str,
    broker_name: str, tags: frozenset[str] | None,
) -> list[MessageExt] | None:
    """Messages ``start..count-1`` of the framed, CRC-checked batch of ``count`` (<= _SMALL)
    messages without keys or compression at ``buf[a:]`` (``rec``: where a one-message batch's
    records would start), or None when a record's sizes do not add up or a tag or properties
    are not UTF-8 (the general path then words it). One unpack reads the whole index, and the
    batch's shared metadata is built once. Per message only the four sizes of its record
    header are read (born_ts would be a new int object per message; it is read lazily), and
    one comparison checks them: ``r + size + 4`` is where the record ends, which must be where
    its tags, properties and body end, inside the records section (a record header running
    past the body is caught by the unpack: struct.error). A batch of equal records without
    tags or properties (one producer's messages of one size: the index is a fixed stride and
    every header reads the same four sizes) is checked with two tuple comparisons and its
    messages built in one comprehension (:func:`_alike`; ~7 % of decoding at 10,000 queues)."""
    ipos = rec - INDEX_ENTRY_SIZE
    off = ipos + count * INDEX_ENTRY_SIZE
    rlen = off + h[H_RECORDS_SIZE]
    rels = _RELS_OF[count].unpack_from(buf, ipos)
    meta = _BatchMeta(topic, broker_name, h, buf, a, buf, off)
    qo = h[H_QUEUE_OFFSET]
    if count > 1:
        stride = rels[1]
        if not rels[0] and h[H_RECORDS_SIZE] == count * stride:
            alike = _alike(count, stride)
            if (alike is not None and rels == alike[0]
                    and alike[1].unpack_from(buf, off) == alike[2]):
                # equal records without tags or properties, end to end: checked at once
                if tags is not None:
                    return []
                bl = stride - RECORD_HEADER_SIZE
                s0 = off + RECORD_HEADER_SIZE + start * stride
                return [MessageExt(buf[s : s + bl], qo + i, None, meta, i)
                        for i, s in zip(range(start, count),
                                        range(s0, rlen + RECORD_HEADER_SIZE, stride),
                                        strict=True)]
    unpack_rec = _REC_SIZES.unpack_from
    out: list[MessageExt] = []
    append = out.append
    try:
        for i in range(start, count):
            r = off + rels[i]
            size, tl, pl, bl = unpack_rec(buf, r)
            q = r + RECORD_HEADER_SIZE
            s = q + tl + pl
            e = s + bl
            if r + size + 4 != e or e > rlen:
                return None
            if tl or pl:
                tag = None
                try:
                    if tl:
                        tag = buf[q : q + tl].decode()
                    if pl:
                        buf[q + tl : s].decode()  # properties must decode too
                except UnicodeDecodeError:
                    return None
                if tags is not None and tag not in tags:
                    continue
                append(MessageExt(buf[s:e], qo + i, tag, meta, i))
            elif tags is None:
                append(MessageExt(buf[s:e], qo + i, None, meta, i))
    except struct.error:
        return None
    return out


# (count, stride) -> what a batch of ``count`` alike records of ``stride`` bytes holds: its
# index's rel offsets, a struct of the records' four sizes, and what it must read
_Alike = tuple[tuple[int, ...], struct.Struct, tuple[int, ...]]
_ALIKE: dict[tuple[int, int], _Alike] = {}
_ALIKE_MAX = 4096  # kinds kept (message sizes x batch sizes); then the cache starts over


def _alike(count: int, stride: int) -> _Alike | None:
    """For :func:`_decode_plain`: the index a batch of ``count`` records of ``stride`` bytes
    each, back to back, has; a struct reading the four sizes of every record header at once;
    and the sizes it reads when each record is a body of ``stride - RECORD_HEADER_SIZE`` bytes
    without tags or properties. None when the stride cannot hold a record header."""
    got = _ALIKE.get((count, stride))
    if got is None:
        bl = stride - RECORD_HEADER_SIZE
        if bl < 0:
            return None
        if len(_ALIKE) >= _ALIKE_MAX:
            _ALIKE.clear()
        got = _ALIKE[count, stride] = (
            tuple(range(0, count * stride, stride)),
            struct.Struct("<" + f"I12xH2xII{bl}x" * count),
            (stride - 4, 0, 0, bl) * count,
        )
    return got


def _why_undecodable(raw: bytes, q: int, tl: int, pl: int, i: int) -> str:
    """Which string of the record at ``raw[q:]`` (tags ``tl`` bytes, then properties ``pl``)
    is not UTF-8, in BatchView's words. Only called once a decode has failed."""
    try:
        if tl:
            decode_utf8(raw[q : q + tl], f"tags of message {i}")
        decode_utf8(raw[q + tl : q + tl + pl], f"properties of message {i}")
    except CorruptBatchError as exc:
        return exc.message
    return f"message {i} does not decode"


def _keys_checked(src: bytes, q: int, size: int, count: int,
                  wanted: Container[int] | None = None) -> dict[int, str]:
    """The keys section at ``src[q:q + size]`` checked: index -> why the keys of that message
    are not UTF-8, for the messages in ``wanted`` (None: all) -- the framing of every entry is
    checked (CorruptBatchError when it is broken), the bytes only of wanted ones: a POP answer
    hands out a share of a batch (a key-shared consumer's quarter)."""
    bad: dict[int, str] = {}
    end = q + size
    unpack = KEYS_ENTRY.unpack_from
    while q < end:
        if q + 6 > end:
            raise CorruptBatchError("keys section entry is truncated")
        i, n = unpack(src, q)
        q += 6
        if q + n > end or i >= count:
            raise CorruptBatchError("keys section entry points outside the batch")
        if wanted is not None and i not in wanted:
            q += n
            continue
        # Only checked here (ASCII, the usual case, without making a str); the keys are
        # decoded when a message's ``keys`` is read (_BatchMeta.keys). The reason
        # (decode_utf8's wording, an f-string) is only built for a key that fails.
        k = src[q : q + n]
        if not k.isascii():
            try:
                k.decode()
            except UnicodeDecodeError:
                try:
                    decode_utf8(k, f"keys of message {i}")
                except CorruptBatchError as exc:
                    bad[i] = exc.message
        q += n
    return bad


def _decode_general(
    mv: memoryview, buf: bytes, a: int, pos: int, h: tuple[Any, ...], rec: int, start: int,
    topic: str,
    broker_name: str, tags: frozenset[str] | None, max_raw: int,
    bad: list[tuple[int, str]] | None,
    members: Sequence[int] | None = None,
) -> list[MessageExt]:
    """Messages ``start..`` (or only ``members``) of the framed, CRC-checked batch at
    ``buf[a:]`` (``mv[pos:]``) whose headers are ``h``; ``rec`` is where its records would
    start without keys.

    A message that does not decode is appended to ``bad`` as (index, reason) and skipped, or
    raises CorruptBatchError when ``bad`` is None; a batch-wide problem always raises."""
    if h[H_ATTRIBUTES] & ATTR_COMPRESSION_MASK:
        raw = bytes(BatchView(mv, pos).raw_records(max_raw))
        off, rlen = 0, len(raw)
    else:
        raw = buf
        off = rec - INDEX_ENTRY_SIZE + h[H_COUNT] * INDEX_ENTRY_SIZE + h[H_KEYS_SIZE]
        rlen = off + h[H_RECORDS_SIZE]
    meta = _BatchMeta(topic, broker_name, h, buf, a, raw, off)
    bad_keys: dict[int, str] = {}
    if h[H_KEYS_SIZE]:  # keys: checked once per batch here, so MessageExt.keys never fails later
        # (only those of the messages handed out: the others are never asked for)
        wanted: Container[int] | None = (
            set(members) if members is not None else range(start, h[H_COUNT]) if start else None)
        bad_keys = _keys_checked(buf, rec - INDEX_ENTRY_SIZE + h[H_COUNT] * INDEX_ENTRY_SIZE,
                                 h[H_KEYS_SIZE], h[H_COUNT], wanted)
    if bad is None:
        msgs = _decode_one(meta, raw, off, rlen, h[H_COUNT], start, tags, None, members)
        for m in msgs:
            if m._i in bad_keys:
                raise CorruptBatchError(bad_keys[m._i])
        return msgs
    msgs = _decode_one(meta, raw, off, rlen, h[H_COUNT], start, tags, bad, members)
    if bad_keys:
        bad.extend((m._i, bad_keys[m._i]) for m in msgs if m._i in bad_keys)
        msgs = [m for m in msgs if m._i not in bad_keys]
    return msgs


def _decode_checked(
    mv: memoryview, buf: bytes, boff: int, pos: int, from_offset: int, end_offset: int,
    broker_name: str, tags: frozenset[str] | None, check_crc: bool, topic: str | None,
    on_corrupt: Callable[[int, int, str], None] | None, out: list[MessageExt], max_raw: int,
) -> tuple[int, int]:
    """The batch at ``mv[pos:]`` through BatchView and every check, messages appended to
    ``out``: (where the next batch starts, or -1 to stop; the new end offset)."""
    try:
        view = BatchView(mv, pos)
    except CorruptBatchError as exc:
        if on_corrupt is None:
            raise
        on_corrupt(end_offset, -1, str(exc))
        return -1, end_offset
    nxt = pos + view.total_size
    end_offset = max(end_offset, view.queue_offset + view.count)
    start = from_offset - view.queue_offset
    if start >= view.count:
        return nxt, end_offset
    start = max(start, 0)
    bad: list[tuple[int, str]] | None = [] if on_corrupt is not None else None
    try:
        if check_crc:
            view.verify()
        h = STORE_HEADER.unpack_from(mv, pos) + PRODUCER_HEADER.unpack_from(
            mv, pos + view.producer_start)
        out.extend(_decode_general(mv, buf, boff + pos, pos, h,
                                   boff + pos + view.index_start + INDEX_ENTRY_SIZE, start,
                                   topic if topic is not None else view.topic, broker_name,
                                   tags, max_raw, bad))
    except CorruptBatchError as exc:
        if on_corrupt is None:
            raise
        on_corrupt(view.queue_offset + start, view.count - start, str(exc))
    if bad and on_corrupt is not None:
        for i, why in bad:
            on_corrupt(view.queue_offset + i, 1, why)
    return nxt, end_offset


# (bytes, its data address) of the last body _base_bytes saw; one body at most is kept alive
# (one tuple, replaced whole: safe for readers decoding in threads)
_last_base: tuple[Any, int] = (None, 0)


def _base_bytes(mv: memoryview) -> tuple[bytes, int] | None:
    """(the bytes object ``mv`` views, the offset of ``mv[0]`` in it), or None."""
    global _last_base
    base = mv.obj
    if type(base) is not bytes or not mv.contiguous or mv.itemsize != 1:
        return None
    if len(mv) == len(base):
        return base, 0
    # The addresses through __array_interface__ (``.ctypes`` builds a ctypes object: ~2x the
    # cost); the base's is kept for the next call, as a multi-queue answer's queues all slice
    # one body (thousands of calls per answer).
    cached = _last_base
    if cached[0] is base:
        base_addr = cached[1]
    else:
        base_addr = np.frombuffer(base, dtype=np.uint8).__array_interface__["data"][0]
        _last_base = (base, base_addr)
    off = np.frombuffer(mv, dtype=np.uint8).__array_interface__["data"][0] - base_addr
    if not 0 <= off <= len(base) - len(mv):
        return None
    return base, off


def _decode_small(
    meta: _BatchMeta, raw: bytes, off: int, rlen: int, count: int, start: int,
    tags: frozenset[str] | None, bad: list[tuple[int, str]] | None,
    indices: Sequence[int] | None = None,
) -> list[MessageExt]:
    out: list[MessageExt] = []
    unpack_idx = INDEX_ENTRY.unpack_from
    unpack_rec = RECORD_HEADER.unpack_from
    index = meta.src
    ipos = meta.index_pos()
    qo = meta.queue_offset
    for i in range(start, count) if indices is None else indices:
        _h, rel = unpack_idx(index, ipos + i * INDEX_ENTRY_SIZE)
        rel += off
        if rel + RECORD_HEADER_SIZE > rlen:
            raise CorruptBatchError(f"message {i} starts outside the records section")
        size, _ts, _f, tl, _r, pl, bl = unpack_rec(raw, rel)
        q = rel + RECORD_HEADER_SIZE
        if size + 4 != RECORD_HEADER_SIZE + tl + pl + bl or q + tl + pl + bl > rlen:
            raise CorruptBatchError(f"message {i} record sizes are inconsistent")
        try:
            tag = raw[q : q + tl].decode() if tl else None
            if tags is not None and tag not in tags:
                continue
            if pl:
                raw[q + tl : q + tl + pl].decode()  # properties must decode too
        except UnicodeDecodeError:
            why = _why_undecodable(raw, q, tl, pl, i)
            if bad is None:
                raise CorruptBatchError(why) from None
            bad.append((i, why))
            continue
        s = q + tl + pl
        out.append(MessageExt(raw[s : s + bl], qo + i, tag, meta, i))
    return out


def _decode_uniform(
    meta: _BatchMeta, raw: bytes, off: int, rlen: int, count: int, start: int, rel: np.ndarray,
) -> list[MessageExt] | None:
    """Messages ``start..count-1`` of a batch whose records are all alike -- the same size,
    no tag, no properties (what ``send_batch`` of equal messages stores) -- or None when they
    are not, for the general path to decode (and word what is wrong).

    Alike records sit at a fixed stride, so their headers are one strided numpy view (no
    gather) and their bodies' starts a ``range``: this saves ~60 µs of a 1,000-message batch
    (~0.06 µs of a consumer's ~1 µs per message) over the general path's gather and lists."""
    n = len(rel)
    r0 = int(rel[0])
    stride = int(rel[1]) - r0
    first = off + r0
    if (stride < RECORD_HEADER_SIZE or first + (n - 1) * stride + RECORD_HEADER_SIZE > rlen
            or not bool((np.diff(rel) == stride).all())):
        return None
    hdr = np.ndarray((n,), REC_DTYPE, raw, first, (stride,))
    bl = int(hdr["bl"][0])
    s0 = first + RECORD_HEADER_SIZE
    if (hdr["tl"].any() or hdr["pl"].any() or not bool((hdr["bl"] == bl).all())
            or not bool((hdr["size"] == RECORD_HEADER_SIZE - 4 + bl).all())
            or s0 + (n - 1) * stride + bl > rlen):
        return None
    qo = meta.queue_offset
    return [MessageExt(raw[s : s + bl], qo + i, None, meta, i)
            for i, s in zip(range(start, count), range(s0, s0 + n * stride, stride),
                            strict=True)]


def _decode_one(
    meta: _BatchMeta, raw: bytes, off: int, rlen: int, count: int, start: int,
    tags: frozenset[str] | None, bad: list[tuple[int, str]] | None,
    members: Sequence[int] | None = None,
) -> list[MessageExt]:
    """Messages ``start..count-1`` (or only ``members`` among them) of a batch whose records
    section is ``raw[off:rlen]``; undecodable ones go to ``bad`` (see :func:`_decode_general`)."""
    indices: Sequence[int] = range(start, count)
    if members is not None:
        indices = [i for i in members if start <= i < count]
    if len(indices) <= _SMALL:
        return _decode_small(meta, raw, off, rlen, count, start, tags, bad, indices)
    idx = np.frombuffer(meta.src, dtype=IDX_DTYPE, count=count, offset=meta.index_pos())
    if members is None and tags is None:
        msgs = _decode_uniform(meta, raw, off, rlen, count, start, idx["rel"][start:])
        if msgs is not None:
            return msgs
    idx = idx[start:] if members is None else idx[np.asarray(indices, dtype=np.int64)]
    rel = idx["rel"].astype(np.int64) + off
    if len(rel) and (int(rel.max()) + RECORD_HEADER_SIZE > rlen or int(rel.min()) < off):
        raise CorruptBatchError("a message of the batch starts outside its records section")
    rawnp = np.frombuffer(raw, dtype=np.uint8)
    hdr = rawnp[rel[:, None] + ARANGE_REC].view(REC_DTYPE).reshape(-1)
    tl = hdr["tl"].astype(np.int64)
    pl = hdr["pl"].astype(np.int64)
    bl = hdr["bl"].astype(np.int64)
    sizes = hdr["size"].astype(np.int64)
    bstart = rel + RECORD_HEADER_SIZE + tl + pl
    bend = bstart + bl
    if bool(((sizes + 4) != (RECORD_HEADER_SIZE + tl + pl + bl)).any()) or (
        len(bend) and int(bend.max()) > rlen
    ):
        raise CorruptBatchError("record sizes of the batch are inconsistent")
    qo = meta.queue_offset
    b = meta
    if not bool(tl.any()) and not bool(pl.any()):
        if tags is not None:
            return []
        return [
            MessageExt(raw[s:e], qo + i, None, b, i)
            for i, s, e in zip(indices, bstart.tolist(), bend.tolist(), strict=True)
        ]
    # Tags or properties: each is decoded (tags are kept, properties only checked so that
    # MessageExt.properties never fails later); an undecodable record is skipped.
    tstart = (rel + RECORD_HEADER_SIZE).tolist()
    tls = tl.tolist()
    pls = pl.tolist()
    out: list[MessageExt] = []
    append = out.append
    seen: dict[bytes, str] = {}  # tag bytes -> str: a batch's messages share a few tags
    for i, s, e, ts, t, p in zip(
        indices, bstart.tolist(), bend.tolist(), tstart, tls, pls, strict=True
    ):
        try:
            if t:
                tb = raw[ts : ts + t]
                tag = seen.get(tb)
                if tag is None:
                    tag = seen[tb] = tb.decode()
            else:
                tag = None
            if tags is not None and tag not in tags:
                continue
            if p:
                pb = raw[ts + t : s]
                if not pb.isascii():  # checked without making a str when ASCII
                    pb.decode()
        except UnicodeDecodeError:
            why = _why_undecodable(raw, ts, t, p, i)
            if bad is None:
                raise CorruptBatchError(why) from None
            bad.append((i, why))
            continue
        append(MessageExt(raw[s:e], qo + i, tag, b, i))
    return out
