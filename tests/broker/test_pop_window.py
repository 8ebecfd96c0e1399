"""PopWindow (broker/pop_window.py) against a model: a plain dict of offset -> state, driven
by a hypothesis state machine of pops, orderly deliveries of chosen offsets (which may skip
offsets), acks (current and stale), invisible-time changes, clock steps, queue growth and
snapshot round trips. Nothing is lost (every offset below the queue's end is acked, in flight
or new), nothing acked comes back, stale answers change nothing, and start is the acked
prefix."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tidemq.broker.pop_window import Popped, PopWindow


class PopModel(RuleBasedStateMachine):
    @initialize(start=st.integers(0, 5))
    def init(self, start):
        self.w = PopWindow(start)
        self.now = 1_000
        self.end = start
        self.start = start
        # offset -> ("acked",) | ("flight", pop_time, deadline, attempt)
        self.model: dict[int, tuple] = {}
        self.handles: list[tuple[int, int]] = []  # every (offset, pop_time) ever handed out

    @rule(n=st.integers(1, 5))
    def produce(self, n):
        self.end += n

    @rule(ms=st.integers(0, 3000))
    def tick(self, ms):
        self.now += ms

    @rule(n=st.integers(1, 6), invisible=st.integers(1, 2000))
    def pop(self, n, invisible):
        got = self.w.pop(n, self.now, invisible, self.end)
        # model: revived and skipped ones first, in offset order, then new ones
        new_from = max([o for o in self.model] + [self.start - 1]) + 1
        revived = sorted([o for o, s in self.model.items()
                          if s[0] == "flight" and s[2] <= self.now]
                         + [o for o in range(self.start, new_from) if o not in self.model])[:n]
        fresh = list(range(new_from, self.end))[: n - len(revived)]
        assert [p.offset for p in got] == revived + fresh
        for p in got:
            attempt = self.model[p.offset][3] + 1 if p.offset in self.model else 1
            assert (p.attempt, p.pop_time, p.invisible_ms) == (attempt, self.now, invisible)
            self.model[p.offset] = ("flight", self.now, self.now + invisible, attempt)
            self.handles.append((p.offset, p.pop_time))

    @precondition(lambda self: self.end > self.start)
    @rule(data=st.data(), invisible=st.integers(1, 2000))
    def deliver(self, data, invisible):
        """Orderly POP's move: hand out one chosen offset that is not acked."""
        off = data.draw(st.integers(self.start, self.end - 1))
        s = self.model.get(off)
        if s == ("acked",):
            with pytest.raises(ValueError):
                self.w.deliver(off, self.now, invisible)
            return
        p = self.w.deliver(off, self.now, invisible)
        attempt = s[3] + 1 if s is not None else 1
        assert (p.offset, p.attempt, p.pop_time) == (off, attempt, self.now)
        self.model[off] = ("flight", self.now, self.now + invisible, attempt)
        self.handles.append((off, self.now))

    @rule()
    def snapshot_round_trip(self):
        self.w = PopWindow.from_state(self.w.to_state())

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def ack(self, data):
        off, pt = data.draw(st.sampled_from(self.handles))
        s = self.model.get(off)
        current = s is not None and s[0] == "flight" and s[1] == pt
        assert self.w.ack(off, pt) is current
        if current:
            self.model[off] = ("acked",)
            while self.model.get(self.start) == ("acked",):
                del self.model[self.start]
                self.start += 1

    @precondition(lambda self: self.handles)
    @rule(data=st.data(), invisible=st.integers(1, 2000))
    def change(self, data, invisible):
        off, pt = data.draw(st.sampled_from(self.handles))
        s = self.model.get(off)
        current = s is not None and s[0] == "flight" and s[1] == pt
        p = self.w.change_invisible(off, pt, invisible, self.now)
        assert (p is not None) is current
        if current:
            assert (p.offset, p.attempt, p.pop_time) == (off, s[3], self.now)
            self.model[off] = ("flight", self.now, self.now + invisible, s[3])
            self.handles.append((off, self.now))

    @invariant()
    def agrees(self):
        if not hasattr(self, "w"):
            return
        assert self.w.start == self.start
        for off in range(max(0, self.start - 2), self.end + 2):
            s = self.model.get(off)
            want = ("acked" if off < self.start or s == ("acked",)
                    else "in_flight" if s is not None else "new")
            assert self.w.state(off) == want, off
        assert self.w.in_flight() == sum(1 for s in self.model.values() if s[0] == "flight")
        assert self.w.unacked(self.end) == sum(
            1 for o in range(self.start, self.end) if self.model.get(o) != ("acked",))
        flights = [s[2] for s in self.model.values() if s[0] == "flight" and s[2] > self.now]
        assert self.w.earliest_deadline(self.now) == (min(flights) if flights else None)
        new_from = max([o for o in self.model] + [self.start - 1]) + 1
        assert self.w.poppable(self.now, self.end) == (
            new_from < self.end or any(o not in self.model for o in range(self.start, new_from))
            or any(s[0] == "flight" and s[2] <= self.now for s in self.model.values()))


# A test function, not PopModel.TestCase: hypothesis digests the
# machine's source, and for a class inspect.getsource runs ast.parse, which
# CPython 3.11 can fail ('AST constructor recursion depth mismatch') while
# another thread (a client's I/O thread formatting a traceback) parses too.
# A lambda's source is found without ast.
def test_pop_window_matches_the_model() -> None:
    run_state_machine_as_test(lambda: PopModel(), settings=settings(
        max_examples=150, stateful_step_count=40, deadline=None))


def test_a_slow_consumers_ack_is_stale_once_the_message_came_back():
    w = PopWindow()
    [first] = w.pop(1, now=0, invisible_ms=100, max_offset=1)
    assert w.pop(1, now=50, invisible_ms=100, max_offset=1) == []  # still invisible
    [again] = w.pop(1, now=150, invisible_ms=100, max_offset=1)  # revived: attempt 2
    assert (again.offset, again.attempt) == (0, 2) and w.redelivered == 1
    assert not w.ack(0, first.pop_time)  # the first consumer was too slow
    assert w.ack(0, again.pop_time) and w.start == 1
    assert w.pop(5, now=1000, invisible_ms=100, max_offset=1) == []  # acked never comes back


def test_bad_arguments():
    with pytest.raises(ValueError):
        PopWindow(-1)
    with pytest.raises(ValueError):
        PopWindow().pop(0, 0, 10, 5)
    with pytest.raises(ValueError):
        PopWindow().change_invisible(0, 0, 0, 0)


def test_state_round_trip_and_restore():
    from tidemq.broker.pop_window import PopWindow as W
    w = W(5)
    a, b, c = w.pop(3, 1000, 100, 20)
    assert w.ack(b.offset, b.pop_time)
    copy = W.from_state(w.to_state())
    assert copy.to_state() == w.to_state()
    assert [copy.state(o) for o in range(5, 9)] == ["in_flight", "acked", "in_flight", "new"]
    # replay of a record naming offset 10 on a window at 5: 5..9 come back at the next pop
    r = W(5)
    r.restore(10, 2, 1000, 100)
    assert r.next == 11 and r.state(10) == "in_flight"
    assert [p.offset for p in r.pop(10, 1001, 100, 11)] == [5, 6, 7, 8, 9]


def test_deliver_chosen_offsets_pass_over_and_expire() -> None:
    """Key-shared's use of a window: chosen offsets delivered, the skipped ones left as gaps
    (never delivered, not acked), a leaving consumer's delivery ended early."""
    w = PopWindow(10)
    p = w.deliver(12, 1000, 500)
    assert (p.offset, p.attempt, w.next) == (12, 1, 13)
    assert w.deliverable(10, 1000) and w.deliverable(11, 1000)  # gaps wait for their owner
    assert not w.deliverable(12, 1000) and w.deliverable(13, 1000)
    assert w.deliver(11, 1001, 500).attempt == 1  # a first delivery, not a redelivery
    assert w.redelivered == 0
    assert w.holds(12, 1000) and not w.holds(12, 999)
    assert w.expire(12, 1000) and not w.expire(12, 999)
    assert sorted(w.expired(1002)) == [12]  # gaps are not in flight
    again = w.deliver(12, 1003, 500)
    assert (again.attempt, w.redelivered) == (2, 1)
    assert w.ack(12, 1003) and w.ack(11, 1001)
    assert w.start == 10 and w.unacked(13) == 1  # the hole at 10
    w.pass_over(15)
    assert w.next == 15 and w.unacked(15) == 3
    assert PopWindow.from_state(w.to_state()).unacked(15) == 3  # gaps survive a snapshot


def test_deliver_many_is_deliver_of_each_deliverable_offset() -> None:
    """``deliver_many`` (one call per key-shared pop) hands out exactly what ``deliverable``
    allows, as ``deliver`` would, and skips acked and still-invisible offsets."""
    def setup() -> PopWindow:
        w = PopWindow(0)
        w.pass_over(6)  # 0..5 read, unassigned
        w.deliver(1, 100, 50)
        w.deliver(2, 100, 10)
        assert w.ack(1, 100)
        return w

    many, one = setup(), setup()
    offsets = [0, 1, 2, 3, 5, 6, 8]  # 1 acked; 2 in flight, revived at 110; 6, 8 past next
    got = many.deliver_many(offsets, 120, 30)
    want = [one.deliver(o, 120, 30) for o in offsets if one.deliverable(o, 120)]
    assert got == want and [p.offset for p in got] == [0, 2, 3, 5, 6, 8]
    assert got[1].attempt == 2 and all(p.attempt == 1 for p in got if p.offset != 2)
    assert many.to_state() == one.to_state() and many.next == 9
    assert many.deliver_many([0, 2, 4], 130, 30) == [Popped(4, 1, 130, 30)]  # 0, 2 invisible
