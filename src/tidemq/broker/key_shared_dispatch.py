"""Key-shared dispatch of one POP group's queues (docs/pop-dispatch.md; rules in
``subscription_types.py``, slot selection in ``key_shared.py``).

A key-shared pop of consumer C takes, in offset order, the queue's messages whose ordering key's
slot C owns, plus keyless ones. Messages are read ahead from the window's ``next``: each read
message gets its slot once, is *routed* to its owner, and -- unless the popping consumer takes
it -- stays in the window unassigned (``PopWindow.pass_over``: in flight with attempt 0, a
deadline already passed) until its owner pops. Per window this module keeps those pending
offsets: ``slots`` (offset -> slot, -1 keyless) and ``routes`` (owner -> its pending offsets,
in offset order; keyless under None), so a pop costs what it takes, not what waits for others.

Routes are computed for one membership *epoch* of the group; a join or a leave moves the epoch
and the next pop re-routes every pending offset (``owner_of`` then applies the
recently-joined rule to offsets below a joiner's mark). Deliveries that come back -- a leaving
consumer's (``SubscriptionTypes.left`` marks the group for a scan) or expired ones (found by a
scan at most every ``_SCAN_MS``) -- join the pending offsets and the routes are rebuilt, so a
key's revived messages go out before its later ones.

Threads: the broker's event loop only.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Any

from tidemq.broker.key_shared import SHARDING_KEY, key_slot, ordering_key
from tidemq.broker.pop_window import Popped, PopWindow
from tidemq.protocol.batch.codec import filter_fields
from tidemq.protocol.errors import CorruptBatchError
from tidemq.protocol.record import BatchView

__all__ = ["KEYLESS", "PendingOffsets", "choose_key_shared"]

KEYLESS = -1
SCAN_NEW = 4096  # new offsets a pop reads at most
MAX_PENDING = 20_000  # pending offsets per queue before pops stop reading ahead
#: expired deliveries (an ack timeout passed) are looked for at most this often per queue; a
#: leaving consumer's are looked for at the next pop (``scan_at`` reset)
_SCAN_MS = 1000
_SHARDING_BYTES = SHARDING_KEY.encode() + b"\x01"  # a property name as records store it

#: (batch bytes, base offset, member indices) of the batches holding some offsets
Reader = Callable[[list[int]], Iterator[tuple[Any, int, list[int]]]]
#: owner of (offset, slot) under the current membership and join marks; None: no member
OwnerOf = Callable[[int, int], str | None]


class PendingOffsets:
    """The read-but-unassigned offsets of one window (see the module doc)."""

    __slots__ = ("slots", "routes", "epoch", "scan_at")

    def __init__(self) -> None:
        self.slots: dict[int, int] = {}
        self.routes: dict[str | None, collections.deque[int]] = {}
        self.epoch = -1
        self.scan_at = 0  # ms: look for expired deliveries from then on (0: at once)

    def route(self, owner_of: OwnerOf, epoch: int) -> None:
        """Re-route every pending offset (a new membership epoch, or revived offsets)."""
        routes: dict[str | None, collections.deque[int]] = {}
        for o in sorted(self.slots):
            s = self.slots[o]
            who = None if s == KEYLESS else owner_of(o, s)
            q = routes.get(who)
            if q is None:
                q = routes[who] = collections.deque()
            q.append(o)
        self.routes = routes
        self.epoch = epoch

    def add(self, o: int, slot: int, owner_of: OwnerOf) -> None:
        """A newly read offset (above every pending one)."""
        self.slots[o] = slot
        who = None if slot == KEYLESS else owner_of(o, slot)
        q = self.routes.get(who)
        if q is None:
            q = self.routes[who] = collections.deque()
        q.append(o)


def read_slots(read: Reader, offsets: list[int]) -> dict[int, int]:
    """The slot of each offset (keyless, undecodable or gone from the store: KEYLESS)."""
    out = dict.fromkeys(offsets, KEYLESS)
    for data, base, idx in read(offsets):
        try:
            view = BatchView(data)
            keys = view.keys()
            raw = view.raw_records()
            # the properties are parsed only in a batch that names a sharding key somewhere
            # (one search of its records; most batches order by their keys alone)
            props = ({i: p for i, _t, p in filter_fields(view, idx[0], raw)}
                     if _SHARDING_BYTES in bytes(raw) else {})
        except (CorruptBatchError, ValueError):
            continue
        for i in idx:
            k = ordering_key(props.get(i) or {}, keys.get(i))
            if k is not None:
                out[base + i] = key_slot(k)
    return out


def choose_key_shared(p: PendingOffsets, w: PopWindow, me: str, gated: bool, want: int,
                      now: int, invisible_ms: int, max_offset: int, epoch: int,
                      owner_of: OwnerOf, read: Reader) -> list[Popped]:
    """Up to ``want`` deliveries of window ``w`` for consumer ``me`` (``gated``: a recently
    joined consumer whose marks are not passed yet takes keyless messages only)."""
    if now >= p.scan_at:  # deliveries that came back: pending again, in offset order
        p.scan_at = now + _SCAN_MS
        back = [o for o in w.expired(now) if o not in p.slots]
        if back:
            p.slots.update(read_slots(read, back))
            p.epoch = -1
    if p.epoch != epoch:
        p.route(owner_of, epoch)
    out: list[Popped] = []
    _take(p, w, me, gated, want, now, invisible_ms, out)
    scanned = 0
    while len(out) < want and w.next < max_offset and scanned < SCAN_NEW \
            and len(p.slots) < MAX_PENDING:
        end = min(max_offset, w.next + 1024)
        new = list(range(w.next, end))
        for o, s in read_slots(read, new).items():
            p.add(o, s, owner_of)
        w.pass_over(end)
        scanned += len(new)
        _take(p, w, me, gated, want, now, invisible_ms, out)
    return out


def _take(p: PendingOffsets, w: PopWindow, me: str, gated: bool, want: int, now: int,
          invisible_ms: int, out: list[Popped]) -> None:
    """Deliver ``me``'s pending offsets (and keyless ones) in offset order."""
    empty: collections.deque[int] = collections.deque()
    a = empty if gated else p.routes.get(me, empty)
    b = p.routes.get(None, empty)
    slots = p.slots
    while len(out) < want and (a or b):
        o = b.popleft() if b and (not a or b[0] < a[0]) else a.popleft()
        slots.pop(o, None)
        if w.deliverable(o, now):  # not acked meanwhile by the consumer that left
            out.append(w.deliver(o, now, invisible_ms))
