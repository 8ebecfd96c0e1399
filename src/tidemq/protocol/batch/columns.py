"""The headers of many batches at once, as numpy columns (a SEND_MULTI_QUEUE body, issue 17).

Spread traffic over thousands of queues makes one-message batches: a frame of 1,000 batches
parsed one ``BatchView`` at a time costs the broker a Python object, two ``struct`` unpacks and
a handful of attribute reads per batch. :func:`read_columns` gathers every batch's store
header, producer header, first message-index entry and first record header with one numpy
fancy-index each (an overlapping view of the body with one item starting at every byte, the
trick ``batch_rules._check_records`` uses for record headers), so the checks and the store's
stamping can work on whole columns.

Nothing here decides what is valid: a column read from where a batch's own sizes say a section
is, clipped to the body when those sizes are nonsense (``in_bounds`` is False for such a
batch). ``protocol/batch_rules.py`` owns the rules (:func:`~tidemq.protocol.batch_rules.
plain_batches`); the layout's offsets are ``layout.py``'s.

Sans-IO: bytes in, arrays out; any thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tidemq.protocol.batch.layout import (
    INDEX_ENTRY_SIZE,
    PRODUCER_HEADER_SIZE,
    RECORD_HEADER_SIZE,
    STORE_HEADER_SIZE,
)

__all__ = ["BatchColumns", "read_columns", "STORE_DTYPE", "PRODUCER_DTYPE", "RECORD_DTYPE"]

#: STORE_HEADER (layout.py) as a numpy record, field for field
STORE_DTYPE = np.dtype([
    ("total", "<u4"), ("magic", "<u2"), ("version", "u1"), ("reserved", "u1"),
    ("store_crc", "<u4"), ("phys", "<u8"), ("qoff", "<u8"), ("store_ts", "<i8"),
    ("prepared", "<i8"), ("queue_id", "<u4"), ("reconsume", "<u4"), ("topic_len", "<u2"),
    ("store_port", "<u2"), ("store_host", "V16"),
])
#: PRODUCER_HEADER (layout.py) as a numpy record
PRODUCER_DTYPE = np.dtype([
    ("batch_crc", "<u4"), ("attributes", "<u2"), ("born_port", "<u2"), ("count", "<u4"),
    ("keys_size", "<u4"), ("records_size", "<u4"), ("raw_size", "<u4"),
    ("producer_id", "<u8"), ("base_seq", "<u8"), ("deliver_at", "<i8"), ("born_host", "V16"),
])
#: INDEX_ENTRY then RECORD_HEADER (layout.py): what a one-message batch holds after its
#: producer header when it has no keys
RECORD_DTYPE = np.dtype([
    ("tag_hash", "<u8"), ("rel", "<u4"),
    ("record_size", "<u4"), ("born_ts", "<i8"), ("flag", "<u4"), ("tags_len", "<u2"),
    ("rec_reserved", "<u2"), ("props_len", "<u4"), ("body_len", "<u4"),
])
assert STORE_DTYPE.itemsize == STORE_HEADER_SIZE
assert PRODUCER_DTYPE.itemsize == PRODUCER_HEADER_SIZE
assert RECORD_DTYPE.itemsize == INDEX_ENTRY_SIZE + RECORD_HEADER_SIZE


@dataclass(slots=True)
class BatchColumns:
    """Every batch's headers, one row per batch (structured arrays, copies: the body may
    change afterwards). ``first``: the index entry and record header that follow the producer
    header directly, as in a one-message batch without keys (meaningless for other batches)."""

    starts: np.ndarray  # int64: where each batch begins in the body
    sizes: np.ndarray  # int64: each batch's length (its total_size, checked by the framing)
    store: np.ndarray  # STORE_DTYPE
    producer: np.ndarray  # PRODUCER_DTYPE
    first: np.ndarray  # RECORD_DTYPE
    #: False where a batch is too short for its headers, its topic and a first message: its
    #: ``producer`` and ``first`` rows were read from elsewhere and mean nothing
    in_bounds: np.ndarray


_MIN_SINGLE = STORE_HEADER_SIZE + PRODUCER_HEADER_SIZE + INDEX_ENTRY_SIZE + RECORD_HEADER_SIZE


def _gather(arr: np.ndarray, at: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``dtype`` items read at byte positions ``at`` of ``arr`` (each within it)."""
    w = dtype.itemsize
    every = np.ndarray((len(arr) - w + 1,), dtype=f"V{w}", buffer=arr, strides=(1,))
    out: np.ndarray = every[at].view(dtype)
    return out


def read_columns(body: bytes | bytearray | memoryview, starts: list[int],
                 sizes: list[int]) -> BatchColumns:
    """The header columns of the batches at ``starts`` (``sizes`` bytes each, every one within
    ``body``: ``multi_queue.split_offsets`` checked the framing)."""
    arr = np.frombuffer(body, dtype=np.uint8)
    if len(arr) < _MIN_SINGLE:  # no batch fits: read zeros (every row out of bounds)
        arr = np.concatenate([arr, np.zeros(_MIN_SINGLE - len(arr), np.uint8)])
    st = np.array(starts, dtype=np.int64)
    sz = np.array(sizes, dtype=np.int64)
    # A batch shorter than a one-message batch's fixed parts is read from position 0 (any
    # place inside the body) and marked out of bounds.
    big = sz >= _MIN_SINGLE
    at = np.where(big, st, 0)
    store = _gather(arr, at, STORE_DTYPE)
    p = STORE_HEADER_SIZE + store["topic_len"].astype(np.int64)
    ok = big & (p + (PRODUCER_HEADER_SIZE + INDEX_ENTRY_SIZE + RECORD_HEADER_SIZE) <= sz)
    at_p = np.where(ok, st + p, 0)
    producer = _gather(arr, at_p, PRODUCER_DTYPE)
    first = _gather(arr, at_p + PRODUCER_HEADER_SIZE, RECORD_DTYPE)
    return BatchColumns(st, sz, store, producer, first, ok)
