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

import bisect
import collections
import functools
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
_BOUNDS = 64  # stored batch bounds kept per window (a pending window spans a few dozen)
_SHARDING_BYTES = SHARDING_KEY.encode() + b"\x01"  # a property name as records store it

#: (batch bytes, base offset, member indices) of the batches holding some offsets
Reader = Callable[[list[int]], Iterator[tuple[Any, int, list[int]]]]
#: owner of (offset, slot) under the current membership and join marks; None: no member
OwnerOf = Callable[[int, int], str | None]


class PendingOffsets:
    """The read-but-unassigned offsets of one window (see the module doc)."""

    __slots__ = ("slots", "routes", "epoch", "scan_at", "batch", "starts", "ends", "trimmed")

    def __init__(self) -> None:
        #: bounds of the latest stored batches read (``starts`` increasing, ``ends`` the
        #: matching ends), to end a pop at a stored batch's boundary (``_take``)
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.trimmed = False  # the last pop ended early, at a stored batch's start
        #: (base offset, slot of each message) of the last stored batch read: read-ahead steps
        #: of 1024 offsets straddle stored batches, and the next step reads the rest of it
        self.batch: tuple[int, list[int]] = (-1, [])
        self.slots: dict[int, int] = {}
        self.routes: dict[str | None, collections.deque[int]] = {}
        self.epoch = -1
        self.scan_at = 0  # ms: look for expired deliveries from then on (0: at once)

    def bound(self, base: int, end: int) -> None:
        """A stored batch ``[base, end)`` was read (the latest _BOUNDS are kept)."""
        if not self.starts or base > self.starts[-1]:
            self.starts.append(base)
            self.ends.append(end)
            if len(self.starts) > 2 * _BOUNDS:
                del self.starts[:_BOUNDS], self.ends[:_BOUNDS]

    def batch_of(self, o: int) -> tuple[int, int] | None:
        """(base, end) of the known stored batch holding offset ``o``."""
        k = bisect.bisect_right(self.starts, o) - 1
        if k >= 0 and o < self.ends[k]:
            return self.starts[k], self.ends[k]
        return None

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

    def add_all(self, new: dict[int, int], table: list[str]) -> None:
        """Newly read offsets (increasing, above every pending one) routed by a slot -> owner
        ``table`` (no joiner marks apply): one list index per message."""
        self.slots.update(new)
        routes = self.routes
        for o, s in new.items():
            who = None if s == KEYLESS else table[s]
            q = routes.get(who)
            if q is None:
                q = routes[who] = collections.deque()
            q.append(o)


@functools.lru_cache(maxsize=65_536)  # a keys string repeats as often as its key does
def _keys_slot(keys: str) -> int:
    """The slot of a message's keys string without a sharding key (its first key)."""
    first = keys.split(" ", 1)[0]
    return key_slot(first) if first else KEYLESS


def read_slots(read: Reader, offsets: list[int], p: PendingOffsets | None = None
               ) -> dict[int, int]:
    """The slot of each offset (keyless, undecodable or gone from the store: KEYLESS).

    Per stored batch at once: its keys section is parsed once, and in a batch that names no
    sharding key (the common case; one search of its records) each message's slot is one
    cached lookup of its keys string. With ``p``, the slots of the last batch read are kept
    there (a stored batch at an offset never changes) for the next read of its rest."""
    out = dict.fromkeys(offsets, KEYLESS)
    for data, base, idx in read(offsets):
        if p is not None and p.batch[0] == base:
            p.bound(base, base + len(p.batch[1]))
            cached = p.batch[1]
            for i in idx:
                out[base + i] = cached[i]
            continue
        try:
            view = BatchView(data)
            keys = view.keys()
            raw = view.raw_records()
            sharded = _SHARDING_BYTES in bytes(raw)
            # the properties are parsed only in a batch that names a sharding key somewhere
            props = ({i: p for i, _t, p in filter_fields(view, idx[0], raw)}
                     if sharded else {})
        except (CorruptBatchError, ValueError):
            continue
        if not sharded and p is not None:  # the whole batch, kept for its next read
            get = keys.get
            every = [_keys_slot(k) if (k := get(i)) else KEYLESS for i in range(view.count)]
            p.batch = (base, every)
            p.bound(base, base + view.count)
            for i in idx:
                out[base + i] = every[i]
            continue
        if not sharded:
            get = keys.get
            for i in idx:
                k = get(i)
                if k:
                    out[base + i] = _keys_slot(k)
            continue
        for i in idx:
            k = ordering_key(props.get(i) or {}, keys.get(i))
            if k is not None:
                out[base + i] = key_slot(k)
    return out


def choose_key_shared(p: PendingOffsets, w: PopWindow, me: str, gated: bool, want: int,
                      now: int, invisible_ms: int, max_offset: int, epoch: int,
                      owner_of: OwnerOf, read: Reader,
                      table: list[str] | None = None) -> list[Popped]:
    """Up to ``want`` deliveries of window ``w`` for consumer ``me`` (``gated``: a recently
    joined consumer whose marks are not passed yet takes keyless messages only). ``table``,
    when no joiner mark applies: slot -> owner, the same answer as ``owner_of`` read off a
    list."""
    if now >= p.scan_at:  # deliveries that came back: pending again, in offset order
        p.scan_at = now + _SCAN_MS
        back = [o for o in w.expired(now) if o not in p.slots]
        if back:
            p.slots.update(read_slots(read, back))
            p.epoch = -1
    if p.epoch != epoch:
        p.route(owner_of, epoch)
    out: list[Popped] = []
    p.trimmed = False
    _take(p, w, me, gated, want, now, invisible_ms, out)
    scanned = 0
    while len(out) < want and w.next < max_offset and scanned < SCAN_NEW \
            and len(p.slots) < MAX_PENDING and not p.trimmed:
        end = min(max_offset, w.next + 1024)
        new = list(range(w.next, end))
        slots = read_slots(read, new, p)
        if table is not None:
            p.add_all(slots, table)
        else:
            for o, s in slots.items():
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
        n = want - len(out)
        if not b:  # one owner's offsets only (no keyless pending): take them in one go
            take = [a.popleft() for _ in range(min(n, len(a)))]
        elif not a:
            take = [b.popleft() for _ in range(min(n, len(b)))]
        else:
            take = []
            while len(take) < n and (a or b):
                take.append(b.popleft() if b and (not a or b[0] < a[0]) else a.popleft())
        if len(take) == n and (cut := _batch_cut(p, take, bool(out))) is not None:
            for o in reversed(take[cut:]):  # back to the front of their routes, for my next pop
                (b if slots.get(o, KEYLESS) == KEYLESS else a).appendleft(o)
            del take[cut:]
            p.trimmed = True
        for o in take:
            slots.pop(o, None)
        # those acked meanwhile (by a consumer that left) are skipped
        out += w.deliver_many(take, now, invisible_ms)
        if p.trimmed:
            break


def _batch_cut(p: PendingOffsets, take: list[int], have: bool) -> int | None:
    """Where to end a pop that ``take`` fills, so that it does not end inside a stored batch
    (None: as it is). A pop answers whole stored batches with member bitmaps: a key-shared
    consumer owns a share of every batch, and a pop that ends inside one makes the batch
    travel to that consumer twice (a 1000-message batch, 4 consumers, pops of 500: six times
    the bytes instead of four). So the pop ends before the batch of its last offset when that
    batch goes on past it, and the rest waits, first in line, for the consumer's next pop --
    unless that would leave the pop empty (``have``: earlier parts of it are taken)."""
    last = take[-1]
    b = p.batch_of(last)
    if b is None or b[1] - 1 <= last:
        return None
    cut = bisect.bisect_left(take, b[0])
    return cut if cut > 0 or have else None
