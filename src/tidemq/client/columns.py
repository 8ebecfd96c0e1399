"""Rows given as columns, encoded into one batch without a ``Message`` per row.

:class:`Columns` holds the bodies of a batch the way Arrow stores a ``binary`` column: one
contiguous data buffer and ``n + 1`` offsets (row i is ``data[offsets[i]:offsets[i + 1]]``),
plus optional per-row ``tags``, ``keys`` and ``properties`` lists. ``encode`` writes the batch
(docs/format.md) straight from those buffers: record headers and the index are numpy columns,
and bodies of one size are copied as one 2-D block. Rows with tags, keys or properties take the
general path (``codec.encode_messages`` over ``Message`` objects), which is correct but slower.

``producer_id`` (optional) stamps the batch with another producer's id than the sending
Producer's: with ``dedup_producer_id(name)`` it makes the batch deduplicated by that name's
sequences (SPEC BR12), which is how the Spark sink gives every (query, task, queue) its own
deterministic producer without one Producer instance each. Send with
``Producer.send_columns`` (always to an explicit queue, with an explicit ``sequence_id``).

Pure functions and plain values: any thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tidemq.client.codec import _IDX_DTYPE, _REC_DTYPE, _seal, encode_messages
from tidemq.client.message import Message
from tidemq.protocol.headers import dedup_producer_id
from tidemq.protocol.record import (
    INDEX_ENTRY_SIZE,
    PRODUCER_HEADER_SIZE,
    RECORD_HEADER_SIZE,
    STORE_HEADER_SIZE,
)

__all__ = ["Columns", "dedup_producer_id"]


@dataclass
class Columns:
    topic: str
    data: bytes | memoryview | np.ndarray
    offsets: np.ndarray  # int64, n + 1 entries, offsets[0] may be > 0
    tags: Sequence[str | None] | None = None
    keys: Sequence[Sequence[str] | str | None] | None = None
    properties: Sequence[dict[str, str] | None] | None = None
    producer_id: int | None = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def nbytes(self) -> int:
        return int(self.offsets[-1] - self.offsets[0])

    def body(self, i: int) -> bytes:
        return bytes(memoryview(self.data)[int(self.offsets[i]) : int(self.offsets[i + 1])])

    def __getitem__(self, i: int) -> Message:
        """Row ``i`` as a Message (the slow path; selectors and the general encoder use it)."""
        return Message(self.topic, self.body(i),
                       tags=self.tags[i] if self.tags is not None else None,
                       keys=self.keys[i] if self.keys is not None else None,  # type: ignore[arg-type]
                       properties=dict(self.properties[i]) if self.properties is not None
                       and self.properties[i] else None)

    def encode(self, queue_id: int, producer_id: int, base_seq: int, born_ts: int,
               born_host: bytes, born_port: int) -> bytearray:
        """The batch of these rows; row i gets sequence ``base_seq + i``."""
        n = len(self)
        if n <= 0:
            raise ValueError("a batch holds at least one message")
        if self.tags is not None or self.keys is not None or self.properties is not None:
            return encode_messages(self.topic, [self[i] for i in range(n)], queue_id=queue_id,
                                   producer_id=producer_id, base_seq=base_seq, born_ts=born_ts,
                                   born_host=born_host, born_port=born_port)
        topic_b = self.topic.encode()
        if not topic_b or len(topic_b) > 0xFFFF:
            raise ValueError("topic must be 1..65535 bytes of UTF-8")
        offsets = np.asarray(self.offsets, dtype=np.int64)
        lens = np.diff(offsets)
        p = STORE_HEADER_SIZE + len(topic_b)
        q = p + PRODUCER_HEADER_SIZE
        r = q + n * INDEX_ENTRY_SIZE
        rec_sizes = lens + RECORD_HEADER_SIZE
        rec_size = int(rec_sizes.sum())
        buf = bytearray(r + rec_size)
        arr = np.frombuffer(buf, dtype=np.uint8)
        arr[q:r].view(_IDX_DTYPE)["rel"] = np.cumsum(rec_sizes) - rec_sizes
        hdr = np.zeros(n, dtype=_REC_DTYPE)
        hdr["size"] = lens + (RECORD_HEADER_SIZE - 4)
        hdr["born_ts"] = born_ts
        hdr["bl"] = lens
        data = np.frombuffer(self.data, dtype=np.uint8) if not isinstance(
            self.data, np.ndarray) else self.data.view(np.uint8)
        rec = arr[r:]
        first = int(lens[0])
        if bool((lens == first).all()):
            rec2d = rec.reshape(n, RECORD_HEADER_SIZE + first)
            rec2d[:, :RECORD_HEADER_SIZE] = hdr.view(np.uint8).reshape(n, RECORD_HEADER_SIZE)
            if first:
                rec2d[:, RECORD_HEADER_SIZE:] = data[offsets[0] : offsets[-1]].reshape(n, first)
        else:
            hv = hdr.view(np.uint8).reshape(n, RECORD_HEADER_SIZE)
            starts = np.cumsum(rec_sizes) - rec_sizes
            for i, (s, a, b) in enumerate(zip(starts.tolist(), offsets[:-1].tolist(),
                                              offsets[1:].tolist(), strict=True)):
                rec[s : s + RECORD_HEADER_SIZE] = hv[i]
                rec[s + RECORD_HEADER_SIZE : s + RECORD_HEADER_SIZE + b - a] = data[a:b]
        return _seal(buf, p, topic_b, queue_id, producer_id, base_seq, born_host, born_port,
                     n, 0, rec_size, 0, 0)
