"""failOnDataLoss both ways, with real retention: a broker whose 64 KiB CommitLog segments
expire after ~18 s and whose retention runs every 300 ms (disk ratio 0: always time to clean)."""

from __future__ import annotations

import json
import shutil
import tempfile

import pytest
from tests.spark.conftest import Collector, create_topic, send, wait_for

import tidemq
from support.cluster import start_dev, stop_dev

pytestmark = pytest.mark.timeout(300)

TOPIC = "dl-orders"


@pytest.fixture(scope="module")
def dev():
    d = tempfile.mkdtemp(prefix="tidemq-spark-loss-")
    c = start_dev(d, "store.segment_size=65536", "store.cq_units_per_file=64",
                  "store.file_reserved_hours=0.005", "store.disk_max_used_ratio=0.0",
                  "store.retention_check_interval_ms=300")
    try:
        yield c
    finally:
        stop_dev(c)
        shutil.rmtree(d, ignore_errors=True)


def _min_offset(dev) -> int:
    with tidemq.Admin(dev.namesrv, timeout=10.0) as admin:
        (st,) = admin.topic_status(TOPIC)
        return st.min_offset


def _send(dev, first: int, n: int) -> None:
    for lo in range(first, first + n, 40):  # 40 KiB batches: a batch must fit a segment
        send(dev, TOPIC, 0, [b"%05d" % i + b"." * 1000 for i in range(lo, min(lo + 40,
                                                                               first + n))])


def _stream(spark, dev, **opts):
    r = (spark.readStream.format("tidemq").option("namesrv", dev.namesrv)
         .option("topics", TOPIC).option("startingOffsets", "earliest"))
    for k, v in opts.items():
        r = r.option(k, v)
    return r.load()


def test_fail_on_data_loss_both_ways(spark, dev, tmp_path):
    create_topic(dev, TOPIC, 1)
    _send(dev, 0, 600)
    ckpt = str(tmp_path / "ckpt")
    c = Collector()
    # First run: one batch of 100, then the query stops (the next trigger is an hour away).
    q = (_stream(spark, dev, maxOffsetsPerTrigger=100).writeStream.foreachBatch(c)
         .option("checkpointLocation", ckpt).trigger(processingTime="1 hour").start())
    try:
        wait_for(lambda: len(c.rows) == 100, 60, "the first batch")
    finally:
        q.stop()
    # Retention deletes the old segments (more data keeps a newer segment active).
    _send(dev, 600, 300)
    wait_for(lambda: _min_offset(dev) > 100, 90, "retention to delete offsets the query needs")
    lost_to = _min_offset(dev)

    # failOnDataLoss=true (the default): the restarted query stops with a clear error.
    q = (_stream(spark, dev).writeStream.foreachBatch(Collector())
         .option("checkpointLocation", ckpt).trigger(availableNow=True).start())
    with pytest.raises(Exception, match="deleted by retention|no longer stored"):
        q.awaitTermination(120)
    assert "failOnDataLoss=false" in str(q.exception())

    # failOnDataLoss=false: the same checkpoint skips what is gone and reads everything else.
    c2 = Collector()
    q = (_stream(spark, dev, failOnDataLoss="false").writeStream.foreachBatch(c2)
         .option("checkpointLocation", ckpt).trigger(availableNow=True).start())
    assert q.awaitTermination(120)
    assert q.exception() is None
    offsets = sorted(r[2] for r in c2.rows)
    lo = offsets[0]
    assert lo > 100 and lo >= lost_to - 64  # nothing of the deleted range, nothing twice
    assert offsets == list(range(lo, 900))
    assert all(bytes(r[3]).startswith(b"%05d" % r[2]) for r in c2.rows)


def test_batch_read_below_the_minimum(spark, dev):
    lo = _min_offset(dev)
    assert lo > 0
    start = json.dumps({TOPIC: {"0": 0}})

    def read(fail: str):
        return (spark.read.format("tidemq").option("namesrv", dev.namesrv)
                .option("topics", TOPIC).option("startingOffsets", start)
                .option("failOnDataLoss", fail).load().select("queue_offset").collect())

    with pytest.raises(Exception, match="deleted by retention"):
        read("true")
    offsets = sorted(r.queue_offset for r in read("false"))
    assert offsets[0] >= lo and offsets == list(range(offsets[0], offsets[0] + len(offsets)))
