"""The five allocation strategies: every queue to exactly one member, deterministic."""

from __future__ import annotations

import pytest

from tidemq.client.message import MessageQueue
from tidemq.client.rebalance import AllocateStrategy, allocate

MQS = sorted(MessageQueue("t", b, i) for b in ("room1@a", "room2@b") for i in range(8))


@pytest.mark.parametrize("strategy", ["avg", "avg_by_circle", "consistent_hash"])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 20])
def test_each_queue_has_exactly_one_owner(strategy: str, n: int) -> None:
    cids = sorted(f"c{i}" for i in range(n))
    owned = [mq for c in cids for mq in allocate(strategy, c, MQS, cids)]
    assert sorted(owned) == MQS


def test_averagely_gives_contiguous_blocks_first_members_one_more() -> None:
    cids = ["a", "b", "c"]
    sizes = [len(allocate(AllocateStrategy.AVG, c, MQS, cids)) for c in cids]
    assert sizes == [6, 5, 5]
    assert allocate("avg", "a", MQS, cids) == MQS[:6]


def test_by_circle_is_round_robin() -> None:
    assert allocate("avg_by_circle", "b", MQS, ["a", "b", "c"]) == MQS[1::3]


def test_consistent_hash_moves_few_queues_when_a_member_joins() -> None:
    before = {c: set(allocate("consistent_hash", c, MQS, ["a", "b", "c"])) for c in "abc"}
    after = {c: set(allocate("consistent_hash", c, MQS, ["a", "b", "c", "d"])) for c in "abcd"}
    moved = sum(len(before[c] - after[c]) for c in "abc")
    assert moved == len(after["d"])  # only what the new member took moved


def test_by_config_and_by_machine_room() -> None:
    mine = [MQS[0], MQS[5]]
    assert allocate("config", "x", MQS, ["x", "y"], config=mine) == mine
    cids = ["a", "b"]
    room1 = [m for c in cids for m in allocate("machine_room", c, MQS, cids, rooms=["room1"])]
    assert sorted(room1) == [m for m in MQS if m.broker_name.startswith("room1@")]


def test_a_member_not_yet_registered_gets_nothing() -> None:
    assert allocate("avg", "late", MQS, ["a", "b"]) == []
