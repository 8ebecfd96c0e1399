"""A real `tidemq dev` (name server + broker in one process) per test module."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator

import pytest

from tidemq.bench.dev_process import DevProcess

#: The tests' cluster is the product's own child-process helper (also used by benchmarks).
DevCluster = DevProcess


def start_dev(data_dir: str, *options: str) -> DevCluster:
    return DevProcess(data_dir, *options).start(20)


def stop_dev(c: DevCluster) -> None:
    c.stop(10)


@pytest.fixture(scope="module")
def dev() -> Iterator[DevCluster]:
    with tempfile.TemporaryDirectory(prefix="tidemq-client-") as d:
        c = start_dev(d)
        try:
            yield c
        finally:
            stop_dev(c)
