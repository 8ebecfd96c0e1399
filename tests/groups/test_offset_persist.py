"""A clustering consumer persists its offsets in UPDATE_CONSUMER_OFFSETS requests (issue 17):
one request per broker for many queues, only the offsets that moved, all or nothing on the
broker."""

from __future__ import annotations

import asyncio

import tidemq
from tidemq.client.connection import ConnectionPool
from tidemq.client.message import MessageQueue
from tidemq.client.offset_store import RemoteOffsetStore
from tidemq.client.offsets import query_consumer_offset
from tidemq.client.route import RouteCache
from tidemq.protocol.codes import RequestCode, ResponseCode
from tidemq.protocol.errors import BrokerError
from tidemq.protocol.headers import QueueCommit, UpdateConsumerOffsetsRequestHeader


def test_many_queues_persist_in_one_request_and_only_what_moved(dev) -> None:
    topic = "offsets-persist"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 300)

    async def go() -> tuple[list[int], dict[int, int | None]]:
        pool = ConnectionPool()
        routes = RouteCache(pool, dev.namesrv)
        sent: list[int] = []
        real = pool.request

        async def counting(addr, code, *a, **kw):  # counts what goes out, sends it as is
            sent.append(code)
            return await real(addr, code, *a, **kw)

        pool.request = counting  # type: ignore[method-assign]
        try:
            store = RemoteOffsetStore(pool, routes, "persist-group", 3.0)
            await routes.get(topic)
            sent.clear()
            mqs = {MessageQueue(topic, "broker-a", q) for q in range(300)}
            for mq in mqs:
                store.update(mq, mq.queue_id + 10, False)
            await store.persist_all(mqs)
            first = list(sent)
            sent.clear()
            await store.persist_all(mqs)  # nothing moved: nothing sent
            nothing = list(sent)
            store.update(MessageQueue(topic, "broker-a", 7), 99, False)
            await store.persist_all(mqs)
            one = list(sent)
            addr = await routes.addr_for_admin(MessageQueue(topic, "broker-a", 0))
            got = {q: await query_consumer_offset(pool, addr, "persist-group",
                                                  MessageQueue(topic, "broker-a", q))
                   for q in (0, 7, 299)}
            return [len(first), len(nothing), len(one), *first, *one], got
        finally:
            await routes.close()
            pool.close()

    counts, got = asyncio.run(go())
    assert counts[:3] == [1, 0, 1]
    assert set(counts[3:]) == {RequestCode.UPDATE_CONSUMER_OFFSETS}
    assert got == {0: 10, 7: 99, 299: 309}


def test_a_bad_queue_refuses_the_whole_request(dev) -> None:
    topic = "offsets-refused"
    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(topic, 2)

    async def go() -> tuple[BrokerError | None, int | None]:
        pool = ConnectionPool()
        routes = RouteCache(pool, dev.namesrv)
        try:
            mq = MessageQueue(topic, "broker-a", 0)
            addr = await routes.addr_for_admin(mq)
            err = None
            try:
                await pool.request(addr, RequestCode.UPDATE_CONSUMER_OFFSETS,
                                   UpdateConsumerOffsetsRequestHeader(
                                       consumer_group="refused-group",
                                       offsets=[QueueCommit(topic, 0, 5),
                                                QueueCommit(topic, 9, 5)]))
            except BrokerError as exc:
                err = exc
            return err, await query_consumer_offset(pool, addr, "refused-group", mq)
        finally:
            await routes.close()
            pool.close()

    err, committed = asyncio.run(go())
    assert err is not None and err.response_code == ResponseCode.INVALID_ARGUMENT
    assert "queue id 9 is out of range" in err.message
    assert committed is None  # queue 0 was not committed either


def test_a_rebalance_pass_asks_the_member_list_once_per_set_of_brokers(dev) -> None:
    """A push consumer of 30 topics on one broker: one GET_CONSUMER_LIST_BY_GROUP per pass,
    not one per topic, and every queue still assigned."""
    from tidemq.client.listener import ConsumeStatus
    from tidemq.client.push_consumer import PushConsumer

    topics = [f"walk-members-{i}" for i in range(30)]
    with tidemq.Admin(dev.namesrv) as admin:
        for t in topics:
            admin.create_topic(t, 2)

    async def listener(msgs, ctx):
        return ConsumeStatus.SUCCESS

    async def go() -> tuple[int, int, int]:
        c = PushConsumer(dev.namesrv, "walk-members-group", listener)
        for t in topics:
            c.subscribe(t)
        await c.start()
        try:
            for _ in range(100):  # the passes of the start and of the join notification
                seen = c.rebalance.rebalances
                await asyncio.sleep(0.3)
                if len(c.assignment()) == 61 and c.rebalance.rebalances == seen:
                    break
            before = c.rebalance.member_queries
            await c.rebalance.do_rebalance()
            return c.rebalance.member_queries - before, len(c.assignment()), len(c.rebalance.table)
        finally:
            await c.close()

    queries, assigned, table = asyncio.run(go())
    assert queries == 1
    assert assigned == table == 61  # and the group's retry queue
