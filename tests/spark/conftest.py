"""One SparkSession for the whole test run, one `tidemq dev` per module.

The session runs on ``local[2,4]``: two cores and up to four attempts per task, so a test can
make a task fail and watch Spark retry it (plain ``local[2]`` never retries a task).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

pytest.importorskip("pyspark")

import tidemq  # noqa: E402
from support.cluster import DevCluster, dev_cluster  # noqa: E402


@pytest.fixture(scope="session")
def spark() -> Iterator[object]:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    from pyspark.sql import SparkSession

    import tidemq.spark

    s = (SparkSession.builder.master("local[2,4]").appName("tidemq-tests")
         .config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false")
         .config("spark.sql.shuffle.partitions", "2")
         .config("spark.driver.bindAddress", "127.0.0.1")
         .config("spark.sql.session.timeZone", "UTC")
         .config("spark.sql.streaming.pollingDelay", "50ms")
         .getOrCreate())
    s.sparkContext.setLogLevel("ERROR")
    tidemq.spark.register(s)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def dev() -> Iterator[DevCluster]:
    yield from dev_cluster("tidemq-spark-")


def create_topic(dev: DevCluster, topic: str, queues: int) -> None:
    with tidemq.Admin(dev.namesrv, timeout=10.0) as admin:
        admin.create_topic(topic, queues)


def send(dev: DevCluster, topic: str, queue: int, bodies: list[bytes], **fields: object) -> None:
    """``bodies`` as one batch to ``queue`` of ``topic`` (``fields``: tags, keys, properties)."""
    with tidemq.Producer(dev.namesrv) as p:
        p.send_batch([tidemq.Message(topic, b, **fields) for b in bodies],  # type: ignore[arg-type]
                     queue_id=queue)


class Collector:
    """A ``foreachBatch`` target that keeps every micro-batch's rows (driver side)."""

    def __init__(self, *cols: str) -> None:
        self.cols = cols or ("topic", "queue_id", "queue_offset", "body")
        self.batches: dict[int, list[tuple]] = {}
        self.lock = threading.Lock()

    def __call__(self, df: object, batch_id: int) -> None:
        rows = [tuple(r) for r in df.select(*self.cols).collect()]  # type: ignore[attr-defined]
        with self.lock:
            self.batches[batch_id] = rows

    @property
    def rows(self) -> list[tuple]:
        with self.lock:
            return [r for _b, rows in sorted(self.batches.items()) for r in rows]


def wait_for(cond: Callable[[], bool], timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")
