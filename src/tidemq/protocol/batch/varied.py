"""The records, index and keys section of a batch of varied messages (each of its own size,
tag, keys and properties), built column by column: what ``fast.encode_messages`` uses for a
batch of more than a few messages with tags, keys or properties.

Why hand-written (measured, docs/producer-path.md): a Python loop over the messages costs
~1.5-2 µs per message in attribute reads, a properties join, a ``struct.pack`` and list stores;
``send_async`` of 200 k varied messages spent half of its client CPU there. Here no Python code
runs per message, and a batch makes only a few numpy calls (each costs ~1 µs, which a batch of
~125 messages of ~1 KiB, what ``batch_max_bytes`` lets through, feels):

- the caller reads every field of all messages in one pass (``map`` of an ``attrgetter``);
- tags' bytes and hashes come from two dicts (tags are few);
- all properties of the batch are one ``str.join`` (``name 0x01 value 0x02`` per property, the
  format's encoding), encoded once; each message's share is a slice whose ends come from the
  lengths of the properties (ASCII) or from the positions of the 0x02 bytes (UTF-8 never has
  0x01/0x02 inside a character). A name or value holding a separator shows as more
  separators than properties;
- the record headers are ``struct.pack`` mapped over the columns; the keys section is one join
  of entries from two tables of little-endian integers and the keys' bytes; the index is one
  numpy structured array;
- the caller's ``bytes.join`` copies the records' parts (header, tag, properties, body of each
  message) straight into the batch: one copy of each body.

Anything irregular (properties that are not ``dict[str, str]`` or hold a separator, a cache
full of tags, strings that do not encode) returns None, and the caller uses
the per-message reference loop, which names the offending message.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import accumulate, chain, compress, repeat
from operator import add, sub
from typing import Any

import msgspec
import numpy as np

from tidemq.protocol.batch.codec import properties_over_limit
from tidemq.protocol.batch.layout import (
    IDX_DTYPE,
    KEYS_ENTRY,
    RECORD_HEADER,
    RECORD_HEADER_SIZE,
)
from tidemq.protocol.batch.tags import tag_hash

__all__ = ["varied_records"]

_R = RECORD_HEADER_SIZE
_PACK_RECORD = RECORD_HEADER.pack
assert KEYS_ENTRY.format == "<IH"
#: index -> its u32 and length -> its u16, little-endian: the keys section's entries are joined
#: from these (grown on demand, up to _TABLE_MAX messages per batch)
_U32: list[bytes] = []
_U16: list[bytes] = []
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
#: tag -> UTF-8 bytes and tag -> hash (None and "" are no tag); bounded, tags are few
_tag_bytes: dict[str | None, bytes] = {None: b"", "": b""}
_tag_hashes: dict[str | None, int] = {None: 0, "": 0}
_TAGS_MAX = 65536


def _learn_tags(tags: Sequence[Any]) -> bool:
    """Cache the tags not cached yet; False when one is too long, not a str, or the cache is
    full (the caller then takes the reference loop)."""
    for t in set(tags):
        if t not in _tag_bytes:
            if type(t) is not str or len(_tag_bytes) >= _TAGS_MAX:
                return False
            b = t.encode()
            if len(b) > 0xFFFF:
                return False
            _tag_hashes[t] = tag_hash(t)
            _tag_bytes[t] = b
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
    kinds = set(map(type, keys))
    if kinds == {_NONE_T}:
        return b""
    if not kinds <= {str, _NONE_T}:
        # lists of keys: checked and joined by the message (one at a time, only for these)
        keys = [k if type(k) is str else (m.keys_string or "")
                for k, m in zip(keys, messages, strict=True)]
    elif _NONE_T in kinds:
        keys = [k if k is not None else "" for k in keys]
    try:
        kbs = list(map(str.encode, keys))
    except ValueError:
        return None
    kl = list(map(len, kbs))
    top = max(kl)
    if top > 0xFFFF:
        raise ValueError("keys must be at most 65535 bytes")
    if not top:
        return b""
    n = len(kbs)
    if n > _TABLE_MAX:
        return None
    _grow(_U16, top + 1, 2)
    _grow(_U32, n, 4)
    at: Iterator[bytes]
    if 0 in kl:  # messages without keys have no entry
        kbs = list(compress(kbs, kl))
        at = map(_U32.__getitem__, compress(range(n), kl))
        kl = list(compress(kl, kl))
    else:
        at = iter(_U32[:n])
    # entry (message index u32, length u16) and keys' bytes of each message, one join
    return b"".join(chain.from_iterable(zip(at, map(_U16.__getitem__, kl), kbs, strict=True)))


def _grow(table: list[bytes], size: int, width: int) -> None:
    """Extend a table of little-endian integers (index -> its ``width`` bytes) to ``size``."""
    if len(table) < size:
        table.extend([i.to_bytes(width, "little") for i in range(len(table), size)])


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
        tbs: list[Any] = list(map(_tag_bytes.get, tags))
        if None in tbs:
            if not _learn_tags(tags):
                return None
            tbs = list(map(_tag_bytes.get, tags))
        hashes = list(map(_tag_hashes.__getitem__, tags))
    except TypeError:  # an unhashable tag
        return None
    got = _properties(props, max_props)
    if got is None:
        return None
    pbs, pl = got
    keys_b = _keys_section(messages, keys)
    if keys_b is None:
        return None
    tl = list(map(len, tbs))
    bl = list(map(len, bodies))
    # record_size (the bytes after the field): header - 4 + tags + properties + body
    sizes = list(map(add, map(add, map(add, tl, pl), bl), repeat(_R - 4)))
    zero = repeat(0)
    hdrs = list(map(_PACK_RECORD, sizes, repeat(born_ts), zero, tl, zero, pl, bl))
    ends = list(accumulate(map(add, sizes, repeat(4)), initial=0))
    idx = np.empty(n, dtype=IDX_DTYPE)
    idx["hash"] = hashes
    idx["rel"] = ends[:-1]
    parts: list[bytes] = [b""] * (4 * n)
    parts[0::4] = hdrs
    parts[1::4] = tbs
    parts[2::4] = pbs
    parts[3::4] = bodies
    return parts, idx.tobytes(), keys_b, ends[-1]
