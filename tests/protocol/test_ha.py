"""The replication link's frames (protocol/ha.py): golden bytes, round trips, bad input."""

from __future__ import annotations

import pytest

from tidemq.protocol.errors import RemoteProtocolError
from tidemq.protocol.ha import (
    ACK,
    HELLO_MAGIC,
    MESSAGE_PREFIX,
    TRANSFER,
    HaAction,
    HaHello,
    HaWelcome,
    Transfer,
    decode_ack,
    decode_message,
    decode_transfer,
    encode_ack,
    encode_hello,
    encode_transfer,
    encode_welcome,
)


def test_transfer_golden_bytes():
    t = Transfer(body_size=0x10, phys_offset=0x0102, master_max=0x0304, epoch=2,
                 meta_version=7, epoch_start=0x0506, master_ms=0x0708)
    raw = encode_transfer(t)
    assert len(raw) == TRANSFER.size == 48
    assert raw.hex() == (
        "487e" "0000" "10000000"  # magic 0x7E48, flags, body_size
        "0201000000000000"  # phys_offset
        "0403000000000000"  # master_max
        "02000000" "07000000"  # epoch, meta_version
        "0605000000000000"  # epoch_start
        "0807000000000000"  # master_ms
    )
    assert decode_transfer(raw) == t


def test_ack_golden_bytes():
    raw = encode_ack(0x0A0B, 0x0C0D)
    assert len(raw) == ACK.size == 24
    assert raw.hex() == "417e" "0000" "00000000" "0b0a000000000000" "0d0c000000000000"
    assert decode_ack(raw) == (0x0A0B, 0x0C0D)


def test_hello_and_welcome_round_trip():
    h = HaHello(broker_name="broker-a", broker_id=1, segment_size=1 << 20, min_offset=0,
                max_offset=4096, epochs=[(1, 0), (2, 1024)])
    raw = encode_hello(h)
    length, magic = MESSAGE_PREFIX.unpack_from(raw)
    assert magic == HELLO_MAGIC
    assert length == len(raw) - 4
    assert raw[4:8] == b"THAH"
    back = decode_message(magic, raw[8:])
    assert back == HaHello(broker_name="broker-a", broker_id=1, segment_size=1 << 20,
                           min_offset=0, max_offset=4096, epochs=[(1, 0), (2, 1024)])
    w = HaWelcome(action=HaAction.TRUNCATE, offset=1024, epochs=[(1, 0), (2, 1024)])
    raw = encode_welcome(w)
    assert raw[4:8] == b"THAW"
    assert decode_message(*MESSAGE_PREFIX.unpack_from(raw)[1:], raw[8:]) == w


def test_garbage_is_refused_clearly():
    with pytest.raises(RemoteProtocolError, match="HA port"):
        decode_message(0x12345678, b"")
    with pytest.raises(RemoteProtocolError, match="malformed"):
        decode_message(HELLO_MAGIC, b"\xc1\xc1")
    with pytest.raises(RemoteProtocolError, match="out of step"):
        decode_transfer(bytes(48))
    with pytest.raises(RemoteProtocolError, match="out of step"):
        decode_ack(bytes(24))
