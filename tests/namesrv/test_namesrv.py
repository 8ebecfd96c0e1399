"""Name server and brokers as real processes: registration, routes, failure detection."""

from __future__ import annotations

import time

import pytest

from broker.wire import (
    RequestCode,
    ResponseCode,
    Wire,
    error_message,
    start,
    start_broker,
    start_namesrv,
    wait_until,
)
from tidemq.protocol.headers import RegisterBrokerRequestHeader, TopicConfig

R = ResponseCode
FAST = ["-o", "register_interval_ms=300", "-o", "heartbeat_timeout_ms=1500"]


def route(ns: str, topic: str):
    with Wire(ns) as w:
        return w.request(RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": topic})


def route_brokers(ns: str, topic: str) -> list[str]:
    r = route(ns, topic)
    if r.code != R.SUCCESS:
        return []
    return [q.broker_name for q in r.header.queue_datas]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cluster")
    ns = start_namesrv(tmp, "--scan-interval-ms", "200")
    a = start_broker(tmp, ns.addr, *FAST, name="broker-a")
    b = start_broker(tmp, ns.addr, *FAST, name="broker-b")
    yield tmp, ns, a, b
    for srv in (a, b, ns):
        if srv.alive():
            srv.stop()


def test_routes_list_both_brokers(cluster):
    _tmp, ns, a, b = cluster
    for srv in (a, b):
        with Wire(srv.addr) as w:
            assert w.create_topic("shared", 4).code == R.SUCCESS
    # Topic changes reach the name server at once, not at the next 30 s registration.
    assert wait_until(lambda: route_brokers(ns.addr, "shared") == ["broker-a", "broker-b"], 3)
    r = route(ns.addr, "shared")
    addrs = {bd.broker_name: bd.broker_addrs[0] for bd in r.header.broker_datas}
    assert addrs == {"broker-a": a.addr, "broker-b": b.addr}
    assert {q.write_queue_nums for q in r.header.queue_datas} == {4}
    with Wire(ns.addr) as w:
        topics = w.request(RequestCode.GET_ALL_TOPIC_LIST_FROM_NAMESERVER).header.topics
        assert "shared" in topics
        info = w.request(RequestCode.GET_BROKER_CLUSTER_INFO).header
        assert info.cluster_addr_table == {"DefaultCluster": ["broker-a", "broker-b"]}


def test_auto_created_topic_gets_a_route(cluster):
    _tmp, ns, a, _b = cluster
    with Wire(a.addr) as w:
        assert w.send_messages("auto1", [b"x"]).code == R.SUCCESS
    assert wait_until(lambda: route_brokers(ns.addr, "auto1") == ["broker-a"], 3)


def test_unknown_topic_and_bad_requests(cluster):
    _tmp, ns, _a, _b = cluster
    r = route(ns.addr, "no-such-topic")
    assert r.code == R.TOPIC_NOT_EXIST and "no-such-topic" in error_message(r)
    with Wire(ns.addr) as w:
        r = w.request(RequestCode.REGISTER_BROKER, {"broker_name": "x"})
        assert r.code == R.INVALID_ARGUMENT
        r = w.request(RequestCode.PULL_MESSAGE, {})
        assert r.code == R.REQUEST_CODE_NOT_SUPPORTED
        assert w.request(RequestCode.GET_ALL_TOPIC_LIST_FROM_NAMESERVER).code == R.SUCCESS
    with Wire(ns.addr) as bad:
        bad.send_raw(b"\xff" * 32)
        assert bad.is_closed_by_peer(5)
    assert route(ns.addr, "shared").code == R.SUCCESS


def test_silent_broker_expires_after_its_heartbeat_timeout(cluster):
    """A broker that stops registering but keeps its connection open (hung, partitioned)."""
    _tmp, ns, _a, _b = cluster
    with Wire(ns.addr) as w:
        h = RegisterBrokerRequestHeader(
            cluster_name="DefaultCluster", broker_name="ghost", broker_id=0,
            broker_addr="127.0.0.1:1", heartbeat_timeout_millis=800,
            topics={"ghost-topic": TopicConfig(topic_name="ghost-topic")},
        )
        assert w.request(RequestCode.REGISTER_BROKER, h).code == R.SUCCESS
        t0 = time.monotonic()
        assert route_brokers(ns.addr, "ghost-topic") == ["ghost"]
        assert wait_until(lambda: route_brokers(ns.addr, "ghost-topic") == [], 5)
        took = time.monotonic() - t0
        assert 0.7 <= took < 2.5, took


def test_killed_broker_drops_out_of_the_route(cluster):
    tmp, ns, a, b = cluster
    assert wait_until(lambda: route_brokers(ns.addr, "shared") == ["broker-a", "broker-b"], 3)
    b.kill9()
    t0 = time.monotonic()
    # Within the (test-shortened) 1.5 s heartbeat timeout plus a scan interval; in practice at
    # once, since the name server sees the registration connection close.
    assert wait_until(lambda: route_brokers(ns.addr, "shared") == ["broker-a"], 3)
    print(f"\nkilled broker left the route after {time.monotonic() - t0:.2f} s")
    # broker-a keeps registering: it stays.
    time.sleep(0.8)
    assert route_brokers(ns.addr, "shared") == ["broker-a"]
    # Restarted on the same data, broker-b comes back with its topics.
    b2 = start_broker(tmp, ns.addr, *FAST, name="broker-b")
    try:
        assert wait_until(lambda: route_brokers(ns.addr, "shared") == ["broker-a", "broker-b"], 3)
    finally:
        b2.stop()
    # A clean stop unregisters at once.
    assert wait_until(lambda: route_brokers(ns.addr, "shared") == ["broker-a"], 1)


def test_dev_runs_both_in_one_process_and_starts_fast(tmp_path):
    t0 = time.monotonic()
    dev = start(["dev", "--data-dir", str(tmp_path / "dev"), "--namesrv-port", "0",
                 "--broker-port", "0"], str(tmp_path / "dev.log"))
    ready = time.monotonic() - t0
    try:
        print(f"\ntidemq dev ready in {ready:.2f} s")
        assert dev.ready.startswith("tidemq dev ready namesrv=127.0.0.1:")
        with Wire(dev.addrs["broker"]) as w:
            assert w.send_messages("hello", [b"world"]).code == R.SUCCESS
        assert wait_until(lambda: route_brokers(dev.addrs["namesrv"], "hello") == ["broker-a"], 3)
        assert ready < 3.0  # generous under a loaded test run; measured ~0.4 s alone
    finally:
        assert dev.stop() == 0


def test_registration_without_topics_stands_for_a_known_data_version(tmp_path):
    """Issue 17: a broker's periodic registration leaves its topic table out when the name
    server holds that data version; a name server that does not (restarted, expired) answers
    need_topics and keeps no empty route."""
    ns = start_namesrv(tmp_path)
    link = Wire(ns.addr)  # the broker's connection (its close unregisters the broker)
    try:
        def reg(version: int, topics: dict[str, int] | None, omitted: bool = False):
            h = RegisterBrokerRequestHeader(
                cluster_name="c", broker_name="bx", broker_id=0, broker_addr="127.0.0.1:1",
                data_version=version, topics_omitted=omitted,
                topics={t: TopicConfig(topic_name=t, read_queue_nums=n, write_queue_nums=n)
                        for t, n in (topics or {}).items()})
            r = link.request(RequestCode.REGISTER_BROKER, h)
            assert r.code == R.SUCCESS, error_message(r)
            return r.header

        assert reg(3, None, omitted=True).need_topics  # never heard of it
        assert route_brokers(ns.addr, "kept") == []
        assert not reg(3, {"kept": 2}).need_topics
        assert route_brokers(ns.addr, "kept") == ["bx"]
        assert not reg(3, None, omitted=True).need_topics  # a heartbeat: topics stay
        assert route_brokers(ns.addr, "kept") == ["bx"]
        assert reg(4, None, omitted=True).need_topics  # a version it does not hold
        assert route_brokers(ns.addr, "kept") == ["bx"]
    finally:
        link.close()
        ns.stop()


def test_a_broker_sends_its_topics_only_when_they_changed(tmp_path):
    ns = start_namesrv(tmp_path, "--scan-interval-ms", "200")
    b = start_broker(tmp_path, ns.addr, "-o", "register_interval_ms=200",
                     "-o", "heartbeat_timeout_ms=1000", name="broker-v")
    try:
        with Wire(b.addr) as w:
            assert w.create_topic("versioned", 2).code == R.SUCCESS
        assert wait_until(lambda: route_brokers(ns.addr, "versioned") == ["broker-v"], 3)
        time.sleep(2.5)  # many heartbeats without topics, past the 1 s heartbeat timeout
        assert route_brokers(ns.addr, "versioned") == ["broker-v"]
        # a name server that lost everything gets the topics again at the next heartbeat
        port = ns.addr.rpartition(":")[2]
        ns.stop()
        ns = start_namesrv(tmp_path, "--port", port)
        assert wait_until(lambda: route_brokers(ns.addr, "versioned") == ["broker-v"], 5)
    finally:
        b.stop()
        ns.stop()
