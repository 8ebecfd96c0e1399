"""`tidemq bench spark-source` and `tidemq bench spark-sink` (the Spark connector's targets).

spark-source: N messages of SIZE bytes are stored in a fresh ``tidemq dev`` (a subprocess on
free ports, temp dir); a streaming query reads them all (``trigger(availableNow=True)``) into
Spark's no-op sink. In the same run, the same query shape reads a *synthetic in-memory Python
source* that yields the same number of rows, in the same schema and partitioning, as ready-made
Arrow RecordBatches: the fastest a Python data source can be on this machine. The target is
tidemq >= 0.5x synthetic.

spark-sink: the synthetic source streams N rows with SIZE-byte bodies into the tidemq sink
(exactly once: deduplicated producers, docs/spark.md); rows/s and the stored count (must be N).

Rates are rows / the sum of the micro-batches' ``triggerExecution`` times (query start-up,
which is the same for every source, is reported apart as ``*_wall_s``).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import click

from tidemq.bench.dev_process import DevProcess
from tidemq.cli.output import emit_result

__all__ = ["register", "bench_spark_source", "bench_spark_sink"]


# -- the synthetic source ------------------------------------------------------------------------

def _synthetic_source() -> type:
    """The DataSource class (built lazily: pyspark is an optional extra)."""
    import numpy as np
    import pyarrow as pa
    from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

    from tidemq.spark.schema import ARROW_SCHEMA, READ_SCHEMA

    class _Range(InputPartition):
        def __init__(self, pid: int, start: int, end: int, size: int) -> None:
            super().__init__(pid)
            self.pid, self.start, self.end, self.size = pid, start, end, size

    def _batch(n: int, size: int, pid: int) -> pa.RecordBatch:
        ts = pa.array(np.full(n, int(time.time() * 1_000_000), dtype=np.int64),
                      pa.timestamp("us", tz="UTC"))
        body = pa.Array.from_buffers(
            pa.binary(), n, [None, pa.py_buffer(np.arange(n + 1, dtype=np.int32) * size),
                             pa.py_buffer(np.full(n * size, 46, dtype=np.uint8))])
        cols = [
            pa.array(["synthetic"] * n), pa.array(np.full(n, pid, dtype=np.int32)),
            pa.array(np.arange(n, dtype=np.int64)), pa.array(["0" * 32] * n),
            pa.array([[]] * n, pa.list_(pa.string())), pa.nulls(n, pa.string()), body,
            pa.array([[]] * n, pa.map_(pa.string(), pa.string())), ts, ts,
            pa.array(np.zeros(n, dtype=np.int32)),
        ]
        return pa.RecordBatch.from_arrays(cols, schema=ARROW_SCHEMA)

    class SyntheticReader(DataSourceStreamReader):
        def __init__(self, rows: int, size: int, partitions: int) -> None:
            self.rows, self.size, self.nparts = rows, size, partitions

        def initialOffset(self) -> dict[str, Any]:
            return {"n": 0}

        def latestOffset(
            self, start: dict[str, Any] | None = None, limit: Any = None
        ) -> dict[str, Any]:
            return {"n": self.rows}

        def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[InputPartition]:
            lo, hi, k = start["n"], end["n"], self.nparts
            return [_Range(i, lo + (hi - lo) * i // k, lo + (hi - lo) * (i + 1) // k, self.size)
                    for i in range(k) if hi > lo]

        def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
            assert isinstance(partition, _Range)
            chunk = 8192
            full = _batch(chunk, partition.size, partition.pid)
            left = partition.end - partition.start
            while left > 0:
                yield full if left >= chunk else full.slice(0, left)
                left -= chunk

        def commit(self, end: dict[str, Any]) -> None:
            pass

    class SyntheticSource(DataSource):
        @classmethod
        def name(cls) -> str:
            return "tidemq-bench-synthetic"

        def schema(self) -> str:
            return READ_SCHEMA

        def streamReader(self, schema: Any) -> DataSourceStreamReader:
            o = self.options
            return SyntheticReader(int(o["rows"]), int(o["size"]), int(o["partitions"]))

    return SyntheticSource


# -- helpers -------------------------------------------------------------------------------------

def _start_dev(data_dir: str) -> DevProcess:
    try:
        return DevProcess(data_dir).start(60)
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from None


def _session(master: str) -> Any:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    import tidemq.spark

    s = (SparkSession.builder.master(master).appName("tidemq-bench")
         .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
         .config("spark.driver.bindAddress", "127.0.0.1")
         .config("spark.sql.shuffle.partitions", "2").getOrCreate())
    s.sparkContext.setLogLevel("ERROR")
    tidemq.spark.register(s)
    s.dataSource.register(_synthetic_source())
    return s


def _run(writer: Any) -> tuple[float, float, int]:
    """Start, wait, and return (sum of triggerExecution s, wall s, input rows)."""
    t0 = time.perf_counter()
    q = writer.start()
    q.awaitTermination()
    wall = time.perf_counter() - t0
    if q.exception() is not None:
        raise click.ClickException(f"the query failed: {q.exception()}")
    busy = [p for p in q.recentProgress if p["numInputRows"]]
    exec_s = sum(p["durationMs"]["triggerExecution"] for p in busy) / 1000
    return exec_s, wall, sum(p["numInputRows"] for p in busy)


def _produce(namesrv: str, topic: str, count: int, size: int, queues: int) -> float:
    import tidemq

    body = b"." * size
    per = max(1, min(1000, (3 << 20) // max(1, size + 64)))
    t0 = time.perf_counter()
    with tidemq.Admin(namesrv) as admin:
        admin.create_topic(topic, queues)
    with tidemq.Producer(namesrv) as p:
        futures = []
        sent = 0
        q = 0
        while sent < count:
            n = min(per, count - sent)
            futures.append(p.send_async([tidemq.Message(topic, body) for _ in range(n)],
                                        queue_id=q))
            q = (q + 1) % queues
            sent += n
            if len(futures) >= 16:
                futures.pop(0).result()
        for f in futures:
            f.result()
    return time.perf_counter() - t0


def _stop_spark(spark: Any) -> None:
    spark.stop()


# -- the benchmarks ------------------------------------------------------------------------------

def bench_spark_source(messages: int, size: int, queues: int, master: str,
                       rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tidemq-bench-spark-") as d:
        dev = _start_dev(os.path.join(d, "broker"))
        namesrv = dev.namesrv
        spark = None
        try:
            produce_s = _produce(namesrv, "bench-spark", messages, size, queues)
            spark = _session(master)
            best_t = best_s = None
            walls: dict[str, float] = {}
            for r in range(rounds):
                tide = (spark.readStream.format("tidemq").option("namesrv", namesrv)
                        .option("topics", "bench-spark").option("startingOffsets", "earliest")
                        .load().writeStream.format("noop")
                        .option("checkpointLocation", os.path.join(d, f"ck-t{r}"))
                        .trigger(availableNow=True))
                t_exec, t_wall, t_rows = _run(tide)
                if t_rows != messages:
                    raise click.ClickException(f"read {t_rows} rows, expected {messages}")
                syn = (spark.readStream.format("tidemq-bench-synthetic")
                       .option("rows", messages).option("size", size)
                       .option("partitions", queues).load().writeStream.format("noop")
                       .option("checkpointLocation", os.path.join(d, f"ck-s{r}"))
                       .trigger(availableNow=True))
                s_exec, s_wall, _ = _run(syn)
                if best_t is None or t_exec < best_t:
                    best_t, walls["tidemq_wall_s"] = t_exec, t_wall
                if best_s is None or s_exec < best_s:
                    best_s, walls["synthetic_wall_s"] = s_exec, s_wall
            assert best_t is not None and best_s is not None
            tide_rate, syn_rate = messages / best_t, messages / best_s
            return {
                "bench": "spark-source", "master": master, "messages": messages,
                "size": size, "queues": queues, "rounds": rounds,
                "produce_s": round(produce_s, 2),
                "tidemq_rows_per_s": round(tide_rate),
                "tidemq_mib_per_s": round(tide_rate * size / (1 << 20), 1),
                "synthetic_rows_per_s": round(syn_rate),
                "ratio": round(tide_rate / syn_rate, 3), "target_ratio": 0.5,
                **{k: round(v, 2) for k, v in walls.items()},
            }
        finally:
            if spark is not None:
                _stop_spark(spark)
            dev.stop(15)


def bench_spark_sink(rows: int, size: int, queues: int, master: str, rounds: int,
                     sort_rows: bool) -> dict[str, Any]:
    import tidemq

    with tempfile.TemporaryDirectory(prefix="tidemq-bench-spark-") as d:
        dev = _start_dev(os.path.join(d, "broker"))
        namesrv = dev.namesrv
        spark = None
        try:
            spark = _session(master)
            best = None
            wall = 0.0
            stored = 0
            for r in range(rounds):
                topic = f"bench-sink-{r}"
                with tidemq.Admin(namesrv) as admin:
                    admin.create_topic(topic, queues)
                w = (spark.readStream.format("tidemq-bench-synthetic").option("rows", rows)
                     .option("size", size).option("partitions", 2).load().select("body")
                     .writeStream.format("tidemq").option("namesrv", namesrv)
                     .option("topic", topic).option("sortRows", str(sort_rows).lower())
                     .option("checkpointLocation", os.path.join(d, f"ck{r}"))
                     .trigger(availableNow=True))
                t_exec, t_wall, _ = _run(w)
                with tidemq.Admin(namesrv) as admin:
                    stored = sum(st.max_offset - st.min_offset
                                 for st in admin.topic_status(topic))
                if stored != rows:
                    raise click.ClickException(f"the sink stored {stored} rows, expected {rows}")
                if best is None or t_exec < best:
                    best, wall = t_exec, t_wall
            assert best is not None
            return {
                "bench": "spark-sink", "master": master, "rows": rows, "size": size,
                "queues": queues, "rounds": rounds, "sort_rows": sort_rows,
                "rows_per_s": round(rows / best),
                "mib_per_s": round(rows / best * size / (1 << 20), 1),
                "stored": stored, "target_rows_per_s": 100_000, "wall_s": round(wall, 2),
            }
        finally:
            if spark is not None:
                _stop_spark(spark)
            dev.stop(15)


# -- the commands --------------------------------------------------------------------------------



@click.command("spark-source")
@click.option("--messages", default=200_000, show_default=True)
@click.option("--size", default=1024, show_default=True, help="Body bytes per message.")
@click.option("--queues", default=4, show_default=True, help="Queues = read tasks.")
@click.option("--master", default="local[2]", show_default=True)
@click.option("--rounds", default=2, show_default=True, help="Best of this many runs each.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_spark_source_cmd(messages, size, queues, master, rounds, as_json) -> None:
    """Streaming read of tidemq into a no-op sink vs a synthetic in-memory Python source."""
    emit_result(bench_spark_source(messages, size, queues, master, rounds), as_json)


@click.command("spark-sink")
@click.option("--rows", default=200_000, show_default=True)
@click.option("--size", default=1024, show_default=True, help="Body bytes per row.")
@click.option("--queues", default=4, show_default=True, help="Queues of the target topic.")
@click.option("--master", default="local[2]", show_default=True)
@click.option("--rounds", default=2, show_default=True, help="Best of this many runs.")
@click.option("--sort-rows/--no-sort-rows", default=True, show_default=True,
              help="The sink's sortRows option.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_spark_sink_cmd(rows, size, queues, master, rounds, sort_rows, as_json) -> None:
    """Exactly-once streaming writes of SIZE-byte rows into tidemq."""
    emit_result(bench_spark_sink(rows, size, queues, master, rounds, sort_rows), as_json)


def register(cli: click.Group) -> None:
    bench = cli.commands.get("bench")
    if isinstance(bench, click.Group):
        bench.add_command(bench_spark_source_cmd)
        bench.add_command(bench_spark_sink_cmd)
