"""Long polling: pulls that found nothing wait here for messages (ref BR3).

This is RocketMQ's PullRequestHoldService plus its NotifyMessageArrivingListener:

- A pull that would answer PULL_NOT_FOUND and carries PullSysFlag.SUSPEND is *held* instead:
  :meth:`PullRequestHoldService.suspend` files it under the key ``topic@queueId`` (the
  ``pullRequestTable`` of ``ManyPullRequest`` lists).
- Wake on arrival: the store calls :meth:`on_message_arrival` (a dispatch listener) after every
  put with the queue's new max offset and the stored batch. Held pulls of that key whose offset
  is now below the max are re-checked against their tag filter (the batch's tag hashes, as
  RocketMQ checks the consume queue's tag code) and those that match are executed again at once.
- Fallback check: every ``check_interval`` (5 s; 1 s short polling when long polling is off)
  the held pulls of a key are compared with its max offset, like ``checkHoldRequest``; pulls
  below the max are executed again (no tag re-check, as RocketMQ passes no tag code there: the
  pull itself answers NO_MATCHED_MSG if nothing matches). The
  timer checks at most CHECK_KEYS_PER_TICK keys per tick (:meth:`check_some`, round robin),
  so its cost does not grow with the number of held queues, CHECK_KEYS_PER_STEP keys a loop
  turn: 4,096 keys in one stretch held the loop 7-12 ms of CPU (a push consumer of 10,000
  standing queues, loaded machine; issue 17), every send and wake-up waiting behind it.
- Timeout: a held pull is executed again at its deadline (suspend_timeout_millis, or
  short_polling_time_ms when long polling is off); finding nothing it answers PULL_NOT_FOUND.
  RocketMQ notices the deadline only at the next check; a timer per held pull answers on time.
- Re-execution never suspends again (RocketMQ's ``executeRequestWhenWakeup`` runs the pull with
  ``brokerAllowSuspend = false``): a woken pull always gets a response.

With long polling disabled (``long_polling_enable = false``) arrivals do not wake anyone, as in
RocketMQ (the reput service notifies only when long polling is on): held pulls are answered by
the 1 s check or their 1 s deadline.

Threads: everything runs on the broker's event loop. The store calls the dispatch listener on
the putting thread, inside its put lock; the broker puts on the loop thread, so the listener
runs synchronously there, does only dictionary work and lists the woken pulls. They are run
outside the put lock, and their answers written at once (one write per connection):

- at the end of the read that carried the send (``FrameServer.after_read`` ->
  :meth:`PullRequestHoldService.run_woken_in_read`) when they are few (``IN_READ_MAX``): the
  answers on the sender's own connection (a client instance's producer and consumer share it)
  join the send's answer in the read's one write; the send's answer waits for at most that
  many pulls;
- else (more woken at once, or a put that came from elsewhere) by a ``call_soon`` of
  :meth:`PullRequestHoldService.run_woken`: the sender's answer leaves first.

Answering them one loop turn later (a ``call_soon`` per pull, then another for the write) let
the requests the loop read in between go first: 22 % of the woken pulls' answers waited behind a
whole read (p50 65 µs, p99 0.24 ms more) in ``bench e2e`` at 10 k msgs/s (docs/benchmarks.md,
"The e2e tail, third look"). If a put ever comes from another thread the listener hops to the
loop with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from tidemq.protocol.batch.layout import index_hashes
from tidemq.protocol.record import BatchView

__all__ = ["HeldPull", "PullRequestHoldService", "hold_key"]

log = logging.getLogger(__name__)



def hold_key(topic: str, queue_id: int) -> str:
    """RocketMQ's ``topic@queueId`` key (topic names cannot contain '@')."""
    return f"{topic}@{queue_id}"


class HeldPull:
    """One suspended pull: the request, where it pulls from, its filter and its deadline
    (created and finished on the event loop)."""

    __slots__ = (
        "conn", "opaque", "header", "tag_hashes", "offset", "suspended_at", "deadline",
        "timer", "done",
    )

    def __init__(
        self,
        conn: Any,
        opaque: int,
        header: Any,
        tag_hashes: frozenset[int] | None,
        timeout_s: float,
        now: float,
    ) -> None:
        self.conn = conn
        self.opaque = opaque
        self.header = header
        self.tag_hashes = tag_hashes
        self.offset: int = header.queue_offset
        self.suspended_at = now
        self.deadline = now + timeout_s
        self.timer: asyncio.TimerHandle | None = None
        self.done = False


#: keys of held pulls the periodic check looks at per tick at most
CHECK_KEYS_PER_TICK = 4096
#: keys it looks at per loop turn (~0.5 ms of CPU): the rest of the tick's after a yield
CHECK_KEYS_PER_STEP = 256
#: woken pulls answered inside the read that woke them at most (more: after it, call_soon)
IN_READ_MAX = 8


class PullRequestHoldService:
    """The table of held pulls and the three ways out of it (arrival, check, deadline).

    Event loop only, except :meth:`on_message_arrival`, which any putting thread may call.

    ``execute(held)`` runs the pull again without suspending and answers it; ``max_offset``
    is the store's ``max_offset(topic, queue_id)``.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        execute: Callable[[HeldPull], None],
        max_offset: Callable[[str, int], int],
        *,
        long_polling: bool = True,
        check_interval_s: float = 5.0,
    ) -> None:
        self.loop = loop
        self.execute = execute
        self.max_offset = max_offset
        self.long_polling = long_polling
        self.check_interval_s = check_interval_s
        self.table: dict[str, list[HeldPull]] = {}
        self._check_keys: list[str] = []  # the periodic check's pass, in progress
        self._loop_thread = threading.get_ident()
        self._task: asyncio.Task[None] | None = None
        self._woken: list[HeldPull] = []  # woken, not answered yet (run_woken)
        self._woken_scheduled = False
        self.woken_by_arrival = 0
        self.woken_by_check = 0
        self.timed_out = 0

    # -- holding ---------------------------------------------------------------------------------
    def suspend(self, held: HeldPull, *, timed: bool = True) -> None:
        """File ``held``; ``timed=False``: no timer of its own (a queue of a PULL_MULTI_QUEUE,
        which times out with its request: 100,000 held queues were 100,000 timers)."""
        h = held.header
        key = hold_key(h.topic, h.queue_id)
        lst = self.table.get(key)
        if lst is None:
            self.table[key] = [held]
        else:
            # answered ones go now (not only at an arrival or the bounded check): a queue
            # pulled again and again never collects finished entries
            if lst[0].done or lst[-1].done:
                lst = self.table[key] = [x for x in lst if not x.done]
            lst.append(held)
        held.conn.held.add(held)
        if timed:
            held.timer = self.loop.call_at(held.deadline, self._expire, held)

    def held_count(self) -> int:
        return sum(1 for lst in self.table.values() for h in lst if not h.done)

    def drop_connection(self, conn: Any) -> None:
        """The connection closed: its held pulls are never answered (pruned lazily)."""
        for held in conn.held:
            held.done = True
            if held.timer is not None:
                held.timer.cancel()
        conn.held.clear()

    def _finish(self, held: HeldPull) -> bool:
        """Take ``held`` out of service; False if it was already answered or dropped."""
        if held.done:
            return False
        held.done = True
        if held.timer is not None:
            held.timer.cancel()
        held.conn.held.discard(held)
        return True

    def _run(self, held: HeldPull) -> None:
        if held.conn.closed:
            return
        try:
            self.execute(held)
        except Exception:  # execute answers its own errors; this is the last line of defence
            log.exception("re-executing held pull %s failed", hold_key(held.header.topic,
                                                                        held.header.queue_id))

    # -- way out 1: a message arrived ----------------------------------------------------------
    def on_message_arrival(
        self, topic: str, queue_id: int, new_max_offset: int, batch: BatchView | list[int]
    ) -> None:
        """Store dispatch listener: runs on the putting thread inside the store's put lock.
        ``batch``: the stored batch, or its tag hashes (``MessageStore.put_frame``)."""
        if not self.long_polling or not self.table:  # nobody waits at all: no key to build
            return
        key = f"{topic}@{queue_id}"
        if key not in self.table:  # the common case: nobody waits on this queue
            return
        if threading.get_ident() != self._loop_thread:
            tags = (batch if isinstance(batch, list)  # put_frame passes the tag hashes
                    else index_hashes(batch.index_view()).tolist())
            self.loop.call_soon_threadsafe(self.notify_message_arriving, key, new_max_offset, tags)
            return
        self.notify_message_arriving(key, new_max_offset, batch)

    def notify_message_arriving(
        self, key: str, max_offset: int, batch: BatchView | list[int] | None
    ) -> None:
        """Wake the pulls of ``key`` below ``max_offset`` whose filter matches ``batch`` (the
        batch that arrived, or its tag hashes; None = no filter check, as the periodic check)."""
        lst = self.table.get(key)
        if not lst:
            return
        batch_tags: set[int] | None = None
        keep: list[HeldPull] = []
        wake: list[HeldPull] = []
        for held in lst:
            if held.done:
                continue
            if max_offset > held.offset:
                match = True
                if held.tag_hashes is not None and batch is not None:
                    if batch_tags is None:
                        batch_tags = _tags_of(batch)
                    match = not held.tag_hashes.isdisjoint(batch_tags)
                if match:
                    wake.append(held)
                    continue
            keep.append(held)
        if keep:
            self.table[key] = keep
        else:
            del self.table[key]
        if not wake:
            return
        for held in wake:
            self._finish(held)
        if batch is not None:
            self.woken_by_arrival += len(wake)
        else:
            self.woken_by_check += len(wake)
        # Deferred: we may be inside the store's put lock. The end of the current read runs
        # them if few (run_woken_in_read); the call_soon, if many or a put made elsewhere.
        self._woken += wake
        if not self._woken_scheduled:
            self._woken_scheduled = True
            self.loop.call_soon(self.run_woken)

    def run_woken_in_read(self) -> None:
        """The end of a read (``FrameServer.after_read``): :meth:`run_woken` if at most
        ``IN_READ_MAX`` pulls wait, else leave them to its ``call_soon`` (after the read's
        answers are written)."""
        if self._woken and len(self._woken) <= IN_READ_MAX:
            self.run_woken()

    def run_woken(self) -> None:
        """Answer the pulls woken since the last call, then write their answers at once (one
        write per connection, not at the end of the loop iteration). Loop thread only."""
        woken = self._woken
        if not woken:
            self._woken_scheduled = False
            return
        self._woken = []
        self._woken_scheduled = False
        conns: dict[Any, None] = {}
        for held in woken:
            self._run(held)
            conns[held.conn] = None
        for conn in conns:
            flush = getattr(conn, "flush_writes", None)  # a multi pull's slot answers its own way
            if flush is None:
                continue
            try:  # inside another connection's read: a failure here must not end that one
                flush()
            except Exception:
                log.exception("writing woken pulls' answers to %s failed",
                              getattr(conn, "peer", "?"))

    # -- way out 2: the periodic check ---------------------------------------------------------
    def _check_key(self, key: str) -> None:
        """RocketMQ's checkHoldRequest for one key: drop its finished pulls, compare the
        queue's max offset with the others and wake those below it."""
        lst = self.table.get(key)
        if lst is None:
            return
        live = [h for h in lst if not h.done]
        if not live:
            del self.table[key]
            return
        self.table[key] = live
        topic, _, qid = key.rpartition("@")
        try:
            mx = self.max_offset(topic, int(qid))
        except Exception:
            log.exception("check of held pulls for %s failed", key)
            return
        self.notify_message_arriving(key, mx, None)

    def check_some(self, limit: int) -> None:
        """:meth:`_check_key` of the next ``limit`` keys of the table, round robin: the
        periodic check's work per tick stays bounded however many queues are held (a
        consumer of 100,000 queues holds all of them; a full pass then takes several
        ticks -- the check only catches what an arrival did not wake)."""
        keys = self._check_keys
        if not keys:
            keys = self._check_keys = list(self.table)
            keys.reverse()  # popped from the end: in table order
        for _ in range(min(limit, len(keys))):
            self._check_key(keys.pop())

    async def run_checks(self) -> None:
        """Run :meth:`check_some` (CHECK_KEYS_PER_TICK keys, CHECK_KEYS_PER_STEP a loop turn,
        within one pass of the table) every ``check_interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.check_interval_s)
            cost = 0.0
            left = CHECK_KEYS_PER_TICK
            while left > 0:
                t0 = time.perf_counter()
                n = min(left, CHECK_KEYS_PER_STEP)
                self.check_some(n)
                cost += time.perf_counter() - t0
                left -= n
                if not self._check_keys:  # the pass is complete: the next tick starts anew
                    break
                await asyncio.sleep(0)
            if cost > 1.0:
                log.info("[NOTIFYME] check of held pulls took %.0f ms", cost * 1000)

    # -- way out 3: the deadline ---------------------------------------------------------------
    def _expire(self, held: HeldPull) -> None:
        held.timer = None
        if not self._finish(held):
            return
        key = hold_key(held.header.topic, held.header.queue_id)
        lst = self.table.get(key)
        if lst is not None:
            try:
                lst.remove(held)
            except ValueError:
                pass
            if not lst:
                del self.table[key]
        self.timed_out += 1
        self._run(held)

    def close(self) -> None:
        for lst in self.table.values():
            for held in lst:
                self._finish(held)
        self.table.clear()


def _tags_of(batch: BatchView | list[int]) -> set[int]:
    if isinstance(batch, list):
        return set(batch)
    if batch.count == 1:
        return {batch.tag_hash_at(0)}
    return set(index_hashes(batch.index_view()).tolist())
