"""Key-shared read-ahead (broker/key_shared_dispatch.py ``batch_slots``): each message's slot is
its ordering key's (sharding key, else first key; keyless: KEYLESS), whether the stored batch
names a sharding key somewhere (properties parsed) or not (its keys section alone); and a pop
ends at a stored batch's start."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from tidemq.broker.key_shared import SHARDING_KEY, key_slot, ordering_key
from tidemq.broker.key_shared_dispatch import KEYLESS, PendingOffsets, batch_slots
from tidemq.protocol.batch.fast import encode_messages


@dataclass
class _Msg:
    keys: str | None
    properties: dict[str, str] | None = None
    body: bytes = b"x"
    tags: str | None = None
    delay_level: int = 0
    deliver_at: int = 0
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def keys_string(self) -> str | None:
        return self.keys


key_text = st.sampled_from(["", "a", "b c", "order-1", "order-2 x", "k9", " lead"])
messages = st.lists(
    st.tuples(st.one_of(st.none(), key_text),
              st.one_of(st.none(), st.sampled_from(["g1", "g2"]))),
    min_size=1, max_size=40)


def _model(keys: str | None, sharding: str | None) -> int:
    k = ordering_key({SHARDING_KEY: sharding} if sharding else {}, keys)
    return KEYLESS if k is None else key_slot(k)


@settings(max_examples=60, deadline=None)
@given(messages)
def test_slots_match_the_ordering_key_model(msgs):
    batch = [_Msg(k or None, {SHARDING_KEY: s} if s else None) for k, s in msgs]
    data = encode_messages("t", batch, queue_id=0, producer_id=1, base_seq=0, born_ts=1)
    assert batch_slots(memoryview(data)) == [_model(k or None, s) for k, s in msgs]


def test_bytes_that_are_no_batch_have_no_slots():
    assert batch_slots(memoryview(b"not a batch at all")) == []


def test_a_key_shared_pop_ends_at_a_stored_batch_start():
    """A pop that would end inside a stored batch ends before it instead (the batch would
    travel to the consumer twice); the rest comes first in its next pop, in offset order; a
    pop that would be left empty is not cut."""
    from tidemq.broker.key_shared import SLOTS, IndexTable
    from tidemq.broker.key_shared_dispatch import choose_key_shared
    from tidemq.broker.pop_window import PopWindow

    batches = {base: encode_messages("t", [_Msg(f"k{base + i}") for i in range(8)],
                                     queue_id=0, producer_id=1, base_seq=base, born_ts=1)
               for base in (0, 8, 16)}

    def read(offsets: list[int]):
        for base, data in batches.items():
            idx = [o - base for o in offsets if base <= o < base + 8]
            if idx:
                yield memoryview(data), base, idx

    table = IndexTable(["me"] * SLOTS)
    p, w = PendingOffsets(), PopWindow(0)

    def pop(want: int, now: int) -> list[int]:
        got = choose_key_shared(p, w, "me", False, want, now, 60_000, 24, 0,
                                lambda o, s: "me", read, table)
        return [x.offset for x in got]

    assert pop(10, 1) == list(range(8)) and p.trimmed  # not 0..9: 8, 9 are batch 8's
    assert pop(10, 2) == list(range(8, 16))
    assert pop(5, 3) == list(range(16, 21)) and not p.trimmed  # cutting would leave nothing
    assert pop(10, 4) == [21, 22, 23]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.sampled_from([None, "a", "b", "c", "d", "e", "f", "g"]),
                         min_size=1, max_size=30), min_size=1, max_size=6),
       st.lists(st.tuples(st.sampled_from(["m1", "m2", "m3", "join", "leave"]),
                          st.integers(1, 40)), min_size=1, max_size=40))
def test_key_shared_dispatch_against_a_model(batches, steps):
    """choose_key_shared over stored batches of keyed and keyless messages, pops of random
    sizes by random members, members joining and leaving (no joiner marks: the plain owner
    table): every message is delivered once, a keyed one only to the owner of its key's slot
    at the time, and each key's messages in offset order."""
    from tidemq.broker.key_shared import KeySharedSelector
    from tidemq.broker.key_shared_dispatch import choose_key_shared
    from tidemq.broker.pop_window import PopWindow

    stored: dict[int, bytes] = {}
    keys: list[str | None] = []
    for b in batches:
        stored[len(keys)] = encode_messages("t", [_Msg(k) for k in b], queue_id=0,
                                            producer_id=1, base_seq=len(keys), born_ts=1)
        keys += b
    end = len(keys)

    def read(offsets):
        offs = list(offsets)
        for base, data in stored.items():
            n = len(batches[list(stored).index(base)])
            idx = [o - base for o in offs if base <= o < base + n]
            if idx:
                yield memoryview(data), base, idx

    members = {"m1", "m2"}
    epoch = 0
    p, w = PendingOffsets(), PopWindow(0)
    got: list[tuple[str, int]] = []
    for now, (who, want) in enumerate(steps + [(m, 100) for m in ("m1", "m2", "m3")] * 3,
                                      start=1):
        if who == "join":
            members.add(f"m{want % 3 + 1}")
            epoch += 1
            continue
        if who == "leave":
            if len(members) > 1:
                members.discard(sorted(members)[want % len(members)])
                epoch += 1
            continue
        if who not in members:
            members.add(who)
            epoch += 1
        sel = KeySharedSelector()
        for m in members:
            sel.add(m)
        out = choose_key_shared(p, w, who, False, want, now, 10**9, end, epoch,
                                lambda o, s, sel=sel: sel.owner(s), read, sel.index_table())
        assert len(out) <= want
        for x in out:
            k = keys[x.offset]
            assert x.attempt == 1
            assert k is None or sel.select(k) == who, (x.offset, k, who)
            got.append((who, x.offset))
    offsets = [o for _w, o in got]
    assert len(offsets) == len(set(offsets))  # once each
    assert sorted(offsets) == list(range(end))  # all of them, in the end
    for k in set(keys) - {None}:
        mine = [o for o in offsets if keys[o] == k]
        assert mine == sorted(mine), k  # a key's messages in offset order
