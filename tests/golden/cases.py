"""The inputs of the golden files in this directory (``tests/golden/*.bin``).

The ``.bin`` files were written once, by ``python -m tests.golden.make_golden``, from the code
as it was *before* the batch format got its single owner (``tidemq.protocol.batch``): they are
the format as it is on the wire and on disk. ``test_golden.py`` checks, byte for byte, that
today's encoders still produce them and today's decoders still read them. Re-generate them only
for a deliberate format change (and say so in the commit).

Every input is fixed: timestamps, producer ids, sequence ids, hosts -- nothing comes from the
clock or a random generator.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))

BORN_TS = 1_764_000_000_123
STORE_TS = 1_764_000_000_456
PRODUCER_ID = 0x1234_5678_9ABC_DEF0
BORN_HOST = "10.1.2.3"
BORN_PORT = 40_123
STORE_HOST = "192.168.7.9"
STORE_PORT = 10_911


def path(name: str) -> str:
    return os.path.join(HERE, name)


@dataclass
class Msg:
    body: bytes
    tags: str | None = None
    keys: str | None = None
    properties: dict[str, str] | None = None


@dataclass
class BatchCase:
    """One batch: ``topic``, ``messages`` and the ``encode_batch`` keywords in ``kw``.

    ``client``: the fast encoder (protocol/batch/fast.py encode_messages: the numpy paths
    that were in client/codec.py) builds the same bytes from the same input (it does for
    batches without a per-batch transaction type, prepared offset or reconsume count, which
    only the broker sets)."""

    name: str
    topic: str
    messages: list[Msg]
    kw: dict[str, Any] = field(default_factory=dict)
    client: bool = True
    # The stored form: the store header fields a broker stamps at append time.
    phys_offset: int = 4096
    queue_offset: int = 17


_LOREM = b"tidemq golden body " * 40  # compressible

CHUNK_PROPS = {
    "__CHUNK_UUID": "golden-producer-7",
    "__CHUNK_ID": "1",
    "__CHUNK_TOTAL": "3",
    "__CHUNK_SIZE": "300",
    "color": "blue",
}

BATCHES: list[BatchCase] = [
    BatchCase("plain_one", "Golden", [Msg(b"hello")]),
    BatchCase("plain_many", "Golden", [Msg(b"m%02d" % i) for i in range(5)], {"queue_id": 3}),
    # Over 32 messages of equal size: the client's numpy 2-D fast path.
    BatchCase("plain_fixed_40", "Golden", [Msg(b"%08d" % i) for i in range(40)]),
    # Over 32 messages of varied sizes: the client's numpy plain path with ragged bodies.
    BatchCase("plain_ragged_40", "Golden", [Msg(b"x" * (i % 7)) for i in range(40)]),
    BatchCase(
        "varied",
        "Golden.Topic-Ü",
        [
            Msg(b"a", tags="TagA"),
            Msg(b"", tags=None, keys="k1 k2"),
            Msg(b"body three", tags="TagB", keys="order-3",
                properties={"p": "1", "unicode": "ünï"}),
            Msg(b"\x00\x01\x02\xff", properties={"empty": ""}),
        ],
        {"queue_id": 7, "base_seq": 1000},
    ),
    # Over 32 messages with tags/keys/properties: the client's numpy index path.
    BatchCase(
        "varied_40",
        "Golden",
        [
            Msg(b"v%d" % i, tags=f"T{i % 3}" if i % 4 else None,
                keys=f"key-{i}" if i % 5 == 0 else None,
                properties={"i": str(i)} if i % 2 else None)
            for i in range(40)
        ],
        {"queue_id": 1, "base_seq": 77},
    ),
    BatchCase("lz4", "Golden", [Msg(_LOREM, tags="Z") for _ in range(3)],
              {"compression": 1, "compress_min": 64}),
    BatchCase("zstd", "Golden", [Msg(_LOREM, keys="z") for _ in range(3)],
              {"compression": 2, "compress_min": 64}),
    BatchCase("transaction_prepared", "GoldenTx",
              [Msg(b"half", tags="Tx", properties={"TRAN_MSG": "true", "PGROUP": "pg"})],
              {"txn": 1, "prepared_offset": 123_456}, client=False),
    BatchCase("transaction_commit_retry", "%RETRY%golden_group",
              [Msg(b"again", tags="Tx")], {"txn": 2, "reconsume_times": 3}, client=False),
    BatchCase("chunk", "GoldenChunk", [Msg(b"c" * 100, tags="Big", keys="big-1",
                                           properties=CHUNK_PROPS)]),
    BatchCase("delay_level", "GoldenDelay", [Msg(b"later", tags="D")], {"delay_level": 3}),
    BatchCase("deliver_at", "GoldenDelay", [Msg(b"at", keys="when")],
              {"deliver_at": 1_764_000_060_000}),
]

# Frames: (name, kind, code, opaque, header, body).
FRAMES: list[tuple[str, str, int, int, dict[str, Any] | None, bytes]] = [
    ("frame_request", "request", 10, 41, {"topic": "Golden", "queueId": 3, "bornTs": BORN_TS},
     b"\x01\x02body"),
    ("frame_response", "response", 0, 41,
     {"msgId": "0123456789ABCDEF0123456789ABCDEF", "queueOffset": 17, "status": "SEND_OK"},
     b""),
    ("frame_oneway_no_header", "oneway", 34, 7, None, b"x"),
]

# Consume-queue units: (queue_offset, phys_offset, size, tag_hash) appended in order.
CQ_UNITS = [
    (0, 0, 120, 0),
    (1, 120, 97, 0x0123_4567_89AB_CDEF),
    (2, 217, 300, 0xFFFF_FFFF_FFFF_FFFF),
]
CQ_UNITS_PER_FILE = 8

# Index file: (key, phys_offset, store_ts) put in order, slots and entries small.
INDEX_PUTS = [
    ("order-1", 0, STORE_TS),
    ("order-2", 120, STORE_TS + 5),
    ("order-1", 217, STORE_TS + 9),
]
INDEX_SLOTS = 4
INDEX_MAX_ENTRIES = 8
