"""Frame layer: golden bytes, round trips, chunked decoding, and rejection of bad input."""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidemq.protocol.codes import RequestCode, ResponseCode
from tidemq.protocol.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from tidemq.protocol.frame import (
    DEFAULT_MAX_FRAME_SIZE,
    FLAG_ONEWAY,
    FLAG_RESPONSE,
    FRAME_PREFIX,
    PREFIX_SIZE,
    Frame,
    FrameDecoder,
    encode_frame,
    encode_frame_parts,
)
from tidemq.protocol.headers import (
    ErrorResponseHeader,
    SendMessageRequestHeader,
    SendMessageResponseHeader,
    request_header_type,
    response_header_type,
)

# -- golden bytes -------------------------------------------------------------------------------

GOLDEN_REQUEST = bytes.fromhex(
    "38000000"  # total_len = 56 = 14 + 37 (header) + 5 (body)
    "d7"  # magic
    "01"  # version
    "00"  # flags: request
    "00"  # reserved
    "0a00"  # code 10 = SEND_MESSAGE
    "07000000"  # opaque 7
    "25000000"  # header_len 37
    "83"  # header: map of 3
    "ae" + b"producer_group".hex() + "a2" + b"pg".hex()
    + "a5" + b"topic".hex() + "a1" + b"t".hex()
    + "a8" + b"queue_id".hex() + "00"
    + b"hello".hex()  # body
)
GOLDEN_REQUEST_FRAME = Frame.request(
    RequestCode.SEND_MESSAGE,
    7,
    SendMessageRequestHeader(producer_group="pg", topic="t", queue_id=0),
    b"hello",
)

GOLDEN_RESPONSE = bytes.fromhex(
    "30000000"  # total_len = 48 = 14 + 34 (header) + 0 (body)
    "d7"  # magic
    "01"  # version
    "01"  # flags: RESPONSE
    "00"  # reserved
    "0000"  # code 0 = SUCCESS
    "07000000"  # opaque 7 (the request's)
    "22000000"  # header_len 34
    "83"  # header: map of 3
    "a6" + b"msg_id".hex() + "a1" + b"A".hex()
    + "a8" + b"queue_id".hex() + "01"
    + "ac" + b"queue_offset".hex() + "2a"
)
GOLDEN_RESPONSE_FRAME = GOLDEN_REQUEST_FRAME.response(
    ResponseCode.SUCCESS, SendMessageResponseHeader(msg_id="A", queue_id=1, queue_offset=42)
)

GOLDEN_ONEWAY = bytes.fromhex("0e000000" "d7" "01" "02" "00" "2800" "ffffffff" "00000000")


def test_golden_request_bytes():
    assert encode_frame(GOLDEN_REQUEST_FRAME) == GOLDEN_REQUEST
    (frame,) = FrameDecoder(header_types=lambda f, c, o: request_header_type(c)).feed(
        GOLDEN_REQUEST
    )
    assert frame == GOLDEN_REQUEST_FRAME
    assert bytes(frame.body) == b"hello"


def test_golden_response_bytes():
    assert GOLDEN_RESPONSE_FRAME.opaque == 7 and GOLDEN_RESPONSE_FRAME.is_response
    assert encode_frame(GOLDEN_RESPONSE_FRAME) == GOLDEN_RESPONSE
    (frame,) = FrameDecoder(header_types=lambda f, c, o: SendMessageResponseHeader).feed(
        GOLDEN_RESPONSE
    )
    assert frame == GOLDEN_RESPONSE_FRAME


def test_golden_oneway_without_header_or_body():
    frame = Frame.request(RequestCode.NOTIFY_CONSUMER_IDS_CHANGED, 0xFFFFFFFF, oneway=True)
    assert encode_frame(frame) == GOLDEN_ONEWAY
    (back,) = FrameDecoder().feed(GOLDEN_ONEWAY)
    assert back.is_oneway and not back.is_response
    assert back.header is None and bytes(back.body) == b""


def test_prefix_struct_matches_the_documented_offsets():
    raw = FRAME_PREFIX.pack(1, 2, 3, 4, 5, 6, 7, 8)
    assert raw == bytes.fromhex("01000000 02 03 04 05 0600 07000000 08000000")
    assert PREFIX_SIZE == FRAME_PREFIX.size == 18


# -- strategies ---------------------------------------------------------------------------------

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                  max_size=4),
    max_leaves=12,
)
headers = st.none() | st.dictionaries(st.text(max_size=12), _values, max_size=6)
frames = st.builds(
    Frame,
    code=st.integers(0, 0xFFFF),
    opaque=st.integers(0, 0xFFFF_FFFF),
    flags=st.sampled_from([0, FLAG_RESPONSE, FLAG_ONEWAY]),
    header=headers,
    body=st.binary(max_size=600),
)


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, prev = [], 0
    for p in [*points, len(data)]:
        out.append(data[prev:p])
        prev = p
    return out


def _feed_all(dec: FrameDecoder, chunks: list[bytes]) -> list[Frame]:
    out: list[Frame] = []
    for c in chunks:
        out.extend(dec.feed(c))
    return out


# -- round trips --------------------------------------------------------------------------------


@given(frames)
def test_encode_decode_round_trip(frame):
    wire = encode_frame(frame)
    assert b"".join(bytes(p) for p in encode_frame_parts(frame, inline_body_max=0)) == wire
    assert len(wire) == 4 + struct.unpack_from("<I", wire)[0]
    dec = FrameDecoder()
    (back,) = dec.feed(wire)
    assert back == frame
    if frame.body:
        assert type(back.body) is memoryview and back.body.readonly
    else:
        assert back.body == b""
    assert dec.buffered == 0


@given(st.lists(frames, min_size=1, max_size=8))
def test_decoder_fed_whole_stream(fs):
    assert FrameDecoder().feed(b"".join(encode_frame(f) for f in fs)) == fs


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(frames, min_size=1, max_size=3))
def test_decoder_fed_byte_by_byte(fs):
    wire = b"".join(encode_frame(f) for f in fs)
    dec = FrameDecoder()
    got = []
    for i in range(len(wire)):
        got.extend(dec.feed(wire[i : i + 1]))
        assert dec.buffered == (i + 1 - sum(len(encode_frame(f)) for f in got))
    assert got == fs and dec.buffered == 0


@given(st.lists(frames, min_size=1, max_size=6), st.lists(st.integers(0, 10_000), max_size=12))
def test_decoder_fed_random_chunks(fs, cuts):
    wire = b"".join(encode_frame(f) for f in fs)
    dec = FrameDecoder()
    assert _feed_all(dec, _split(wire, cuts)) == fs
    assert dec.buffered == 0
    dec.eof()  # a clean end: nothing pending, no error


@given(st.lists(frames, min_size=1, max_size=6), st.lists(st.integers(0, 10_000), max_size=12),
       st.data())
def test_a_partial_frame_taken_over_and_fed_whole_decodes_the_same(fs, cuts, data):
    """take_partial, as the client connection uses it for large frames: whenever a frame's
    prefix is in, the caller may take what is held, collect the rest of that frame itself and
    feed it whole; the frames decoded are those of feeding the stream as it came."""
    wire = b"".join(encode_frame(f) for f in fs)
    dec = FrameDecoder()
    got: list[Frame] = []
    taken: bytearray | None = None
    need = 0
    for chunk in _split(wire, cuts):
        while chunk:
            if taken is not None:  # the caller collects the rest of the frame it took
                n = min(len(chunk), need - len(taken))
                taken += chunk[:n]
                chunk = chunk[n:]
                if len(taken) == need:
                    got.extend(dec.feed(bytes(taken)))
                    taken = None
                continue
            got.extend(dec.feed(chunk))
            chunk = b""
            if dec.missing and data.draw(st.booleans()):
                missing, size = dec.missing, dec.partial_size
                need, held = dec.take_partial()
                assert (need, len(held)) == (size, size - missing)
                assert dec.buffered == 0 and dec.missing == 0
                taken = bytearray(held)
    assert taken is None and got == fs and dec.buffered == 0
    assert dec.take_partial() == (0, b"")  # nothing held: nothing changes


@given(st.lists(frames, max_size=4), frames, st.data())
def test_trailing_bytes_stay_buffered_as_the_next_frame(fs, nxt, data):
    wire = b"".join(encode_frame(f) for f in fs)
    tail = encode_frame(nxt)
    k = data.draw(st.integers(1, len(tail) - 1), label="trailing bytes")
    dec = FrameDecoder()
    assert dec.feed(wire + tail[:k]) == fs
    assert dec.buffered == k
    assert dec.feed(tail[k:]) == [nxt]
    assert dec.buffered == 0
    cut = FrameDecoder()
    assert cut.feed(tail[:k]) == []
    with pytest.raises(RemoteProtocolError, match="mid-frame"):
        cut.eof()  # the peer closed with the trailing bytes still buffered


def test_parts_keep_a_big_body_by_identity():
    body = memoryview(bytearray(b"x" * 100_000))
    frame = Frame.request(RequestCode.SEND_BATCH, 1, {"topic": "t"}, body)
    parts = encode_frame_parts(frame)
    assert len(parts) == 2 and parts[1] is body
    assert b"".join(parts) == encode_frame(frame)
    small = Frame.request(RequestCode.SEND_BATCH, 1, {"topic": "t"}, b"tiny")
    (only,) = encode_frame_parts(small)
    assert only == encode_frame(small)


def test_memoryview_body_length_counts_bytes_not_items():
    body = memoryview(bytes(range(16))).cast("I")  # 4 items, 16 bytes
    (back,) = FrameDecoder().feed(encode_frame(Frame.request(1, 1, None, body)))
    assert bytes(back.body) == bytes(range(16))


def test_bodies_are_views_of_the_received_bytes():
    wire = encode_frame(Frame.request(1, 1, None, b"a" * 50)) * 3
    for frame in FrameDecoder().feed(wire):
        assert frame.body.obj is wire
    (empty,) = FrameDecoder().feed(encode_frame(Frame.request(1, 1, {"k": 1})))
    assert type(empty.body) is bytes  # does not pin the received chunk


def test_a_reusable_receive_buffer_is_not_aliased():
    buf = bytearray(encode_frame(Frame.request(1, 1, None, b"payload")))
    (frame,) = FrameDecoder().feed(memoryview(buf))
    buf[:] = bytes(len(buf))
    assert bytes(frame.body) == b"payload"


def test_pre_encoded_header_bytes_pass_through():
    raw = encode_frame(Frame.request(1, 1, {"k": "v"}))
    assert encode_frame(Frame.request(1, 1, b"\x81\xa1k\xa1v")) == raw


# -- typed headers through the decoder ----------------------------------------------------------


def test_typed_request_and_error_response_headers():
    req = Frame.request(
        RequestCode.SEND_MESSAGE, 9, SendMessageRequestHeader(producer_group="g", topic="t",
                                                              queue_id=2)
    )
    err = req.response(ResponseCode.TOPIC_NOT_EXIST, ErrorResponseHeader(message="no topic t"))
    pending = {9: RequestCode.SEND_MESSAGE}

    def client_types(flags, code, opaque):
        request = pending.get(opaque)
        return None if request is None else response_header_type(request, code)

    broker = FrameDecoder(header_types=lambda f, c, o: request_header_type(c))
    (got,) = broker.feed(encode_frame(req))
    assert isinstance(got.header, SendMessageRequestHeader) and got.header.queue_id == 2
    (resp,) = FrameDecoder(header_types=client_types).feed(encode_frame(err))
    assert resp.is_response and resp.code == ResponseCode.TOPIC_NOT_EXIST
    assert resp.header == ErrorResponseHeader(message="no topic t")


def test_typed_header_missing_a_required_field_is_a_remote_error():
    wire = encode_frame(Frame.request(RequestCode.SEND_MESSAGE, 3, {"topic": "t"}))
    dec = FrameDecoder(header_types=lambda f, c, o: request_header_type(c))
    with pytest.raises(RemoteProtocolError, match="SendMessageRequestHeader"):
        dec.feed(wire)


def test_empty_header_decodes_to_defaults_of_a_typed_header():
    wire = encode_frame(Frame.request(RequestCode.SEND_MESSAGE, 3))
    (frame,) = FrameDecoder(header_types=lambda f, c, o: ErrorResponseHeader).feed(wire)
    assert frame.header == ErrorResponseHeader()


# -- bad input from the peer --------------------------------------------------------------------


def _prefix(total=14, magic=0xD7, version=1, flags=0, reserved=0, code=1, opaque=1, hlen=0):
    return FRAME_PREFIX.pack(total, magic, version, flags, reserved, code, opaque, hlen)


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (_prefix(magic=0x00), "magic"),
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "magic"),
        (_prefix(version=2), "version"),
        (_prefix(flags=FLAG_RESPONSE | FLAG_ONEWAY), "flags"),
        (_prefix(flags=0x80), "flags"),
        (_prefix(reserved=1), "reserved"),
        (_prefix(total=13), "minimum"),
        (_prefix(total=20, hlen=7) + bytes(6), "header_len"),
        (_prefix(total=15, hlen=1) + b"\xc1", "does not decode"),  # 0xC1: never used
        (_prefix(total=15, hlen=1) + b"\x01", "map"),  # an int, not a map
        (_prefix(total=17, hlen=3) + b"\x81\x01\x02", "map"),  # {1: 2}: key not a string
        (_prefix(total=16, hlen=2) + b"\x91\xc0", "map"),  # an array
        (_prefix(total=18, hlen=4) + b"\x81\xa1\xff\xc0", "decode"),  # key is not UTF-8
    ],
)
def test_bad_frames_raise_remote_protocol_error(raw, match):
    dec = FrameDecoder()
    with pytest.raises(RemoteProtocolError, match=match):
        dec.feed(raw)
    with pytest.raises(RemoteProtocolError, match="already failed"):
        dec.feed(GOLDEN_REQUEST)  # a failed decoder stays failed


def test_deeply_nested_header_is_a_remote_error():
    header = b"\x81\xa1k" + b"\x91" * 100_000 + b"\xc0"
    raw = _prefix(total=14 + len(header), hlen=len(header)) + header
    with pytest.raises(RemoteProtocolError):
        FrameDecoder().feed(raw)


def test_oversize_length_rejected_before_the_body_is_buffered():
    dec = FrameDecoder(max_frame_size=1024)
    with pytest.raises(RemoteProtocolError, match="exceeds the limit of 1024"):
        dec.feed(struct.pack("<I", 1021))  # a 1025-byte frame: the length field alone suffices
    assert dec.buffered == 0

    dec = FrameDecoder()
    big = _prefix(total=DEFAULT_MAX_FRAME_SIZE - 3)
    with pytest.raises(RemoteProtocolError, match="exceeds the limit"):
        dec.feed(big + bytes(100))
    assert dec.buffered == 0


@pytest.mark.parametrize(
    ("raw", "fails_at"),
    [(struct.pack("<I", 2**31), 4), (_prefix(magic=0x16), 5), (_prefix(version=9), 6)],
    ids=["length", "magic", "version"],
)
def test_a_bad_prefix_fails_as_soon_as_its_bad_byte_arrives(raw, fails_at):
    dec = FrameDecoder()
    for i in range(fails_at - 1):
        assert dec.feed(raw[i : i + 1]) == []
    with pytest.raises(RemoteProtocolError):
        dec.feed(raw[fails_at - 1 : fails_at])


def test_frame_of_exactly_max_size_is_accepted():
    frame = Frame.request(1, 1, None, bytes(1024 - PREFIX_SIZE))
    wire = encode_frame(frame, max_frame_size=1024)
    assert len(wire) == 1024
    dec = FrameDecoder(max_frame_size=1024)
    assert dec.feed(wire[:500]) == [] and dec.buffered == 500
    assert dec.feed(wire[500:]) == [frame]


def test_eof_mid_frame_is_a_remote_error():
    dec = FrameDecoder()
    dec.feed(GOLDEN_REQUEST[:-1])
    with pytest.raises(RemoteProtocolError, match="mid-frame"):
        dec.eof()


@settings(max_examples=300)
@given(st.binary(max_size=300), st.lists(st.integers(0, 400), max_size=5))
def test_arbitrary_bytes_only_raise_remote_protocol_error(garbage, cuts):
    dec = FrameDecoder(max_frame_size=4096)
    try:
        for chunk in _split(garbage, cuts):
            for frame in dec.feed(chunk):
                assert isinstance(frame, Frame)
        dec.eof()
    except RemoteProtocolError:
        pass


@settings(max_examples=300)
@given(st.lists(frames, min_size=1, max_size=3), st.data())
def test_damaged_frames_only_raise_remote_protocol_error(fs, data):
    wire = bytearray(b"".join(encode_frame(f) for f in fs))
    for _ in range(data.draw(st.integers(1, 4), label="damage")):
        i = data.draw(st.integers(0, len(wire) - 1), label="at")
        wire[i] = data.draw(st.integers(0, 255), label="byte")
    header_types = data.draw(st.sampled_from([None, lambda f, c, o: request_header_type(c)]))
    dec = FrameDecoder(header_types=header_types)
    try:
        dec.feed(bytes(wire))
        dec.eof()
    except RemoteProtocolError:
        pass


# -- bad frames from our own caller -------------------------------------------------------------


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        (Frame(code=0x10000, opaque=1), "code"),
        (Frame(code=-1, opaque=1), "code"),
        (Frame(code=1, opaque=2**32), "opaque"),
        (Frame(code=1, opaque=1, flags=3), "flags"),
        (Frame(code=1, opaque=1, flags=4), "flags"),
        (Frame(code=1, opaque=1, header={"k": object()}), "does not encode"),
        (Frame(code=1, opaque=1, header={"k": 2**64}), "does not encode"),
        (Frame(code=1, opaque=1, body=bytes(DEFAULT_MAX_FRAME_SIZE)), "exceeds the limit"),
    ],
)
def test_bad_frames_from_the_caller_raise_local_protocol_error(frame, match):
    with pytest.raises(LocalProtocolError, match=match):
        encode_frame(frame)
    with pytest.raises(LocalProtocolError, match=match):
        encode_frame_parts(frame)


def test_responses_only_answer_two_way_requests():
    oneway = Frame.request(1, 1, oneway=True)
    with pytest.raises(LocalProtocolError, match="one-way"):
        oneway.response()
    with pytest.raises(LocalProtocolError, match="response"):
        GOLDEN_RESPONSE_FRAME.response()


def test_error_classes():
    assert issubclass(LocalProtocolError, ProtocolError)
    assert issubclass(RemoteProtocolError, ProtocolError)
    assert not issubclass(RemoteProtocolError, LocalProtocolError)
    with pytest.raises(ValueError):
        FrameDecoder(max_frame_size=10)


# -- dropping a partial frame (servers that cannot afford to hold it) -------------------------


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(frames, min_size=2, max_size=6), st.data())
def test_dropped_partial_frame_is_skipped_and_reported(fs, data):
    """Model: drop frame k while it is partially held (its prefix in); the decoder then yields
    exactly the other frames, in order, and reports (code, opaque, flags) of frame k once its
    last byte has arrived -- however the bytes are cut."""
    k = data.draw(st.integers(0, len(fs) - 1), label="dropped frame")
    wires = [encode_frame(f) for f in fs]
    start = sum(len(w) for w in wires[:k])
    held = data.draw(st.integers(18, len(wires[k]) - 1), label="bytes of it held") \
        if len(wires[k]) > 18 else None
    if held is None:  # a frame of exactly the prefix is never partial past its prefix
        return
    stream = b"".join(wires)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=8), label="cuts")
    dec = FrameDecoder()
    got = _feed_all(dec, _split(stream[: start + held], cuts))
    assert dec.partial_size == len(wires[k]) and dec.buffered == held
    assert dec.drop_partial()
    assert dec.buffered == 0 and dec.partial_size == 0
    assert not dec.drop_partial()  # nothing held any more
    rest = stream[start + held :]
    got.extend(_feed_all(dec, _split(rest, cuts)))
    assert got == fs[:k] + fs[k + 1 :]
    f = fs[k]
    assert dec.dropped == [(f.code, f.opaque, f.flags)]


def test_drop_partial_needs_a_complete_prefix():
    dec = FrameDecoder()
    wire = encode_frame(Frame.request(RequestCode.SEND_MESSAGE, 9, None, b"x" * 100))
    assert dec.feed(wire[:10]) == []
    assert dec.partial_size == 0 and not dec.drop_partial()  # length known, prefix not
    assert dec.feed(wire[10:40]) == []
    assert dec.partial_size == len(wire) and dec.drop_partial()
    assert dec.feed(wire[40:]) == [] and dec.dropped == [(RequestCode.SEND_MESSAGE, 9, 0)]
    nxt = Frame.request(RequestCode.HEART_BEAT, 10, None, b"ok")
    assert dec.feed(encode_frame(nxt)) == [nxt]
