"""Key-shared selection (Pulsar's Key_Shared subscription; docs/pop-dispatch.md, ref CO10).

In a key-shared subscription every message with the same *ordering key* goes to one consumer,
so per-key order holds while the keys spread over the consumers. The ordering key of a message
is its sharding key (the ``__SHARDINGKEY`` property, RocketMQ 5's message group), else its first
key; a message without either has none and is dispatched as in a shared subscription.

Keys are hashed into 65 536 slots (``key_slot``) and the slots are split between the consumers
by consistent hashing (Pulsar's ConsistentHashingStickyKeyConsumerSelector): each consumer has
``replicas`` (100) points on a ring of the slot space, and a slot belongs to the consumer whose
point comes first at or after it (wrapping). So the assignment is

- *consistent*: every broker and every restart computes the same owner from the same member set;
- *sticky*: a consumer joining takes about 1/n of the slots, all from the others, and a consumer
  leaving gives away only its own -- no other key changes owner.

Pulsar's recently-joined-consumer rule (a joining consumer receives a key's messages only after
what was dispatched before it joined is acked) lives with the dispatcher, which knows what is in
flight; this module is the pure selection.

Sans-IO; one owner (the dispatcher).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Iterable, Mapping
from hashlib import blake2b
from typing import Any

import numpy as np

__all__ = ["SLOTS", "SHARDING_KEY", "IndexTable", "KeySharedSelector", "key_slot",
           "ordering_key"]

SLOTS = 65_536
#: the property naming a message's ordering key (RocketMQ's MessageConst.PROPERTY_SHARDING_KEY)
SHARDING_KEY = "__SHARDINGKEY"


def _hash(data: bytes) -> int:
    return int.from_bytes(blake2b(data, digest_size=4).digest(), "little")


@functools.lru_cache(maxsize=65_536)  # keys repeat: a dispatcher asks for the same ones
def key_slot(key: str | bytes) -> int:
    """The slot (0 .. 65 535) of an ordering key."""
    return _hash(key.encode() if isinstance(key, str) else key) % SLOTS


def ordering_key(properties: Mapping[str, str], keys: Iterable[str] | str | None) -> str | None:
    """The sharding key, else the first key, else None (no ordering key)."""
    sk = properties.get(SHARDING_KEY)
    if sk:
        return sk
    if isinstance(keys, str):
        first = keys.split(" ", 1)[0]
        return first or None
    for k in keys or ():
        if k:
            return k
    return None


class IndexTable:
    """The owner of every slot as ``index`` (slot -> position in ``names``, a numpy array for
    routing whole batches at once), whose extra last entry -- index -1, a keyless message's
    slot -- is ``len(names)``: no owner. Built from an owner per slot (``owners``), or by
    :meth:`KeySharedSelector.index_table` straight from the ring."""

    __slots__ = ("names", "index")

    def __init__(self, owners: list[str] | None = None, *, names: list[str] | None = None,
                 index: Any = None) -> None:
        if owners is not None:
            names = sorted(set(owners))
            pos = {n: k for k, n in enumerate(names)}
            index = np.empty(SLOTS + 1, dtype=np.int32)
            index[:SLOTS] = [pos[c] for c in owners]
            index[SLOTS] = len(names)
        if names is None or index is None:
            raise ValueError("an IndexTable needs owners, or names and index")
        self.names = names
        self.index = index

    def owner(self, slot: int) -> str:
        """The consumer of ``slot`` (0 .. SLOTS - 1)."""
        return self.names[int(self.index[slot])]


class KeySharedSelector:
    """Which consumer gets a slot: consistent hashing of the slot space (see the module doc)."""

    def __init__(self, replicas: int = 100) -> None:
        if replicas < 1:
            raise ValueError("replicas must be >= 1")
        self.replicas = replicas
        self._points: list[int] = []  # sorted ring positions
        self._owners: list[str] = []  # consumer at each position
        self._members: set[str] = set()
        self._table: list[str] | None = None  # slot -> consumer, built at the first lookup
        self._index: IndexTable | None = None

    @property
    def consumers(self) -> frozenset[str]:
        return frozenset(self._members)

    def add(self, consumer: str) -> None:
        if consumer in self._members:
            return
        self._members.add(consumer)
        for i in range(self.replicas):
            p = _hash(f"{consumer}#{i}".encode()) % SLOTS
            k = bisect.bisect_left(self._points, p)
            # equal positions: order by name, so the ring is the same whatever the join order
            while k < len(self._points) and self._points[k] == p and self._owners[k] < consumer:
                k += 1
            self._points.insert(k, p)
            self._owners.insert(k, consumer)
        self._table = self._index = None

    def remove(self, consumer: str) -> None:
        if consumer not in self._members:
            return
        self._members.discard(consumer)
        keep = [(p, c) for p, c in zip(self._points, self._owners, strict=True) if c != consumer]
        self._points = [p for p, _ in keep]
        self._owners = [c for _, c in keep]
        self._table = self._index = None

    def table(self) -> list[str] | None:
        """The owner of every slot, indexed by slot (None without consumers): a dispatcher
        routes a message with one list index instead of a ring search per message. Built once
        per membership from the ring's segments (a few hundred list extends)."""
        if not self._points:
            return None
        t = self._table
        if t is None:
            points, owners = self._points, self._owners
            t = []
            lo = 0
            for p, c in zip(points, owners, strict=True):
                if p >= lo:  # slots lo..p belong to the first point at or after them
                    t.extend([c] * (p + 1 - lo))
                    lo = p + 1
            t.extend([owners[0]] * (SLOTS - lo))  # past the last point: wraps to the first
            self._table = t
        return t

    def index_table(self) -> IndexTable | None:
        """:meth:`table` with owner positions as an array (None without consumers), read off
        the ring with one vectorised search (a slot's owner: the first point at or after it,
        wrapping) -- about a millisecond, where converting the 65 536-entry list took ~25:
        the first pop after every membership change builds it, on the event loop."""
        if self._index is None:
            if not self._points:
                return None
            names = sorted(self._members)
            pos = {n: k for k, n in enumerate(names)}
            own = np.asarray([pos[c] for c in self._owners], dtype=np.int32)
            k = np.searchsorted(np.asarray(self._points, dtype=np.int64),
                                np.arange(SLOTS, dtype=np.int64), side="left")
            k[k == len(own)] = 0  # past the last point: the first one's
            index = np.empty(SLOTS + 1, dtype=np.int32)
            index[:SLOTS] = own[k]
            index[SLOTS] = len(names)
            self._index = IndexTable(names=names, index=index)
        return self._index

    def owner(self, slot: int) -> str | None:
        """The consumer of ``slot``; None without consumers."""
        if not self._points:
            return None
        if not 0 <= slot < SLOTS:
            raise ValueError(f"slot {slot} is outside 0..{SLOTS - 1}")
        k = bisect.bisect_left(self._points, slot)
        return self._owners[k % len(self._owners)]

    def select(self, key: str | bytes) -> str | None:
        """The consumer of an ordering key."""
        return self.owner(key_slot(key))
