"""Routes of broker groups (masters and slaves): sends go to masters only, reads to the
suggested broker, else the master, else a slave; an unreachable address is skipped."""

from __future__ import annotations

import asyncio

from tidemq.client.connection import ConnectionPool
from tidemq.client.message import MessageQueue
from tidemq.client.route import RouteCache, TopicRoute
from tidemq.protocol.headers import BrokerData, QueueData, TopicRouteData


def route() -> TopicRoute:
    return TopicRoute("T", TopicRouteData(
        queue_datas=[QueueData(broker_name="a", read_queue_nums=2, write_queue_nums=2),
                     QueueData(broker_name="b", read_queue_nums=2, write_queue_nums=2)],
        broker_datas=[BrokerData(cluster="c", broker_name="a", broker_addrs={0: "m:1", 1: "s:1"}),
                      BrokerData(cluster="c", broker_name="b", broker_addrs={1: "s:2"})],
    ))


def test_a_group_without_master_is_read_but_not_written():
    r = route()
    assert r.broker_addrs == {"a": "m:1"}
    assert {q.broker_name for q in r.write_queues} == {"a"}
    assert {(q.broker_name, q.queue_id) for q in r.read_queues} == {
        ("a", 0), ("a", 1), ("b", 0), ("b", 1)}
    assert r.read_addrs == {"a": "m:1", "b": "s:2"}


def test_addr_for_read_follows_the_suggestion_and_skips_dead_addresses():
    async def go() -> None:
        rc = RouteCache(ConnectionPool(), "127.0.0.1:1")
        r = route()
        rc._routes["T"] = r
        rc._group_addrs.update(r.group_addrs)
        a0 = MessageQueue("T", "a", 0)
        assert await rc.addr_for_read(a0) == ("m:1", False)
        assert await rc.addr_for_read(a0, 1) == ("s:1", True)  # suggested: the slave
        assert await rc.addr_for_read(a0, 7) == ("m:1", False)  # unknown id: the master
        assert await rc.addr_for_read(MessageQueue("T", "b", 1)) == ("s:2", True)
        assert await rc.addr_for_admin(a0) == "m:1"
        rc.mark_down("m:1")  # the master stopped answering: reads go to the slave
        assert await rc.addr_for_read(a0) == ("s:1", True)
        rc.mark_down("s:1")  # everyone down: still an address to try
        assert (await rc.addr_for_read(a0))[0] in ("m:1", "s:1")
        assert rc.group_size("a") == 2

    asyncio.run(go())
