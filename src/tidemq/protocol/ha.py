"""The replication link between a master and its slaves (ref BR15; RocketMQ's HAService).

A slave opens one TCP connection to its master's HA port. The slave speaks first; after the
hello the master streams its CommitLog and the slave acknowledges what it has stored. All
integers are little-endian.

Hello and welcome are self-describing (a length, a magic, a MessagePack map, so fields can be
added with defaults as in the frame headers)::

    +-----+------+-------------+--------------------------------------------------+
    | off | size | field       | meaning                                          |
    +-----+------+-------------+--------------------------------------------------+
    |   0 |    4 | length u32  | bytes after this field (4 + map)                 |
    |   4 |    4 | magic  u32  | 0x48414854 "THAH" (hello) / 0x57414854 "THAW"    |
    |   8 |    L | map         | MessagePack: HaHello / HaWelcome                 |
    +-----+------+-------------+--------------------------------------------------+

    slave -> master  HaHello    who the slave is, its segment size, its CommitLog range and
                                its epoch history (epoch -> start offset)
    master -> slave  HaWelcome  refused (``error``), or what the slave does before the
                                stream starts at ``offset``: APPEND (nothing: it continues),
                                TRUNCATE (cut its log back to ``offset``: the tail the master
                                does not have), RESET (drop everything and start empty at
                                ``offset``, the master's oldest retained byte)

Then the master sends TRANSFER frames, a 48-byte header and ``body_size`` bytes of its CommitLog
as stored at ``phys_offset`` (never crossing a segment; a frame with no body is a heartbeat)::

    +-----+------+-------------------+------------------------------------------------+
    | off | size | field             | meaning                                        |
    +-----+------+-------------------+------------------------------------------------+
    |   0 |    2 | magic u16         | 0x7E48                                         |
    |   2 |    2 | flags u16         | 0                                              |
    |   4 |    4 | body_size u32     | CommitLog bytes that follow                    |
    |   8 |    8 | phys_offset u64   | where they are in the CommitLog                |
    |  16 |    8 | master_max u64    | the master's write position when it sent this  |
    |  24 |    4 | epoch u32         | the master's epoch ...                         |
    |  28 |    4 | meta_version u32  | ... and its metadata version (topics, groups)  |
    |  32 |    8 | epoch_start u64   | CommitLog offset where that epoch began        |
    |  40 |    8 | master_ms i64     | the master's wall clock, ms since the epoch    |
    +-----+------+-------------------+------------------------------------------------+

and the slave sends ACK frames, after every stored transfer and at least every heartbeat
interval (RocketMQ: 5 s)::

    +-----+------+-------------------+------------------------------------------------+
    |   0 |    2 | magic u16         | 0x7E41                                         |
    |   2 |    2 | flags u16         | 0                                              |
    |   4 |    4 | reserved u32      | 0                                              |
    |   8 |    8 | acked u64         | the slave's CommitLog write position: every    |
    |     |      |                   | byte below it is stored (a record boundary)    |
    |  16 |    8 | slave_ms i64      | the slave's wall clock                         |
    +-----+------+-------------------+------------------------------------------------+

Sans-IO: this module builds and parses bytes only.
"""

from __future__ import annotations

import enum
import struct

import msgspec

from tidemq.protocol.errors import RemoteProtocolError

__all__ = [
    "HELLO_MAGIC",
    "WELCOME_MAGIC",
    "TRANSFER",
    "TRANSFER_MAGIC",
    "ACK",
    "ACK_MAGIC",
    "HaAction",
    "HaHello",
    "HaWelcome",
    "Transfer",
    "encode_hello",
    "encode_welcome",
    "decode_message",
    "MESSAGE_PREFIX",
    "encode_transfer",
    "decode_transfer",
    "encode_ack",
    "decode_ack",
    "HA_VERSION",
    "MAX_MESSAGE",
]

HA_VERSION = 1
HELLO_MAGIC = 0x48414854  # "THAH" little-endian
WELCOME_MAGIC = 0x57414854  # "THAW"
MESSAGE_PREFIX = struct.Struct("<II")  # length, magic
#: Largest hello / welcome accepted (an epoch history is a few bytes per epoch).
MAX_MESSAGE = 1 << 20

TRANSFER_MAGIC = 0x7E48
TRANSFER = struct.Struct("<HHIQQIIQq")
assert TRANSFER.size == 48
ACK_MAGIC = 0x7E41
ACK = struct.Struct("<HHIQq")
assert ACK.size == 24


class HaAction(enum.StrEnum):
    APPEND = "APPEND"
    TRUNCATE = "TRUNCATE"
    RESET = "RESET"


class HaHello(msgspec.Struct, kw_only=True, omit_defaults=True):
    version: int = HA_VERSION
    cluster_name: str = ""
    broker_name: str
    broker_id: int
    broker_addr: str = ""  # the slave's client address (for status)
    segment_size: int
    min_offset: int  # the slave's CommitLog [min, max); equal when it holds nothing
    max_offset: int
    empty: bool = False  # no segment at all (a new or wiped slave)
    epochs: list[tuple[int, int]] = []  # (epoch, start offset), ascending


class HaWelcome(msgspec.Struct, kw_only=True, omit_defaults=True):
    version: int = HA_VERSION
    error: str = ""  # non-empty: refused, the connection closes after this
    action: HaAction = HaAction.APPEND
    offset: int = 0  # where the stream starts (after the action)
    epochs: list[tuple[int, int]] = []  # the master's history
    master_role: str = ""
    master_addr: str = ""
    master_min: int = 0
    master_max: int = 0


_enc = msgspec.msgpack.Encoder()
_dec_hello = msgspec.msgpack.Decoder(HaHello)
_dec_welcome = msgspec.msgpack.Decoder(HaWelcome)


def _message(magic: int, obj: msgspec.Struct) -> bytes:
    body = _enc.encode(obj)
    return MESSAGE_PREFIX.pack(4 + len(body), magic) + body


def encode_hello(h: HaHello) -> bytes:
    return _message(HELLO_MAGIC, h)


def encode_welcome(w: HaWelcome) -> bytes:
    return _message(WELCOME_MAGIC, w)


def decode_message(magic: int, body: bytes) -> HaHello | HaWelcome:
    """The map after a prefix with ``magic``; RemoteProtocolError for anything else."""
    try:
        if magic == HELLO_MAGIC:
            return _dec_hello.decode(body)
        if magic == WELCOME_MAGIC:
            return _dec_welcome.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RemoteProtocolError(f"malformed replication handshake: {exc}") from None
    raise RemoteProtocolError(
        f"not a tidemq replication peer (magic 0x{magic:08X}); check that the address is an "
        "HA port"
    )


class Transfer(msgspec.Struct, frozen=True):
    body_size: int
    phys_offset: int
    master_max: int
    epoch: int
    meta_version: int
    epoch_start: int
    master_ms: int


def encode_transfer(t: Transfer) -> bytes:
    return TRANSFER.pack(
        TRANSFER_MAGIC, 0, t.body_size, t.phys_offset, t.master_max, t.epoch,
        t.meta_version & 0xFFFF_FFFF, t.epoch_start, t.master_ms,
    )


def decode_transfer(buf: bytes | bytearray | memoryview, pos: int = 0) -> Transfer:
    magic, _flags, size, phys, mx, epoch, meta, estart, ms = TRANSFER.unpack_from(buf, pos)
    if magic != TRANSFER_MAGIC:
        raise RemoteProtocolError(
            f"replication stream out of step: transfer magic 0x{magic:04X}, expected "
            f"0x{TRANSFER_MAGIC:04X}"
        )
    return Transfer(size, phys, mx, epoch, meta, estart, ms)


def encode_ack(acked: int, slave_ms: int) -> bytes:
    return ACK.pack(ACK_MAGIC, 0, 0, acked, slave_ms)


def decode_ack(buf: bytes | bytearray | memoryview, pos: int = 0) -> tuple[int, int]:
    """(acked offset, slave wall ms)."""
    magic, _flags, _res, acked, ms = ACK.unpack_from(buf, pos)
    if magic != ACK_MAGIC:
        raise RemoteProtocolError(
            f"replication ack out of step: magic 0x{magic:04X}, expected 0x{ACK_MAGIC:04X}"
        )
    return acked, ms
