"""A real `tidemq dev` (name server + broker in one process) per test module
(the launcher: tests/support/cluster.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from support.cluster import DevCluster, dev_cluster, start_dev, stop_dev

__all__ = ["DevCluster", "start_dev", "stop_dev"]


@pytest.fixture(scope="module")
def dev() -> Iterator[DevCluster]:
    yield from dev_cluster("tidemq-client-")
