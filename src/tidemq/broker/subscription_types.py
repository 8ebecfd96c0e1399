"""Pulsar subscription types on server-side dispatch (SPEC CO10; docs/pop-dispatch.md).

A Pulsar-style consumer (``client/subscription_consumer.py``) is a POP consumer that names
itself (``PopMessageRequestHeader.consumer``, its client id) and its subscription type, and is
a member of its group through the broker's ordinary heartbeats (HEART_BEAT with
``consume_type="POP"`` and ``subscription_type``; ``consumer_manager.py``): a member leaves
when its connection closes (kill -9), when it unregisters, or after
``client_channel_expired_ms`` of silence. The rules of each type, on top of the plain pop of
``pop_processor.py``:

==========  ================================================================================
Exclusive   the first member owns the group; a second consumer's heartbeat (and pop) is
            refused with CONSUMER_BUSY naming the owner
Failover    one active consumer per queue (Pulsar's failover on a partitioned topic): members
            sorted by name, queue q's is member ``q % n``, so the queues spread over them
            (a one-queue topic: the first by name); a pop takes only its own queues and
            finds nothing else (held like an empty pop); when a member joins or leaves the
            queues are dealt again at once
Shared      the plain pop (any member, any message)
Key_Shared  a message's ordering key (its sharding key, else its first key) hashed into
            65 536 slots split between the members by consistent hashing
            (``key_shared.py``); keyless messages go to anyone, as Shared
==========  ================================================================================

Shared to all types: a member that leaves has its deliveries in flight ended at once
(revivable by the next pop, with attempt + 1) instead of after their invisible time -- so a
failover standby or a key's new owner continues where the dead one stopped, and per-key order
holds (a key's next owner takes the revived messages first, in offset order).

**Key_Shared dispatch** (``key_shared_dispatch.py``): a pop of member C takes, in offset order,
the pending offsets routed to C (read earlier, or come back) and then reads new ones, routing
each to its slot's owner; what C does not take stays in the window unassigned (attempt 0,
``PopWindow.pass_over``) for its owner's next pop.

**Recently joined members** (Pulsar's rule): when C joins, the read position of each queue
(``PopWindow.next``) is recorded; an offset below it is dispatched as if C were not there, and
C takes no keyed message until everything below it is acked (the window's ``start`` passes
it). A key moving to C therefore reaches C only after every earlier message of
that key was acked by its old owner: per-key order holds through a join, and the others never
stall.

**One mode per group**: a group with live pull/push members refuses POP members and the
reverse; a group's live POP members all have one subscription type (a SimpleConsumer's is "");
a consumer of another type is refused with CONSUME_MODE_CONFLICT naming the type it has.

**Seek** (SEEK_SUBSCRIPTION): a queue's window is replaced by an empty one starting at the
offset (or at the first message stored at or after a time); the old deliveries become stale.
The seek is a ``rmq_sys_POP_LOG`` record, written before the answer (``pop_log.py``): a broker
restart, even a kill -9 before the next snapshot, and a slave promoted in its place serve
from the seek's offset.

Threads: the broker's event loop only.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from tidemq.broker.connection import decode_request
from tidemq.broker.errors import RequestRejected, check_group
from tidemq.broker.key_shared import KeySharedSelector
from tidemq.broker.key_shared_dispatch import MAX_PENDING, PendingOffsets, choose_key_shared
from tidemq.broker.pop_hold import WindowKey
from tidemq.broker.pop_window import Popped, PopWindow
from tidemq.protocol.codes import ResponseCode
from tidemq.protocol.pop import ANY_QUEUE, SeekRequestHeader, SeekResponseHeader

if TYPE_CHECKING:
    from tidemq.broker.connection import BrokerConnection
    from tidemq.broker.pop_processor import PopProcessor
    from tidemq.protocol.frame import Frame
    from tidemq.protocol.headers import ConsumerData
    from tidemq.protocol.pop import NotificationRequestHeader, PopMessageRequestHeader

__all__ = ["SubscriptionTypes", "EXCLUSIVE", "FAILOVER", "SHARED", "KEY_SHARED", "TYPES"]

log = logging.getLogger(__name__)

EXCLUSIVE = "Exclusive"
FAILOVER = "Failover"
SHARED = "Shared"
KEY_SHARED = "Key_Shared"
TYPES = (EXCLUSIVE, FAILOVER, SHARED, KEY_SHARED)
POP_CONSUME_TYPE = "POP"  # ConsumerData.consume_type of POP members

_R = ResponseCode


def _kind(t: str) -> str:
    return f"a {t} subscription" if t else "SimpleConsumers"


class SubscriptionTypes:
    """The subscription-type rules of one broker's POP groups (see the module doc)."""

    def __init__(self, pop: PopProcessor) -> None:
        self.pop = pop
        self.broker = pop.broker
        self.types: dict[str, str] = {}  # group -> subscription type of its live POP members
        # (group, consumer) -> deliveries in flight: [(window key, pop time, offsets), ...]
        self._holds: dict[tuple[str, str], list[tuple[WindowKey, int, list[int]]]] = {}
        self._held_n: dict[tuple[str, str], int] = {}
        self._compact_at: dict[tuple[str, str], int] = {}
        # group -> consumer -> (topic, queue) -> read position when it joined (key-shared)
        self._joined: dict[str, dict[str, dict[tuple[str, int], int]]] = {}
        self._pending: dict[WindowKey, PendingOffsets] = {}  # key-shared read-ahead
        self.ended_early = False  # see choose()
        self._epoch: dict[str, int] = {}  # group -> membership changes (key-shared routes)
        self._selectors: dict[tuple[str, frozenset[str]], KeySharedSelector] = {}
        self.revived = 0  # deliveries ended early because their consumer left

    # -- membership (from consumer_manager.py) ---------------------------------------------------
    def members(self, group: str) -> list[str]:
        info = self.broker.consumers.group_of(group)
        return sorted(info.members) if info is not None else []

    def check_heartbeat(self, client_id: str, cd: ConsumerData) -> None:
        """Refuse a POP member whose type breaks the group's one type or its exclusivity (the
        consumption mode itself -- POP or pull -- is ``PopProcessor.check_mode``'s)."""
        if cd.consume_type != POP_CONSUME_TYPE:
            return
        group, t = cd.group, cd.subscription_type
        if t and t not in TYPES:
            raise RequestRejected(
                _R.INVALID_ARGUMENT,
                f"subscription type {t!r} is not one of {', '.join(TYPES)}")
        info = self.broker.consumers.group_of(group)
        others = [c for c in info.members if c != client_id] if info is not None else []
        have = self.types.get(group) if others else None
        if have is not None and have != t:
            raise RequestRejected(
                _R.CONSUME_MODE_CONFLICT,
                f"consumer group {group!r} is {_kind(have)} (members {', '.join(others)}); "
                f"{_kind(t)} cannot join it: one group name has one subscription type")
        if t == EXCLUSIVE and others:
            raise RequestRejected(
                _R.CONSUMER_BUSY,
                f"exclusive subscription {group!r} is held by consumer {others[0]!r}; wait "
                "until it closes, or use a Failover or Shared subscription")

    def joined(self, group: str, client_id: str, cd: ConsumerData) -> None:
        """A new POP member (after :meth:`check_heartbeat` let it in)."""
        self.types[group] = cd.subscription_type
        self.pop.modes.setdefault(group, POP_CONSUME_TYPE)
        self._drop_selectors(group)
        if cd.subscription_type == FAILOVER:
            self.wake(group)  # the queues are dealt again
        if cd.subscription_type != KEY_SHARED or len(self.members(group)) < 2:
            return
        marks = {(t, q): w.next for (g, t, q), w in self.pop.windows.items()
                 if g == group and w.next > w.start}
        if marks:
            self._joined.setdefault(group, {})[client_id] = marks

    def left(self, group: str, client_id: str) -> None:
        """A member left (closed, unregistered, expired): its deliveries revive now."""
        self._drop_selectors(group)
        j = self._joined.get(group)
        if j is not None:
            j.pop(client_id, None)
        hk = (group, client_id)
        self._held_n.pop(hk, None)
        self._compact_at.pop(hk, None)
        n = 0
        for key, pop_time, offsets in self._holds.pop(hk, ()):
            w = self.pop.windows.get(key)
            if w is not None:
                n += sum(1 for o in offsets if w.expire(o, pop_time))
        self.revived += n
        for (g, _t, _q), p in self._pending.items():
            if g == group:
                p.scan_at = 0  # its deliveries are revivable: look for them at the next pop
        if n:
            log.info("consumer %s left group %s: %d deliveries revived", client_id, group, n)
        if not self.members(group):
            self.types.pop(group, None)
            self._joined.pop(group, None)
        self.wake(group)  # a standby is active now; revived messages are poppable

    def acked(self, group: str, keys: Any) -> None:
        """Acks of ``group`` on windows ``keys``: a recently joined key-shared consumer may
        take its keys now if a window's start passed its mark -- its held pops are woken
        then, not at every ack (a futile try walks every queue)."""
        joined = self._joined.get(group)
        if not joined:
            return
        windows = self.pop.windows
        woken: set[str] = set()
        for key in keys:
            w = windows.get(key)
            topic = key[1]
            if w is None or topic in woken:
                continue
            tq = (topic, key[2])
            if any(tq in pos and w.start >= pos[tq] for pos in joined.values()):
                woken.add(topic)
                self.pop.hold.wake(group, topic)

    def wake(self, group: str) -> None:
        """Wake the group's held pops: something may be poppable for them now."""
        for topic in {t for (g, t, _q) in self.pop.windows if g == group}:
            self.pop.hold.wake(group, topic)

    def _drop_selectors(self, group: str) -> None:
        """The membership changed: selectors and key-shared routes are out of date."""
        self._epoch[group] = self._epoch.get(group, 0) + 1
        for k in [k for k in self._selectors if k[0] == group]:
            del self._selectors[k]

    # -- pops (from pop_processor.py) --------------------------------------------------------
    def admit(self, h: PopMessageRequestHeader | NotificationRequestHeader) -> None:
        """Refuse a pop (or notification) its group's type does not allow (at the door)."""
        group = h.consumer_group
        t = getattr(h, "subscription_type", "")  # a notification is a SimpleConsumer's
        have = self.types.get(group)
        if not t:
            if have:
                raise RequestRejected(
                    _R.CONSUME_MODE_CONFLICT,
                    f"consumer group {group!r} is {_kind(have)}; a SimpleConsumer cannot pop "
                    "from it: one group name has one consumption mode")
            return
        if t not in TYPES:
            raise RequestRejected(
                _R.INVALID_ARGUMENT, f"subscription type {t!r} is not one of {', '.join(TYPES)}")
        if getattr(h, "order", False):
            raise RequestRejected(
                _R.INVALID_ARGUMENT,
                "an orderly pop is a SimpleConsumer's (orderly=True); a Pulsar-style consumer "
                "orders by key with a Key_Shared subscription")
        info = self.broker.consumers.group_of(group)
        consumer = getattr(h, "consumer", "")
        if not consumer or info is None or consumer not in info.members:
            raise RequestRejected(
                _R.CONSUMER_NOT_ONLINE,
                f"consumer {consumer!r} is not a member of group {group!r} on broker "
                f"{self.broker.config.broker_name}: send a heartbeat (consume type POP, "
                f"subscription type {t}) before popping")
        if have != t:
            raise RequestRejected(
                _R.CONSUME_MODE_CONFLICT,
                f"consumer group {group!r} is {_kind(have or '')}; {_kind(t)} cannot pop from it")

    def may_pop(self, h: PopMessageRequestHeader) -> bool:
        """False for a consumer that left (a held pop of it must not take messages)."""
        if not h.subscription_type:
            return True
        return h.consumer in self.members(h.consumer_group)

    def own_queues(self, h: PopMessageRequestHeader, qids: list[int]) -> list[int]:
        """The queues of ``qids`` the pop may take: a failover consumer's own ones (queue q is
        active on member ``q % n`` of the members sorted by name, as Pulsar picks the active
        consumer of partition q); every one for the other types."""
        if h.subscription_type != FAILOVER:
            return qids
        members = self.members(h.consumer_group)
        if h.consumer not in members:
            return []
        n = len(members)
        return [q for q in qids if members[q % n] == h.consumer]

    def choose(self, h: PopMessageRequestHeader, w: PopWindow, qid: int, want: int, now: int,
               max_offset: int) -> list[Popped]:
        """The deliveries of one pop of queue ``qid``: the plain pop, or key-shared's
        (``ended_early``: it stopped short of ``want`` at a stored batch's start on purpose;
        the pop asks this queue no more)."""
        self.ended_early = False
        if h.subscription_type != KEY_SHARED:
            return w.pop(want, now, h.invisible_ms, max_offset)
        return self._choose_key_shared(h, w, qid, want, now, max_offset)

    def hold(self, group: str, consumer: str, key: WindowKey, popped: list[Popped]) -> None:
        """Remember the deliveries of ``consumer`` (ended at once if it leaves)."""
        if not consumer or not popped:
            return
        hk = (group, consumer)
        holds = self._holds.setdefault(hk, [])
        holds.append((key, popped[0].pop_time, [p.offset for p in popped]))
        n = self._held_n.get(hk, 0) + len(popped)
        if n > self._compact_at.get(hk, 4096):
            # drop what was acked; the next compaction at twice what is left (amortised O(1))
            windows = self.pop.windows
            kept = []
            for k, pt, offs in holds:
                wk = windows.get(k)
                live = [o for o in offs if wk is not None and wk.holds(o, pt)]
                if live:
                    kept.append((k, pt, live))
            holds[:] = kept
            n = sum(len(x[2]) for x in kept)
            self._compact_at[hk] = max(4096, 2 * n)
        self._held_n[hk] = n

    # -- key-shared ------------------------------------------------------------------------------
    def _selector(self, group: str, members: frozenset[str]) -> KeySharedSelector:
        sel = self._selectors.get((group, members))
        if sel is None:
            sel = self._selectors[(group, members)] = KeySharedSelector()
            for m in members:
                sel.add(m)
        return sel

    def _choose_key_shared(self, h: PopMessageRequestHeader, w: PopWindow, qid: int, want: int,
                           now: int, max_offset: int) -> list[Popped]:
        group, me, topic = h.consumer_group, h.consumer, h.topic
        key = (group, topic, qid)
        members = frozenset(self.members(group))
        # recently joined members of this queue: (read position at join, name)
        marks: list[tuple[int, str]] = []
        joined = self._joined.get(group)
        if joined:
            for c, pos in list(joined.items()):
                p = pos.get((topic, qid))
                if p is None:
                    continue
                if w.start >= p:  # everything before its join is acked: a full member
                    del pos[(topic, qid)]
                    if not pos:
                        del joined[c]
                elif c in members:
                    marks.append((p, c))
        full = self._selector(group, members)

        def owner_of(o: int, slot: int) -> str | None:
            excl = frozenset(c for p, c in marks if p > o) if marks else None
            sel = self._selector(group, members - excl) if excl else full
            return sel.owner(slot)

        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = PendingOffsets()
        read_from, full_before = w.next, pending.n >= MAX_PENDING
        out = choose_key_shared(
            pending, w, me, any(c == me for _p, c in marks), want, now, h.invisible_ms,
            max_offset, self._epoch.get(group, 0), owner_of,
            lambda offsets: self.pop._read(topic, qid, offsets),
            # new offsets are read from the window's ``next``, at or above every joiner's
            # mark (its ``next`` when it joined): no mark applies to them, the plain table does
            full.index_table())
        self.ended_early = pending.trimmed
        if w.next > read_from or full_before and pending.n < MAX_PENDING:
            self._wake_routed(group, topic, me, pending, {c for _p, c in marks})
        return out

    def _wake_routed(self, group: str, topic: str, me: str, pending: PendingOffsets,
                     gated: set[str]) -> None:
        """A pop read ahead (routing offsets to their owners) or took the pending offsets
        below ``MAX_PENDING`` again: wake the held pops of the group when one of another
        consumer may find something now -- its own runs, keyless ones, or room to read ahead.
        No arrival comes for a backlog already stored, so without this such a pop would
        wait for its deadline (``poll_ms``). Only after progress (new offsets read, pending
        ones taken), so the wakes end with the backlog; a gated joiner's runs do not count
        (its wake is ``acked``'s)."""
        hold = self.pop.hold
        groups = hold.table.get(topic)
        held = groups.get(group) if groups is not None else None
        if not held:
            return
        routes = pending.routes
        room = pending.n < MAX_PENDING
        for x in held:
            c = getattr(x.header, "consumer", "")
            if c == me or x.done:
                continue
            if routes.get(None) or room or c not in gated and routes.get(c):
                hold.wake(group, topic, routed=True)
                return

    # -- SEEK_SUBSCRIPTION ---------------------------------------------------------------------
    def handle_seek(self, conn: BrokerConnection, frame: Frame) -> None:
        h: SeekRequestHeader = decode_request(frame, SeekRequestHeader)
        group = h.consumer_group
        check_group(group)
        broker = self.broker
        tc = self.pop.readable_topic(h.topic, h.queue_id)
        if (h.offset < 0) == (h.timestamp < 0):
            raise RequestRejected(_R.INVALID_ARGUMENT,
                                  "a seek names an offset or a timestamp (exactly one)")
        self.pop.check_mode(group, POP_CONSUME_TYPE)
        store = broker.store
        qids = range(tc.read_queue_nums) if h.queue_id == ANY_QUEUE else [h.queue_id]
        moved: dict[int, int] = {}
        for q in qids:
            lo, hi = store.min_offset(h.topic, q), store.max_offset(h.topic, q)
            if h.offset >= 0:
                off = h.offset
            else:
                off = hi if h.timestamp > time.time() * 1000 else \
                    store.offset_for_timestamp(h.topic, q, h.timestamp)
            off = max(lo, min(off, hi))
            self.move(group, h.topic, q, off)
            moved[q] = off
        log.info("group %s seeks %s to %s", group, h.topic, moved)
        self.wake(group)  # held pops: the moved queues may have something now
        conn.respond(frame.opaque, _R.SUCCESS, SeekResponseHeader(offsets=moved))

    def move(self, group: str, topic: str, qid: int, offset: int) -> None:
        """The group's POP state of a queue starts over at ``offset`` (a seek, or an offset
        reset by ``tidemq group reset-offset``): earlier deliveries become stale."""
        key = (group, topic, qid)
        self.pop.log.seek(group, topic, qid, offset)  # durable before the answer
        self.pop.windows[key] = PopWindow(offset)
        self._pending.pop(key, None)
        for pos in self._joined.get(group, {}).values():
            pos.pop((topic, qid), None)
        self.broker.offsets.commit(group, topic, qid, offset)

    def stats(self) -> dict[str, Any]:
        return {"types": dict(self.types), "revived": self.revived,
                "key_shared_pending": sum(p.n for p in self._pending.values())}
