"""One `tidemq dev` per test module, with test-sized group timings (see cluster.py)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator

import pytest

from .cluster import GROUP_OPTIONS, DevCluster, start_dev, stop_dev


@pytest.fixture(scope="module")
def dev() -> Iterator[DevCluster]:
    with tempfile.TemporaryDirectory(prefix="tidemq-groups-") as d:
        c = start_dev(d, *GROUP_OPTIONS)
        try:
            yield c
        finally:
            stop_dev(c)
