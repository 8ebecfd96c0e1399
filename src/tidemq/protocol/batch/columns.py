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
    FIRST_DTYPE,
    INDEX_ENTRY_SIZE,
    PRODUCER_DTYPE,
    PRODUCER_HEADER_SIZE,
    RECORD_HEADER_SIZE,
    STORE_DTYPE,
    STORE_HEADER_SIZE,
)

__all__ = ["BatchColumns", "read_columns", "gather"]

@dataclass(slots=True)
class BatchColumns:
    """Every batch's headers, one row per batch (structured arrays, copies: the body may
    change afterwards). ``first``: the index entry and record header that follow the producer
    header directly, as in a one-message batch without keys (meaningless for other batches)."""

    starts: np.ndarray  # int64: where each batch begins in the body
    sizes: np.ndarray  # int64: each batch's length (its total_size, checked by the framing)
    store: np.ndarray  # layout.STORE_DTYPE
    producer: np.ndarray  # layout.PRODUCER_DTYPE
    first: np.ndarray  # layout.FIRST_DTYPE
    #: False where a batch is too short for its headers, its topic and a first message: its
    #: ``producer`` and ``first`` rows were read from elsewhere and mean nothing
    in_bounds: np.ndarray


_MIN_SINGLE = STORE_HEADER_SIZE + PRODUCER_HEADER_SIZE + INDEX_ENTRY_SIZE + RECORD_HEADER_SIZE


def gather(arr: np.ndarray, at: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``dtype`` items read at byte positions ``at`` of ``arr`` (each within it): one fancy
    index over an overlapping view with an item starting at every byte."""
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
    store = gather(arr, at, STORE_DTYPE)
    p = STORE_HEADER_SIZE + store["topic_len"].astype(np.int64)
    ok = big & (p + (PRODUCER_HEADER_SIZE + INDEX_ENTRY_SIZE + RECORD_HEADER_SIZE) <= sz)
    at_p = np.where(ok, st + p, 0)
    producer = gather(arr, at_p, PRODUCER_DTYPE)
    first = gather(arr, at_p + PRODUCER_HEADER_SIZE, FIRST_DTYPE)
    return BatchColumns(st, sz, store, producer, first, ok)
