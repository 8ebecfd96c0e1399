"""Orderly POP (RocketMQ 5 FIFO): one message per message group in flight, in queue order
(docs/pop-dispatch.md, "Orderly POP").

A message's *message group* is its ``__SHARDINGKEY`` property (RocketMQ 5's message group);
a message without one belongs to the group of its queue. A pop with ``order`` walks a queue from
the window's ``start`` (the first unacked offset) in offset order:

- acked: passed over;
- in flight and still invisible: its message group is *blocked* -- no later message of that
  group is handed out until it is acked or its invisible time runs out;
- in flight with its invisible time run out (a revive), or never delivered: handed out
  (attempt + 1 for a revive) unless its group is blocked; then the group is blocked.

So a message group has at most one message in flight, and a message comes only after every
earlier message of its group was acked: the redelivery of an expired one comes before the
group's later messages. Messages of other groups are not held back. Messages the subscription
does not select are acked on the spot (they do not block their group), and a revive past the
group's ``retry_max_times`` goes to ``%DLQ%<group>`` (then the group's next message may go).

The walk is bounded: ``ORDER_SCAN`` offsets from ``start`` per queue and pop (a group blocked
there holds back what lies beyond, as RocketMQ's FIFO holds a queue). An ack wakes the held pops
of the (group, topic) (``pop_hold.py``): it may free a group.

Threads: the broker's event loop only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from tidemq.broker.key_shared import SHARDING_KEY
from tidemq.protocol.errors import CorruptBatchError
from tidemq.protocol.members import bitmap, filter_fields
from tidemq.protocol.pop import PoppedBatch
from tidemq.protocol.record import BatchView
from tidemq.store.message_store import GetStatus

if TYPE_CHECKING:
    from tidemq.broker.pop_processor import PopProcessor
    from tidemq.broker.pop_window import Popped, PopWindow
    from tidemq.protocol.pop import PopMessageRequestHeader
    from tidemq.store.pull_outcome import ReadBatch

__all__ = ["ORDER_SCAN", "OrderScan", "pop_orderly"]

#: offsets an orderly pop examines past a window's start, per queue
ORDER_SCAN = 2048
_READ = 256  # offsets per store read


class OrderScan:
    """The walk of one queue (see the module doc): iterating yields the offsets that may be
    handed out, as ``(batch, index, offset, tag, properties, message group)``; the caller adds a
    group to ``blocked`` once it hands out one of its messages. ``gone``: offsets no longer in
    the store (retention), to be acked."""

    def __init__(self, proc: PopProcessor, w: PopWindow, topic: str, qid: int, now: int
                 ) -> None:
        self.store = proc.broker.store
        self.w = w
        self.topic = topic
        self.qid = qid
        self.now = now
        self.blocked: set[str] = set()
        self.gone: list[int] = []

    def __iter__(self) -> Iterator[tuple[ReadBatch, int, int, str | None,
                                         dict[str, str] | None, str]]:
        w, now, blocked = self.w, self.now, self.blocked
        off = w.start
        end = min(self.store.max_offset(self.topic, self.qid), off + ORDER_SCAN)
        while off < end:
            r = self.store.get_messages(self.topic, self.qid, off, min(end - off, _READ))
            if r.status is not GetStatus.FOUND or not r.batches:
                nxt = min(r.next_begin_offset, end)
                if nxt <= off:
                    return
                self.gone += [o for o in range(off, nxt) if w.state(o) != "acked"]
                off = nxt
                continue
            for b in r.batches:
                base = b.queue_offset - b.first_index
                if b.queue_offset > off:  # not in the store any more
                    self.gone += [o for o in range(off, b.queue_offset) if w.state(o) != "acked"]
                try:
                    fields: Any = filter_fields(BatchView(b.data), b.first_index)
                    fields = list(fields)
                except CorruptBatchError:
                    fields = [(i, None, None) for i in range(b.first_index,
                                                              b.first_index + b.count)]
                for i, tag, props in fields:
                    o = base + i
                    if o >= end:
                        return
                    st = w.state(o)
                    if st == "acked":
                        continue
                    g = (props.get(SHARDING_KEY) if props else None) or ""  # "": the queue
                    if g in blocked:
                        continue
                    if st == "in_flight" and not w.revivable(o, now):
                        blocked.add(g)
                        continue
                    yield b, i, o, tag, props, g
                off = b.queue_offset + b.count


def poppable_orderly(proc: PopProcessor, w: PopWindow, topic: str, qid: int, now: int) -> bool:
    """Would an orderly pop of this queue hand out something now (filters not applied)?"""
    return next(iter(OrderScan(proc, w, topic, qid, now)), None) is not None


def pop_orderly(proc: PopProcessor, h: PopMessageRequestHeader, qid: int, want: int, now: int,
                sel: Any, bodies: list[Any], batches: list[PoppedBatch]) -> int:
    """The orderly counterpart of ``PopProcessor._pop_queue``: up to ``want`` messages of queue
    ``qid``, at most one per message group, into ``bodies``/``batches``; how many."""
    group, topic = h.consumer_group, h.topic
    w = proc.window(group, topic, qid, h.init_mode)
    scan = OrderScan(proc, w, topic, qid, now)
    logged: list[Popped] = []
    acks: list[tuple[int, int]] = []
    got = 0
    sg = None
    cur: Any = None  # the batch being collected
    keep: list[int] = []
    attempts: list[int] = []

    def flush() -> None:
        if keep:
            bodies.append(cur.data)
            batches.append(PoppedBatch(qid, bitmap(keep),
                                       attempts[:] if any(a != 1 for a in attempts) else []))
        keep.clear()
        attempts.clear()

    for b, i, o, tag, props, g in scan:
        if b is not cur:
            flush()
            cur = b
        p = w.deliver(o, now, h.invisible_ms)
        logged.append(p)
        if not sel.everything and not sel.matches(tag, props):
            w.ack(o, p.pop_time)  # not this subscription's: does not block its group
            acks.append((o, p.pop_time))
            continue
        if p.attempt > 1:
            if sg is None:
                sg = proc.broker.subscription_groups.ensure(group)
            if p.attempt > sg.retry_max_times:
                proc._dead_letter(group, b.data, i, p)
                w.ack(o, p.pop_time)
                acks.append((o, p.pop_time))
                continue
        scan.blocked.add(g)
        keep.append(i)
        attempts.append(p.attempt)
        got += 1
        if got >= want:
            break
    flush()
    for o in scan.gone:  # gone from the store (retention): nothing to deliver
        p = w.deliver(o, now, h.invisible_ms)
        w.ack(o, p.pop_time)
        logged.append(p)
        acks.append((o, p.pop_time))
    proc.log.append(group, topic, qid, logged, acks)  # durable before the answer leaves
    if logged:
        proc.hold.deadline_set((group, topic, qid), now + h.invisible_ms)
    proc.popped += got
    proc._commit(group, topic, qid, w)
    return got
