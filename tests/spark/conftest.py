"""One SparkSession (local[2]) for the whole test run, one `tidemq dev` per module."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator

import pytest

pytest.importorskip("pyspark")

from tests.client.conftest import DevCluster, start_dev, stop_dev  # noqa: E402


@pytest.fixture(scope="session")
def spark() -> Iterator[object]:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    from pyspark.sql import SparkSession

    import tidemq.spark

    s = (SparkSession.builder.master("local[2]").appName("tidemq-tests")
         .config("spark.ui.enabled", "false")
         .config("spark.sql.shuffle.partitions", "2")
         .config("spark.driver.bindAddress", "127.0.0.1")
         .config("spark.sql.session.timeZone", "UTC")
         .getOrCreate())
    s.sparkContext.setLogLevel("ERROR")
    tidemq.spark.register(s)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def dev() -> Iterator[DevCluster]:
    with tempfile.TemporaryDirectory(prefix="tidemq-spark-") as d:
        c = start_dev(d)
        try:
            yield c
        finally:
            stop_dev(c)
