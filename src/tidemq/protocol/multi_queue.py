"""The body of SEND_MULTI_QUEUE (issue 17): batches for many queues of one broker in one frame,
as Kafka's produce request holds many partitions.

Spread traffic (one producer, thousands of queues) otherwise becomes one small request per
queue, each costing the broker its per-request work; one frame per broker carries all of them.
The body is whole batches back to back, nothing between them::

    body = batch_0 | batch_1 | ... | batch_{n-1}        (n = header.batches)

Each batch is exactly what a SEND_BATCH body would be (``record.py``): its ``total_size``
(bytes 0-3) frames it, and its own header names its topic and queue id. The response carries
one ``MultiQueueSendResult`` per batch, in the same order (``headers.py``). The framing here is
checked before any batch is looked at: a body that does not split into exactly ``n`` batches
of sane sizes is refused whole (MESSAGE_ILLEGAL); a batch that splits but fails the broker's
checks is refused alone, in its result.

Sans-IO: bytes in, views out.
"""

from __future__ import annotations

import struct

from tidemq.protocol.errors import CorruptBatchError

__all__ = ["split_batches", "split_offsets", "join_batches", "MIN_BATCH_BYTES"]

_TOTAL = struct.Struct("<I")
#: No batch is shorter than its fixed headers; a smaller total_size is a framing error.
MIN_BATCH_BYTES = 16


def split_offsets(body: bytes | bytearray | memoryview, expected: int,
                  max_batch: int) -> tuple[list[int], list[int]]:
    """Where the ``expected`` batches of a SEND_MULTI_QUEUE body start and how long each is,
    or CorruptBatchError saying where the framing breaks (a batch size below MIN_BATCH_BYTES
    or above ``max_batch``, a batch running past the body, bytes left over, a different
    count)."""
    mv = memoryview(body).cast("B")
    n = len(mv)
    starts: list[int] = []
    sizes: list[int] = []
    unpack = _TOTAL.unpack_from
    pos = 0
    while pos < n:
        if pos + 4 > n:
            raise CorruptBatchError(f"{n - pos} stray bytes after batch {len(starts)}")
        size = unpack(mv, pos)[0]
        if size < MIN_BATCH_BYTES or size > max_batch:
            raise CorruptBatchError(
                f"batch {len(starts)} at byte {pos} says it is {size} bytes (limit {max_batch})")
        if pos + size > n:
            raise CorruptBatchError(
                f"batch {len(starts)} at byte {pos} ({size} bytes) runs past the body end {n}")
        starts.append(pos)
        sizes.append(size)
        pos += size
        if len(starts) > expected:
            break
    if len(starts) != expected:
        raise CorruptBatchError(
            f"the header says {expected} batches but the body holds "
            f"{'more' if len(starts) > expected else len(starts)}")
    return starts, sizes


def split_batches(body: bytes | bytearray | memoryview, expected: int,
                  max_batch: int) -> list[memoryview]:
    """The ``expected`` batches of a SEND_MULTI_QUEUE body as views (``split_offsets``)."""
    mv = memoryview(body).cast("B")
    starts, sizes = split_offsets(mv, expected, max_batch)
    return [mv[s : s + z] for s, z in zip(starts, sizes, strict=True)]


def join_batches(batches: list[bytes | bytearray]) -> tuple[list[bytes | bytearray], int]:
    """The body parts (written as they are, no copy) and their total length."""
    return batches, sum(len(b) for b in batches)
