"""The ``tidemq`` Spark data source: batch and streaming reads, batch and streaming writes.

::

    spark.dataSource.register(TideMQDataSource)
    df = (spark.readStream.format("tidemq").option("namesrv", "127.0.0.1:9876")
          .option("topics", "orders").option("startingOffsets", "earliest").load())

Reading (ref SP1, SP2, SP4): the driver plans ``[start, end)`` offset ranges per queue
(planner.py); each task reads exactly its range with a :class:`RangeReader` built from its
:class:`QueueRange` and yields Arrow RecordBatches (schema.py). In streaming, the checkpoint
holds per-queue offsets; new queues and, with ``topicPattern``, new topics are picked up at
every trigger. With ``group`` set, the offsets of every finished batch are stored as that
consumer group's, at the next trigger (``latestOffset(start)``: ``start`` is where the finished
batches end) or at ``commit(end)`` (which Spark calls at the start of the next batch), whichever
comes first; ``tidemq group lag`` then shows how far behind the query is.

Writing (ref SP3): sink.py.

Threading: Spark calls the readers from one thread of the driver's Python process; ``read``
runs in executor Python workers on an unpickled copy of a partition.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from tidemq.client.chunk_columns import ColumnAssembler
from tidemq.client.range_reader import RangeReader
from tidemq.spark.options import ReadOptions
from tidemq.spark.planner import Offsets, Planner, QueueRange
from tidemq.spark.schema import READ_SCHEMA, to_record_batch

__all__ = ["TideMQDataSource", "read_range"]

log = logging.getLogger(__name__)


def read_range(partition: InputPartition) -> Iterator[pa.RecordBatch]:
    """The messages of one planned range as Arrow RecordBatches (runs in a Spark task).

    Chunked messages (PR5) come out whole, once, from the range holding their first chunk: a
    range ending inside one reads on until it is complete, the next range skips its other
    chunks (``client/chunk_columns.py``)."""
    assert isinstance(partition, QueueRange)
    asm = ColumnAssembler()
    with partition.read() as reader:
        for chunk in reader.read(partition.queue, partition.start, partition.end,
                                 tags=partition.tags,
                                 fail_on_data_loss=partition.fail_on_data_loss):
            chunk = asm.feed(chunk)
            if len(chunk):
                yield to_record_batch(chunk)
        if asm.pending:
            yield from _read_on(reader, asm, partition)
    if asm.expired:
        log.warning("%s: %d incomplete chunked messages expired", partition.queue, asm.expired)


def _read_on(reader: RangeReader, asm: ColumnAssembler, p: QueueRange
             ) -> Iterator[pa.RecordBatch]:
    """Past the range's end, the rest of the chunked messages it started: as it is stored,
    until each is complete or expired (its first chunk stored over 60 s ago, the rest not)."""
    offset = p.end
    while asm.pending:
        mx = reader.max_offset(p.queue)
        if mx > offset:
            hi = min(mx, offset + _READ_ON_STEP)
            for chunk in reader.read(p.queue, offset, hi, tags=p.tags, fail_on_data_loss=False):
                chunk = asm.feed(chunk, tail=True)
                if len(chunk):
                    yield to_record_batch(chunk)
                if not asm.pending:
                    return
            offset = hi
        elif not asm.expire(int(time.time() * 1000)):
            time.sleep(0.1)  # the producer is still sending the rest


_READ_ON_STEP = 64  # offsets read at a time past a range's end (chunks are up to 4 MiB each)


class TideMQDataSource(DataSource):
    """``format("tidemq")``: see the module docstring and docs/spark.md for the options."""

    @classmethod
    def name(cls) -> str:
        return "tidemq"

    def schema(self) -> str:
        return READ_SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return TideMQBatchReader(ReadOptions.parse(self.options, streaming=False))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return TideMQStreamReader(ReadOptions.parse(self.options, streaming=True))

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        from tidemq.spark.sink import TideMQBatchWriter

        return TideMQBatchWriter(dict(self.options), schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        from tidemq.spark.sink import TideMQStreamWriter

        return TideMQStreamWriter(dict(self.options), schema)


class TideMQBatchReader(DataSourceReader):
    """A batch read of ``[startingOffsets, endingOffsets)`` (or the timestamp range)."""

    def __init__(self, opts: ReadOptions) -> None:
        self.opts = opts

    def partitions(self) -> Sequence[InputPartition]:
        planner = Planner(self.opts)
        try:
            queues = planner.queues()
            o = self.opts
            start = planner.resolve(o.starting, o.starting_timestamp, queues, default=-2)
            end = planner.resolve(o.ending, o.ending_timestamp, queues, default=-1)
            return planner.ranges(start, end, queues)
        finally:
            planner.close()

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_range(partition)


class TideMQStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batch reads; offsets ``{"topic": {"broker:queue": next offset}}``."""

    def __init__(self, opts: ReadOptions) -> None:
        self.opts = opts
        self.planner = Planner(opts)
        self._initial: Offsets | None = None
        self._latest: Offsets | None = None
        self._available_now: Offsets | None = None
        self._group_committed: dict[str, Any] | None = None

    # -- offsets -----------------------------------------------------------------------------
    def initialOffset(self) -> dict[str, Any]:
        # Spark calls this twice on a fresh start: answer the same both times ("latest" must
        # not move between the calls).
        if self._initial is None:
            queues = self.planner.queues()
            o = self.opts
            self._initial = self.planner.resolve(o.starting, o.starting_timestamp, queues,
                                                 default=-2 if o.starting != "latest" else -1)
        return self._initial

    def _current(self) -> tuple[Offsets, dict[str, Any]]:
        queues = self.planner.queues()
        latest = {t: {k: q.max_offset for k, q in qs.items()} for t, qs in queues.items()}
        if self._available_now is not None:
            cap = self._available_now
            latest = {t: {k: min(v, cap.get(t, {}).get(k, v)) for k, v in qs.items()}
                      for t, qs in latest.items() if t in cap}
            latest = {t: {k: v for k, v in qs.items() if k in cap[t]} for t, qs in latest.items()}
        self._latest = latest
        return latest, queues

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        # Spark asks for the next batch's end only once every batch up to ``start`` is done,
        # and asks at every trigger, data or not: the right moment to show the group's lag.
        self._commit_group(start)
        latest, queues = self._current()
        # A queue can only move forward: keep start where the broker reports less (a truncated
        # queue is reported as data loss when the range is planned, not silently rewound).
        for topic, qs in start.items():
            for key, off in qs.items():
                cur = latest.setdefault(topic, {}).get(key)
                if cur is None or cur < off:
                    latest[topic][key] = off
        max_rows = max_bytes = None
        if isinstance(limit, ReadMaxRows):
            max_rows = limit.max_rows
            max_bytes = self.opts.max_bytes_per_trigger
        elif isinstance(limit, ReadMaxBytes):
            max_bytes = limit.max_bytes
            max_rows = self.opts.max_offsets_per_trigger
        elif not isinstance(limit, ReadAllAvailable):
            max_rows = self.opts.max_offsets_per_trigger
            max_bytes = self.opts.max_bytes_per_trigger
        if max_rows is None and max_bytes is None:
            return latest
        return self.planner.limit(start, latest, queues, max_rows, max_bytes)

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.opts.max_offsets_per_trigger is not None:
            return ReadMaxRows(self.opts.max_offsets_per_trigger)
        if self.opts.max_bytes_per_trigger is not None:
            return ReadMaxBytes(self.opts.max_bytes_per_trigger)
        return ReadAllAvailable()

    def reportLatestOffset(self) -> dict[str, Any] | None:
        return self._latest

    def prepareForTriggerAvailableNow(self) -> None:
        self._available_now = None
        self._available_now, _ = self._current()

    # -- planning and reading ----------------------------------------------------------------
    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        return self.planner.ranges(start, end, None)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_range(partition)

    def commit(self, end: dict[str, Any]) -> None:
        self._commit_group(end)

    def _commit_group(self, offsets: dict[str, Any]) -> None:
        if not self.opts.group or offsets == self._group_committed:
            return
        try:
            self.planner.commit_group(offsets)
            self._group_committed = offsets
        except Exception as exc:  # the pipeline's progress must not depend on the lag display
            log.warning("committing offsets as group %s failed: %s", self.opts.group, exc)

    def stop(self) -> None:
        self.planner.close()
