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

from typing import TYPE_CHECKING, Any

from tidemq.base.lazy import lazy_names

if TYPE_CHECKING:
    from tidemq.spark.schema import READ_SCHEMA
    from tidemq.spark.source import TideMQDataSource

__all__ = ["TideMQDataSource", "READ_SCHEMA", "register"]

#: Loaded on first use (PEP 562), not by ``import tidemq.spark``: a Spark task that writes
#: unpickles its writer from ``tidemq.spark.sink``, which first runs this package's
#: ``__init__``; importing the read side here (source, planner, schema, range_reader) cost
#: every fresh Python worker and every micro-batch commit process 0.3-0.5 s more before its
#: first row (measured on a loaded 2-core machine, docs/benchmarks.md).
_LAZY = {"TideMQDataSource": "tidemq.spark.source", "READ_SCHEMA": "tidemq.spark.schema"}
__getattr__ = lazy_names(globals(), _LAZY)


def register(spark: Any) -> None:
    """Register ``format("tidemq")`` with a SparkSession."""
    from tidemq.spark.source import TideMQDataSource

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
