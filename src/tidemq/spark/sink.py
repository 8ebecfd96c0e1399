"""The ``tidemq`` sink: batch and streaming writes, exactly once (SPEC SP3).

Columns: ``body`` (binary or string, required); optional ``topic`` (else the ``topic``
option), ``keys`` (string or array<string>), ``tags``, ``properties`` (map<string,string>),
``queue_id`` (pin a queue: an index into the topic's sorted writable queues) or ``hash_key``
(CRC32C of the key modulo the writable queue count, as the producer's ``hash_key=``).

How exactly-once works: producer deduplication (docs/producer-path.md). Each task writes with
a *deterministic producer name* and *deterministic sequence ids*:

- name ``spark-<queryId>-<partitionId>`` in a streaming query (the query id survives restarts
  from the same checkpoint), ``spark-<jobUuid>-<partitionId>`` in a batch write;
- rows are cut into windows of ``batchRows`` rows by their index in the partition; window
  ``w`` of micro-batch ``b`` uses sequences ``b * 2**32 + w * batchRows + i``, split into one
  sent batch per target queue, all sent one after the other and each acknowledged before the
  next (so the broker's "sequences of a name grow" rule holds even after a failed send).

A retried task, or a micro-batch replayed after a restart (Spark re-plans it with the same
offsets), re-sends the same rows with the same name and sequences; the broker acknowledges what
it already stored with DUPLICATE and stores the rest. This needs what every exactly-once Spark
sink needs: the rows of a (batch, partition) must be the same on a replay (true for a
deterministic query over a replayable source such as this one).

Why not transactions: half messages committed in the driver's ``commit(messages, batchId)``
need the commit itself to be idempotent and recoverable after a driver crash between commit
and checkpoint; dedup gives the same guarantee with one round trip per batch and no second
phase.

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
import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

import tidemq
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
    """Writable queue count per topic (for hash_key and the default spread)."""

    def __init__(self, namesrv: str, timeout: float) -> None:
        self.namesrv = namesrv
        self.timeout = timeout
        self._n: dict[str, int] = {}
        self._admin: Any = None

    def __call__(self, topic: str) -> int:
        n = self._n.get(topic)
        if n is None:
            if self._admin is None:
                self._admin = tidemq.Admin(self.namesrv, timeout=self.timeout)
            route = self._admin.topic_route(topic)
            n = sum(qd.write_queue_nums for qd in route.queue_datas if qd.perm & 2)
            if n <= 0:
                raise OptionError(f"topic {topic} has no writable queue (create it first)")
            self._n[topic] = n
        return n

    def close(self) -> None:
        if self._admin is not None:
            self._admin.close()


def _column(rb: pa.RecordBatch, name: str) -> list[Any] | None:
    i = rb.schema.get_field_index(name)
    return None if i < 0 else rb.column(i).to_pylist()


def write_partition(batches: Iterator[pa.RecordBatch], opts: WriteOptions, producer_name: str,
                    base_seq: int, partition: int) -> WriteStats:
    """Send every row of ``batches`` exactly once (see the module docstring)."""
    counts = _QueueCounts(opts.namesrv, opts.request_timeout)
    rows = dups = sent = 0
    window = opts.batch_rows
    Message = tidemq.Message
    dup_status = getattr(tidemq.SendStatus, "DUPLICATE", None)
    producer = tidemq.Producer(opts.namesrv, producer_name=producer_name)
    try:
        pending: list[tuple[str, int, Any]] = []  # (topic, queue index, Message) of a window
        row = 0

        def flush() -> None:
            nonlocal dups, sent
            if not pending:
                return
            first = row - len(pending)
            groups: dict[tuple[str, int], list[Any]] = {}
            for topic, q, msg in pending:
                groups.setdefault((topic, q), []).append(msg)
            seq = base_seq + first
            for (_topic, q), msgs in groups.items():  # insertion order: deterministic
                r = producer.send_batch(msgs, queue_id=q, sequence_id=seq)
                seq += len(msgs)
                sent += 1
                if r.status == dup_status:
                    dups += len(msgs)
            pending.clear()

        for rb in batches:
            n = rb.num_rows
            if not n:
                continue
            bodies = _column(rb, "body")
            assert bodies is not None
            topics = _column(rb, "topic")
            keys = _column(rb, "keys")
            tags = _column(rb, "tags")
            props = _column(rb, "properties")
            qids = _column(rb, "queue_id")
            hkeys = _column(rb, "hash_key")
            for i in range(n):
                topic = (topics[i] if topics is not None else None) or opts.topic
                if topic is None:
                    raise OptionError(f"row {row} has no topic and the option topic is unset")
                body = bodies[i]
                if body is None:
                    raise OptionError(f"row {row} has a null body")
                if qids is not None and qids[i] is not None:
                    q = int(qids[i]) % counts(topic)
                elif hkeys is not None and hkeys[i] is not None:
                    k = hkeys[i]
                    q = crc32c.crc32c(k.encode() if isinstance(k, str) else bytes(k)) % counts(
                        topic)
                else:
                    q = (partition + row // window) % counts(topic)
                p = props[i] if props is not None else None
                msg = Message(topic, body, tags=tags[i] if tags is not None else None,
                              keys=keys[i] if keys is not None else None,
                              properties=dict(p) if p else None)
                pending.append((topic, q, msg))
                row += 1
                if len(pending) >= window:
                    flush()
            rows += n
        flush()
    finally:
        producer.close()
        counts.close()
    return WriteStats(partition, rows, dups, sent)


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
