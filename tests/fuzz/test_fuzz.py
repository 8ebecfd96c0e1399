"""Fuzz suite (issue 13): generated frames and batches against a running broker and name server
(real processes). Whatever arrives -- any request code and flags, headers that are valid
MessagePack with wrong, missing or extreme fields, bodies of garbage or of batches with valid
CRCs and hostile content -- the servers never answer SYSTEM_ERROR, never answer a one-way
request, never die, keep serving a bystander client, lose nothing it was acknowledged, and keep
their memory bounded. Every batch the broker accepts decodes in the client.

``make test`` runs a bounded number of examples (about a minute); ``make fuzz`` sets
``TIDEMQ_FUZZ_EXAMPLES`` and runs many more.
"""

from __future__ import annotations

import itertools
import os
import select
import socket
import time

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.broker.wire import (
    Wire,
    decode_pull,
    error_message,
    start_broker,
    start_namesrv,
)

from tidemq.client.codec import decode_pull_body
from tidemq.protocol.codes import RequestCode, ResponseCode
from tidemq.protocol.frame import FLAG_ONEWAY, FLAG_RESPONSE, Frame, FrameDecoder
from tidemq.protocol.headers import Perm, SendMessageRequestHeader

from .strategies import BROKER_CODES, NAMESRV_CODES, Sent, batches, header_bytes

R = ResponseCode
SCALE = int(os.environ.get("TIDEMQ_FUZZ_EXAMPLES", "0"))  # make fuzz: many more examples
FRAMES = SCALE or 800
BATCHES = SCALE or 220
NAMESRV_FRAMES = SCALE or 400
RSS_GROWTH_LIMIT = 256 << 20
_opaque = itertools.count(1)



def _readable(sock: socket.socket, timeout: float) -> bool:
    """poll, not select: the test process may hold descriptors past FD_SETSIZE (1024)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLHUP)
    return bool(poller.poll(max(0.0, timeout) * 1000))

class Peer:
    """A raw connection: sends generated frames, collects responses by opaque."""

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.connect()

    def connect(self) -> None:
        host, _, port = self.addr.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.decoder = FrameDecoder(header_types=lambda *_: None)
        self.responses: dict[int, Frame] = {}
        self.oneway: set[int] = set()

    def close(self) -> None:
        self.sock.close()

    def _read(self, timeout: float) -> bool:
        if not _readable(self.sock, timeout):
            return True
        try:
            data = self.sock.recv(1 << 20)
        except ConnectionError:
            data = b""
        if not data:
            return False
        for f in self.decoder.feed(data):
            if f.flags & FLAG_RESPONSE:  # the broker's own requests (NOTIFY_...) are ignored
                assert f.opaque not in self.oneway, f"a one-way request was answered: {f}"
                self.responses[f.opaque] = f
        return True

    def exchange(self, sent: Sent, timeout: float = 20.0) -> Frame | None:
        """Send; the response when one is due (None for a one-way), else fail."""
        self.sock.sendall(sent.data)
        if not sent.answered:
            if sent.flags & FLAG_ONEWAY:
                self.oneway.add(sent.opaque)
            # A request after it: its response comes after any (wrong) answer to the one-way.
            ping = Sent(RequestCode.GET_ALL_TOPIC_CONFIG, 0, next(_opaque), b"", b"")
            self.exchange(ping, timeout)
            return None
        deadline = time.monotonic() + timeout
        while sent.opaque not in self.responses:
            left = deadline - time.monotonic()
            assert left > 0, f"no answer in {timeout} s to {sent!r}"
            assert self._read(left), f"the server closed the connection after {sent!r}"
        return self.responses.pop(sent.opaque)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _message(f: Frame) -> str:
    h = f.header
    return str(h.get("message", "")) if isinstance(h, dict) else ""


class Cluster:
    def __init__(self, tmp) -> None:
        self.namesrv = start_namesrv(tmp)
        self.broker = start_broker(
            tmp, self.namesrv.addr, "-o", "max_suspend_ms=100", "-o", "short_polling_time_ms=100",
            "-o", "transaction_check_interval_ms=500",
        )
        with Wire(self.broker.addr) as w:
            for t, perm in (("fz-ok", Perm.READ_WRITE), ("fz-ro", Perm.READ),
                            ("fz-wo", Perm.WRITE), ("bystander", Perm.READ_WRITE),
                            ("fz-batch", Perm.READ_WRITE)):
                assert w.create_topic(t, 4, perm=perm).code == R.SUCCESS
        self.rss0 = {p.proc.pid: _rss(p.proc.pid) for p in (self.namesrv, self.broker)}
        self.acked: list[bytes] = []
        self.bystander = Wire(self.broker.addr)
        self.examples = 0

    def check_bystander(self) -> None:
        """The servers live and serve a well-behaved client (send acknowledged, route known)."""
        assert self.broker.alive(), self.broker.log()[-3000:]
        assert self.namesrv.alive(), self.namesrv.log()[-3000:]
        body = b"bystander-%d" % len(self.acked)
        r = self.bystander.send_messages("bystander", [body])
        assert r.code == R.SUCCESS, error_message(r)
        self.acked.append(body)
        with Wire(self.namesrv.addr) as ns:
            r = ns.request(RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": "bystander"})
            assert r.code == R.SUCCESS and r.header.broker_datas, error_message(r)

    def step(self) -> None:
        self.examples += 1
        if self.examples % 100 == 0:
            self.check_bystander()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("fuzz"))
    yield c
    try:
        c.check_bystander()
        # Nothing acknowledged was lost: the bystander's messages, in order.
        got: list = []
        deadline = time.monotonic() + 10
        while len(got) < len(c.acked) and time.monotonic() < deadline:
            r = c.bystander.pull("bystander", len(got), group="bystander-g", max_msgs=256)
            if r.code == R.SUCCESS:
                got += decode_pull(r, len(got))
        assert [m.body for m in got] == c.acked
        for p in (c.namesrv, c.broker):
            grown = _rss(p.proc.pid) - c.rss0[p.proc.pid]
            assert grown < RSS_GROWTH_LIMIT, f"{p.ready}: RSS grew {grown >> 20} MiB"
            assert "Traceback" not in p.log(), p.log()[-5000:]
    finally:
        c.bystander.close()
        for p in (c.broker, c.namesrv):
            if p.alive():
                assert p.stop() == 0, p.log()[-3000:]


@pytest.fixture(scope="module")
def broker_peer(cluster):
    p = Peer(cluster.broker.addr)
    yield p
    p.close()


@pytest.fixture(scope="module")
def namesrv_peer(cluster):
    p = Peer(cluster.namesrv.addr)
    yield p
    p.close()


@st.composite
def frames(draw, codes: list[int]) -> Sent:
    code = draw(st.sampled_from(codes) | st.integers(0, 0xFFFF))
    flags = draw(st.sampled_from([0, 0, 0, FLAG_ONEWAY, FLAG_RESPONSE]))
    header = draw(header_bytes(code))
    if code in (RequestCode.SEND_MESSAGE, RequestCode.SEND_BATCH) and draw(st.booleans()):
        topic = draw(st.sampled_from(["fz-ok", "fz-ro", "fz-wo", "%RETRY%fz-g", "fz-new"]))
        body = draw(batches(topic))
    else:
        body = draw(st.just(b"") | st.binary(max_size=200))
    return Sent(code, flags, next(_opaque), header, body)


def _checked(peer: Peer, cluster: Cluster, sent: Sent) -> Frame | None:
    try:
        f = peer.exchange(sent)
    except AssertionError:
        peer.close()  # a fresh connection for the next example
        peer.connect()
        raise
    if f is not None:
        assert f.code != R.SYSTEM_ERROR, f"{sent!r} -> SYSTEM_ERROR: {_message(f)}"
    cluster.step()
    return f


_SETTINGS = {"deadline": None, "derandomize": not SCALE, "database": None,
             "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture]}


@settings(max_examples=FRAMES, **_SETTINGS)
@given(data=st.data())
def test_broker_frames(cluster, broker_peer, data):
    _checked(broker_peer, cluster, data.draw(frames(BROKER_CODES)))


@settings(max_examples=NAMESRV_FRAMES, **_SETTINGS)
@given(data=st.data())
def test_namesrv_frames(cluster, namesrv_peer, data):
    _checked(namesrv_peer, cluster, data.draw(frames(NAMESRV_CODES)))


_ACCEPTED = {R.SUCCESS, R.MESSAGE_ILLEGAL, R.MESSAGE_TOO_LARGE, R.INVALID_ARGUMENT}


@settings(max_examples=BATCHES, **_SETTINGS)
@given(data=st.data())
def test_batches(cluster, broker_peer, data):
    """Hostile batches: refused with a clear code, or stored -- and then every message of it
    decodes in the client, as a consumer would read it."""
    qid = data.draw(st.integers(0, 3))
    body = data.draw(batches("fz-batch"))
    if len(body) > 72 + 8 + 48:  # the queue id the header must repeat
        b = bytearray(body)
        b[44:48] = qid.to_bytes(4, "little")
        from tidemq.protocol.record import seal_store_header

        seal_store_header(b, 0, 72 + len("fz-batch"))
        body = bytes(b)
    header = msgspec.msgpack.encode(SendMessageRequestHeader(
        producer_group="fz-pg", topic="fz-batch", queue_id=qid, batch=True))
    before = _max_offset(broker_peer, "fz-batch", qid)
    f = _checked(broker_peer, cluster, Sent(RequestCode.SEND_BATCH, 0, next(_opaque), header,
                                            body))
    assert f.code in _ACCEPTED, (R(f.code).name, _message(f))
    if f.code != R.SUCCESS:
        assert _message(f), "a refusal says why"
        return
    pull = msgspec.msgpack.encode({"consumer_group": "fz-reader", "topic": "fz-batch",
                                   "queue_id": qid, "queue_offset": before,
                                   "max_msg_nums": 1024})
    r = broker_peer.exchange(Sent(RequestCode.PULL_MESSAGE, 0, next(_opaque), pull, b""))
    if r.code != R.SUCCESS:  # held (delay level, deliver_at): not in the queue yet
        return

    def corrupt(qo, n, why):
        raise AssertionError(f"an accepted batch does not decode at offset {qo}: {why}")

    msgs, _ = decode_pull_body(r.body, from_offset=before, on_corrupt=corrupt)
    for m in msgs:
        m.properties, m.keys, m.tags  # noqa: B018 -- lazily decoded fields


def _max_offset(peer: Peer, topic: str, qid: int) -> int:
    h = msgspec.msgpack.encode({"topic": topic, "queue_id": qid})
    f = peer.exchange(Sent(RequestCode.GET_MAX_OFFSET, 0, next(_opaque), h, b""))
    assert f.code == R.SUCCESS
    return f.header["offset"]
