"""ProcessQueue against a simple model: what is held, its count and size, and the offset to
commit (the smallest offset in flight, else the one after the last pulled), for pulls of one
message (its fast path, the usual pull at 10,000 queues) and of several, consumed in any order."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tidemq.client.codec import decode_pull_body
from tidemq.client.message import Message, MessageExt
from tidemq.client.process_queue import ProcessQueue
from tidemq.protocol.batch.fast import encode_messages
from tidemq.protocol.record import STORE_FIELDS, STORE_FIELDS_OFFSET, seal_store_header


def _pulled(offset: int, sizes: list[int]) -> list[MessageExt]:
    """Messages of ``sizes`` bytes at consecutive offsets from ``offset``, as a pull decodes
    them (one stored batch)."""
    b = encode_messages("t", [Message("t", b"x" * n) for n in sizes], queue_id=0,
                        producer_id=1, base_seq=offset, born_ts=1)
    STORE_FIELDS.pack_into(b, STORE_FIELDS_OFFSET, 0, offset, 2)
    seal_store_header(b, 0, 73)
    return decode_pull_body(bytes(b), from_offset=offset)[0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=4), min_size=1, max_size=8),
       st.data())
def test_process_queue_matches_a_model(pulls: list[list[int]], data: st.DataObject) -> None:
    pq = ProcessQueue()
    held: dict[int, int] = {}  # the model: offset -> body size
    offset = 3
    last = -1
    for sizes in pulls:
        msgs = _pulled(offset, sizes)
        assert pq.put_messages(msgs) is not None
        for m in msgs:
            held[m.queue_offset] = len(m.body)
        offset += len(sizes)
        last = offset - 1
        if data.draw(st.booleans()):  # the same pull again (a re-delivery): nothing new
            pq.put_messages(msgs)
        while held and data.draw(st.booleans()):
            k = data.draw(st.integers(1, len(held)))
            offs = data.draw(st.permutations(sorted(held)))[:k]
            gone = [m for m in (_pulled(o, [held[o]])[0] for o in offs)]
            if data.draw(st.booleans()) and len(gone) > 1:
                got = [pq.remove_messages([m]) for m in gone][-1]
            else:
                got = pq.remove_messages(gone)
            for o in offs:
                del held[o]
            assert got == (min(held) if held else last + 1)
        assert pq.msg_count == len(held)
        assert pq.msg_size == sum(held.values())
        assert list(pq.msgs) == sorted(held)
        assert pq.max_span() == (last - min(held) if held else 0)
