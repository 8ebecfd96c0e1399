"""Periodic passes cost what changed, not what exists (issue 17): the stats sample copies only
the counters that moved, and the shrinker's pass sees only the shrinking topics. Each is held
against a simple model (the full copy / the full filter it replaces)."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.wire import start_namesrv
from tidemq.broker.registration import NamesrvRegistration
from tidemq.broker.stats import BrokerStats
from tidemq.broker.topic_config import TopicConfigManager
from tidemq.protocol.headers import RegisterBrokerRequestHeader, TopicConfig

TOPICS = [f"t{i}" for i in range(5)]
GROUPS = ["g1", "g2"]


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_sample_copies_only_the_counters_that_changed() -> None:
    stats = BrokerStats(5.0, clock=_Clock())
    for i in range(10_000):
        stats.record_put(f"topic-{i}", 1, 10, 0.0)
        stats.record_get("g", f"topic-{i}", 1, 10)
    stats.sample()
    assert stats.last_sample_keys == 20_000
    stats.record_put("topic-7", 3, 30, 0.0)
    stats.record_get("g", "topic-9", 2, 20)
    stats.sample()
    assert stats.last_sample_keys == 2
    stats.sample()
    assert stats.last_sample_keys == 0


_op = st.one_of(
    st.tuples(st.just("put"), st.sampled_from(TOPICS), st.integers(1, 50)),
    st.tuples(st.just("get"), st.sampled_from(TOPICS), st.sampled_from(GROUPS),
              st.integers(1, 50)),
    st.tuples(st.just("sample"), st.floats(0.5, 10.0)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_op, max_size=80))
def test_rates_equal_those_of_full_copies(ops: list[tuple]) -> None:
    """The sparse ring gives the rates a ring of full copies gives (the old design)."""
    clock = _Clock()
    stats = BrokerStats(20.0, clock=clock)  # a ring of 4 samples: short runs wrap it
    full: list[tuple[float, dict[str, int], dict[str, int]]] = []
    for op in ops:
        if op[0] == "put":
            stats.record_put(op[1], op[2], 1, 0.0)
        elif op[0] == "get":
            stats.record_get(op[2], op[1], op[3], 1)
        else:
            clock.now += op[1]
            stats.sample()
            full.append((clock.now, {k: v[0] for k, v in stats.put.items()},
                         {k: v[0] for k, v in stats.get.items()}))
            full = full[-stats._samples.maxlen:]  # type: ignore[operator]
    clock.now += 1.0
    ts, put_base, get_base = full[0] if full else (stats.started, {}, {})
    elapsed = max(clock.now - ts, 1e-3)
    for t in TOPICS:
        want = (stats.put.get(t, [0])[0] - put_base.get(t, 0)) / elapsed
        assert abs(stats.put_tps(t) - want) < 1e-9
        for g in GROUPS:
            key = f"{t}@{g}"
            want = (stats.get.get(key, [0])[0] - get_base.get(key, 0)) / elapsed
            assert abs(stats.get_tps(g, t) - want) < 1e-9


_tc_op = st.one_of(
    st.tuples(st.just("update"), st.sampled_from(TOPICS), st.integers(0, 3)),
    st.tuples(st.just("delete"), st.sampled_from(TOPICS)),
    st.tuples(st.just("reload")),
    st.tuples(st.just("adopt")),
)


@settings(max_examples=100, deadline=None)
@given(st.lists(_tc_op, max_size=40))
def test_the_shrinking_set_follows_the_table(tmp_path_factory, ops: list[tuple]) -> None:
    """shrinking() is always exactly the configs with shrinking_to set, through updates,
    deletes, a reload from the file and a slave's adoption of a table."""
    path = str(tmp_path_factory.mktemp("topics") / "topics.json")
    tm = TopicConfigManager(path)
    for op in ops:
        if op[0] == "update":
            tm.update(TopicConfig(topic_name=op[1], read_queue_nums=8, write_queue_nums=4,
                                  shrinking_to=op[2]))
        elif op[0] == "delete":
            tm.delete(op[1])
        elif op[0] == "reload":
            tm.persist()
            tm = TopicConfigManager(path)
            tm.load()
        else:
            other = TopicConfigManager(path + ".slave")
            other.adopt(tm.all(), tm.data_version)
            tm = other
        want = sorted((tc for tc in tm.all().values() if tc.shrinking_to),
                      key=lambda tc: tc.topic_name)
        assert tm.shrinking() == want


def test_the_shrinker_pass_sees_only_shrinking_topics(tmp_path) -> None:
    tm = TopicConfigManager(str(tmp_path / "topics.json"))
    for i in range(12_500):
        tm.update(TopicConfig(topic_name=f"scale-{i}", read_queue_nums=8, write_queue_nums=8))
    tm.update(TopicConfig(topic_name="scale-77", read_queue_nums=8, write_queue_nums=2,
                          shrinking_to=2))
    assert [tc.topic_name for tc in tm.shrinking()] == ["scale-77"]
    tm.update(TopicConfig(topic_name="scale-77", read_queue_nums=2, write_queue_nums=2))
    assert tm.shrinking() == []


def test_the_periodic_registration_copies_the_topic_table_only_when_needed(tmp_path) -> None:
    """REGISTER_BROKER every interval: the table (12,500 topics at 100,000 queues) is copied
    for the first registration, after a change and after need_topics, not for heartbeats."""
    ns = start_namesrv(tmp_path)
    version = [1]
    built: list[bool] = []

    def make(with_topics: bool) -> RegisterBrokerRequestHeader:
        built.append(with_topics)
        return RegisterBrokerRequestHeader(
            cluster_name="c", broker_name="walks", broker_id=0, broker_addr="127.0.0.1:1",
            data_version=version[0], topics_omitted=not with_topics,
            topics={"w": TopicConfig(topic_name="w", read_queue_nums=2, write_queue_nums=2)}
            if with_topics else {})

    async def go() -> list[int]:
        reg = NamesrvRegistration([ns.addr], make, interval_s=60, timeout_s=3)
        try:
            out = [await reg.register_all() for _ in range(3)]
            version[0] = 2  # the table changed
            out += [await reg.register_all() for _ in range(2)]
            return out
        finally:
            reg.close()

    try:
        assert asyncio.run(go()) == [1] * 5
    finally:
        ns.stop()
    # round 1: full; 2, 3: heartbeats; 4: a new version, full; 5: heartbeat
    assert built == [False, True, False, False, False, True, False]
