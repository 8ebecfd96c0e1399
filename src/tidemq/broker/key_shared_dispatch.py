"""Key-shared dispatch of one POP group's queues (docs/pop-dispatch.md; rules in
``subscription_types.py``, slot selection in ``key_shared.py``).

A key-shared pop of consumer C takes, in offset order, the queue's messages whose ordering key's
slot C owns, plus keyless ones. Messages are read ahead from the window's ``next``, one stored
batch at a time: each batch's slots are computed once (``batch_slots``), its messages are
*routed* to their owners, and -- unless the popping consumer takes them -- stay in the window
unassigned (``PopWindow.pass_over``: never delivered, not acked) until their owner pops.

Per window this module keeps those pending offsets as *runs*: ``routes`` maps an owner (None:
keyless) to its runs in offset order, a run being ``(batch base, [offsets])`` -- one stored
batch's share of that owner. So the work is per stored batch, not per message, wherever it
can be: a batch's slots are routed with one vectorised pass (numpy) over a slot -> owner-index
table, a pop takes whole runs, and a pop ends at a stored batch's start rather than inside
one (each pop answers whole stored batches with a member bitmap: a batch split over two pops
of one consumer would travel to it twice). What is left per message is the window's own
bookkeeping of a delivery.

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
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from tidemq.broker.key_shared import SHARDING_KEY, IndexTable, key_slot, ordering_key
from tidemq.broker.pop_window import Popped, PopWindow
from tidemq.protocol.batch.codec import filter_fields
from tidemq.protocol.batch.layout import KEYS_ENTRY
from tidemq.protocol.errors import CorruptBatchError
from tidemq.protocol.record import BatchView

__all__ = ["KEYLESS", "PendingOffsets", "batch_slots", "choose_key_shared"]

KEYLESS = -1
SCAN_NEW = 4096  # new offsets a pop reads at most (whole stored batches: a little more)
MAX_PENDING = 20_000  # pending offsets per queue before pops stop reading ahead
#: expired deliveries (an ack timeout passed) are looked for at most this often per queue; a
#: leaving consumer's are looked for at the next pop (``scan_at`` reset)
_SCAN_MS = 1000
_STEP = 1024  # offsets a read-ahead step asks for (extended to the end of its last batch)
_NUMPY_MIN = 64  # fewer messages in a step: routed by a plain loop (numpy's calls cost more)
#: a property name as records store it: a batch without it names no sharding key
_SHARDING_RE = re.compile(re.escape(SHARDING_KEY.encode() + b"\x01"))
_KEYS_SLOT_MAX = 65_536  # cached keys strings (raw bytes -> slot) before the cache starts over
_keys_slots: dict[bytes, int] = {}

#: (batch bytes, base offset, member indices) of the batches holding some offsets (increasing:
#: a list or a range)
Reader = Callable[[Sequence[int]], Iterator[tuple[Any, int, list[int]]]]
#: owner of (offset, slot) under the current membership and join marks; None: no member
OwnerOf = Callable[[int, int], str | None]
#: one stored batch's share of an owner: (batch base, its offsets, increasing)
Run = tuple[int, list[int]]


class PendingOffsets:
    """The read-but-unassigned offsets of one window (see the module doc)."""

    __slots__ = ("routes", "batches", "left", "n", "back", "epoch", "scan_at", "trimmed")

    def __init__(self) -> None:
        self.routes: dict[str | None, collections.deque[Run]] = {}
        #: base -> (end, slot of each message) of the stored batches with pending offsets
        self.batches: dict[int, tuple[int, list[int]]] = {}
        self.left: dict[int, int] = {}  # base -> pending offsets of that batch
        self.n = 0  # pending offsets
        self.back: set[int] = set()  # pending offsets that came back (in flight, expired)
        self.epoch = -1
        self.scan_at = 0  # ms: look for expired deliveries from then on (0: at once)
        self.trimmed = False  # the last pop ended early, at a stored batch's start

    def offsets(self) -> list[int]:
        """Every pending offset, increasing (tests, re-routing)."""
        return sorted(o for q in self.routes.values() for _b, offs in q for o in offs)

    def _add_run(self, who: str | None, base: int, offs: list[int]) -> None:
        q = self.routes.get(who)
        if q is None:
            q = self.routes[who] = collections.deque()
        q.append((base, offs))

    def _batch(self, base: int, end: int, slots: list[int], n: int) -> None:
        """``n`` more pending offsets of the stored batch ``[base, end)``."""
        if base not in self.batches:
            self.batches[base] = (end, slots)
        self.left[base] = self.left.get(base, 0) + n
        self.n += n

    def _taken(self, base: int, n: int) -> None:
        left = self.left[base] - n
        self.n -= n
        if left > 0:
            self.left[base] = left
        else:  # nothing of this batch is pending: its slots are not needed any more
            del self.left[base], self.batches[base]

    def route(self, owner_of: OwnerOf, epoch: int,
              back: dict[int, tuple[int, int, list[int]]] | None = None) -> None:
        """Re-route every pending offset (a new membership epoch), with the offsets that
        came ``back`` (offset -> (base, end, slots of its batch)) joining them."""
        per_base: dict[int, list[int]] = {}
        for q in self.routes.values():
            for base, offs in q:
                per_base.setdefault(base, []).extend(offs)
        for o, (base, end, slots) in (back or {}).items():
            per_base.setdefault(base, []).append(o)
            self._batch(base, end, slots, 1)
            self.back.add(o)
        self.routes = {}
        for base in sorted(per_base):
            slots = self.batches[base][1]
            runs: dict[str | None, list[int]] = {}
            for o in sorted(per_base[base]):
                s = slots[o - base]
                who = None if s == KEYLESS else owner_of(o, s)
                r = runs.get(who)
                if r is None:
                    r = runs[who] = []
                r.append(o)
            for who, offs in runs.items():
                self._add_run(who, base, offs)
        self.epoch = epoch


def _slot_of_keys(raw: bytes) -> int:
    """The slot of a message's keys (raw bytes, space separated) without a sharding key: its
    first key's (``key_slot`` hashes the UTF-8 bytes of a key, which these are)."""
    first = raw.split(b" ", 1)[0]
    return key_slot(first) if first else KEYLESS


def batch_slots(data: Any) -> list[int]:
    """The slot of every message of one stored batch (KEYLESS: no ordering key; every
    message of a batch whose records do not decode; [] for bytes that are no batch).

    A batch that names no sharding key (the common case; one search of its records, no
    copy) is read from its keys section alone: one cached lookup of each message's raw keys
    bytes, with no per-message string or dict. A batch that names one has its properties
    parsed (``ordering_key``: the sharding key, else the first key)."""
    try:
        view = BatchView(data)
    except (CorruptBatchError, ValueError):
        return []
    count = view.count
    out = [KEYLESS] * count
    try:
        raw = view.raw_records()
        if _SHARDING_RE.search(raw) is not None:
            keys = view.keys()
            for i, _t, props in filter_fields(view, 0, raw):
                ok = ordering_key(props or {}, keys.get(i))
                if ok is not None:
                    out[i] = key_slot(ok)
            return out
    except (CorruptBatchError, ValueError):
        return [KEYLESS] * count
    if not view.keys_size:
        return out
    # the keys section, entry by entry: (message index u32, length u16, bytes), copied once
    # (a few bytes per message) so that each key is one slice; the door checked its framing
    # (batch_rules.py) -- a damaged one leaves the rest keyless
    q0 = view.pos + view.keys_start
    ks = bytes(view.buf[q0:q0 + view.keys_size])
    end = len(ks)
    q = 0
    unpack = KEYS_ENTRY.unpack_from
    cache = _keys_slots
    get = cache.get
    while q + 6 <= end:
        i, n = unpack(ks, q)
        q += 6
        e = q + n
        if e > end or i >= count:
            break
        k = ks[q:e]
        q = e
        s = get(k)
        if s is None:
            if len(cache) >= _KEYS_SLOT_MAX:
                cache.clear()
            s = cache[k] = _slot_of_keys(k)
        out[i] = s
    return out


def _slots_of(p: PendingOffsets, data: Any, base: int, idx: list[int]) -> list[int]:
    """The slots of the stored batch at ``base`` (kept while offsets of it are pending)."""
    known = p.batches.get(base)
    if known is not None:
        return known[1]
    return batch_slots(data) or [KEYLESS] * (idx[-1] + 1)


def choose_key_shared(p: PendingOffsets, w: PopWindow, me: str, gated: bool, want: int,
                      now: int, invisible_ms: int, max_offset: int, epoch: int,
                      owner_of: OwnerOf, read: Reader,
                      table: IndexTable | None = None) -> list[Popped]:
    """Up to ``want`` deliveries of window ``w`` for consumer ``me`` (``gated``: a recently
    joined consumer whose marks are not passed yet takes keyless messages only). ``table``:
    the owner of every slot under the full membership -- ``owner_of``'s answer for the new
    offsets read ahead, which lie at or above every joiner's mark (None: ``owner_of`` for
    them too); ``owner_of`` re-routes the pending offsets when the membership changes."""
    back: dict[int, tuple[int, int, list[int]]] | None = None
    if now >= p.scan_at:  # deliveries that came back: pending again, in offset order
        p.scan_at = now + _SCAN_MS
        came = sorted(o for o in w.expired(now) if o not in p.back)
        if came:
            back = _locate(p, came, read)
    if p.epoch != epoch or back:
        p.route(owner_of, epoch, back)
    out: list[Popped] = []
    p.trimmed = False
    _take(p, w, me, gated, want, now, invisible_ms, out)
    scanned = 0
    while len(out) < want and w.next < max_offset and scanned < SCAN_NEW \
            and p.n < MAX_PENDING and not p.trimmed:
        start = w.next
        end = _read_ahead(p, read, start, min(max_offset, start + _STEP), max_offset,
                          owner_of, table)
        w.pass_over(end)
        scanned += end - start
        _take(p, w, me, gated, want, now, invisible_ms, out)
    return out


def _locate(p: PendingOffsets, offsets: list[int], read: Reader
            ) -> dict[int, tuple[int, int, list[int]]]:
    """offset -> (base, end, slots of its stored batch) of offsets that came back (a
    batch no longer readable: a batch of its own, keyless -- its pop acks it as gone)."""
    out: dict[int, tuple[int, int, list[int]]] = {}
    for data, base, idx in read(offsets):
        slots = _slots_of(p, data, base, idx)
        for i in idx:
            out[base + i] = (base, base + len(slots), slots)
    for o in offsets:
        if o not in out:
            out[o] = (o, o + 1, [KEYLESS])
    return out


def _read_ahead(p: PendingOffsets, read: Reader, start: int, stop: int, max_offset: int,
                owner_of: OwnerOf, table: IndexTable | None) -> int:
    """Read the stored batches holding ``[start, stop)`` -- to the end of the last one --
    and route their offsets; returns the end of what was read. Offsets no batch holds (gone
    by retention) become keyless runs of their own (their pop acks them as gone)."""
    parts: list[tuple[int, int, int, list[int]]] = []  # (base, lo, hi, slots of the batch)
    at = start
    for data, base, idx in read(range(start, stop)):
        lo = base + idx[0]
        if lo > at:  # a hole: not readable
            parts.append((at, at, lo, [KEYLESS] * (lo - at)))
        slots = _slots_of(p, data, base, idx)
        hi = min(base + len(slots), max_offset)
        if hi <= lo:
            continue
        parts.append((base, lo, hi, slots))
        at = hi
    if at < stop:
        parts.append((at, at, stop, [KEYLESS] * (stop - at)))
        at = stop
    total = at - start
    for base, lo, hi, slots in parts:
        p._batch(base, base + len(slots), slots, hi - lo)
    if table is None or total < _NUMPY_MIN:
        _route_loop(p, parts, owner_of, table)
    else:
        _route_numpy(p, parts, start, total, table)
    return at


def _route_loop(p: PendingOffsets, parts: list[tuple[int, int, int, list[int]]],
                owner_of: OwnerOf, table: IndexTable | None) -> None:
    """Route new offsets one by one (few of them, or joiner marks to apply)."""
    for base, lo, hi, slots in parts:
        runs: dict[str | None, list[int]] = {}
        for o in range(lo, hi):
            s = slots[o - base]
            if s == KEYLESS:
                who = None
            elif table is not None:
                who = table.owner(s)
            else:
                who = owner_of(o, s)
            r = runs.get(who)
            if r is None:
                r = runs[who] = []
            r.append(o)
        for who, offs in runs.items():
            p._add_run(who, base, offs)


def _route_numpy(p: PendingOffsets, parts: list[tuple[int, int, int, list[int]]],
                 start: int, total: int, table: IndexTable) -> None:
    """Route new offsets ``[start, start + total)`` (contiguous, over ``parts``) with one
    vectorised pass: owner index of each slot, a stable sort by owner (offset order kept
    inside an owner), then each owner's offsets cut at the batch bounds."""
    names, tab = table.names, table.index
    k_none = len(names)
    flat: list[int] = []
    for base, lo, hi, slots in parts:
        flat += slots[lo - base:hi - base]
    own = tab[np.asarray(flat, dtype=np.int64)]  # slot -1 (keyless) -> the last entry
    order = np.argsort(own, kind="stable")
    counts = np.bincount(own, minlength=k_none + 1)
    offsets = order + start
    los = np.asarray([lo for _b, lo, _h, _s in parts], dtype=np.int64)
    bases = [b for b, _l, _h, _s in parts]
    pos = 0
    for k in np.flatnonzero(counts).tolist():
        c = int(counts[k])
        seg = offsets[pos:pos + c]
        pos += c
        who = names[k] if k < k_none else None
        cuts = np.searchsorted(seg, los).tolist()
        cuts.append(c)
        segl = seg.tolist()
        q = p.routes.get(who)
        if q is None:
            q = p.routes[who] = collections.deque()
        for j, base in enumerate(bases):
            x, y = cuts[j], cuts[j + 1]
            if x < y:
                q.append((base, segl[x:y]))


def _take(p: PendingOffsets, w: PopWindow, me: str, gated: bool, want: int, now: int,
          invisible_ms: int, out: list[Popped]) -> None:
    """Deliver ``me``'s pending runs (and keyless ones) in offset order, whole runs; a run
    that does not fit ends the pop at its batch's start (``trimmed``), unless the pop has
    nothing yet -- then a part of it is taken and the rest stays first in line."""
    empty: collections.deque[Run] = collections.deque()
    a = empty if gated else p.routes.get(me, empty)
    b = p.routes.get(None, empty)
    while len(out) < want and (a or b):
        ha = a[0] if a else None
        hb = b[0] if b else None
        if hb is None or ha is not None and ha[0] < hb[0]:
            base, offs = a.popleft()
            kl: list[int] | None = None
        elif ha is None or hb[0] < ha[0]:
            base, offs = b.popleft()
            kl = offs
        else:  # mine and keyless runs of one stored batch: they go together
            base = ha[0]
            kl = hb[1]
            offs = sorted(ha[1] + kl)
            a.popleft()
            b.popleft()
        room = want - len(out)
        if len(offs) > room:
            if out:  # end at this batch's start: it comes first in my next pop
                _push_back(a, b, base, offs, kl)
                p.trimmed = True
                break
            _push_back(a, b, base, offs[room:], kl)
            offs = offs[:room]
        p._taken(base, len(offs))
        if p.back:
            p.back.difference_update(offs)
        # those acked meanwhile (by a consumer that left) are skipped
        out += w.deliver_many(offs, now, invisible_ms)


def _push_back(a: collections.deque[Run], b: collections.deque[Run], base: int,
               offs: list[int], kl: list[int] | None) -> None:
    """Put offsets of a run back at the front of their routes (``kl``: the keyless ones
    among them, when they came from the keyless route)."""
    if kl is None:
        a.appendleft((base, offs))
        return
    if kl is offs:
        b.appendleft((base, offs))
        return
    keyless = set(kl)
    mine = [o for o in offs if o not in keyless]
    rest = [o for o in offs if o in keyless]
    if mine:
        a.appendleft((base, mine))
    if rest:
        b.appendleft((base, rest))
