"""Held pops and notifications: long polling of server-side dispatch (docs/pop-dispatch.md).

A POP_MESSAGE (or NOTIFICATION) that finds nothing poppable and carries ``poll_ms`` is *held*
here, filed under its (group, topic), and tried again only when something may have become
poppable -- never on a periodic scan:

- **arrival**: the store's dispatch listener (:meth:`PopHoldService.on_message_arrival`, as
  ``long_polling.py``'s held pulls get it) wakes the held requests of the topic (of that queue,
  or of any queue);
- **revive**: an in-flight message becomes poppable again when its invisible time runs out.
  One timer per pop window (group, topic, queue), at the window's earliest invisible deadline,
  armed only while some request of that (group, topic) is held; a pop or an invisible-time
  change that sets an earlier deadline moves it (:meth:`deadline_set`);
- **ack**: an ack can free a message (orderly POP: the next message of a message group;
  ``pop_orderly.py``), so the processor wakes the (group, topic) after acks (:meth:`wake`);
- **route**: a key-shared pop that read ahead routes messages to other consumers
  (``subscription_types.py``): their held pops are woken (:meth:`wake` with ``routed``);
- **deadline**: a timer per held request answers it when ``poll_ms`` is up (nothing found).

A wake schedules one retry pass per (group, topic) with ``call_soon`` (many arrivals in one
loop turn cost one pass; the store calls the listener inside its put lock, and the sender's
answer leaves first). The pass tries the held requests in arrival order; one that still finds
nothing stays held, and a later one asking exactly the same (queue, subscription, order) is not
tried in that pass (it would find nothing too). ``stats()`` counts the passes' tries, so a test
can tell an event-driven wait from a polling loop.

Threads: the broker's event loop; :meth:`on_message_arrival` from any putting thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["HeldPop", "PopHoldService"]

log = logging.getLogger(__name__)

#: Key of a pop window: (group, topic, queue id).
WindowKey = tuple[str, str, int]


def _now_ms() -> int:
    return int(time.time() * 1000)


class HeldPop:
    """One held request: ``attempt(held) -> bool`` answers it if it can (True), ``expire(held)``
    answers it at its deadline. ``header`` has consumer_group, topic and queue_id."""

    __slots__ = ("conn", "opaque", "header", "attempt", "expire", "deadline", "timer", "done",
                 "same")

    def __init__(self, conn: Any, opaque: int, header: Any,
                 attempt: Callable[[HeldPop], bool], expire: Callable[[HeldPop], None],
                 poll_s: float, now: float) -> None:
        self.conn = conn
        self.opaque = opaque
        self.header = header
        self.attempt = attempt
        self.expire = expire
        self.deadline = now + poll_s
        self.timer: asyncio.TimerHandle | None = None
        self.done = False
        h = header
        #: requests with equal ``same`` find the same things poppable
        # the consumer too: of a key-shared or failover subscription, what one consumer may
        # pop another may not (subscription_types.py)
        self.same = (attempt.__name__, h.queue_id, getattr(h, "subscription", None),
                     getattr(h, "expression_type", None), getattr(h, "order", False),
                     getattr(h, "consumer", ""))


class PopHoldService:
    """The held pops of one broker (see the module doc).

    ``windows(group, topic, queue_id)`` yields the existing pop windows (key, window) a request
    of that queue (or -1: any) covers; a window has ``earliest_deadline(now) -> int | None``
    (ms). ``fail(held, exc)`` answers a request whose try raised.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 windows: Callable[[str, str, int], Iterable[tuple[WindowKey, Any]]],
                 fail: Callable[[HeldPop, BaseException], None]) -> None:
        self.loop = loop
        self.windows = windows
        self.fail = fail  # answer a request whose retry raised (never leave a client waiting)
        #: topic -> group -> held requests, oldest first
        self.table: dict[str, dict[str, list[HeldPop]]] = {}
        self._revive: dict[WindowKey, tuple[int, asyncio.TimerHandle]] = {}
        self._pending: set[tuple[str, str]] = set()
        self._loop_thread = threading.get_ident()
        self.tries = 0  # held requests tried again (by any wake)
        self.woken_by_arrival = 0
        self.woken_by_revive = 0
        self.woken_by_ack = 0
        self.woken_by_route = 0
        self.answered = 0  # held requests answered by a retry
        self.timed_out = 0

    # -- holding ---------------------------------------------------------------------------------
    def hold(self, held: HeldPop) -> None:
        h = held.header
        self.table.setdefault(h.topic, {}).setdefault(h.consumer_group, []).append(held)
        held.timer = self.loop.call_at(held.deadline, self._expire, held)
        self._arm_windows(h.consumer_group, h.topic, h.queue_id, _now_ms())

    def held_count(self) -> int:
        return sum(len(lst) for groups in self.table.values() for lst in groups.values())

    def waiting(self, group: str, topic: str) -> bool:
        groups = self.table.get(topic)
        return groups is not None and group in groups

    def drop_connection(self, conn: Any) -> None:
        for topic, groups in list(self.table.items()):
            for group, lst in list(groups.items()):
                keep = [x for x in lst if x.conn is not conn]
                for x in lst:
                    if x.conn is conn:
                        self._finish(x)
                self._put(topic, group, keep)

    def close(self) -> None:
        for groups in self.table.values():
            for lst in groups.values():
                for x in lst:
                    self._finish(x)
        self.table.clear()
        for _when, t in self._revive.values():
            t.cancel()
        self._revive.clear()

    def _finish(self, held: HeldPop) -> None:
        held.done = True
        if held.timer is not None:
            held.timer.cancel()
            held.timer = None

    def _put(self, topic: str, group: str, lst: list[HeldPop]) -> None:
        groups = self.table.get(topic)
        if groups is None:
            return
        if lst:
            groups[group] = lst
        else:
            groups.pop(group, None)
            if not groups:
                del self.table[topic]

    # -- wakes -----------------------------------------------------------------------------------
    def on_message_arrival(self, topic: str, queue_id: int, new_max_offset: int,
                           batch: Any) -> None:
        """Store dispatch listener: runs on the putting thread inside the store's put lock."""
        groups = self.table.get(topic)
        if groups is None:  # the common case: nobody holds a pop on this topic
            return
        if threading.get_ident() != self._loop_thread:
            self.loop.call_soon_threadsafe(self._arrived, topic, queue_id)
            return
        self._arrived(topic, queue_id)

    def _arrived(self, topic: str, queue_id: int) -> None:
        groups = self.table.get(topic)
        if groups is None:
            return
        for group, lst in groups.items():
            if any(x.header.queue_id in (-1, queue_id) for x in lst):
                self.woken_by_arrival += 1
                self._schedule(group, topic)

    def wake(self, group: str, topic: str, *, routed: bool = False) -> None:
        """Something of (group, topic) may be poppable now (an ack freed a message group;
        ``routed``: another consumer's key-shared read-ahead routed messages to a held one)."""
        if self.waiting(group, topic):
            if routed:
                self.woken_by_route += 1
            else:
                self.woken_by_ack += 1
            self._schedule(group, topic)

    def deadline_set(self, key: WindowKey, deadline_ms: int) -> None:
        """An in-flight message of window ``key`` becomes poppable at ``deadline_ms`` (a pop,
        an invisible-time change): the window's revive timer fires by then, if anyone waits."""
        if self.waiting(key[0], key[1]):
            self._arm(key, deadline_ms)

    def _schedule(self, group: str, topic: str) -> None:
        k = (group, topic)
        if k not in self._pending:
            self._pending.add(k)
            self.loop.call_soon(self._retry, group, topic)

    def _retry(self, group: str, topic: str) -> None:
        self._pending.discard((group, topic))
        groups = self.table.get(topic)
        lst = groups.get(group) if groups is not None else None
        if not lst:
            return
        keep: list[HeldPop] = []
        empty: set[Any] = set()
        for x in lst:
            if x.done or x.conn.closed:
                self._finish(x)
                continue
            if x.same in empty:
                keep.append(x)
                continue
            self.tries += 1
            try:
                answered = x.attempt(x)
            except Exception as exc:  # answer, never leave the client waiting
                self._finish(x)
                self.fail(x, exc)
                continue
            if answered:
                self._finish(x)
                self.answered += 1
            else:
                empty.add(x.same)
                keep.append(x)
        keep = [x for x in keep if not x.done]
        self._put(topic, group, keep)
        if keep:
            now = _now_ms()
            for q in {x.header.queue_id for x in keep}:
                self._arm_windows(group, topic, q, now)

    # -- revive timers -----------------------------------------------------------------------------
    def _arm_windows(self, group: str, topic: str, queue_id: int, now: int) -> None:
        """Arm the revive timer of every window the request covers at its earliest future
        deadline (a deadline already passed made nothing poppable: it is not waited for)."""
        for key, w in self.windows(group, topic, queue_id):
            if key in self._revive:
                continue
            d = w.earliest_deadline(now)
            if d is not None:
                self._arm(key, d)

    def _arm(self, key: WindowKey, deadline_ms: int) -> None:
        cur = self._revive.get(key)
        if cur is not None:
            if cur[0] <= deadline_ms:
                return
            cur[1].cancel()
        # +1 ms: the pop compares whole ms of the wall clock (a deadline is poppable at
        # now >= deadline); the loop's clock may round the other way
        delay = max(0.0, (deadline_ms - time.time() * 1000 + 1) / 1000)
        self._revive[key] = (deadline_ms, self.loop.call_later(delay, self._revived, key))

    def _revived(self, key: WindowKey) -> None:
        self._revive.pop(key, None)
        group, topic, _qid = key
        if self.waiting(group, topic):
            self.woken_by_revive += 1
            self._schedule(group, topic)

    # -- the deadline ----------------------------------------------------------------------------
    def _expire(self, held: HeldPop) -> None:
        held.timer = None
        if held.done:
            return
        h = held.header
        groups = self.table.get(h.topic)
        lst = groups.get(h.consumer_group) if groups is not None else None
        if lst is not None:
            self._put(h.topic, h.consumer_group, [x for x in lst if x is not held])
        self._finish(held)
        if held.conn.closed:
            return
        self.timed_out += 1
        try:
            # one last try: a wake may be pending in this very loop turn
            if not held.attempt(held):
                held.expire(held)
        except Exception as exc:
            self.fail(held, exc)

    def stats(self) -> dict[str, int]:
        return {
            "pop_held": self.held_count(),
            "pop_held_tries": self.tries,
            "pop_held_answered": self.answered,
            "pop_held_woken_by_arrival": self.woken_by_arrival,
            "pop_held_woken_by_revive": self.woken_by_revive,
            "pop_held_woken_by_ack": self.woken_by_ack,
            "pop_held_woken_by_route": self.woken_by_route,
            "pop_held_timed_out": self.timed_out,
            "pop_revive_timers": len(self._revive),
        }
