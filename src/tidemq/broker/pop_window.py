"""The pop state of one queue for one consumer group (docs/pop-dispatch.md, stage 2 piece).

Server-side dispatch (POP) hands the messages of a queue to any member of a group; each popped
message is invisible for a while and comes back, with its delivery attempt + 1, unless it is
acked in time. :class:`PopWindow` is that bookkeeping for one (group, topic, queue), with no I/O
and no clock of its own (every call takes ``now`` in ms), so the broker, the revive timer and
the tests drive it alike:

- ``start``: every offset below it is acked (what the group's committed offset becomes);
- ``next``: the first offset never popped;
- for each offset in ``[start, next)``: acked, or in flight with its ``pop_time``, invisible
  deadline and delivery ``attempt``.

:meth:`pop` hands out first the offsets whose deadline passed (revived, attempt + 1, in offset
order) and the skipped ones (below), then new ones from ``next``; orderly POP
(``pop_orderly.py``) picks offsets itself and hands each out with :meth:`deliver`, which may
skip offsets (of a message group that has a message in flight): they stay *new* in
``[start, next)`` (``gaps``) until delivered; :meth:`ack` and :meth:`change_invisible` take the
``pop_time`` of the delivery they answer (it is in the receipt handle, ``protocol/receipt.py``):
an answer to an older delivery of the same offset is *stale* and changes nothing, so a consumer
that was too slow cannot ack the message another consumer now holds. Acks move ``start`` over
the acked prefix.

Kept in plain dicts keyed by offset (O(1) per pop, ack and change); revival scans the in-flight
entries in offset order, bounded by ``max_messages``. Not durable by itself: the broker logs pops
and acks (docs/pop-dispatch.md, "Broker state") and rebuilds a window from that log.

Threads: one owner (the broker's event loop).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

__all__ = ["PopWindow", "Popped", "WindowState"]

#: (start, next, [(offset, pop time, deadline, attempt), ...], [acked offset, ...])
WindowState = tuple[int, int, list[tuple[int, int, int, int]], list[int]]


class Popped(NamedTuple):
    """One delivery: the message at ``offset``, its ``attempt`` (1 = first) and ``pop_time``
    (the receipt handle's; ms), invisible until ``pop_time + invisible_ms``. A named tuple,
    not a frozen dataclass: one is made per delivered message, and a tuple is made at about
    half the cost."""

    offset: int
    attempt: int
    pop_time: int
    invisible_ms: int


class _InFlight:
    __slots__ = ("pop_time", "deadline", "attempt")

    def __init__(self, pop_time: int, deadline: int, attempt: int) -> None:
        self.pop_time = pop_time
        self.deadline = deadline
        self.attempt = attempt


class PopWindow:
    """Pop/ack/revive state of one queue for one group (see the module doc)."""

    def __init__(self, start: int = 0) -> None:
        if start < 0:
            raise ValueError("start offset must be >= 0")
        self.start = start
        self.next = start
        self._inflight: dict[int, _InFlight] = {}
        self._acked: set[int] = set()  # acked offsets in [start, next)
        self._gaps: set[int] = set()  # never delivered offsets in [start, next) (orderly skips)
        self.redelivered = 0  # deliveries with attempt > 1

    # -- queries -----------------------------------------------------------------------------
    def in_flight(self) -> int:
        return len(self._inflight)

    def unacked(self, max_offset: int) -> int:
        """Messages of the queue (up to ``max_offset``) not acked yet: the group's lag, holes
        included."""
        return len(self._inflight) + len(self._gaps) + max(0, max_offset - self.next)

    def earliest_deadline(self, now: int) -> int | None:
        """The earliest invisible deadline after ``now`` (ms) among the in-flight deliveries:
        when the next one becomes poppable again (None: none in flight, or all passed)."""
        return min((e.deadline for e in self._inflight.values() if e.deadline > now),
                   default=None)

    def poppable(self, now: int, max_offset: int) -> bool:
        """Would :meth:`pop` hand out something now (the queue ends at ``max_offset``)?"""
        return self.next < max_offset or bool(self._gaps) or any(
            e.deadline <= now for e in self._inflight.values())

    def revivable(self, offset: int, now: int) -> bool:
        """Is ``offset`` in flight with its invisible time run out?"""
        e = self._inflight.get(offset)
        return e is not None and e.deadline <= now

    def state(self, offset: int) -> str:
        """"acked", "in_flight" or "new" (never popped, or skipped)."""
        if offset < self.start or offset in self._acked:
            return "acked"
        if offset in self._inflight:
            return "in_flight"
        return "new"

    # -- operations ----------------------------------------------------------------------------
    def pop(self, max_messages: int, now: int, invisible_ms: int, max_offset: int
            ) -> list[Popped]:
        """Up to ``max_messages`` deliveries: revived offsets first (deadline <= now), then new
        ones below ``max_offset`` (the queue's end)."""
        if max_messages < 1 or invisible_ms < 1:
            raise ValueError("max_messages and invisible_ms must be >= 1")
        out: list[Popped] = []
        deadline = now + invisible_ms
        old = [o for o, e in self._inflight.items() if e.deadline <= now]
        if self._gaps:
            old += self._gaps
        for off in sorted(old):
            if len(out) >= max_messages:
                break
            out.append(self.deliver(off, now, invisible_ms))
        while len(out) < max_messages and self.next < max_offset:
            off = self.next
            self.next += 1
            self._inflight[off] = _InFlight(now, deadline, 1)
            out.append(Popped(off, 1, now, invisible_ms))
        return out

    def deliver(self, offset: int, now: int, invisible_ms: int) -> Popped:
        """Hand out ``offset`` (not acked) now: a delivery again (attempt + 1) when it is in
        flight, else its first; offsets between ``next`` and it are skipped (gaps)."""
        e = self._inflight.get(offset)
        deadline = now + invisible_ms
        if e is not None:
            e.attempt += 1
            e.pop_time = now
            e.deadline = deadline
            self.redelivered += 1
            return Popped(offset, e.attempt, now, invisible_ms)
        if offset < self.start or offset in self._acked:
            raise ValueError(f"offset {offset} is acked: it cannot be delivered")
        if offset < self.next:
            self._gaps.discard(offset)
        else:
            self._gaps.update(range(self.next, offset))
            self.next = offset + 1
        self._inflight[offset] = _InFlight(now, deadline, 1)
        return Popped(offset, 1, now, invisible_ms)

    def ack(self, offset: int, pop_time: int) -> bool:
        """Ack the delivery of ``offset`` popped at ``pop_time``; False when it is stale
        (acked already, popped again since, or never popped)."""
        e = self._inflight.get(offset)
        if e is None or e.pop_time != pop_time:
            return False
        del self._inflight[offset]
        self._acked.add(offset)
        self._advance()
        return True

    def change_invisible(self, offset: int, pop_time: int, invisible_ms: int, now: int
                         ) -> Popped | None:
        """Make the delivery of ``offset`` popped at ``pop_time`` invisible for
        ``invisible_ms`` from ``now``; the new delivery (its receipt handle replaces the old),
        or None when the old one is stale."""
        if invisible_ms < 1:
            raise ValueError("invisible_ms must be >= 1")
        e = self._inflight.get(offset)
        if e is None or e.pop_time != pop_time:
            return None
        e.pop_time = now
        e.deadline = now + invisible_ms
        return Popped(offset, e.attempt, now, invisible_ms)

    def restore(self, offset: int, attempt: int, pop_time: int, invisible_ms: int) -> None:
        """Replay one logged delivery (recovery, ``broker/pop_log.py``): ``offset`` is in
        flight with this attempt and deadline, unless it is acked already. Offsets between
        ``next`` and ``offset`` that no record names (a lost record) become in flight with a
        passed deadline: delivered again at the next pop, never lost."""
        if offset < self.start or offset in self._acked:
            return
        while self.next < offset:
            self._inflight.setdefault(self.next, _InFlight(0, 0, 0))
            self.next += 1
        if offset == self.next:
            self.next += 1
        self._gaps.discard(offset)
        e = self._inflight.get(offset)
        if e is None:
            self._inflight[offset] = _InFlight(pop_time, pop_time + invisible_ms, attempt)
        else:
            e.pop_time, e.deadline, e.attempt = pop_time, pop_time + invisible_ms, attempt

    # -- chosen deliveries (key-shared, ``key_shared_dispatch.py``) ------------------------------
    def expired(self, now: int) -> list[int]:
        """In-flight offsets whose deadline passed (an ack timeout, a consumer that left),
        unsorted; the skipped offsets (gaps) are not in flight."""
        return [o for o, e in self._inflight.items() if e.deadline <= now]

    def deliverable(self, offset: int, now: int) -> bool:
        """True when :meth:`deliver` may hand out ``offset`` now: not acked, and not in flight
        with a deadline to come."""
        e = self._inflight.get(offset)
        if e is None:
            return offset >= self.next or offset in self._gaps
        return e.deadline <= now

    def deliver_many(self, offsets: list[int], now: int, invisible_ms: int) -> list[Popped]:
        """:meth:`deliver` of each of ``offsets`` (increasing) that :meth:`deliverable` allows,
        skipping the others: one call per pop, not per message. The common case -- read but
        unassigned offsets (gaps), all first deliveries -- is told by one set operation and
        taken without a per-offset test."""
        inflight, gaps = self._inflight, self._gaps
        deadline = now + invisible_ms
        if gaps.issuperset(offsets):  # every one is a gap: all first deliveries
            gaps.difference_update(offsets)
            for o in offsets:
                inflight[o] = _InFlight(now, deadline, 1)
            return [Popped(o, 1, now, invisible_ms) for o in offsets]
        out: list[Popped] = []
        for o in offsets:
            e = inflight.get(o)
            if e is None and o in gaps:
                gaps.discard(o)
                inflight[o] = _InFlight(now, deadline, 1)
                out.append(Popped(o, 1, now, invisible_ms))
            elif e is None and o >= self.next or e is not None and e.deadline <= now:
                out.append(self.deliver(o, now, invisible_ms))
        return out

    def pass_over(self, end: int) -> None:
        """Offsets from ``next`` up to ``end`` (excluded) were read but given to nobody: they
        become gaps (never delivered, not acked: their first delivery is attempt 1)."""
        if end > self.next:
            self._gaps.update(range(self.next, end))
            self.next = end

    def expire(self, offset: int, pop_time: int) -> bool:
        """End the delivery of ``offset`` popped at ``pop_time`` now (its consumer left): it is
        revivable at once. False when that delivery is over already."""
        e = self._inflight.get(offset)
        if e is None or e.pop_time != pop_time:
            return False
        e.deadline = 0
        return True

    def holds(self, offset: int, pop_time: int) -> bool:
        """True while the delivery of ``offset`` popped at ``pop_time`` is in flight."""
        e = self._inflight.get(offset)
        return e is not None and e.pop_time == pop_time

    def to_state(self) -> WindowState:
        """Everything of the window, as plain tuples (``broker/pop_log.py`` snapshots)."""
        return (self.start, self.next,
                [(o, e.pop_time, e.deadline, e.attempt) for o, e in self._inflight.items()],
                sorted(self._acked))

    @classmethod
    def from_state(cls, state: Sequence[Any]) -> PopWindow:
        start, nxt, inflight, acked = state
        w = cls(start)
        w.next = nxt
        w._inflight = {o: _InFlight(pt, dl, a) for o, pt, dl, a in inflight}
        w._acked = set(acked)
        if nxt - start != len(w._inflight) + len(w._acked):  # orderly skips: never delivered
            w._gaps = set(range(start, nxt)) - w._inflight.keys() - w._acked
        return w

    def _advance(self) -> None:
        acked = self._acked
        s = self.start
        while s in acked:
            acked.discard(s)
            s += 1
        self.start = s
