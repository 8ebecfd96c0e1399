"""The ``tidemq`` sink: batch and streaming writes, exactly once (ref SP3).

Columns: ``body`` (binary or string, required); optional ``topic`` (else the ``topic``
option), ``keys`` (string or array<string>), ``tags``, ``properties`` (map<string,string>),
``queue_id`` (pin a queue: an index into the topic's sorted writable queues) or ``hash_key``
(CRC32C of the key modulo the writable queue count, as the producer's ``hash_key=``).

How exactly-once works: producer deduplication (ref BR12, docs/producer-path.md). The rows
of one task are split by target (topic, queue) into *substreams*; each substream is written
under its own deterministic producer id and deterministic sequence ids:

- id ``dedup_producer_id("spark-<queryId>-<partitionId>-<topic>-<queue>")`` in a streaming
  query (the query id survives restarts from the same checkpoint), ``spark-<jobUuid>-...`` in a
  batch write (the uuid is chosen on the driver, so a retried task of the job has it too);
- row ``i`` of the substream (in the partition's order, or sorted with ``sortRows``, the
  default) gets sequence ``batchId * 2**32 + i`` (``i`` for a batch write);
- the substream is cut into sent batches of at most ``batchRows`` rows and ``batchBytes``
  bytes, a cut that depends only on the substream's rows; one batch per substream is in
  flight at a time (the broker's "sequences of an id only grow" rule needs them in order),
  different queues are written concurrently.

A retried task, or a micro-batch replayed after a restart (Spark re-plans it with the same
offsets), re-sends the same rows as the same batches with the same ids and sequences; the
broker answers DUPLICATE for what it already stored and stores the rest. This needs what every
exactly-once Spark sink needs: a (batch, partition) must produce the same rows on a replay
(true for a deterministic query over a replayable source such as tidemq); ``sortRows`` removes
the need for the same *order*.

Why not transactions: half messages committed in the driver's ``commit(messages, batchId)``
need that commit itself to be idempotent and recoverable after a driver crash between the
commit and Spark's checkpoint, and cost a second round trip per batch; dedup gives the same
guarantee with one round trip and no coordinator (docs/spark.md).

Threading: ``write`` runs in a Spark task (executor Python worker); ``commit``/``abort`` on
the driver.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

import tidemq
from tidemq.client.columns import Columns, dedup_producer_id
from tidemq.spark.options import OptionError, WriteOptions

__all__ = ["TideMQBatchWriter", "TideMQStreamWriter", "WriteStats", "write_partition"]

log = logging.getLogger(__name__)

_BATCH_SHIFT = 32  # sequence = batch_id << 32 | row index within the (batch, partition)
_QUERY_ID = "sql.streaming.queryId"
_BATCH_ID = "streaming.sql.batchId"


@dataclass
class WriteStats(WriterCommitMessage):
    """What one task wrote: rows sent, of which the broker already had ``duplicates``."""

    partition: int
    rows: int
    duplicates: int
    batches: int


def _check_schema(schema: StructType, opts: WriteOptions) -> None:
    names = set(schema.fieldNames())
    if "body" not in names:
        raise OptionError("the tidemq sink needs a column named body (binary or string)")
    if "topic" not in names and not opts.topic:
        raise OptionError("set the option topic or give the rows a topic column")
    if "queue_id" in names and "hash_key" in names:
        raise OptionError("give the rows a queue_id or a hash_key column, not both")


class _QueueCounts:
    """Writable queue count per topic (for hash_key and the default spread), as the producer
    sees it: a topic that does not exist yet gets the default route a ``Producer.send`` would
    use, and the broker creates it on the first write (auto-create)."""

    def __init__(self, producer: Any) -> None:
        self.producer = producer
        self._n: dict[str, int] = {}

    def __call__(self, topic: str) -> int:
        n = self._n.get(topic)
        if n is None:
            n = len(self.producer.write_queues(topic))
            if n <= 0:
                raise OptionError(f"topic {topic} has no writable queue (create it first)")
            self._n[topic] = n
        return n


#: add() sends runs of one queue as slices when they average at least this many rows
_RUN_ROWS = 64

_SORT_TYPES = (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary,
               pa.types.is_large_binary, pa.types.is_integer)


def _sorted(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The partition's rows in a deterministic order (``sortRows``): a replay of a query whose
    rows come out of a shuffle or a state store in another order still maps each row to the
    same queue and sequence."""
    got = [b for b in batches if b.num_rows]
    if not got:  # an empty partition (Spark may send no batch at all)
        return iter(())
    table = pa.Table.from_batches(got)
    by: dict[str, Any] = {}
    for c in ("topic", "queue_id", "hash_key", "tags", "body", "keys", "properties"):
        if c not in table.column_names:
            continue
        col = table.column(c)
        if any(t(col.type) for t in _SORT_TYPES):
            by[c] = col
        elif c in ("keys", "properties"):
            # Lists and maps do not sort in Arrow; their text does. Without them, rows alike
            # but for their keys or properties kept their arrival order, and a replay in
            # another order gave such rows each other's sequences (one stored twice, one lost).
            by[c] = pa.array([None if v is None else repr(sorted(v) if c == "properties" else v)
                              for v in col.to_pylist()], pa.string())
    order = pc.sort_indices(pa.table(by), sort_keys=[(c, "ascending") for c in by])
    return iter(table.take(order).to_batches())


class _Substream:
    """The rows of one partition bound for one (topic, queue): its own deduplicated producer
    id, sequences from ``base_seq`` up, one send in flight at a time (sequences must reach the
    broker in order)."""

    def __init__(self, topic: str, queue: int, producer_id: int, base_seq: int) -> None:
        self.topic = topic
        self.queue = queue
        self.producer_id = producer_id
        self.seq = base_seq
        self.bodies: list[pa.Array] = []
        self.extras: dict[str, list[Any]] = {}
        self.rows = 0
        self.nbytes = 0
        self.inflight: Any = None
        self.inflight_rows = 0


class _PartitionWriter:
    def __init__(self, opts: WriteOptions, name_prefix: str, base_seq: int, partition: int
                 ) -> None:
        self.opts = opts
        self.name_prefix = name_prefix
        self.base_seq = base_seq
        self.partition = partition
        self.producer = tidemq.Producer(opts.namesrv, send_timeout=opts.request_timeout)
        self.counts = _QueueCounts(self.producer)
        self.subs: dict[tuple[str, int], _Substream] = {}
        self.row = 0
        self.dups = 0
        self.sent = 0
        self.dup_status = tidemq.SendStatus.DUPLICATE

    def close(self) -> None:
        self.producer.close()

    # -- routing -------------------------------------------------------------------------------
    def _topics(self, rb: pa.RecordBatch) -> list[str] | str:
        i = rb.schema.get_field_index("topic")
        if i < 0 or rb.column(i).null_count == rb.num_rows:
            if not self.opts.topic:
                raise OptionError(f"row {self.row} has no topic and the option topic is unset")
            return self.opts.topic
        col = rb.column(i)
        if col.null_count == 0 and pc.all(pc.equal(col, col[0])).as_py():
            first: str = col[0].as_py()
            return first
        out = []
        for k, t in enumerate(col.to_pylist()):
            t = t or self.opts.topic
            if not t:
                raise OptionError(f"row {self.row + k} has no topic and the option topic is "
                                  "unset")
            out.append(t)
        return out

    def _queues(self, rb: pa.RecordBatch, topics: list[str] | str) -> np.ndarray:
        n = rb.num_rows
        if isinstance(topics, str):
            counts = np.full(n, self.counts(topics), dtype=np.int64)
        else:
            counts = np.array([self.counts(t) for t in topics], dtype=np.int64)
        # Default spread: windows of batchRows consecutive rows, one queue each, rotating.
        q = (self.partition + (self.row + np.arange(n, dtype=np.int64))
             // self.opts.batch_rows) % counts
        i = rb.schema.get_field_index("queue_id")
        if i >= 0:
            col = rb.column(i)
            vals = col.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
            q = np.where(vals >= 0, vals % counts, q)
        i = rb.schema.get_field_index("hash_key")
        if i >= 0:
            for k, key in enumerate(rb.column(i).to_pylist()):
                if key is not None:
                    kb = key.encode() if isinstance(key, str) else bytes(key)
                    q[k] = crc32c.crc32c(kb) % counts[k]
        return q

    # -- rows ----------------------------------------------------------------------------------
    def add(self, rb: pa.RecordBatch) -> None:
        n = rb.num_rows
        if not n:
            return
        body = rb.column(rb.schema.get_field_index("body"))
        if body.null_count:
            raise OptionError(f"a row of the partition (from row {self.row}) has a null body")
        if not pa.types.is_binary(body.type):
            body = body.cast(pa.binary())
        topics = self._topics(rb)
        queues = self._queues(rb, topics)
        extras = {name: rb.column(rb.schema.get_field_index(name))
                  for name in ("tags", "keys", "properties")
                  if rb.schema.get_field_index(name) >= 0}
        parts: list[tuple[tuple[str, int], np.ndarray | slice]]
        if isinstance(topics, str):
            cuts = np.flatnonzero(queues[1:] != queues[:-1]) + 1
            if len(cuts) * _RUN_ROWS < n:
                # Runs of consecutive rows for one queue (the default spread's windows of
                # batchRows): zero-copy slices, in row order, so the windows' sends rotate
                # over the queues and each queue has one in flight while the next is cut.
                # Grouping by queue first sent every window of one queue before the next
                # queue's: one request in flight in all, and a copy of every row.
                bounds = [0, *cuts.tolist(), n]
                parts = [((topics, int(queues[a])), slice(a, b))
                         for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
            else:  # rows scattered over the queues (hash_key, queue_id)
                parts = [((topics, q), np.flatnonzero(queues == q))
                         for q in dict.fromkeys(queues.tolist())]
        else:
            keyed: dict[tuple[str, int], list[int]] = {}
            for k, (t, q) in enumerate(zip(topics, queues.tolist(), strict=True)):
                keyed.setdefault((t, q), []).append(k)
            parts = [(key, np.array(v, dtype=np.int64)) for key, v in keyed.items()]
        for (topic, q), sel in parts:
            sub = self._sub(topic, q)
            if isinstance(sel, slice):
                part = body.slice(sel.start, sel.stop - sel.start)
                ex = {k: v.slice(sel.start, sel.stop - sel.start) for k, v in extras.items()}
            else:
                idx = pa.array(sel)
                part = body.take(idx)
                ex = {k: v.take(idx) for k, v in extras.items()}
            sub.bodies.append(part)
            for name, v in ex.items():
                sub.extras.setdefault(name, []).append(v)
            sub.rows += len(part)
            sub.nbytes += int(pc.sum(pc.binary_length(part)).as_py() or 0)
            while sub.rows >= self.opts.batch_rows or sub.nbytes >= self.opts.batch_bytes:
                self._send(sub)
        self.row += n

    def _sub(self, topic: str, q: int) -> _Substream:
        sub = self.subs.get((topic, q))
        if sub is None:
            name = f"{self.name_prefix}-{topic}-{q}"
            sub = self.subs[(topic, q)] = _Substream(topic, q, dedup_producer_id(name),
                                                     self.base_seq)
        return sub

    def _send(self, sub: _Substream) -> None:
        """Send the next chunk of ``sub``: at most batchRows rows and batchBytes bytes (at
        least one row). The cut depends only on the substream's rows, never on how Spark
        happened to batch them, so a replay cuts (and numbers) the same."""
        body = pa.concat_arrays(sub.bodies) if len(sub.bodies) > 1 else sub.bodies[0]
        offsets = np.frombuffer(body.buffers()[1], dtype=np.int32)[
            body.offset : body.offset + len(body) + 1].astype(np.int64)
        limit = offsets[0] + self.opts.batch_bytes
        k = min(len(body), self.opts.batch_rows,
                max(1, int(np.searchsorted(offsets[1:], limit, side="right"))))
        extras = {name: (pa.concat_arrays(v) if len(v) > 1 else v[0])
                  for name, v in sub.extras.items()}
        cols = Columns(sub.topic, body.buffers()[2] or b"", offsets[: k + 1],
                       producer_id=sub.producer_id)
        if extras:
            tags = extras.get("tags")
            keys = extras.get("keys")
            props = extras.get("properties")
            cols.tags = tags.slice(0, k).to_pylist() if tags is not None else None
            cols.keys = keys.slice(0, k).to_pylist() if keys is not None else None
            cols.properties = ([dict(p) if p else None for p in props.slice(0, k).to_pylist()]
                               if props is not None else None)
        self._wait(sub)
        sub.inflight = self.producer.send_columns_async(cols, queue_id=sub.queue,
                                                        sequence_id=sub.seq)
        sub.inflight_rows = k
        sub.seq += k
        self.sent += 1
        rest = body.slice(k)
        sub.bodies = [rest] if len(rest) else []
        sub.extras = {name: [v.slice(k)] for name, v in extras.items()} if len(rest) else {}
        sub.rows = len(rest)
        sub.nbytes = int(offsets[-1] - offsets[k]) if len(rest) else 0

    def _wait(self, sub: _Substream) -> None:
        if sub.inflight is not None:
            r = sub.inflight.result()
            if r.status == self.dup_status:
                self.dups += sub.inflight_rows
            sub.inflight = None

    def finish(self) -> WriteStats:
        for sub in self.subs.values():
            while sub.rows:
                self._send(sub)
        for sub in self.subs.values():
            self._wait(sub)
        return WriteStats(self.partition, self.row, self.dups, self.sent)


def write_partition(batches: Iterator[pa.RecordBatch], opts: WriteOptions, name_prefix: str,
                    base_seq: int, partition: int) -> WriteStats:
    """Send every row of ``batches`` exactly once (see the module docstring)."""
    if opts.sort_rows:
        batches = _sorted(batches)
    w = _PartitionWriter(opts, name_prefix, base_seq, partition)
    pause_at = opts.test_pause_after_rows
    if pause_at:
        ctx = TaskContext.get()
        if ctx is not None and ctx.attemptNumber() > 0:
            pause_at = 0
    try:
        for rb in batches:
            w.add(rb)
            if pause_at and w.row >= pause_at:
                pause_at = 0
                _pause_for_test(w, opts.test_pause_dir or "", partition)
        return w.finish()
    finally:
        w.close()


def _pause_for_test(w: _PartitionWriter, gate_dir: str, partition: int) -> None:
    """The ``testPauseAfterRows`` fault-injection point (options.WriteOptions): wait until
    every row sent so far is stored, say so, and wait for the test to kill this process."""
    import os
    import time

    for sub in w.subs.values():
        w._wait(sub)
    open(os.path.join(gate_dir, f"paused-{partition}"), "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(gate_dir, "release")) and time.monotonic() < deadline:
        time.sleep(0.05)


class TideMQBatchWriter(DataSourceArrowWriter):
    """``df.write.format("tidemq")``: one producer name per (job, partition)."""

    def __init__(self, options: dict[str, str], schema: StructType) -> None:
        self.opts = WriteOptions.parse(options)
        _check_schema(schema, self.opts)
        self.job = uuid.uuid4().hex  # chosen on the driver, shipped to every task

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriteStats:
        ctx = TaskContext.get()
        pid = ctx.partitionId() if ctx is not None else 0
        return write_partition(iterator, self.opts, f"spark-{self.job}-{pid}", 0, pid)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        _log_commit(messages, None)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        log.warning("tidemq batch write aborted; rows already stored stay stored")


class TideMQStreamWriter(DataSourceStreamArrowWriter):
    """``writeStream.format("tidemq")``: one producer name per (query, partition), sequences
    from the micro-batch id (module docstring)."""

    def __init__(self, options: dict[str, str], schema: StructType) -> None:
        self.opts = WriteOptions.parse(options)
        _check_schema(schema, self.opts)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriteStats:
        ctx = TaskContext.get()
        if ctx is None:
            raise OptionError("the tidemq stream writer must run inside a Spark task")
        query = ctx.getLocalProperty(_QUERY_ID)
        batch = ctx.getLocalProperty(_BATCH_ID)
        if not query or batch is None:
            raise OptionError("Spark did not pass the streaming query id and batch id to the "
                              "task; exactly-once writes need them")
        pid = ctx.partitionId()
        return write_partition(iterator, self.opts, f"spark-{query}-{pid}",
                               int(batch) << _BATCH_SHIFT, pid)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        _log_commit(messages, batchId)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        log.warning("tidemq micro-batch %d aborted; its replay re-sends with the same sequence "
                    "ids, so nothing is stored twice", batchId)


def _log_commit(messages: list[WriterCommitMessage | None], batch_id: int | None) -> None:
    stats = [m for m in messages if isinstance(m, WriteStats)]
    rows = sum(s.rows for s in stats)
    dups = sum(s.duplicates for s in stats)
    log.info("tidemq sink committed batch %s: %d rows (%d already stored)", batch_id, rows, dups)
