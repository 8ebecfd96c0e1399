"""The broker freezes its long-lived objects once many new queues have settled (issue 17): a full
collection walking 10,000 queues' state held its loop 68-95 ms of CPU."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

import tidemq
from support.cluster import dev_cluster


@pytest.fixture(scope="module")
def dev() -> Iterator[object]:
    yield from dev_cluster("tidemq-gcfreeze-", "gc_freeze_min_queues=16")


def _freezes(dev) -> int:
    with tidemq.Admin(dev.namesrv) as admin:
        return int(admin.runtime_info(dev.broker)["gc_freezes"])


def test_queues_that_settle_are_frozen_once_and_a_few_more_do_not_freeze_again(dev) -> None:
    assert _freezes(dev) == 0  # a fresh broker has no queue
    with tidemq.Admin(dev.namesrv) as admin:
        for i in range(3):
            admin.create_topic(f"gcf-{i}", 8)
    with tidemq.Producer(dev.namesrv) as p:
        for i in range(3):
            for q in range(8):  # each queue comes into the store with its first message
                p.send(tidemq.Message(f"gcf-{i}", b"x"), queue_id=q)
    t0 = time.monotonic()
    while _freezes(dev) < 1 and time.monotonic() - t0 < 10:
        time.sleep(0.2)
    assert _freezes(dev) == 1  # 24 new queues, then a second without more: one freeze
    with tidemq.Producer(dev.namesrv) as p:
        admin_topic = "gcf-late"
        with tidemq.Admin(dev.namesrv) as admin:
            admin.create_topic(admin_topic, 4)
        for q in range(4):
            p.send(tidemq.Message(admin_topic, b"y"), queue_id=q)
    time.sleep(2.5)
    assert _freezes(dev) == 1  # 4 more queues are under the bound of 16
