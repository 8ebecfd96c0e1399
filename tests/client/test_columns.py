"""Columns.encode writes the same batch as encode_messages over Message objects."""

from __future__ import annotations

import numpy as np
import pytest

from tidemq.client.columns import Columns, dedup_producer_id
from tidemq.client.message import Message
from tidemq.protocol.batch.fast import encode_messages

HOST = bytes(range(16))


def _cols(bodies: list[bytes], **extra: object) -> Columns:
    offsets = np.cumsum([0] + [len(b) for b in bodies]).astype(np.int64) + 3
    return Columns("topic-a", b"xyz" + b"".join(bodies), offsets, **extra)  # type: ignore[arg-type]


@pytest.mark.parametrize("bodies", [
    [b"a" * 100] * 50,                        # one size: the 2-D copy
    [b"x" * (i % 17) for i in range(40)],     # mixed sizes, empty bodies included
    [b"only"],
])
def test_columns_encode_like_messages(bodies):
    pid = dedup_producer_id("spark-q-0-topic-a-1")
    got = _cols(bodies).encode(3, pid, 7 << 32, 1_700_000_000_000, HOST, 4242)
    want = encode_messages("topic-a", [Message("topic-a", b) for b in bodies], queue_id=3,
                           producer_id=pid, base_seq=7 << 32, born_ts=1_700_000_000_000,
                           born_host=HOST, born_port=4242)
    assert bytes(got) == bytes(want)


def test_columns_with_tags_keys_properties_take_the_general_path():
    bodies = [b"one", b"two"]
    cols = _cols(bodies, tags=["paid", None], keys=[["k1"], None],
                 properties=[{"r": "eu"}, None])
    got = cols.encode(0, 5, 0, 1, HOST, 1)
    want = encode_messages("topic-a", [Message("topic-a", b"one", tags="paid", keys=["k1"],
                                               properties={"r": "eu"}),
                                       Message("topic-a", b"two")],
                           queue_id=0, producer_id=5, base_seq=0, born_ts=1, born_host=HOST,
                           born_port=1)
    assert bytes(got) == bytes(want)
    assert len(cols) == 2 and cols[0].body == b"one" and cols[1].tags is None
