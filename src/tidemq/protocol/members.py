"""Which messages of a served batch are the consumer's: member bitmaps of a pull answer.

The broker serves whole stored batches, never re-encoded (ref ST2). When it selects messages
inside a batch -- an SQL92 filter today; shared/POP dispatch later -- the pull answer's header
carries one bitmap per body batch (``PullMessageResponseHeader.members``, in body order) and
the client hands out only the members. No ``members`` field means every message of every batch
(the tag path, where the client re-checks the tag itself).

Bitmap layout: bit ``i`` is message ``i`` of the batch (counted from the batch's first message,
not from the first message wanted), least significant bit first within each byte::

    byte 0: messages 0..7 (bit 0 = message 0) | byte 1: messages 8..15 | ...

A bitmap may be shorter than ``ceil(count / 8)`` bytes: missing bytes are zeros.

Also here, by import: :func:`filter_fields` (``batch/codec.py``), the per-message part of a
batch a property filter reads (tag and properties), without building whole messages.
"""

from __future__ import annotations

from collections.abc import Iterable

# filter_fields lives with the batch format's owner; it is re-exported here for its callers
from tidemq.protocol.batch.codec import filter_fields, read_total_size_magic
from tidemq.protocol.batch.fields import queue_offset_at

__all__ = ["bitmap", "is_member", "members", "member_offsets", "filter_fields"]



def bitmap(indices: Iterable[int]) -> bytes:
    """The bitmap with exactly ``indices`` set (message indices within one batch)."""
    out = bytearray()
    for i in indices:
        byte = i >> 3
        if byte >= len(out):
            out.extend(bytes(byte + 1 - len(out)))
        out[byte] |= 1 << (i & 7)
    return bytes(out)


def is_member(bits: bytes, i: int) -> bool:
    byte = i >> 3
    return byte < len(bits) and bool(bits[byte] >> (i & 7) & 1)


def members(bits: bytes) -> list[int]:
    """The indices set in ``bits``, in increasing order."""
    return [b * 8 + k for b, v in enumerate(bits) if v for k in range(8) if v >> k & 1]


def member_offsets(body: bytes | bytearray | memoryview, bitmaps: list[bytes]) -> set[int]:
    """Queue offsets of the members of a pull answer's ``body`` (its batches in order, bitmap
    ``j`` for batch ``j``). A body with more batches than bitmaps, or framing that breaks,
    stops there: what follows is nobody's (the caller's decoder reports the damage)."""
    out: set[int] = set()
    mv = body if isinstance(body, memoryview) else memoryview(body)
    pos, end = 0, len(mv)
    for bits in bitmaps:
        if pos + 28 > end:
            break
        total, _magic = read_total_size_magic(mv, pos)
        if total < 28 or pos + total > end:
            break
        base = queue_offset_at(mv, pos)
        out.update(base + i for i in members(bits))
        pos += total
    return out
