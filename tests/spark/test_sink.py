"""The sink: batch and streaming writes, exactly once when a task fails and is retried and when
a query is stopped mid-stream and restarted (output compared with input, counted by key)."""

from __future__ import annotations

import os
import signal
from collections import Counter

import pytest
from pyspark.sql import functions as F
from tests.spark.conftest import create_topic, send, wait_for

import tidemq

pytestmark = pytest.mark.timeout(300)


def _read_all(spark, dev, topic):
    return (spark.read.format("tidemq").option("namesrv", dev.namesrv).option("topics", topic)
            .load().collect())


def _counts(rows) -> Counter:
    return Counter(bytes(r.body) for r in rows)


def test_batch_write_keeps_every_column_once(spark, dev):
    create_topic(dev, "sk-batch", 4)
    rows = [(f"m-{i:05d}".encode(), [f"k{i}"], "paid" if i % 2 else None,
             {"i": str(i)}, f"cust-{i % 5}") for i in range(1000)]
    df = spark.createDataFrame(
        rows, "body binary, keys array<string>, tags string, properties map<string,string>, "
              "hash_key string").repartition(3)
    (df.write.format("tidemq").option("namesrv", dev.namesrv).option("topic", "sk-batch")
     .mode("append").save())
    out = _read_all(spark, dev, "sk-batch")
    assert _counts(out) == Counter(r[0] for r in rows)
    by_body = {bytes(r.body): r for r in out}
    r = by_body[b"m-00007"]
    assert r.keys == ["k7"] and r.tags == "paid" and r.properties == {"i": "7"}
    assert by_body[b"m-00008"].tags is None
    queue_of = {}
    for row in rows:  # the same hash_key always lands on the same queue
        q = by_body[row[0]].queue_id
        assert queue_of.setdefault(row[4], q) == q


def test_write_errors_are_clear(spark, dev):
    df = spark.createDataFrame([("x",)], "payload string")
    with pytest.raises(Exception, match="needs a column named body"):
        (df.write.format("tidemq").option("namesrv", dev.namesrv).option("topic", "sk-batch")
         .mode("append").save())


def _source(dev, topic, n, queues=2):
    create_topic(dev, topic, queues)
    per = n // queues
    for q in range(queues):
        for lo in range(0, per, 500):
            send(dev, topic, q, [f"{topic}-{q}-{i:06d}".encode()
                                 for i in range(lo, min(lo + 500, per))])
    return Counter(f"{topic}-{q}-{i:06d}".encode() for q in range(queues) for i in range(per))


def _stream(spark, dev, topic, **opts):
    r = (spark.readStream.format("tidemq").option("namesrv", dev.namesrv)
         .option("topics", topic).option("startingOffsets", "earliest"))
    for k, v in opts.items():
        r = r.option(k, v)
    return r.load()


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out.append(int(d))
    return out


def _kill_task_workers() -> int:
    """kill -9 the Python workers of this session's tasks: the children of the ``pyspark.daemon
    pyspark.worker`` process that our own JVM started (other sessions on the machine are left
    alone, and so are the daemons of driver-side planner workers, ``pyspark.sql.worker.*``:
    Spark would hand a dead one to its next driver-side call and fail the query, not a task)."""
    from pyspark import SparkContext

    jvm = SparkContext._gateway.proc.pid  # type: ignore[union-attr]
    killed = 0
    for daemon in _children(jvm):
        try:
            with open(f"/proc/{daemon}/cmdline", "rb") as f:
                args = f.read().rstrip(b"\0").split(b"\0")
        except OSError:
            continue
        if args[-2:] != [b"pyspark.daemon", b"pyspark.worker"]:
            continue
        for worker in _children(daemon):
            try:
                os.kill(worker, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    return killed


def test_sink_exactly_once_when_a_task_fails_and_is_retried(spark, dev, tmp_path):
    n = 60_000
    want = _source(dev, "sk-retry-in", n)
    create_topic(dev, "sk-retry-out", 2)
    gate_dir = tmp_path / "gate"
    gate_dir.mkdir()
    q = (_stream(spark, dev, "sk-retry-in").select("body")
         .writeStream.format("tidemq").option("namesrv", dev.namesrv)
         .option("topic", "sk-retry-out").option("batchRows", "20")
         .option("sortRows", "false")  # send while reading (sorting waits for all rows)
         # each task's first attempt stops once 5,000 of its rows are stored: the kill below
         # lands there (a kill timed by polling once landed after everything was stored)
         .option("testPauseAfterRows", "5000").option("testPauseDir", str(gate_dir))
         .option("checkpointLocation", str(tmp_path / "ckpt")).trigger(availableNow=True)
         .start())
    try:
        # Both tasks (one per queue) pause part-way in their first attempt; then kill their
        # Python workers: Spark retries the tasks (local[2,4]), which re-send everything from
        # their first row.
        with tidemq.Admin(dev.namesrv, timeout=10.0) as admin:
            def stored() -> int:
                return sum(st.max_offset for st in admin.topic_status("sk-retry-out"))
            wait_for(lambda: len(os.listdir(gate_dir)) == 2, 120,
                     "both tasks paused part-way with rows stored")
            at_kill = stored()
            killed = _kill_task_workers()
            (gate_dir / "release").touch()
        assert q.awaitTermination(180)
        assert q.exception() is None
    finally:
        (gate_dir / "release").touch()
        q.stop()
    assert killed > 0 and 10_000 <= at_kill < n
    got = _counts(_read_all(spark, dev, "sk-retry-out"))
    assert got == want  # every input row once: none lost, none twice


def test_sink_exactly_once_across_stop_and_restart(spark, dev, tmp_path):
    want = _source(dev, "sk-restart-in", 3000)
    create_topic(dev, "sk-restart-out", 3)
    ckpt = tmp_path / "ckpt"

    def start():
        return (_stream(spark, dev, "sk-restart-in", maxOffsetsPerTrigger=400)
                .select("body", F.array(F.col("body").cast("string")).alias("keys"))
                .writeStream.format("tidemq").option("namesrv", dev.namesrv)
                .option("topic", "sk-restart-out").option("batchRows", "64")
                .option("checkpointLocation", str(ckpt))
                .trigger(processingTime="100 milliseconds").start())

    q = start()
    try:
        wait_for(lambda: (q.lastProgress or {}).get("batchId", -1) >= 2, 120, "three batches")
    finally:
        q.stop()  # mid-stream: 3000 rows, 400 per batch
    # A crash after the sink wrote a batch but before Spark recorded it: forget the last
    # batch's commit, so the restarted query replays it (same offsets, same rows). A batch the
    # stop left planned but uncommitted is replayed anyway.
    replayed = max(int(p.name) for p in (ckpt / "offsets").iterdir() if p.name.isdigit())
    for name in (str(replayed), f".{replayed}.crc"):
        if (ckpt / "commits" / name).exists():
            (ckpt / "commits" / name).unlink()
    before = sum(_counts(_read_all(spark, dev, "sk-restart-out")).values())
    assert 0 < before < 3000
    q = start()
    try:
        q.processAllAvailable()
        batch_ids = [p["batchId"] for p in q.recentProgress if p["numInputRows"]]
    finally:
        q.stop()
    assert replayed in batch_ids  # the replay happened
    out = _read_all(spark, dev, "sk-restart-out")
    got = _counts(out)
    assert sum(got.values()) == 3000 and max(got.values()) == 1
    assert got == want
    assert all(r.keys == [bytes(r.body).decode()] for r in out)


def test_batch_write_routes_by_topic_and_queue_columns(spark, dev):
    create_topic(dev, "sk-a", 2)
    create_topic(dev, "sk-b", 3)
    rows = [(f"r{i}", "sk-a" if i % 3 else "sk-b", i % 4) for i in range(300)]
    df = spark.createDataFrame(rows, "body string, topic string, queue_id int").coalesce(1)
    df.write.format("tidemq").option("namesrv", dev.namesrv).mode("append").save()
    for topic, n in (("sk-a", 2), ("sk-b", 3)):
        out = _read_all(spark, dev, topic)
        want = {f"r{i}".encode(): i % 4 % n for i, t in ((i, r[1]) for i, r in enumerate(rows))
                if t == topic}
        assert {bytes(r.body): r.queue_id for r in out} == want
        assert len(out) == len(want)


def test_batch_write_to_a_topic_that_does_not_exist_yet(spark, dev):
    """As ``Producer.send``: the broker creates the topic on the first write (auto-create), the
    sink does not ask for a route that is not there yet."""
    with tidemq.Admin(dev.namesrv, timeout=10.0) as admin:
        assert "sk-new-out" not in admin.list_topics()
    rows = [(f"n{i:04d}".encode(), f"c{i % 7}") for i in range(500)]
    df = spark.createDataFrame(rows, "body binary, hash_key string").repartition(2)
    (df.write.format("tidemq").option("namesrv", dev.namesrv).option("topic", "sk-new-out")
     .mode("append").save())
    out = _read_all(spark, dev, "sk-new-out")
    assert _counts(out) == Counter(r[0] for r in rows)


def test_empty_partitions_write_nothing(spark, dev):
    create_topic(dev, "sk-empty", 2)
    df = spark.createDataFrame([(b"only",)], "body binary").repartition(4)  # 3 empty partitions
    for sort in ("true", "false"):
        (df.write.format("tidemq").option("namesrv", dev.namesrv).option("topic", "sk-empty")
         .option("sortRows", sort).mode("append").save())
    assert [bytes(r.body) for r in _read_all(spark, dev, "sk-empty")] == [b"only", b"only"]


def test_options_are_found_whatever_their_case():
    """Spark hands a data source its options with lower-cased names; the writer's options were
    once looked up as ``batchRows`` in a plain dict of them, so every camel-case write option
    was silently ignored."""
    from tidemq.spark.options import ReadOptions, WriteOptions

    w = WriteOptions.parse({"namesrv": "h:1", "batchrows": "20", "sortrows": "false",
                            "BATCHBYTES": "4096", "requesttimeoutms": "500"})
    assert (w.batch_rows, w.sort_rows, w.batch_bytes, w.request_timeout) == (20, False, 4096, 0.5)
    r = ReadOptions.parse({"namesrv": "h:1", "topics": "t", "maxoffsetspertrigger": "7"},
                          streaming=True)
    assert r.max_offsets_per_trigger == 7
