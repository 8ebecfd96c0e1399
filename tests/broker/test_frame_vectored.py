"""frame.encode_frame_head / encode_frame_vectored: a body written in pieces, never joined."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tidemq.protocol.errors import LocalProtocolError
from tidemq.protocol.frame import (
    FLAG_RESPONSE,
    Frame,
    FrameDecoder,
    encode_frame,
    encode_frame_head,
    encode_frame_vectored,
)


@given(
    bodies=st.lists(st.binary(max_size=300), max_size=6),
    header=st.none()
    | st.dictionaries(st.text(max_size=5), st.integers(-(2**63), 2**63 - 1), max_size=3),
    opaque=st.integers(0, 2**32 - 1),
)
def test_vectored_equals_joined(bodies, header, opaque):
    frame = Frame(0, opaque, FLAG_RESPONSE, header, b"")
    parts = encode_frame_vectored(frame, [memoryview(b) for b in bodies])
    wire = b"".join(bytes(p) for p in parts)
    assert wire == encode_frame(Frame(0, opaque, FLAG_RESPONSE, header, b"".join(bodies)))
    [decoded] = FrameDecoder().feed(wire)
    assert bytes(decoded.body) == b"".join(bodies)


def test_bodies_are_passed_through_untouched():
    body = memoryview(bytearray(b"x" * 100))
    parts = encode_frame_vectored(Frame(0, 1, FLAG_RESPONSE, None, b""), [body, body])
    assert parts[1] is body and parts[2] is body


def test_head_checks_the_frame_limit():
    with pytest.raises(LocalProtocolError, match="exceeds the limit"):
        encode_frame_head(Frame(0, 1, FLAG_RESPONSE), 1000, max_frame_size=500)
    with pytest.raises(LocalProtocolError):
        encode_frame_head(Frame(0, 1, FLAG_RESPONSE), -1)
