"""The source's row schema and the column chunk -> Arrow RecordBatch conversion.

Read schema (``READ_SCHEMA``, one row per message)::

    topic            string               the message's topic
    queue_id         int                  queue within the topic (on its broker)
    queue_offset     long                 position in the queue
    msg_id           string               32 hex digits, tidemq's unique message id
    keys             array<string>        message keys ([] when none)
    tags             string               the tag, null when none
    body             binary               the payload
    properties       map<string,string>   user properties ({} when none)
    born_timestamp   timestamp            when the producer built the message
    store_timestamp  timestamp            when the broker stored it
    reconsume_times  int                  redeliveries (retry topics), else 0

Every column of a chunk is built with vectorised Arrow/numpy calls; no Python code runs per
message except for tags, keys and properties when a message has them. Bodies become an Arrow
``binary_view`` array whose views point into the pull responses (built with numpy), then one
C++ cast copies them into the ``binary`` array Spark expects.

Pure functions: any thread.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from tidemq.client.range_reader import ColumnChunk

__all__ = ["READ_SCHEMA", "ARROW_SCHEMA", "to_record_batch", "WRITE_COLUMNS"]

READ_SCHEMA = (
    "topic string, queue_id int, queue_offset long, msg_id string, keys array<string>, "
    "tags string, body binary, properties map<string,string>, born_timestamp timestamp, "
    "store_timestamp timestamp, reconsume_times int"
)

#: Columns the sink understands (only ``body`` is required).
WRITE_COLUMNS = ("body", "topic", "keys", "tags", "properties", "queue_id", "hash_key")

_TS = pa.timestamp("us", tz="UTC")
ARROW_SCHEMA = pa.schema([
    ("topic", pa.string()), ("queue_id", pa.int32()), ("queue_offset", pa.int64()),
    ("msg_id", pa.string()), ("keys", pa.list_(pa.string())), ("tags", pa.string()),
    ("body", pa.binary()), ("properties", pa.map_(pa.string(), pa.string())),
    ("born_timestamp", _TS), ("store_timestamp", _TS), ("reconsume_times", pa.int32()),
])

_VIEW = np.dtype([("len", "<i4"), ("prefix", "V4"), ("buf", "<i4"), ("off", "<i4")])
_INLINE = 12  # Arrow keeps values up to 12 bytes inside the view itself
_AR12 = np.arange(_INLINE, dtype=np.int64)


def _bodies(chunk: ColumnChunk) -> pa.Array:
    n = len(chunk)
    starts, lens = chunk.body_starts, chunk.body_lens
    views = np.zeros(n, dtype=_VIEW)
    raw = views.view(np.uint8).reshape(n, 16)
    views["len"] = lens
    views["buf"] = chunk.body_buffer
    views["off"] = starts
    for b, buf in enumerate(chunk.body_buffers):
        sel = np.flatnonzero(chunk.body_buffer == b) if len(chunk.body_buffers) > 1 else None
        s = starts if sel is None else starts[sel]
        npbuf = np.frombuffer(buf, dtype=np.uint8)
        head = (npbuf[np.minimum(s[:, None] + _AR12, len(npbuf) - 1)] if len(npbuf)
                else np.zeros((len(s), 12), dtype=np.uint8))
        ln = lens if sel is None else lens[sel]
        short = ln <= _INLINE
        if bool(short.any()):
            inline = np.where(_AR12[None, :] < ln[:, None], head, 0).astype(np.uint8)
            rows = np.flatnonzero(short) if sel is None else sel[short]
            raw[rows, 4:16] = inline[short]
        long_rows = np.flatnonzero(~short) if sel is None else sel[~short]
        raw[long_rows, 4:8] = head[~short, :4]
    arr = pa.Array.from_buffers(pa.binary_view(), n,
                                [None, pa.py_buffer(views),
                                 *(pa.py_buffer(b) for b in chunk.body_buffers)])
    return arr.cast(pa.binary())


def _constant_string(value: str, n: int) -> pa.Array:
    data = value.encode()
    offsets = np.arange(n + 1, dtype=np.int32) * len(data)
    return pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offsets),
                                                  pa.py_buffer(data * n)])


def _fixed_strings(chars: np.ndarray) -> pa.Array:
    n, width = chars.shape
    offsets = np.arange(n + 1, dtype=np.int32) * width
    return pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offsets),
                                                  pa.py_buffer(np.ascontiguousarray(chars))])


_EMPTY_STR = pa.array([], pa.string())


def _empty_lists(n: int) -> pa.Array:
    return pa.ListArray.from_arrays(pa.array(np.zeros(n + 1, dtype=np.int32)), _EMPTY_STR)


def _empty_maps(n: int) -> pa.Array:
    return pa.MapArray.from_arrays(pa.array(np.zeros(n + 1, dtype=np.int32)), _EMPTY_STR,
                                   _EMPTY_STR)


def to_record_batch(chunk: ColumnChunk) -> pa.RecordBatch:
    """One Arrow RecordBatch in ``ARROW_SCHEMA`` holding the chunk's messages."""
    n = len(chunk)
    cols = [
        _constant_string(chunk.topic, n),
        pa.array(np.full(n, chunk.queue_id, dtype=np.int32)),
        pa.array(chunk.queue_offsets),
        _fixed_strings(chunk.msg_ids),
        _empty_lists(n) if chunk.keys is None else pa.array(chunk.keys, pa.list_(pa.string())),
        pa.nulls(n, pa.string()) if chunk.tags is None else pa.array(chunk.tags, pa.string()),
        _bodies(chunk),
        _empty_maps(n) if chunk.properties is None else pa.array(
            [list(d.items()) for d in chunk.properties], pa.map_(pa.string(), pa.string())),
        pa.array(chunk.born_ts * 1000, _TS),
        pa.array(chunk.store_ts * 1000, _TS),
        pa.array(chunk.reconsume_times.astype(np.int32)),
    ]
    return pa.RecordBatch.from_arrays(cols, schema=ARROW_SCHEMA)
