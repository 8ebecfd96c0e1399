"""The records, index and keys section of a batch of varied messages (each of its own size,
tag, keys and properties), built column by column: what ``fast.encode_messages`` uses for a
batch of more than a few messages with tags, keys or properties.

Why hand-written (measured, docs/producer-path.md): a Python loop over the messages costs
~1.5-2 µs per message in attribute reads, a properties join, a ``struct.pack`` and list stores;
``send_async`` of 200 k varied messages spent half of its client CPU there. Here no Python code
runs per message:

- the caller reads every field of all messages in one pass (``map`` of an ``attrgetter``);
- tags' bytes and hashes come from two dicts (tags are few);
- all properties of the batch are one ``str.join`` (``name 0x01 value 0x02`` per property, the
  format's encoding), encoded once; each message's share is found from the positions of the
  0x02 bytes and the number of properties of each message (UTF-8 never has 0x01/0x02 inside a
  character, so byte positions are exact). A name or value holding a separator shows as more
  separators than properties;
- the record headers, tags and properties of all messages (the *prefixes*) are scattered into
  one array with numpy (a few dozen bytes per message), the keys section likewise; only the
  prefixes are sliced per message, and ``bytes.join`` interleaves them with the bodies (one copy
  of each body, straight into the batch).

Anything irregular (properties that are not ``dict[str, str]`` or hold a separator, a cache
full of tags, strings that do not encode) returns None, and the caller uses
the per-message reference loop, which names the offending message.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import Any

import numpy as np

from tidemq.protocol.batch.codec import properties_over_limit
from tidemq.protocol.batch.layout import (
    ARANGE_REC,
    IDX_DTYPE,
    KEYS_ENTRY,
    REC_DTYPE,
    RECORD_HEADER_SIZE,
)
from tidemq.protocol.batch.tags import tag_hash

__all__ = ["varied_records"]

_R = RECORD_HEADER_SIZE
_KE = KEYS_ENTRY.size
_KE_DTYPE = np.dtype([("i", "<u4"), ("n", "<u2")])
assert _KE_DTYPE.itemsize == _KE
_ARANGE_KE = np.arange(_KE, dtype=np.int64)
_NONE_T = type(None)
_EMPTY: dict[str, str] = {}
_items = dict.items
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


def _properties(props: Sequence[Any], max_props: int
                ) -> tuple[bytes, np.ndarray, np.ndarray] | None:
    """(all properties' bytes, start and length of each message's share) or None."""
    if None in props:
        props = [p if p is not None else _EMPTY for p in props]
    try:
        counts = np.fromiter(map(len, props), np.int64, len(props))
        s = "\x02".join(map(_join_item, chain.from_iterable(map(_items, props))))
        pb = s.encode()
    except (TypeError, ValueError):  # not dicts of str, or a string that does not encode
        return None
    nitems = int(counts.sum())
    if nitems:
        pb += b"\x02"
        if pb.count(1) != nitems or pb.count(2) != nitems:
            return None  # a separator inside a name or value
    ends = np.zeros(nitems + 1, np.int64)
    ends[1:] = np.flatnonzero(np.frombuffer(pb, np.uint8) == 2)
    ends[1:] += 1
    last = np.cumsum(counts)
    start = ends[last - counts]
    pl = ends[last] - start
    if nitems and int(pl.max()) > max_props:
        i = int(np.argmax(pl > max_props))
        raise ValueError(properties_over_limit(i, int(pl[i]), max_props))
    return pb, start, pl


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
    kl = np.fromiter(map(len, kbs), np.int64, len(kbs))
    if int(kl.max()) > 0xFFFF:
        raise ValueError("keys must be at most 65535 bytes")
    sel = np.flatnonzero(kl)
    if not len(sel):
        return b""
    kl = kl[sel]
    kall = b"".join(kbs)
    size = kl + _KE
    at = np.cumsum(size) - size
    out = np.empty(len(kall) + _KE * len(sel), np.uint8)
    ent = np.empty(len(sel), _KE_DTYPE)
    ent["i"] = sel
    ent["n"] = kl
    out[(at[:, None] + _ARANGE_KE).ravel()] = ent.view(np.uint8)
    out[np.repeat(at + _KE - (np.cumsum(kl) - kl), kl) + np.arange(len(kall))] = \
        np.frombuffer(kall, np.uint8)
    return out.tobytes()


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
        hashes = np.fromiter(map(_tag_hashes.__getitem__, tags), np.uint64, n)
    except TypeError:  # an unhashable tag
        return None
    got = _properties(props, max_props)
    if got is None:
        return None
    pb, pstart, pl = got
    keys_b = _keys_section(messages, keys)
    if keys_b is None:
        return None
    tl = np.fromiter(map(len, tbs), np.int64, n)
    bl = np.fromiter(map(len, bodies), np.int64, n)
    plen = tl + pl + _R  # a record's prefix: header, tags, properties
    pend = np.cumsum(plen)
    pat = pend - plen
    prefixes = np.empty(int(pend[-1]), np.uint8)
    hdr = np.zeros(n, dtype=REC_DTYPE)
    sizes = plen + bl - 4
    hdr["size"] = sizes
    hdr["born_ts"] = born_ts
    hdr["tl"] = tl
    hdr["pl"] = pl
    hdr["bl"] = bl
    prefixes[(pat[:, None] + ARANGE_REC).ravel()] = hdr.view(np.uint8)
    tall = b"".join(tbs)
    if tall:
        prefixes[np.repeat(pat + _R - (np.cumsum(tl) - tl), tl) + np.arange(len(tall))] = \
            np.frombuffer(tall, np.uint8)
    if len(pb):
        prefixes[np.repeat(pat + _R + tl - pstart, pl) + np.arange(len(pb))] = \
            np.frombuffer(pb, np.uint8)
    idx = np.empty(n, dtype=IDX_DTYPE)
    idx["hash"] = hashes
    ends = np.cumsum(sizes + 4)
    idx["rel"] = ends - (sizes + 4)
    pre = prefixes.tobytes()
    parts: list[bytes] = [b""] * (2 * n)
    parts[0::2] = map(pre.__getitem__, map(slice, pat.tolist(), pend.tolist()))
    parts[1::2] = bodies
    return parts, idx.tobytes(), keys_b, int(ends[-1])
