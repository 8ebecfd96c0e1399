"""One `tidemq dev` per test module, with test-sized group timings (see cluster.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from support.cluster import dev_cluster

from .cluster import GROUP_OPTIONS, DevCluster


@pytest.fixture(scope="module")
def dev() -> Iterator[DevCluster]:
    yield from dev_cluster("tidemq-groups-", *GROUP_OPTIONS)
