"""tidemq's Spark connector: the ``tidemq`` data source (read and write, batch and streaming).

::

    import tidemq.spark                   # registers with the active session, if any
    tidemq.spark.register(spark)          # spark.dataSource.register(TideMQDataSource)
    df = spark.read.format("tidemq").option("namesrv", "127.0.0.1:9876") \\
        .option("topics", "orders").load()

Needs the ``spark`` extra (``pip install 'tidemq[spark]'``: pyspark 4.3, pyarrow). The user's
guide is docs/spark.md. This package uses only ``tidemq.client`` (import-linter checks it).
"""

from __future__ import annotations

from typing import Any

from tidemq.spark.schema import READ_SCHEMA
from tidemq.spark.source import TideMQDataSource

__all__ = ["TideMQDataSource", "READ_SCHEMA", "register"]


def register(spark: Any) -> None:
    """Register ``format("tidemq")`` with a SparkSession."""
    spark.dataSource.register(TideMQDataSource)


def _register_active() -> None:
    """``import tidemq.spark`` registers the source with the active session, if there is one."""
    try:
        from pyspark.sql import SparkSession

        active = SparkSession.getActiveSession()
    except Exception:  # noqa: BLE001 - no JVM yet, or not on the driver
        return
    if active is not None:
        register(active)


_register_active()
