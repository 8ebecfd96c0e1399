"""Issue 13, the broker's door: what a careless or hostile client could store or reach before,
each answered now with a clear error and nothing stored -- against a real broker, with raw
frames where the client would refuse to build the input. Every acknowledged message of the
module is read back intact at the end."""

from __future__ import annotations

import time
import zlib

import pytest

from tidemq.protocol.codes import RequestCode
from tidemq.protocol.frame import Frame, encode_frame
from tidemq.protocol.headers import Perm, SendMessageRequestHeader
from tidemq.protocol.record import RECORD_HEADER, Compression

from .forge import Rec, forge
from .wire import ResponseCode, Wire, decode_pull, error_message, start_broker, wait_until

R = ResponseCode
ACKED: dict[str, list[bytes]] = {}  # topic -> bodies acknowledged, in order (queue 0)


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("door")
    srv = start_broker(tmp, "", "-o", "message_delay_level=1s 2s")
    with Wire(srv.addr) as w:
        for t in ("ok", "wo", "delayed"):
            assert w.create_topic(t, 2).code == R.SUCCESS
    yield srv
    try:
        assert srv.alive(), srv.log()
        assert "Traceback" not in srv.log(), srv.log()
    finally:
        assert srv.stop() == 0, srv.log()


@pytest.fixture
def wire(broker):
    with Wire(broker.addr) as w:
        yield w


def send(w: Wire, body: bytes, topic: str = "ok", group: str = "pg", code=RequestCode.SEND_BATCH,
         queue_id: int = 0):
    return w.request(code, SendMessageRequestHeader(producer_group=group, topic=topic,
                                                    queue_id=queue_id, batch=True), body)


def send_ok(w: Wire, bodies: list[bytes], topic: str = "ok", **kw):
    r = send(w, forge(topic, [Rec(body=b) for b in bodies], **kw), topic)
    assert r.code == R.SUCCESS, error_message(r)
    ACKED.setdefault(topic, []).extend(bodies)
    return r


def max_offset(w: Wire, topic: str = "ok", queue_id: int = 0) -> int:
    r = w.request(RequestCode.GET_MAX_OFFSET, {"topic": topic, "queue_id": queue_id})
    assert r.code == R.SUCCESS
    return r.header.offset


def refused(w: Wire, body: bytes, code: int, *words: str, topic: str = "ok") -> None:
    before = max_offset(w, topic)
    r = send(w, body, topic)
    assert r.code == code, (R(r.code).name, error_message(r))
    for word in words:
        assert word in error_message(r), error_message(r)
    assert max_offset(w, topic) == before  # nothing stored
    send_ok(w, [b"the connection still serves"], topic)


# -- validate at the door -------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 40])
@pytest.mark.parametrize("codec", [Compression.NONE, Compression.LZ4, Compression.ZLIB],
                         ids=["plain", "lz4", "zlib"])
@pytest.mark.parametrize("field,bad,words", [
    ("tag", b"\xc3(", ["tag of message", "UTF-8"]),
    ("props", b"UNIQ\x01\xff\x02", ["properties of message", "UTF-8"]),
    ("keys", b"order-\xe2\x82", ["keys of message", "UTF-8"]),
    ("props", b"p" * 40_000, ["40000 bytes of properties, over the limit of 32768"]),
])
def test_what_a_reader_could_not_decode_is_refused_in_any_message(wire, n, codec, field, bad,
                                                                 words):
    """Non-UTF-8 tags, keys and properties, and the 32 KiB properties limit, in every message
    of a batch, compressed or not (before: only a single uncompressed message's properties
    size was checked, and a non-UTF-8 key was a SYSTEM_ERROR)."""
    recs = [Rec(body=b"m%d" % i, tag=b"T", props=b"a\x01b\x02", keys=b"k%d" % i)
            for i in range(n)]
    setattr(recs[-1], field, bad)
    refused(wire, forge("ok", recs, compression=codec), R.MESSAGE_ILLEGAL, *words,
            f"message {n - 1}")


def test_compression_lies_are_refused_cheaply(broker, wire):
    raw = RECORD_HEADER.pack(25, 1, 0, 0, 0, 0, 1) + b"x"
    # 261 KB -> 256 MiB; made before the clock starts: compressing it costs this process
    # ~1 s of CPU (several on a loaded machine), which is not the broker's refusal
    bomb = zlib.compress(raw + bytes(256 << 20), 9)
    rss0 = _rss(broker)
    t0 = time.monotonic()
    for _ in range(3):
        refused(wire, forge("ok", [Rec()], compression=Compression.ZLIB, records=bomb,
                            raw_size=len(raw)), R.MESSAGE_ILLEGAL, "raw_size of 29 bytes")
    assert time.monotonic() - t0 < 5
    assert _rss(broker) - rss0 < 64 << 20  # never decompressed past the declared size
    # The declared raw size is what the size limit counts.
    refused(wire, forge("ok", [Rec()], compression=Compression.ZLIB, raw_size=16 << 20,
                        records=zlib.compress(bytes(16 << 20))),
            R.MESSAGE_TOO_LARGE, "once its records are decompressed")
    # Records that decompress to less than declared.
    refused(wire, forge("ok", [Rec()], compression=Compression.LZ4, raw_size=len(raw) + 10),
            R.MESSAGE_ILLEGAL, "the batch says 39")


def test_batches_whose_records_do_not_add_up_are_refused(wire):
    refused(wire, forge("ok", [Rec(), Rec()], rels=[0, 0]), R.MESSAGE_ILLEGAL, "message 1")
    refused(wire, forge("ok", [Rec(size_fix=3)]), R.MESSAGE_ILLEGAL, "inconsistent")
    refused(wire, forge("ok", [Rec()], raw_size=500), R.MESSAGE_ILLEGAL, "raw_size")
    refused(wire, forge("ok", [Rec()], attributes=6), R.MESSAGE_ILLEGAL, "compression codec 6")


def test_a_damaged_batch_is_reported_as_damaged(wire):
    body = bytearray(forge("ok", [Rec(tag=b"TagA")]))
    body[-3] ^= 0x80  # inside the tag: it also stops being UTF-8, but the CRC tells why
    refused(wire, bytes(body), R.MESSAGE_ILLEGAL, "CRC")


def test_names_in_a_send(wire):
    for group, words in [("", "producer group name is empty"), ("a b", "contains ' '"),
                         ("g" * 121, "longer than 120")]:
        r = send(wire, forge("ok", [Rec()]), group=group)
        assert r.code == R.INVALID_ARGUMENT and words in error_message(r), error_message(r)
    r = send(wire, forge("bad/name", [Rec()]), "bad/name")
    assert r.code == R.MESSAGE_ILLEGAL and "contains '/'" in error_message(r)


def test_delay_level_above_the_maximum_is_clamped(wire):
    """Level 31 on a broker whose highest is 2 ("1s 2s") waits the highest, as RocketMQ."""
    t0 = time.time()
    r = send(wire, forge("delayed", [Rec(body=b"late")], delay_level=31), "delayed")
    assert r.code == R.SUCCESS
    got = _pull_until(wire, "delayed", 1, timeout=10)
    assert [m.body for m in got] == [b"late"] and time.time() - t0 >= 1.9
    ACKED.setdefault("delayed", []).append(b"late")


# -- one-way requests ----------------------------------------------------------------------------

ONEWAY_HEADERS = {
    RequestCode.GET_CONSUMER_LIST_BY_GROUP: {"consumer_group": "g"},
    RequestCode.GET_CONSUMER_CONNECTION_LIST: {"consumer_group": "g"},
    RequestCode.LOCK_BATCH_MQ: {"consumer_group": "g", "client_id": "c", "queues": [
        {"topic": "ok", "broker_name": "broker-a", "queue_id": 0}]},
    RequestCode.GET_LAST_SEQUENCE: {"producer_name": "p"},
    RequestCode.GET_ALL_TOPIC_CONFIG: {},
    RequestCode.GET_BROKER_RUNTIME_INFO: {},
    RequestCode.GET_MAX_OFFSET: {"topic": "ok", "queue_id": 0},
    RequestCode.GET_MIN_OFFSET: {"topic": "ok", "queue_id": 0},
    RequestCode.QUERY_CONSUMER_OFFSET: {"consumer_group": "g", "topic": "ok", "queue_id": 0},
    RequestCode.GET_TOPIC_STATS: {"topic": "ok"},
    RequestCode.GET_CONSUME_STATS: {"consumer_group": "g"},
    RequestCode.HEART_BEAT: {"client_id": "c"},
    RequestCode.SEARCH_OFFSET_BY_TIMESTAMP: {"topic": "ok", "queue_id": 0, "timestamp": 0},
    RequestCode.QUERY_MESSAGE: {"topic": "ok", "key": "nothing"},
    RequestCode.VIEW_MESSAGE_BY_ID: {"msg_id": "0" * 32},
}


@pytest.mark.parametrize("code", sorted(RequestCode), ids=lambda c: RequestCode(c).name)
def test_a_one_way_request_is_never_answered(wire, code):
    """Before, one-way GET_CONSUMER_LIST_BY_GROUP (38), GET_CONSUMER_CONNECTION_LIST (203),
    LOCK_BATCH_MQ (41) and GET_LAST_SEQUENCE (330) were answered."""
    wire.send(code, ONEWAY_HEADERS.get(code, {}), oneway=True)
    r = wire.request(RequestCode.GET_MAX_OFFSET, {"topic": "ok", "queue_id": 1})
    assert r.code == R.SUCCESS
    # Responses go out in request order: an answer to the one-way would have come first.
    assert not wire._ready, [(f.code, f.opaque, f.header) for f in wire._ready]


# -- SYSTEM_ERROR paths reachable by client input --------------------------------------------------

def test_empty_producer_name_is_an_invalid_argument(wire):
    r = wire.request(RequestCode.GET_LAST_SEQUENCE, {"producer_name": ""})
    assert r.code == R.INVALID_ARGUMENT and "producer_name is empty" in error_message(r)


def test_bad_group_names_are_refused_everywhere_and_never_persisted(wire):
    off = _some_commit_log_offset(wire)
    for group in ("a b", "", "x" * 121):
        r = wire.request(RequestCode.CONSUMER_SEND_MSG_BACK,
                         {"consumer_group": group, "commit_log_offset": off})
        assert r.code == R.INVALID_ARGUMENT, error_message(r)
        r = wire.request(RequestCode.HEART_BEAT,
                         {"client_id": "c", "consumers": [{"group": group}]})
        assert r.code == R.INVALID_ARGUMENT, error_message(r)
        r = wire.request(RequestCode.HEART_BEAT, {"client_id": "c", "producer_groups": [group]})
        assert r.code == R.INVALID_ARGUMENT, error_message(r)
        r = wire.request(RequestCode.END_TRANSACTION, {
            "producer_group": group, "tran_state_table_offset": 0, "commit_log_offset": 0})
        assert r.code == R.INVALID_ARGUMENT, error_message(r)
    r = wire.pull("ok", 0, group="a b")  # what a consumer of group 'a b' gets
    assert r.code == R.INVALID_ARGUMENT and "contains ' '" in error_message(r)
    r = wire.pull("ok", 0, queue_id=99)  # ... and one of queue 99
    assert r.code == R.INVALID_ARGUMENT and "queue id 99 is out of range" in error_message(r)
    r = wire.request(RequestCode.GET_CONSUMER_CONNECTION_LIST, {"consumer_group": "a b"})
    assert r.code == R.SUCCESS and r.header.config is None  # no group 'a b' was created
    topics = wire.request(RequestCode.GET_ALL_TOPIC_CONFIG).header.topics
    assert not any(" " in t for t in topics)


# -- system, retry and dead-letter topics ---------------------------------------------------------

RESERVED = ["SCHEDULE_TOPIC_XXXX", "rmq_sys_wheel_timer", "RMQ_SYS_TRANS_HALF_TOPIC",
            "RMQ_SYS_TRANS_OP_HALF_TOPIC", "TRANS_CHECK_MAX_TIME_TOPIC", "%RETRY%g1", "%DLQ%g1"]


def test_reserved_topics_cannot_be_created_updated_or_deleted(wire):
    """Creating then deleting SCHEDULE_TOPIC_XXXX used to drop its consume queues: an
    acknowledged delayed message was lost. It is refused now, and the message arrives."""
    r = send(wire, forge("delayed", [Rec(body=b"due in 1s")], delay_level=1), "delayed")
    assert r.code == R.SUCCESS
    for topic in RESERVED:
        r = wire.create_topic(topic, 4)
        assert r.code == R.NO_PERMISSION and "cannot be created" in error_message(r), topic
        r = wire.request(RequestCode.DELETE_TOPIC, {"topic": topic})
        assert r.code == R.NO_PERMISSION, (topic, error_message(r))
    got = _pull_until(wire, "delayed", len(ACKED.get("delayed", [])) + 1, timeout=10)
    assert got[-1].body == b"due in 1s"
    ACKED.setdefault("delayed", []).append(b"due in 1s")


@pytest.mark.parametrize("topic", RESERVED)
def test_reserved_topics_cannot_be_sent_to_by_a_stranger(wire, topic):
    r = send(wire, forge(topic, [Rec()]), topic)
    assert r.code == R.NO_PERMISSION, error_message(r)
    topics = wire.request(RequestCode.GET_ALL_TOPIC_CONFIG).header.topics
    assert topic not in topics  # not auto-created on the way


def test_a_retry_topic_takes_direct_sends_from_members_of_its_group_only(broker, wire):
    r = wire.request(RequestCode.HEART_BEAT, {"client_id": "member-1", "consumers": [
        {"group": "g2", "subscriptions": [{"topic": "ok"}]}]})
    assert r.code == R.SUCCESS
    assert wait_until(lambda: "%RETRY%g2" in wire.request(
        RequestCode.GET_ALL_TOPIC_CONFIG).header.topics)
    # RocketMQ's consumers send a failed message straight to %RETRY%<group> when the
    # send-back fails; a member may do that on its own connection ...
    send_ok(wire, [b"direct retry"], "%RETRY%g2")
    # ... another connection, or the dead-letter topic, may not
    with Wire(broker.addr) as stranger:
        r = send(stranger, forge("%RETRY%g2", [Rec()]), "%RETRY%g2")
        assert r.code == R.NO_PERMISSION and "live member of 'g2'" in error_message(r)
    r = send(wire, forge("%DLQ%g2", [Rec()]), "%DLQ%g2")
    assert r.code == R.NO_PERMISSION and "only the broker writes it" in error_message(r)


def test_a_write_only_topic_is_read_by_no_path(wire):
    body = forge("wo", [Rec(body=b"secret", keys=b"k-secret")])
    r = send(wire, body, "wo")
    assert r.code == R.SUCCESS
    msg_id = r.header.msg_id
    phys = decode_pull(wire.pull("wo", 0), 0)[0].phys_offset
    assert wire.create_topic("wo", 2, perm=Perm.WRITE).code == R.SUCCESS
    assert wire.pull("wo", 0).code == R.NO_PERMISSION
    r = wire.request(RequestCode.VIEW_MESSAGE_BY_ID, {"msg_id": msg_id})
    assert r.code == R.NO_PERMISSION and "not readable" in error_message(r)
    r = wire.request(RequestCode.QUERY_MESSAGE, {"topic": "wo", "key": "k-secret"})
    assert r.code == R.NO_PERMISSION and "not readable" in error_message(r)
    r = wire.request(RequestCode.CONSUMER_SEND_MSG_BACK,
                     {"consumer_group": "reader", "commit_log_offset": phys})
    assert r.code == R.NO_PERMISSION and "not readable" in error_message(r)
    assert "%RETRY%reader" not in wire.request(RequestCode.GET_ALL_TOPIC_CONFIG).header.topics
    assert wire.create_topic("wo", 2).code == R.SUCCESS  # readable again: all paths answer
    r = wire.request(RequestCode.VIEW_MESSAGE_BY_ID, {"msg_id": msg_id})
    assert r.code == R.SUCCESS


def test_raw_frames_never_get_a_system_error(wire):
    """A few frames that used to end in SYSTEM_ERROR (the fuzz suite tries many more)."""
    for code, header in [
        (RequestCode.GET_LAST_SEQUENCE, {"producer_name": ""}),
        (RequestCode.HEART_BEAT, {"client_id": "c", "consumers": [{"group": "y" * 200}]}),
        (RequestCode.UPDATE_AND_CREATE_SUBSCRIPTION_GROUP, {"group_name": "z" * 200}),
    ]:
        r = wire.request(code, header)
        assert r.code not in (R.SUCCESS, R.SYSTEM_ERROR), (code, error_message(r))
    wire.send_raw(encode_frame(Frame.request(RequestCode.SEND_MESSAGE, 9999, {
        "producer_group": "pg", "topic": "ok", "queue_id": 0}, forge("ok", [Rec(keys=b"\xff")]))))
    r = wire.recv(9999, timeout=10)
    assert r.code == R.MESSAGE_ILLEGAL and "keys of message 0" in error_message(r)


# -- nothing acknowledged was lost -----------------------------------------------------------------

def test_every_acknowledged_message_is_intact(wire):
    assert ACKED.get("ok")
    for topic, bodies in ACKED.items():
        got = _pull_until(wire, topic, len(bodies), timeout=10)
        assert [m.body for m in got] == bodies, topic


# -- helpers --------------------------------------------------------------------------------------

def _pull_until(w: Wire, topic: str, n: int, timeout: float):
    deadline = time.monotonic() + timeout
    got: list = []
    while len(got) < n and time.monotonic() < deadline:
        r = w.pull(topic, len(got), group="reader", max_msgs=256, suspend_ms=1000)
        if r.code == R.SUCCESS:
            got += decode_pull(r, len(got))
    return got


def _some_commit_log_offset(w: Wire) -> int:
    send_ok(w, [b"for send-back"])
    got = _pull_until(w, "ok", len(ACKED["ok"]), timeout=5)
    return got[-1].phys_offset


def _rss(srv) -> int:
    with open(f"/proc/{srv.proc.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0
