"""Key-shared read-ahead (broker/key_shared_dispatch.py ``read_slots``): each message's slot is
its ordering key's (sharding key, else first key; keyless: KEYLESS), whether a stored batch is
read whole, in parts (read-ahead steps straddle stored batches: the second part comes from the
kept slots of the batch), or names a sharding key somewhere."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from tidemq.broker.key_shared import SHARDING_KEY, key_slot, ordering_key
from tidemq.broker.key_shared_dispatch import KEYLESS, PendingOffsets, read_slots
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
@given(messages, st.integers(0, 39), st.integers(0, 5))
def test_slots_match_the_ordering_key_model_read_whole_or_in_parts(msgs, cut, base):
    batch = [_Msg(k or None, {SHARDING_KEY: s} if s else None) for k, s in msgs]
    data = encode_messages("t", batch, queue_id=0, producer_id=1, base_seq=0, born_ts=1)
    n = len(batch)
    cut = min(cut, n)

    def read(offsets: list[int]):  # one stored batch at ``base``, as PopProcessor._read
        idx = [o - base for o in offsets if base <= o < base + n]
        if idx:
            yield memoryview(data), base, idx

    want = {base + i: _model(k or None, s) for i, (k, s) in enumerate(msgs)}
    assert read_slots(read, list(range(base, base + n))) == want
    p = PendingOffsets()
    first = read_slots(read, list(range(base, base + cut)), p)
    rest = read_slots(read, list(range(base + cut, base + n + 3)), p)  # past the end: KEYLESS
    assert {**first, **rest} == {**want, **dict.fromkeys(range(base + n, base + n + 3), KEYLESS)}


def test_a_key_shared_pop_ends_at_a_stored_batch_start():
    """A pop that would end inside a stored batch ends before it instead (the batch would
    travel to the consumer twice); the rest comes first in its next pop, in offset order; a
    pop that would be left empty is not cut."""
    from tidemq.broker.key_shared import SLOTS
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

    table = ["me"] * SLOTS
    p, w = PendingOffsets(), PopWindow(0)

    def pop(want: int, now: int) -> list[int]:
        got = choose_key_shared(p, w, "me", False, want, now, 60_000, 24, 0,
                                lambda o, s: "me", read, table)
        return [x.offset for x in got]

    assert pop(10, 1) == list(range(8)) and p.trimmed  # not 0..9: 8, 9 are batch 8's
    assert pop(10, 2) == list(range(8, 16))
    assert pop(5, 3) == list(range(16, 21)) and not p.trimmed  # cutting would leave nothing
    assert pop(10, 4) == [21, 22, 23]
