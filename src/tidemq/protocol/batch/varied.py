"""The records, index and keys section of a batch of varied messages (each of its own size,
tag, keys and properties), built column by column: what ``fast.encode_messages`` uses for a
batch of more than a few messages with tags, keys or properties.

Why hand-written (measured, docs/producer-path.md): a Python loop over the messages costs
~1.5-2 µs per message in attribute reads, a properties join, a ``struct.pack`` and list stores;
``send_async`` of 200 k varied messages spent half of its client CPU there. Here no Python code
runs per message, and a batch makes about twenty numpy calls (each costs ~0.5-1 µs, which a
batch of ~125 messages feels; ``batch_max_bytes`` lets ~500 of ~1 KiB through):

- the caller reads every field of all messages in one pass (``map`` of ``astuple`` for the
  client's Message structs, else of an ``attrgetter``);
- each tag becomes an id (one dict lookup a message); its bytes, length and hash are tables
  by id (tags are few);
- all properties of the batch are one msgspec JSON encode whose punctuation becomes the
  format's separators (``_properties_json``), or one ``str.join`` (``name 0x01 value 0x02``
  per property, the format's encoding), encoded once; each message's share is a slice whose
  ends come from the lengths of the properties (ASCII) or from the positions of the 0x02
  bytes (UTF-8 never has 0x01/0x02 inside a character). A name or value holding a separator
  shows as more separators than properties;
- the record headers and the index are one numpy array each (the layout's REC_DTYPE and
  IDX_DTYPE viewed as u32 words), filled a column at a time from three ``array.array``
  columns (properties' and bodies' lengths, tag ids), and the headers are cut into one bytes
  per record by one ``struct`` unpack (measured at 125 messages: ~0.26 instead of ~0.37 µs a
  message for ``struct.pack`` mapped over the columns, tags included);
- the keys section is one join of entries from tables of little-endian integers and the
  keys: as one ``str`` encoded once when every key is ASCII (the entries' bytes as latin-1
  characters; ~0.14 instead of ~0.2 µs a message), else of each key's UTF-8 bytes;
- the caller's ``bytes.join`` copies the records' parts (header, tag, properties, body of each
  message) straight into the batch: one copy of each body.

Anything irregular (properties that are not ``dict[str, str]`` or hold a separator, a cache
full of tags, strings that do not encode) returns None, and the caller uses
the per-message reference loop, which names the offending message.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from itertools import accumulate, chain, compress, repeat
from operator import add, itemgetter, sub
from typing import Any

import msgspec
import numpy as np

from tidemq.protocol.batch.codec import properties_over_limit
from tidemq.protocol.batch.layout import (
    IDX_DTYPE,
    INDEX_ENTRY_SIZE,
    KEYS_ENTRY,
    REC_DTYPE,
    RECORD_HEADER_SIZE,
)
from tidemq.protocol.batch.tags import tag_hash

__all__ = ["varied_records"]

_R = RECORD_HEADER_SIZE
#: the record header's and the index entry's u32 words (REC_DTYPE, IDX_DTYPE viewed as words)
_RW = RECORD_HEADER_SIZE // 4
_IW = INDEX_ENTRY_SIZE // 4


def _word(dtype: np.dtype[Any], name: str) -> int:
    """The u32 word at which field ``name`` of ``dtype`` starts."""
    fields = dtype.fields
    assert fields is not None
    return int(fields[name][1]) // 4


_W_SIZE = _word(REC_DTYPE, "size")
_W_TS = _word(REC_DTYPE, "born_ts")  # born_ts (2 words), then flag
_W_TL = _word(REC_DTYPE, "tl")  # tags_len u16 + reserved u16 (0): one word
_W_PL = _word(REC_DTYPE, "pl")  # props_len, then body_len
assert RECORD_HEADER_SIZE % 4 == 0 and INDEX_ENTRY_SIZE % 4 == 0
assert _word(REC_DTYPE, "flag") == _W_TS + 2
assert _word(REC_DTYPE, "bl") == _W_PL + 1
assert IDX_DTYPE.names == ("hash", "rel") and _word(IDX_DTYPE, "rel") == 2
_TS_FLAG = struct.Struct("<qI")  # born_ts and flag (0), the words _W_TS .. _W_TS + 2
_cutters: dict[int, struct.Struct] = {}


def _u32(values: Any) -> array[int]:
    """Unsigned 32-bit ints of ``values`` (OverflowError past them), for np.frombuffer."""
    return array("I", values)


assert array("I").itemsize == 4
assert KEYS_ENTRY.format == "<IH"
#: index -> its u32 and length -> its u16, little-endian: the keys section's entries are joined
#: from these (grown on demand, up to _TABLE_MAX messages per batch)
_U32: list[bytes] = []
_U16: list[bytes] = []
_U32S: list[str] = []  # the same as latin-1 str, for ASCII keys
_U16S: list[str] = []
_TABLE_MAX = 65536
_NONE_T = type(None)
_EMPTY: dict[str, str] = {}
_items = dict.items
_json = msgspec.json.Encoder().encode
_convert = msgspec.convert
_PROPS = list[dict[str, str]]
#: JSON's punctuation -> the properties' separators (":" -> 0x01, "," -> 0x02, "{" -> 0x00,
#: which marks where a message's properties start)
_JSON_SEPS = bytes.maketrans(b":,{", b"\x01\x02\x00")
_join_item = "\x01".join
#: tag -> its id (None and "" are no tag: id 0), and by id its UTF-8 bytes, their length and
#: its hash (as two little-endian u32 words, the index entry's first two); bounded, tags are few
_tag_ids: dict[str | None, int] = {None: 0, "": 0}
_TAG_B: list[bytes] = [b""]
_tag_hash_list: list[int] = [0]
_TAG_L = np.zeros(1, "<u4")
_TAG_H = np.zeros((1, 2), "<u4")
_TAGS_MAX = 65536


def _learn_tags(tags: Sequence[Any]) -> bool:
    """Give the tags not known yet an id; False when one is too long, not a str, or the table
    is full (the caller then takes the reference loop)."""
    global _TAG_L, _TAG_H
    new = [t for t in set(tags) if t not in _tag_ids]
    for t in new:
        if type(t) is not str or len(_tag_ids) >= _TAGS_MAX:
            return False
        b = t.encode()
        if len(b) > 0xFFFF:
            return False
        _tag_ids[t] = len(_TAG_B)
        _TAG_B.append(b)
        _tag_hash_list.append(tag_hash(t))
    if new:
        _TAG_L = np.array(list(map(len, _TAG_B)), "<u4")
        _TAG_H = np.array(_tag_hash_list, "<u8").view("<u4").reshape(-1, 2)
    return True


def _properties(props: Sequence[Any], max_props: int) -> tuple[list[bytes], list[int]] | None:
    """(each message's properties' bytes, their lengths) or None."""
    if None in props:
        props = [p if p is not None else _EMPTY for p in props]
    got = _properties_json(props)
    if got is not None:
        pbs, pl = got
        if max(pl) > max_props:
            i = next(i for i, x in enumerate(pl) if x > max_props)
            raise ValueError(properties_over_limit(i, pl[i], max_props))
        return got
    try:
        items = list(map(_join_item, chain.from_iterable(map(_items, props))))
        s = "\x02".join(items)
        pb = s.encode()
    except (TypeError, ValueError):  # not dicts of str, or a string that does not encode
        return None
    nitems = len(items)
    bounds = list(accumulate(map(len, props), initial=0))
    if not nitems:
        return [b""] * (len(bounds) - 1), [0] * (len(bounds) - 1)
    pb += b"\x02"
    if pb.count(1) != nitems or pb.count(2) != nitems:
        return None  # a separator inside a name or value
    if len(pb) == len(s) + 1:  # ASCII: one byte a character
        item_ends = list(accumulate(map(add, map(len, items), repeat(1)), initial=0))
    else:
        item_ends = [0, *(np.flatnonzero(np.frombuffer(pb, np.uint8) == 2) + 1).tolist()]
    ends = list(map(item_ends.__getitem__, bounds))
    starts = ends[:-1]
    del ends[0]
    pl = list(map(sub, ends, starts))
    if max(pl) > max_props:
        i = next(i for i, x in enumerate(pl) if x > max_props)
        raise ValueError(properties_over_limit(i, pl[i], max_props))
    return list(map(pb.__getitem__, map(slice, starts, ends))), pl


def _properties_json(props: Sequence[Any]) -> tuple[list[bytes], list[int]] | None:
    """:func:`_properties` for the common case -- every message has at least one property,
    names and values are plain ``str`` without ``"``, ``\\``, control characters or any of
    ``:,{}[]`` -- in C: msgspec writes the batch's dicts as one JSON array, whose
    punctuation is then exactly the format's separators (``"k":"v","k2":"v2"`` of a message
    becomes ``k 0x01 v 0x02 k2 0x01 v2 0x02``: one ``translate`` for the whole batch, one
    ``split`` at the message boundaries). Exact by counting: a string holding any of those
    characters (or escaped by JSON) shows as more of them than the properties account for,
    and then None (the general path). Measured: 0.3 instead of 0.55-0.65 µs per message for
    the two properties of ``bench app``'s messages."""
    n = len(props)
    try:
        nitems = sum(map(len, props))
        if nitems < n:  # a message without properties: the general path (else "{}", below)
            return None
        # dicts of str only, as the general path's joins require: msgspec would also write
        # ints, enums, dates, bytes... as JSON strings, not all as str() spells them
        _convert(props, _PROPS)
        js = _json(props)
    except (TypeError, ValueError):  # msgspec.ValidationError is a ValueError
        return None  # not dicts of str; a string msgspec cannot encode (a lone surrogate)
    c = np.bincount(np.frombuffer(js, np.uint8), minlength=128).tolist()
    if (c[92] or c[34] != 4 * nitems or c[58] != nitems or c[44] != nitems - 1
            or c[123] != n or c[125] != n or c[91] != 1 or c[93] != 1 or b"{}" in js):
        return None  # 92 '\\', 34 '"', 58 ':', 44 ',', 123 '{', 125 '}', 91 '[', 93 ']'
    # [{"a":"1","b":"2"},{"a":"3"}] -> 0x00 a 0x01 1 0x02 b 0x01 2 0x02 0x00 a 0x01 3 (+ 0x02)
    parts = (js.translate(_JSON_SEPS, b'"[]}') + b"\x02").split(b"\x00")
    del parts[0]
    return parts, list(map(len, parts))


def _keys_section(messages: Sequence[Any], keys: Sequence[Any]) -> bytes | None:
    """The keys section (entry + keys' bytes for each message that has keys) or None."""
    try:
        ascii_ = "".join(keys).isascii()
    except TypeError:  # messages without keys (None) or with lists of keys
        kinds = set(map(type, keys))
        if kinds == {_NONE_T}:
            return b""
        if not kinds <= {str, _NONE_T}:
            # lists of keys: checked and joined by the message (one at a time, only for these)
            keys = [k if type(k) is str else (m.keys_string or "")
                    for k, m in zip(keys, messages, strict=True)]
        else:
            keys = [k if k is not None else "" for k in keys]
        ascii_ = "".join(keys).isascii()
    kbs: Sequence[Any]
    u32: list[Any]
    u16: list[Any]
    sep: Any
    if ascii_:
        # ASCII keys (the common case): a character is a byte, so the section is built as a
        # str (the entries' bytes as latin-1 characters) and encoded once, not key by key
        kbs = keys
        u32, u16, sep = _U32S, _U16S, ""
    else:
        try:
            kbs = list(map(str.encode, keys))
        except ValueError:
            return None
        u32, u16, sep = _U32, _U16, b""
    kl = list(map(len, kbs))
    top = max(kl)
    if top > 0xFFFF:
        raise ValueError("keys must be at most 65535 bytes")
    if not top:
        return b""
    n = len(kbs)
    if n > _TABLE_MAX:
        return None
    _grow(u16, top + 1, 2)
    _grow(u32, n, 4)
    at: Sequence[Any]
    if 0 in kl:  # messages without keys have no entry
        kbs = list(compress(kbs, kl))
        at = _pick(u32, list(compress(range(n), kl)))
        kl = list(compress(kl, kl))
    else:
        at = u32[:n]
    # entry (message index u32, length u16) and keys' bytes of each message, one join; the
    # three columns interleaved by slice assignments (~2x cheaper than zip + chain: no tuple
    # per message)
    entries = [sep] * (3 * len(kbs))
    entries[0::3] = at
    entries[1::3] = _pick(u16, kl)
    entries[2::3] = kbs
    joined = sep.join(entries)
    return joined.encode("latin-1") if ascii_ else joined  # type: ignore[no-any-return]


def _pick(table: Any, idx: Sequence[Any]) -> tuple[Any, ...]:
    """``table[i]`` for each ``i`` of ``idx`` (at least one), as one tuple: one
    ``itemgetter`` call, ~15-30 ns a lookup cheaper than ``map`` of ``table.__getitem__``
    (measured at 500 messages; this runs three times per message of a batch)."""
    got = itemgetter(*idx)(table)
    return got if len(idx) != 1 else (got,)


def _grow(table: list[Any], size: int, width: int) -> None:
    """Extend a table of little-endian integers (index -> its ``width`` bytes, or for the
    str tables those bytes as latin-1 characters) to ``size``."""
    if len(table) < size:
        as_str = table is _U32S or table is _U16S
        new = [i.to_bytes(width, "little") for i in range(len(table), size)]
        table.extend([b.decode("latin-1") for b in new] if as_str else new)



def _record_words(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(record headers, index) of ``n`` messages as arrays of little-endian u32 words: the
    layout's REC_DTYPE and IDX_DTYPE, each row viewed as its words."""
    hdr = np.empty(n, REC_DTYPE).view("<u4").reshape(n, _RW)
    idx = np.empty(n, IDX_DTYPE).view("<u4").reshape(n, _IW)
    return hdr, idx


def _pieces(n: int) -> struct.Struct:
    """The Struct that cuts ``n`` record headers (one bytes) into ``n`` bytes objects in one
    C call (cheaper than ``n`` slices)."""
    st = _cutters.get(n)
    if st is None:
        st = struct.Struct(f"{_R}s" * n)
        if len(_cutters) < 4096:
            _cutters[n] = st
    return st


def varied_records(
    messages: Sequence[Any], tags: Sequence[Any], props: Sequence[Any], keys: Sequence[Any],
    bodies: Sequence[bytes], born_ts: int, max_props: int,
) -> tuple[list[bytes], bytes, bytes, int] | None:
    """(records as parts to join, index, keys section, records size) of ``messages``, whose
    tags, properties, keys and bodies are given as columns, or None when the reference loop
    must do it. Raises ValueError for properties over ``max_props`` or keys over 65535
    bytes."""
    n = len(messages)
    try:
        try:
            ids = _pick(_tag_ids, tags)
        except KeyError:  # a tag not seen yet
            if not _learn_tags(tags):
                return None
            ids = _pick(_tag_ids, tags)
    except TypeError:  # an unhashable tag
        return None
    got = _properties(props, max_props)
    if got is None:
        return None
    pbs, pl = got
    keys_b = _keys_section(messages, keys)
    if keys_b is None:
        return None
    # The record headers and the index as u32 words (numpy), from three columns of ints:
    # each header is size | born_ts (2 words) | flag | tags_len + reserved | props_len |
    # body_len, each index entry tag_hash (2 words) | rel_offset.
    try:
        words = _u32(pl)
        words.fromlist(list(map(len, bodies)))
        pb = np.frombuffer(words, "<u4").reshape(2, n)
    except OverflowError:  # a body of 4 GiB or more: the reference loop refuses it
        return None
    tid = np.frombuffer(_u32(ids), "<u4")
    hdr, idx = _record_words(n)
    hdr[:, _W_TS : _W_TS + 3] = np.frombuffer(_TS_FLAG.pack(born_ts, 0), "<u4")
    hdr[:, _W_PL : _W_PL + 2] = pb.T
    tl = hdr[:, _W_TL]
    _TAG_L.take(tid, out=tl)
    size = hdr[:, _W_SIZE]
    np.add(pb[0], pb[1], out=size)
    size += tl
    size += _R - 4
    idx[:, 0:2] = _TAG_H.take(tid, axis=0)
    ends = np.cumsum(size, dtype=np.uint64)
    ends += np.arange(4, 4 * n + 1, 4, dtype=np.uint64)
    rel = idx[:, _IW - 1]
    rel[0] = 0
    rel[1:] = ends[:-1]
    parts: list[bytes] = [b""] * (4 * n)
    parts[0::4] = _pieces(n).unpack(hdr.tobytes())
    parts[1::4] = _pick(_TAG_B, ids)
    parts[2::4] = pbs
    parts[3::4] = bodies
    return parts, idx.tobytes(), keys_b, int(ends[-1])
