"""RouteInfoManager: registration, routes, expiry and connection loss, with a fake clock."""

from __future__ import annotations

from tidemq.namesrv.route_info import RouteInfoManager
from tidemq.protocol.headers import Perm, RegisterBrokerRequestHeader, TopicConfig


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def reg(name: str, addr: str, topics: dict[str, int], *, cluster="c1", bid=0, timeout_ms=120_000,
        version=1, perm=Perm.READ_WRITE) -> RegisterBrokerRequestHeader:
    return RegisterBrokerRequestHeader(
        cluster_name=cluster, broker_name=name, broker_id=bid, broker_addr=addr,
        heartbeat_timeout_millis=timeout_ms, data_version=version,
        topics={t: TopicConfig(topic_name=t, read_queue_nums=n, write_queue_nums=n, perm=perm)
                for t, n in topics.items()},
    )


def test_two_brokers_share_a_topic_route():
    m = RouteInfoManager(clock=Clock())
    m.register_broker(reg("b1", "h:1", {"T": 4, "only1": 2}))
    m.register_broker(reg("b2", "h:2", {"T": 8}))
    route = m.get_route("T")
    assert [q.broker_name for q in route.queue_datas] == ["b1", "b2"]
    assert [q.write_queue_nums for q in route.queue_datas] == [4, 8]
    assert [b.broker_addrs for b in route.broker_datas] == [{0: "h:1"}, {0: "h:2"}]
    assert [q.broker_name for q in m.get_route("only1").queue_datas] == ["b1"]
    assert m.get_route("unknown") is None
    assert m.topic_list() == ["T", "only1"]
    info = m.cluster_info()
    assert info.cluster_addr_table == {"c1": ["b1", "b2"]}
    assert set(info.broker_addr_table) == {"b1", "b2"}


def test_a_registration_replaces_the_brokers_topics():
    m = RouteInfoManager(clock=Clock())
    m.register_broker(reg("b1", "h:1", {"A": 1, "B": 1}))
    m.register_broker(reg("b1", "h:1", {"B": 2}, version=2))
    assert m.get_route("A") is None
    assert m.get_route("B").queue_datas[0].read_queue_nums == 2


def test_expiry_after_the_heartbeat_timeout():
    clock = Clock()
    m = RouteInfoManager(clock=clock)
    m.register_broker(reg("b1", "h:1", {"T": 1}, timeout_ms=2000))
    m.register_broker(reg("b2", "h:2", {"T": 1}, timeout_ms=60_000))
    clock.now += 1.5
    assert m.scan_not_active_brokers() == 0
    m.register_broker(reg("b1", "h:1", {"T": 1}, timeout_ms=2000))  # heartbeat renews
    clock.now += 1.5
    assert m.scan_not_active_brokers() == 0
    clock.now += 1.0
    assert m.scan_not_active_brokers() == 1
    assert [q.broker_name for q in m.get_route("T").queue_datas] == ["b2"]
    assert "b1" not in m.cluster_info().broker_addr_table


def test_expire_override():
    clock = Clock()
    m = RouteInfoManager(expire_override_s=0.5, clock=clock)
    m.register_broker(reg("b1", "h:1", {"T": 1}))
    clock.now += 0.6
    assert m.scan_not_active_brokers() == 1
    assert m.get_route("T") is None


def test_connection_loss_and_unregister():
    m = RouteInfoManager(clock=Clock())
    c1, c2 = object(), object()
    m.register_broker(reg("b1", "h:1", {"T": 1}), c1)
    m.register_broker(reg("b2", "h:2", {"T": 1}), c2)
    m.on_connection_closed(c1)
    assert [q.broker_name for q in m.get_route("T").queue_datas] == ["b2"]
    assert m.unregister_broker("c1", "b2", 0, "h:2")
    assert m.get_route("T") is None
    assert m.cluster_info().cluster_addr_table == {}
    assert not m.unregister_broker("c1", "b2", 0, "h:2")


def test_a_broker_back_on_another_port():
    m = RouteInfoManager(clock=Clock())
    m.register_broker(reg("b1", "h:1", {"T": 1}))
    m.register_broker(reg("b1", "h:9", {"T": 1}))
    assert m.get_route("T").broker_datas[0].broker_addrs == {0: "h:9"}
    assert set(m.broker_live_table) == {"h:9"}


def test_a_group_keeps_its_queues_while_a_slave_lives():
    """RocketMQ: the master's death leaves the group's queues in the routes (consumers read
    them on the slave); they go when the last broker of the group goes."""
    m = RouteInfoManager(clock=Clock())
    cm, cs = object(), object()
    m.register_broker(reg("b1", "h:1", {"T": 4}), cm)
    m.register_broker(reg("b1", "h:2", {"T": 4}, bid=1), cs)
    assert m.get_route("T").broker_datas[0].broker_addrs == {0: "h:1", 1: "h:2"}
    m.on_connection_closed(cm)
    route = m.get_route("T")
    assert route.broker_datas[0].broker_addrs == {1: "h:2"}
    assert route.queue_datas[0].read_queue_nums == 4
    m.on_connection_closed(cs)
    assert m.get_route("T") is None


def test_a_slave_learns_its_master_and_a_masterless_group_takes_the_slaves_topics():
    m = RouteInfoManager(clock=Clock())
    h = reg("b1", "h:2", {"T": 2}, bid=1)
    assert m.register_broker(h) == ("", "")  # no master yet; its topics route the group
    assert m.get_route("T").queue_datas[0].read_queue_nums == 2
    master = reg("b1", "h:1", {"T": 4})
    master.ha_server_addr = "h:11"
    assert m.register_broker(master) == ("h:1", "h:11")
    assert m.register_broker(reg("b1", "h:2", {"T": 2}, bid=1)) == ("h:1", "h:11")
    # with a master, a slave's registration does not change the group's topics
    assert m.get_route("T").queue_datas[0].read_queue_nums == 4


def test_a_master_of_an_older_epoch_is_refused():
    """After a promotion (epoch 2), the old master (epoch 1) must not take the group back."""
    import pytest

    from tidemq.namesrv.route_info import RegistrationRefused

    m = RouteInfoManager(clock=Clock())
    old = reg("b1", "h:1", {"T": 1})
    old.epoch = 1
    m.register_broker(old, object())
    new = reg("b1", "h:2", {"T": 1})
    new.epoch = 2
    m.register_broker(new, object())  # a newer epoch replaces it
    assert m.get_route("T").broker_datas[0].broker_addrs == {0: "h:2"}
    with pytest.raises(RegistrationRefused, match="epoch 2"):
        m.register_broker(old)
    assert m.get_route("T").broker_datas[0].broker_addrs == {0: "h:2"}


# -- the change history (GET_ROUTES_CHANGED) ------------------------------------------------------

def test_changes_since_name_exactly_the_topics_and_groups_that_changed():
    m = RouteInfoManager(clock=Clock())
    first = m.changes_since("", 0)  # a client's first question: another history -> everything
    assert first.full and first.instance == m.instance
    m.register_broker(reg("b1", "h:1", {"A": 1, "B": 1, "C": 1}))
    m.register_broker(reg("b2", "h:2", {"A": 1}))
    v = m.version
    assert m.changes_since(m.instance, v) == type(first)(m.instance, v, False, [], [])
    # the same registration again (a heartbeat with topics): nothing changed
    m.register_broker(reg("b1", "h:1", {"A": 1, "B": 1, "C": 1}, version=2))
    assert m.version == v
    # one topic gets more queues, one is removed: those two only
    m.register_broker(reg("b1", "h:1", {"A": 1, "B": 4}, version=3))
    c = m.changes_since(m.instance, v)
    assert (c.full, c.topics, c.brokers) == (False, ["B", "C"], [])
    v = c.version
    # a slave joins b1: the group changed, no topic did (its topics wait while a master lives)
    m.register_broker(reg("b1", "h:3", {"A": 1, "B": 4}, bid=1))
    c = m.changes_since(m.instance, v)
    assert (c.topics, c.brokers) == ([], ["b1"])
    v = c.version
    # b2 leaves: its group and the topic it held
    m.unregister_broker("c1", "b2", 0, "h:2")
    c = m.changes_since(m.instance, v)
    assert (c.topics, c.brokers) == (["A"], ["b2"])
    # a question from before the history, from another history, or from the future: everything
    assert m.changes_since("other", v).full
    assert m.changes_since(m.instance, m.version + 1).full
    assert not m.changes_since(m.instance, 0).full  # the whole history is still there


def test_a_question_older_than_the_kept_history_gets_everything():
    from collections import deque

    m = RouteInfoManager(clock=Clock())
    m._changes = deque(maxlen=3)
    m.register_broker(reg("b1", "h:1", {"A": 1}))  # versions 1 (group b1) and 2 (A)
    v = m.version
    m.register_broker(reg("b1", "h:1", {"A": 1, "B": 1, "C": 1, "D": 1}, version=2))  # 3-5
    assert m.changes_since(m.instance, v).topics == ["B", "C", "D"]  # all of it still kept
    assert m.changes_since(m.instance, v - 1).full  # A's change fell out of the history
    assert m.changes_since(m.instance, m.version - 2).topics == ["C", "D"]
