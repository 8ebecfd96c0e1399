"""Routes of broker groups (masters and slaves): sends go to masters only, reads to the
suggested broker, else the master, else a slave; an unreachable address is skipped."""

from __future__ import annotations

import asyncio
import itertools

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


def test_spread_choice_avoids_a_slow_broker_asking_each_broker_once():
    """The queue choice of a flush of spread traffic (client/multi_sender.py) picks what
    ``select`` picks -- another broker's queue while one is avoided, round robin when every
    broker of the route is -- asking the latency-fault table once per broker, not once per
    candidate queue of every batch."""
    from tidemq.client.latency_fault import LatencyFaultTable
    from tidemq.client.send_router import SendRouter

    def two(topic: str, queues: int) -> TopicRoute:
        return TopicRoute(topic, TopicRouteData(
            queue_datas=[QueueData(broker_name=n, read_queue_nums=queues,
                                   write_queue_nums=queues) for n in ("a", "b")],
            broker_datas=[BrokerData(cluster="c", broker_name=n, broker_addrs={0: f"{n}:1"})
                          for n in ("a", "b")],
        ))

    asked: list[str] = []

    class Counted(LatencyFaultTable):
        def available(self, broker: str) -> bool:
            asked.append(broker)
            return super().available(broker)

    router = SendRouter(RouteCache(ConnectionPool(), "ns:1"), latency_fault=True,
                        auto_create_route=False, default_topic_queues=4)
    router.faults = Counted()
    routes = [two(f"T{i}", 8) for i in range(50)]
    router.record("a", 10_000)  # a is avoided for a while
    choose = router.spread_chooser()
    picked = [choose(r.write_queues) for r in routes]
    assert {mq.broker_name for mq in picked} == {"b"}
    assert sorted(asked) == ["a", "b"]  # once each for the 50 choices
    # select's choice, from the same round-robin position
    asked.clear()
    router._rr = itertools.count(7)
    sel = [router.select(r, None, None, None, None, None, None)[0]  # type: ignore[arg-type]
           for r in routes[:5]]
    router._rr = itertools.count(7)
    choose = router.spread_chooser()
    assert [choose(r.write_queues) for r in routes[:5]] == sel
    router.record("b", 10_000)  # every broker avoided: plain round robin, as select
    router._rr = itertools.count(3)
    choose = router.spread_chooser()
    assert [choose(r.write_queues) for r in routes[:3]] == [
        r.write_queues[(3 + i) % 16] for i, r in enumerate(routes[:3])]
