"""Helpers of the producer-path tests (tests/types has no __init__.py: a package named `types`
would shadow the standard library): a real `tidemq dev` and raw broker requests."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from support.cluster import DevCluster
from support.cluster import dev_cluster as _dev_cluster
from tidemq import aio
from tidemq.client.connection import ConnectionPool
from tidemq.protocol.codes import RequestCode
from tidemq.protocol.headers import BrokerRuntimeInfo, EmptyHeader


def dev_cluster(*options: str) -> Iterator[DevCluster]:
    """Body of a module fixture: one `tidemq dev` with quick dedup snapshots."""
    yield from _dev_cluster("tidemq-types-", "dedup_snapshot_interval_ms=200", *options)


async def runtime_info(broker_addr: str) -> dict:
    pool = ConnectionPool()
    try:
        conn = await pool.get(broker_addr)
        frame = await conn.request(RequestCode.GET_BROKER_RUNTIME_INFO, EmptyHeader(), timeout=5)
        assert isinstance(frame.header, BrokerRuntimeInfo)
        return dict(frame.header.table)
    finally:
        pool.close()


async def make_topic(namesrv: str, topic: str, queues: int = 1) -> None:
    async with aio.Admin(namesrv) as admin:
        await admin.create_topic(topic, queues)
        for _ in range(250):
            try:
                if len(await admin.topic_queues(topic)) == queues:
                    return
            except aio.NoRouteError:
                pass
            await asyncio.sleep(0.02)
    raise AssertionError(f"topic {topic} never showed up in the route")


async def drain(consumer: aio.PullConsumer, n: int, timeout: float = 20.0) -> list:
    out: list = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while len(out) < n and loop.time() < deadline:
        out += await consumer.poll(timeout=0.5)
    return out
