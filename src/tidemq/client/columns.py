"""Rows given as columns, encoded into one batch without a ``Message`` per row.

:class:`Columns` holds the bodies of a batch the way Arrow stores a ``binary`` column: one
contiguous data buffer and ``n + 1`` offsets (row i is ``data[offsets[i]:offsets[i + 1]]``),
plus optional per-row ``tags``, ``keys`` and ``properties`` lists. ``encode`` writes the batch
(docs/format.md) straight from those buffers: record headers and the index are numpy columns,
and bodies of one size are copied as one 2-D block. Rows with tags, keys or properties take the
general path (``batch.fast.encode_messages`` over ``Message`` objects), which is correct but slower.

``producer_id`` (optional) stamps the batch with another producer's id than the sending
Producer's: with ``dedup_producer_id(name)`` it makes the batch deduplicated by that name's
sequences (ref BR12), which is how the Spark sink gives every (query, task, queue) its own
deterministic producer without one Producer instance each. Send with
``Producer.send_columns`` (always to an explicit queue, with an explicit ``sequence_id``).

Pure functions and plain values: any thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tidemq.client.message import Message
from tidemq.protocol.batch.fast import encode_messages, encode_plain_columns
from tidemq.protocol.headers import dedup_producer_id

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
        data: bytes | memoryview = self.data  # type: ignore[assignment]  # an ndarray is a buffer
        return bytes(memoryview(data)[int(self.offsets[i]) : int(self.offsets[i + 1])])

    def __getitem__(self, i: int) -> Message:
        """Row ``i`` as a Message (the slow path; selectors and the general encoder use it)."""
        return Message(self.topic, self.body(i),
                       tags=self.tags[i] if self.tags is not None else None,
                       keys=self.keys[i] if self.keys is not None else None,  # type: ignore[arg-type]
                       properties=self._properties(i))

    def _properties(self, i: int) -> dict[str, str] | None:
        props = self.properties[i] if self.properties is not None else None
        return dict(props) if props else None

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
        return encode_plain_columns(
            self.topic, self.data, self.offsets, queue_id=queue_id, producer_id=producer_id,
            base_seq=base_seq, born_ts=born_ts, born_host=born_host, born_port=born_port)
