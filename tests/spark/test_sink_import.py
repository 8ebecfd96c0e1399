"""What a Spark task that writes imports: unpickling the sink's writer imports
``tidemq.spark.sink``, which runs the package's ``__init__`` first; the read side (source,
planner, schema, the range reader) is not imported with it (a fresh Python worker or commit
process paid 0.3-0.5 s for it before its first row), and the package's names still load on
first use."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("pyspark")

pytestmark = pytest.mark.timeout(60)

_READ_SIDE = ("tidemq.spark.source", "tidemq.spark.planner", "tidemq.spark.schema",
              "tidemq.client.range_reader")


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport json, sys; print(json.dumps(sorted(sys.modules)))"],
        check=True, capture_output=True, text=True, timeout=60)
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_importing_the_sink_leaves_the_read_side_unloaded() -> None:
    mods = _modules_after("import tidemq.spark.sink")
    assert "tidemq.spark.sink" in mods
    assert not mods & set(_READ_SIDE), sorted(mods & set(_READ_SIDE))


def test_the_package_names_load_on_first_use() -> None:
    import tidemq.spark
    from tidemq.spark.schema import READ_SCHEMA
    from tidemq.spark.source import TideMQDataSource

    assert tidemq.spark.READ_SCHEMA == READ_SCHEMA
    assert tidemq.spark.TideMQDataSource is TideMQDataSource
    assert "TideMQDataSource" in tidemq.spark.__all__
    with pytest.raises(AttributeError):
        _ = tidemq.spark.no_such_name  # type: ignore[attr-defined]
