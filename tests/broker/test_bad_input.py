"""SE2: every client mistake gets an error a person can act on and the connection stays usable;
broken framing closes only that connection; nothing a client sends kills the broker."""

from __future__ import annotations

import random
import socket
import struct

import pytest

from tidemq.protocol.frame import Frame, encode_frame
from tidemq.protocol.headers import Perm, SendMessageRequestHeader, TopicConfig

from .wire import RequestCode, ResponseCode, Wire, batch, error_message, start_broker

R = ResponseCode


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad-input")
    srv = start_broker(tmp, "", "--no-auto-create")
    with Wire(srv.addr) as w:
        assert w.create_topic("ok", 4).code == R.SUCCESS
        assert w.create_topic("readonly", 2, perm=Perm.READ).code == R.SUCCESS
        assert w.create_topic("writeonly", 2, perm=Perm.WRITE).code == R.SUCCESS
    yield srv
    assert srv.alive(), srv.log()
    assert srv.stop() == 0, srv.log()


def still_usable(w: Wire) -> None:
    r = w.send_messages("ok", [b"still here"])
    assert r.code == R.SUCCESS, r


def send_body(w: Wire, body: bytes, topic: str = "ok", queue_id: int = 0):
    header = SendMessageRequestHeader(producer_group="pg", topic=topic, queue_id=queue_id)
    return w.request(RequestCode.SEND_MESSAGE, header, body)


def test_oversize_batch(wire):
    r = wire.send_messages("ok", [b"x" * (5 * 1024 * 1024)])
    assert r.code == R.MESSAGE_TOO_LARGE
    assert "exceeds the broker's limit of 4194304 bytes" in error_message(r)
    still_usable(wire)


def test_unknown_topic_with_auto_create_off(wire):
    r = wire.send_messages("nope", [b"x"])
    assert r.code == R.TOPIC_NOT_EXIST
    assert "auto-create is off" in error_message(r) and "'nope'" in error_message(r)
    r = wire.pull("nope", 0)
    assert r.code == R.TOPIC_NOT_EXIST
    still_usable(wire)


def test_bad_queue_id_on_send_and_pull(wire):
    r = wire.send_messages("ok", [b"x"], queue_id=9)
    assert r.code == R.INVALID_ARGUMENT
    assert "queue id 9 is out of range" in error_message(r) and "4 write queues" in error_message(r)
    r = wire.pull("ok", 0, queue_id=4)
    assert r.code == R.INVALID_ARGUMENT and "4 read queues" in error_message(r)
    still_usable(wire)


def test_missing_and_empty_group(wire):
    r = wire.request(RequestCode.PULL_MESSAGE, {"topic": "ok", "queue_id": 0, "queue_offset": 0})
    assert r.code == R.INVALID_ARGUMENT
    assert "consumer_group" in error_message(r)
    r = wire.pull("ok", 0, group="")
    assert r.code == R.INVALID_ARGUMENT and "consumer_group is empty" in error_message(r)
    r = wire.request(
        RequestCode.QUERY_CONSUMER_OFFSET, {"consumer_group": "", "topic": "ok", "queue_id": 0}
    )
    assert r.code == R.INVALID_ARGUMENT
    still_usable(wire)


def test_mistyped_header_field(wire):
    r = wire.request(
        RequestCode.PULL_MESSAGE,
        {"consumer_group": "g", "topic": "ok", "queue_id": -1, "queue_offset": 0},
    )
    assert r.code == R.INVALID_ARGUMENT and "queue_id" in error_message(r)
    still_usable(wire)


def test_batch_whose_crc_fails(wire):
    body = batch("ok", [b"payload-payload"])
    body[-3] ^= 0xFF  # a flipped bit in a message body
    r = send_body(wire, bytes(body))
    assert r.code == R.MESSAGE_ILLEGAL and "CRC" in error_message(r)
    still_usable(wire)


def test_header_that_mismatches_the_batch(wire):
    r = wire.send_messages("ok", [b"x"], header_topic="readonly")
    assert r.code in (R.MESSAGE_ILLEGAL, R.NO_PERMISSION)
    r = send_body(wire, bytes(batch("writeonly", [b"x"])), topic="ok")
    assert r.code == R.MESSAGE_ILLEGAL
    assert "differs from the batch's topic 'writeonly'" in error_message(r)
    r = wire.send_messages("ok", [b"x"], queue_id=1, header_queue_id=2)
    assert r.code == R.MESSAGE_ILLEGAL and "queue id" in error_message(r)
    still_usable(wire)


def test_body_that_is_not_a_batch(wire):
    r = send_body(wire, b"\x00" * 100)
    assert r.code == R.MESSAGE_ILLEGAL and "not a valid batch" in error_message(r)
    r = send_body(wire, b"")
    assert r.code == R.INVALID_ARGUMENT and "no body" in error_message(r)
    two = bytes(batch("ok", [b"a"])) + bytes(batch("ok", [b"b"]))
    r = send_body(wire, two)
    assert r.code == R.MESSAGE_ILLEGAL and "exactly one batch" in error_message(r)
    still_usable(wire)


def test_properties_over_the_limit(wire):
    from tidemq.protocol.record import MessageData, encode_batch

    body = encode_batch("ok", [MessageData(b"x", properties={"big": "p" * 40_000})])
    r = send_body(wire, bytes(body))
    assert r.code == R.MESSAGE_ILLEGAL and "properties" in error_message(r)
    still_usable(wire)


def test_permissions(wire):
    r = wire.send_messages("readonly", [b"x"])
    assert r.code == R.NO_PERMISSION and "not writable" in error_message(r)
    r = wire.pull("writeonly", 0)
    assert r.code == R.NO_PERMISSION and "not readable" in error_message(r)
    still_usable(wire)


def test_bad_topic_names(wire):
    r = wire.create_topic("has space", 1)
    assert r.code == R.INVALID_ARGUMENT and "' '" in error_message(r)
    r = wire.create_topic("x" * 128, 1)
    assert r.code == R.INVALID_ARGUMENT and "127" in error_message(r)
    r = wire.request(
        RequestCode.UPDATE_AND_CREATE_TOPIC,
        TopicConfig(topic_name="zero", read_queue_nums=0, write_queue_nums=0),
    )
    assert r.code == R.INVALID_ARGUMENT and "read_queue_nums" in error_message(r)
    r = wire.send_messages("bad/name", [b"x"])
    assert r.code == R.MESSAGE_ILLEGAL
    still_usable(wire)


def test_unsupported_subscription_and_request_code(wire):
    h = wire.pull_header("ok", 0, subscription="a >")
    h.expression_type = "SQL92"
    r = wire.request(RequestCode.PULL_MESSAGE, h)
    assert r.code == R.SUBSCRIPTION_PARSE_FAILED and "SQL92" in error_message(r)
    h.expression_type = "XPATH"
    r = wire.request(RequestCode.PULL_MESSAGE, h)
    assert r.code == R.SUBSCRIPTION_PARSE_FAILED and "XPATH" in error_message(r)
    r = wire.pull("ok", 0, subscription="||")
    assert r.code == R.SUBSCRIPTION_PARSE_FAILED
    r = wire.request(999, {"x": 1})
    assert r.code == R.REQUEST_CODE_NOT_SUPPORTED and "999" in error_message(r)
    r = wire.request(RequestCode.HEART_BEAT, {})
    assert r.code == R.INVALID_ARGUMENT and "client_id" in error_message(r)
    still_usable(wire)


def test_queries_that_find_nothing(wire):
    r = wire.request(RequestCode.VIEW_MESSAGE_BY_ID, {"msg_id": "not-an-id"})
    assert r.code == R.INVALID_ARGUMENT and "32 hex digits" in error_message(r)
    r = wire.request(RequestCode.VIEW_MESSAGE_BY_ID, {"msg_id": "F" * 32})
    assert r.code == R.QUERY_NOT_FOUND
    r = wire.request(RequestCode.QUERY_MESSAGE, {"topic": "ok", "key": "never"})
    assert r.code == R.QUERY_NOT_FOUND
    r = wire.request(RequestCode.DELETE_TOPIC, {"topic": "never-created"})
    assert r.code == R.TOPIC_NOT_EXIST
    still_usable(wire)


def test_oneway_mistake_gets_no_answer_and_keeps_the_connection(wire):
    wire.send_messages("nope", [b"x"], oneway=True)
    wire.send(999, {"x": 1}, oneway=True)
    r = wire.request(RequestCode.GET_ALL_TOPIC_CONFIG)
    assert r.code == R.SUCCESS  # the next response is this one: nothing answered the one-ways
    assert set(r.header.topics) >= {"ok", "readonly", "writeonly"}


def test_a_response_frame_sent_to_the_broker_is_ignored(wire):
    wire.send_raw(encode_frame(Frame(0, 77, 1, {"x": 1}, b"")))
    still_usable(wire)


# -- broken framing: the connection closes, the broker lives on -----------------------------------


@pytest.mark.parametrize(
    "garbage",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # not our protocol at all
        struct.pack("<IBBBBHII", 20, 0xD7, 9, 0, 0, 10, 1, 0) + b"xx",  # unknown version
        struct.pack("<IBBBBHII", 5, 0xD7, 1, 0, 0, 10, 1, 0),  # length below the minimum
        struct.pack("<IBBBBHII", 0x7FFF_FFFF, 0xD7, 1, 0, 0, 10, 1, 0),  # 2 GiB frame
        struct.pack("<IBBBBHII", 16, 0xD7, 1, 0, 0, 10, 1, 2) + b"\xc1\xc1",  # not MessagePack
    ],
    ids=["http", "version", "short", "huge", "header"],
)
def test_malformed_frame_closes_only_that_connection(broker, garbage):
    with Wire(broker.addr) as bad:
        bad.send_raw(garbage)
        assert bad.is_closed_by_peer(5), "the broker kept a connection with broken framing"
    with Wire(broker.addr) as good:
        still_usable(good)
    assert broker.alive()


def test_random_garbage_never_kills_the_broker(broker):
    rng = random.Random(20261121)
    for i in range(40):
        n = rng.choice([1, 7, 18, 64, 1000, 70_000])
        blob = bytes(rng.getrandbits(8) for _ in range(n))
        if i % 4 == 0:  # a valid-looking prefix with a random rest
            blob = struct.pack("<IBB", len(blob) + 10, 0xD7, 1) + blob
        with socket.create_connection(tuple(_split(broker.addr)), timeout=5) as s:
            try:
                s.sendall(blob)
                s.shutdown(socket.SHUT_WR)
                s.settimeout(5)
                while s.recv(65536):
                    pass
            except OSError:
                pass  # reset by the broker: fine
    assert broker.alive(), broker.log()
    with Wire(broker.addr) as good:
        still_usable(good)
    assert "closing connection from" in broker.log()


def test_peer_that_stops_mid_frame(broker):
    frame = encode_frame(Frame.request(RequestCode.SEND_MESSAGE, 1, {"topic": "ok"}, b"x" * 100))
    with socket.create_connection(tuple(_split(broker.addr))) as s:
        s.sendall(frame[:50])
    with Wire(broker.addr) as good:
        still_usable(good)


def _split(addr: str):
    host, _, port = addr.rpartition(":")
    return host, int(port)


@pytest.mark.parametrize("topic", ["SCHEDULE_TOPIC_XXXX", "rmq_sys_wheel_timer",
                                   "RMQ_SYS_TRANS_HALF_TOPIC", "RMQ_SYS_TRANS_OP_HALF_TOPIC",
                                   "TRANS_CHECK_MAX_TIME_TOPIC"])
def test_system_topics_are_not_writable_by_clients(wire, topic):
    r = send_body(wire, batch(topic, [b"forged envelope"]), topic=topic)
    assert r.code == R.NO_PERMISSION
    assert "system topic the broker writes itself" in error_message(r)
    still_usable(wire)


@pytest.mark.parametrize("kind", ["delay_level", "deliver_at", "prepared"])
def test_non_persistent_topic_refuses_delayed_and_transactional(wire, kind):
    from tidemq.protocol.record import MessageData, TxnType, encode_batch

    topic = "%NP%np-refuse"
    kw = {"delay_level": 2} if kind == "delay_level" else (
        {"deliver_at": 2**42} if kind == "deliver_at" else {"txn": TxnType.PREPARED})
    assert wire.create_topic(topic, 1).code == R.SUCCESS
    r = send_body(wire, encode_batch(topic, [MessageData(b"x")], **kw), topic=topic)
    assert r.code == R.MESSAGE_ILLEGAL
    assert "non-persistent: it cannot take delayed, timed or transactional" in error_message(r)
    still_usable(wire)
