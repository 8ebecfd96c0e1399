"""Key-shared selection (broker/key_shared.py): one owner per key, the same whatever the join
order, a joining consumer takes slots only from others (about 1/n), a leaving one gives away
only its own, and the spread is even enough."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidemq.broker.key_shared import (
    SHARDING_KEY,
    SLOTS,
    KeySharedSelector,
    key_slot,
    ordering_key,
)

consumer_sets = st.lists(st.text(alphabet="abcdef0123456789-", min_size=1, max_size=8),
                         min_size=1, max_size=8, unique=True)
SAMPLE = range(0, SLOTS, 97)  # 676 slots across the space


def owners(sel: KeySharedSelector) -> list[str | None]:
    return [sel.owner(s) for s in SAMPLE]


@settings(max_examples=60, deadline=None)
@given(consumer_sets, st.randoms())
def test_the_assignment_does_not_depend_on_the_join_order(names, rnd):
    a, b = KeySharedSelector(20), KeySharedSelector(20)
    for n in names:
        a.add(n)
    shuffled = list(names)
    rnd.shuffle(shuffled)
    for n in shuffled:
        b.add(n)
    assert owners(a) == owners(b)
    assert set(owners(a)) <= set(names)


@settings(max_examples=60, deadline=None)
@given(consumer_sets, st.text(alphabet="xyz", min_size=1, max_size=5))
def test_joining_takes_slots_only_from_others_and_leaving_gives_back_only_its_own(names, new):
    sel = KeySharedSelector(20)
    for n in names:
        sel.add(n)
    before = owners(sel)
    sel.add(new)  # "new" uses other letters: never one of names
    during = owners(sel)
    for b, d in zip(before, during, strict=True):
        assert d == b or d == new  # a slot moves only to the newcomer
    sel.remove(new)
    assert owners(sel) == before  # and comes back exactly


def test_the_spread_is_even_and_the_newcomer_takes_about_its_share():
    sel = KeySharedSelector()
    for i in range(4):
        sel.add(f"consumer-{i}")
    counts: dict[str, int] = {}
    for s in range(SLOTS):
        o = sel.owner(s)
        counts[o] = counts.get(o, 0) + 1
    assert all(0.6 * SLOTS / 4 < c < 1.4 * SLOTS / 4 for c in counts.values()), counts
    sel.add("consumer-4")
    moved = sum(1 for s in range(SLOTS) if sel.owner(s) == "consumer-4")
    assert 0.1 * SLOTS < moved < 0.3 * SLOTS  # about 1/5


def test_keys_slots_and_ordering_keys():
    assert key_slot("order-1") == key_slot(b"order-1") and 0 <= key_slot("x") < SLOTS
    sel = KeySharedSelector()
    assert sel.select("k") is None  # no consumer
    sel.add("a")
    assert sel.select("k") == "a"
    assert ordering_key({SHARDING_KEY: "g1"}, ["k1"]) == "g1"
    assert ordering_key({}, ["k1", "k2"]) == "k1"
    assert ordering_key({}, "k1 k2") == "k1"
    assert ordering_key({}, None) is None and ordering_key({}, []) is None
    with pytest.raises(ValueError):
        sel.owner(SLOTS)
    with pytest.raises(ValueError):
        KeySharedSelector(0)


@settings(max_examples=30, deadline=None)
@given(consumer_sets)
def test_the_slot_table_is_the_ring_read_off_a_list(names):
    """Dispatch routes with ``table()`` (one list index per message): the same owner as the
    ring search for every slot, after joins and a leave."""
    sel = KeySharedSelector(replicas=20)
    for n in names:
        sel.add(n)
    table = sel.table()
    assert table is not None and len(table) == SLOTS
    assert all(table[s] == sel.owner(s) for s in range(SLOTS))
    _same_index(sel, table)
    sel.remove(names[0])
    after = sel.table()
    if len(names) == 1:
        assert after is None and sel.index_table() is None
    else:
        assert after is not None and all(after[s] == sel.owner(s) for s in range(SLOTS))
        _same_index(sel, after)


def _same_index(sel: KeySharedSelector, table: list[str]) -> None:
    """``index_table()`` (read off the ring by a vectorised search) is the list table: the same
    owner position per slot, and a keyless slot (-1) owned by nobody."""
    it = sel.index_table()
    assert it is not None and it.names == sorted(set(table))
    assert [it.names[k] for k in it.index[:SLOTS].tolist()] == table
    assert it.index[-1] == len(it.names)
    assert all(it.owner(s) == table[s] for s in range(0, SLOTS, 251))
