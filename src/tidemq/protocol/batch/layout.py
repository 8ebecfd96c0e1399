"""The batch layout: every offset, size and bit of the tidemq batch, and nothing else.

This module and the others of ``tidemq.protocol.batch`` are the only code that knows where a
field of a batch is; everything else calls them (``codec`` encodes and decodes, ``fast`` is the
client's fast encoder, ``patch`` changes fields in place, ``tags`` hashes tags).

The tidemq batch: one binary format on the wire and on disk.

A *batch* is the unit that producers send, the CommitLog stores and consumers receive. A single
message is a batch of one. The broker never re-encodes a producer's batch: it fills in the store
header fields (physical offset, queue offset, store time and host) in place and recomputes the
small header CRC. Every message keeps its own queue offset: message ``i`` of a batch has queue
offset ``queue_offset + i``.

All integers are little-endian. The layout, field by field (``docs/format.md`` draws the same)::

    +--------------------------------------------------------------------------------+
    | STORE HEADER (72 bytes + topic) -- written by the broker, covered by store_crc  |
    +------+------+------------------+-----------------------------------------------+
    |  off | size | field            | meaning                                       |
    +------+------+------------------+-----------------------------------------------+
    |    0 |    4 | total_size  u32  | bytes of the whole batch, this field included |
    |    4 |    2 | magic       u16  | 0x7D51 (BATCH_MAGIC); 0xB1A4 marks a filler   |
    |    6 |    1 | version     u8   | 1                                             |
    |    7 |    1 | reserved    u8   | 0                                             |
    |    8 |    4 | store_crc   u32  | CRC32C of bytes [12, 72 + topic_len)          |
    |   12 |    8 | phys_offset u64  | CommitLog offset of this batch (0 on the wire)|
    |   20 |    8 | queue_offset u64 | queue offset of message 0 (0 on the wire)     |
    |   28 |    8 | store_ts    i64  | store time, ms since the epoch                |
    |   36 |    8 | prepared_off i64 | half-message offset of a transaction, else -1 |
    |   44 |    4 | queue_id    u32  | queue the batch belongs to                    |
    |   48 |    4 | reconsume   u32  | reconsume times (retry copies are batches of 1)|
    |   52 |    2 | topic_len   u16  | bytes of the UTF-8 topic that follows         |
    |   54 |    2 | store_port  u16  | broker port                                   |
    |   56 |   16 | store_host  16s  | broker IPv6 address (IPv4 mapped ::ffff:a.b.c.d)|
    |   72 |    T | topic            | UTF-8, T = topic_len                          |
    +------+------+------------------+-----------------------------------------------+
    | PRODUCER SECTION (starts at P = 72 + T) -- written once by the producer,       |
    | covered by batch_crc, never modified by the broker                             |
    +------+------+------------------+-----------------------------------------------+
    |  P+0 |    4 | batch_crc   u32  | CRC32C of bytes [P + 4, total_size)           |
    |  P+4 |    2 | attributes  u16  | bits 0-2 compression, 3-4 transaction type,   |
    |      |      |                  | 5-9 delay level (0 = none)                    |
    |  P+6 |    2 | born_port   u16  | producer port                                 |
    |  P+8 |    4 | count       u32  | number of messages (>= 1)                     |
    | P+12 |    4 | keys_size   u32  | bytes of the keys section                     |
    | P+16 |    4 | records_size u32 | bytes of the records section as stored        |
    | P+20 |    4 | raw_size    u32  | bytes of the records section uncompressed     |
    | P+24 |    8 | producer_id u64  | random id of the producer instance            |
    | P+32 |    8 | base_seq    u64  | sequence id of message 0 (message i: +i)      |
    | P+40 |    8 | deliver_at  i64  | delivery time in ms since the epoch, 0 = now  |
    | P+48 |   16 | born_host   16s  | producer IPv6 address (IPv4 mapped)           |
    +------+------+------------------+-----------------------------------------------+
    | MESSAGE INDEX: count x 12 bytes, uncompressed, what the broker needs per message|
    |   tag_hash u64 (0 = no tag) | rel_offset u32 (record start in the raw records)  |
    +--------------------------------------------------------------------------------+
    | KEYS SECTION: keys_size bytes, uncompressed, only messages that have keys       |
    |   repeated: msg_index u32 | len u16 | keys (UTF-8, space separated)             |
    +--------------------------------------------------------------------------------+
    | RECORDS: records_size bytes (LZ4 / ZSTD / zlib compressed when flagged)         |
    |   per message: record_size u32 (bytes after this field) | born_ts i64 |         |
    |   flag u32 | tags_len u16 | reserved u16 | props_len u32 | body_len u32 |       |
    |   tags | properties | body                                                      |
    +--------------------------------------------------------------------------------+

Properties are encoded as RocketMQ does: ``name 0x01 value 0x02`` repeated (neither byte may
appear in a name or value). A message's unique id is derived, never stored: the 32 hex digits of
``producer_id`` and ``base_seq + i``; this is what SendResult.msg_id and the id index use.

The filler that closes a CommitLog segment is ``total_size u32 | 0xB1A4 u16`` followed by
zeros up to the end of the segment; a segment always keeps at least FILLER_MIN bytes free for it.

The tag hash is the first 8 bytes (little-endian) of BLAKE2b over the tag; the broker filters by
hash and the client re-checks the tag string, as RocketMQ does with its tag hash codes.
"""

from __future__ import annotations

import functools
import struct

import crc32c as _crc32c_mod
import numpy as np

crc32c = _crc32c_mod.crc32c
#: crc32c that keeps the GIL. The package releases it for buffers from 32 KiB on, which on a
#: consumer's event-loop thread hands the interpreter to a waiting listener thread at every
#: batch checked, and the loop waits to get it back (up to the 5 ms switch interval): measured,
#: a push consumer's loop spent 85 µs per 143 KB batch in crc32c against ~13 µs of checking.
#: The receive path (client/codec.py) calls it as ``crc32c(data, 0, 0)``, the same without
#: functools.partial's keyword call (~0.3 µs a call).
crc32c_held = functools.partial(_crc32c_mod.crc32c, gil_release_mode=0)

BATCH_MAGIC = 0x7D51
FILLER_MAGIC = 0xB1A4
FORMAT_VERSION = 1
FILLER_MIN = 8  # bytes a segment keeps free so a filler header always fits

STORE_HEADER = struct.Struct(
    "<I"  # 0  total_size
    "H"  # 4  magic
    "B"  # 6  version
    "B"  # 7  reserved
    "I"  # 8  store_crc
    "Q"  # 12 phys_offset
    "Q"  # 20 queue_offset
    "q"  # 28 store_ts
    "q"  # 36 prepared_offset
    "I"  # 44 queue_id
    "I"  # 48 reconsume times
    "H"  # 52 topic_len
    "H"  # 54 store_port
    "16s"  # 56 store_host
)
STORE_HEADER_SIZE = 72
assert STORE_HEADER.size == STORE_HEADER_SIZE

# The fields the broker sets at append time, packed at offset 12 in one call.
STORE_FIELDS = struct.Struct("<QQq")  # phys_offset, queue_offset, store_ts
STORE_FIELDS_OFFSET = 12
# Every store-header field after store_crc (bytes [12, 72)), for a writer that stamps them all
# in one call: the store's put, which then seals the header CRC over [12, 72 + topic_len).
STORE_TAIL = struct.Struct(
    "<QQqqIIHH16s"  # phys_offset .. store_host, as in STORE_HEADER
)
assert STORE_TAIL.size == 60
TOTAL_SIZE_MAGIC = struct.Struct("<IH")
CRC_FIELD = struct.Struct("<I")
STORE_CRC_OFFSET = 8
STORE_CRC_FROM = 12

PRODUCER_HEADER = struct.Struct(
    "<I"  # 0  batch_crc
    "H"  # 4  attributes
    "H"  # 6  born_port
    "I"  # 8  count
    "I"  # 12 keys_size
    "I"  # 16 records_size
    "I"  # 20 raw_size
    "Q"  # 24 producer_id
    "Q"  # 32 base_seq
    "q"  # 40 deliver_at
    "16s"  # 48 born_host
)
PRODUCER_HEADER_SIZE = 64
assert PRODUCER_HEADER.size == PRODUCER_HEADER_SIZE

INDEX_ENTRY = struct.Struct("<QI")  # tag_hash, rel_offset
INDEX_ENTRY_SIZE = 12
assert INDEX_ENTRY.size == INDEX_ENTRY_SIZE

KEYS_ENTRY = struct.Struct("<IH")  # msg_index, len

RECORD_HEADER = struct.Struct(
    "<I"  # 0  record_size (bytes after this field)
    "q"  # 4  born_ts
    "I"  # 12 flag
    "H"  # 16 tags_len
    "H"  # 18 reserved
    "I"  # 20 props_len
    "I"  # 24 body_len
)
RECORD_HEADER_SIZE = 28
assert RECORD_HEADER.size == RECORD_HEADER_SIZE

MAX_BATCH_SIZE = 0x7FFF_FFFF
NO_PREPARED_OFFSET = -1

ZERO_HOST = bytes(16)


class Compression:
    """Codec ids kept in attribute bits 0-2 (ref PR4)."""

    NONE = 0
    LZ4 = 1
    ZSTD = 2
    ZLIB = 3
    NAMES = {"none": NONE, "lz4": LZ4, "zstd": ZSTD, "zlib": ZLIB}


class TxnType:
    """Transaction type kept in attribute bits 3-4 (RocketMQ's sys flag values)."""

    NOT_TYPE = 0
    PREPARED = 1
    COMMIT = 2
    ROLLBACK = 3


ATTR_COMPRESSION_MASK = 0x7
ATTR_TXN_SHIFT = 3
ATTR_TXN_MASK = 0x3 << ATTR_TXN_SHIFT
ATTR_DELAY_SHIFT = 5
ATTR_DELAY_MASK = 0x1F << ATTR_DELAY_SHIFT
MAX_DELAY_LEVEL = 31


PROP_NAME_SEP = "\x01"
PROP_SEP = "\x02"



# -- named offsets of single fields (for the in-place patches in ``patch.py`` and the readers
# that take one field without unpacking a header) ----------------------------------------------
TOTAL_SIZE_OFFSET = 0
PHYS_OFFSET_OFFSET = 12
QUEUE_OFFSET_OFFSET = 20
STORE_TS_OFFSET = 28
PREPARED_OFFSET_OFFSET = 36
QUEUE_ID_OFFSET = 44
TOPIC_LEN_OFFSET = 52
STORE_ADDR_OFFSET = 54  # store_port u16 then store_host 16s: 18 bytes
STORE_ADDR_SIZE = 18
# ... inside the producer section (relative to its start P = 72 + topic_len)
P_ATTRIBUTES_OFFSET = 4
P_COUNT_OFFSET = 8
P_PRODUCER_ID_OFFSET = 24
P_BASE_SEQ_OFFSET = 32

# Indexes of the fields in the tuple that one ``unpack_from`` of STORE_HEADER followed by
# PRODUCER_HEADER returns (14 + 11 fields; the client's decoder unpacks both in one call and
# keeps the tuple, client/message.py reads fields from it by these names).
H_TOTAL_SIZE, H_MAGIC, H_VERSION, H_RESERVED, H_STORE_CRC = 0, 1, 2, 3, 4
H_PHYS_OFFSET, H_QUEUE_OFFSET, H_STORE_TS, H_PREPARED, H_QUEUE_ID, H_RECONSUME = 5, 6, 7, 8, 9, 10
H_TOPIC_LEN, H_STORE_PORT, H_STORE_HOST = 11, 12, 13
H_BATCH_CRC, H_ATTRIBUTES, H_BORN_PORT, H_COUNT, H_KEYS_SIZE = 14, 15, 16, 17, 18
H_RECORDS_SIZE, H_RAW_SIZE = 19, 20
H_PRODUCER_ID, H_BASE_SEQ, H_DELIVER_AT, H_BORN_HOST = 21, 22, 23, 24
# ... and what heads_struct() reads after them: index entry 0, record header 0
H_IDX0_HASH, H_IDX0_REL = 25, 26
H_REC0_SIZE, H_REC0_BORN_TS, H_REC0_FLAG, H_REC0_TAGS_LEN = 27, 28, 29, 30
H_REC0_PROPS_LEN, H_REC0_BODY_LEN = 32, 33

# numpy views of the per-message parts, for the encoders and readers that work on whole
# arrays of them (client/codec.py, fast.py, store/consume_queue.py)
REC_DTYPE = np.dtype(
    [
        ("size", "<u4"), ("born_ts", "<i8"), ("flag", "<u4"), ("tl", "<u2"), ("res", "<u2"),
        ("pl", "<u4"), ("bl", "<u4"),
    ]
)
assert REC_DTYPE.itemsize == RECORD_HEADER_SIZE
IDX_DTYPE = np.dtype([("hash", "<u8"), ("rel", "<u4")])
assert IDX_DTYPE.itemsize == INDEX_ENTRY_SIZE
ARANGE_REC = np.arange(RECORD_HEADER_SIZE, dtype=np.int64)
#: STORE_HEADER as a numpy record, field for field (the columns of many batches at once:
#: protocol/batch/columns.py, the store's stamping of a multi-queue frame)
STORE_DTYPE = np.dtype([
    ("total", "<u4"), ("magic", "<u2"), ("version", "u1"), ("reserved", "u1"),
    ("store_crc", "<u4"), ("phys", "<u8"), ("qoff", "<u8"), ("store_ts", "<i8"),
    ("prepared", "<i8"), ("queue_id", "<u4"), ("reconsume", "<u4"), ("topic_len", "<u2"),
    ("store_port", "<u2"), ("store_host", "V16"),
])
assert STORE_DTYPE.itemsize == STORE_HEADER_SIZE
#: PRODUCER_HEADER as a numpy record
PRODUCER_DTYPE = np.dtype([
    ("batch_crc", "<u4"), ("attributes", "<u2"), ("born_port", "<u2"), ("count", "<u4"),
    ("keys_size", "<u4"), ("records_size", "<u4"), ("raw_size", "<u4"),
    ("producer_id", "<u8"), ("base_seq", "<u8"), ("deliver_at", "<i8"), ("born_host", "V16"),
])
assert PRODUCER_DTYPE.itemsize == PRODUCER_HEADER_SIZE
#: INDEX_ENTRY then RECORD_HEADER: what a one-message batch holds after its producer header
#: when it has no keys
FIRST_DTYPE = np.dtype([
    ("tag_hash", "<u8"), ("rel", "<u4"),
    ("record_size", "<u4"), ("born_ts", "<i8"), ("flag", "<u4"), ("tags_len", "<u2"),
    ("rec_reserved", "<u2"), ("props_len", "<u4"), ("body_len", "<u4"),
])
assert FIRST_DTYPE.itemsize == INDEX_ENTRY_SIZE + RECORD_HEADER_SIZE


def index_hashes(index: bytes | bytearray | memoryview) -> np.ndarray:
    """The tag hashes (u8) of a message index (``count x INDEX_ENTRY``), zero-copy."""
    return np.frombuffer(index, IDX_DTYPE)["hash"]

# Bytes of a batch that heads_struct(topic_len) reads, less the topic: both headers, index
# entry 0 and record header 0 (with no keys section, message 0's record follows index entry 0).
HEADS_FIXED = STORE_HEADER_SIZE + PRODUCER_HEADER_SIZE + INDEX_ENTRY_SIZE + RECORD_HEADER_SIZE
_heads_by_topic_len: dict[int, struct.Struct] = {}


def heads_struct(topic_len: int) -> struct.Struct:
    """One struct over a batch whose topic is ``topic_len`` bytes: STORE_HEADER's 14 fields
    (0-13, the H_* indexes), the topic skipped, PRODUCER_HEADER's 11 (14-24), then index entry
    0 (25-26) and record header 0 (27-33), which are where they say only when the batch has no
    keys section. Cached per topic length (a consumer reads few topics)."""
    s = _heads_by_topic_len.get(topic_len)
    if s is None:
        s = struct.Struct(
            STORE_HEADER.format + f"{topic_len}x" + PRODUCER_HEADER.format[1:]
            + INDEX_ENTRY.format[1:] + RECORD_HEADER.format[1:]
        )
        assert s.size == HEADS_FIXED + topic_len
        if len(_heads_by_topic_len) < 65536:
            _heads_by_topic_len[topic_len] = s
    return s
