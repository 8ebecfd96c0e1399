"""The one rule for a read's status (store/pull_outcome.py), used by the CommitLog store and by
non-persistent topics. The non-persistent window used to answer a read past its end with
next offset = max even when min was 0; RocketMQ (and the store) restart from min then."""

from __future__ import annotations

from tidemq.store.pull_outcome import GetStatus, position_outcome, read_outcome


def _out(offset: int, mn: int, mx: int, exists: bool = True) -> tuple[GetStatus, int] | None:
    r = position_outcome(exists, offset, mn, mx)
    return None if r is None else (r.status, r.next_begin_offset)


def test_positions_follow_rocketmq() -> None:
    assert _out(0, 0, 0, exists=False) == (GetStatus.NO_MATCHED_LOGIC_QUEUE, 0)
    assert _out(5, 0, 0) == (GetStatus.NO_MESSAGE_IN_QUEUE, 0)
    assert _out(1, 3, 9) == (GetStatus.OFFSET_TOO_SMALL, 3)
    assert _out(9, 3, 9) == (GetStatus.OFFSET_OVERFLOW_ONE, 9)
    assert _out(50, 3, 9) == (GetStatus.OFFSET_OVERFLOW_BADLY, 9)
    assert _out(50, 0, 9) == (GetStatus.OFFSET_OVERFLOW_BADLY, 0)
    assert _out(4, 3, 9) is None


def test_read_outcomes() -> None:
    assert read_outcome(7, 0, 9, []).status is GetStatus.NO_MATCHED_MESSAGE
    assert read_outcome(7, 0, 9, [], removed=True).status is GetStatus.MESSAGE_WAS_REMOVING
    r = read_outcome(7, 0, 9, [object()])  # type: ignore[list-item]
    assert (r.status, r.next_begin_offset, r.min_offset, r.max_offset) == (
        GetStatus.FOUND, 7, 0, 9)
