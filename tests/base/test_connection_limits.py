"""Memory per connection and per process on both servers (tidemq.base), against real broker and
name server processes: a client that never reads what it asks for, partial frames that never
complete, the connection cap, held pulls, and SYSTEM_BUSY with its retry hint.

Memory is measured as the server's RssAnon (anonymous memory: what queued responses and held
frames cost; the store's mapped files are page cache, RssFile)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from broker.wire import (
    RequestCode,
    ResponseCode,
    Wire,
    error_message,
    start,
    start_broker,
    start_namesrv,
    wait_until,
)
from tidemq.protocol.frame import (
    FRAME_MAGIC,
    FRAME_PREFIX,
    FRAME_VERSION,
    Frame,
    FrameDecoder,
    encode_frame,
)
from tidemq.protocol.headers import (
    EmptyHeader,
    GetRouteInfoRequestHeader,
    RegisterBrokerRequestHeader,
    TopicConfig,
)

R = ResponseCode
MiB = 1 << 20
BUSY_MS = 300
LIMITS = [
    "-o", "socket_send_buffer=65536",
    "-o", "partial_frame_timeout_ms=1500",
    "-o", f"max_partial_frame_bytes={8 * MiB}",
    "-o", f"busy_retry_ms={BUSY_MS}",
]


def rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("limits")
    srv = start_broker(tmp, "", *LIMITS, "-o", "max_held_pulls_per_connection=50")
    yield srv
    assert srv.alive(), srv.log()
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def namesrv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("limits-ns")
    srv = start_namesrv(tmp, *LIMITS)
    yield srv
    assert srv.alive(), srv.log()
    assert srv.stop() == 0, srv.log()


def runtime_info(addr: str) -> dict:
    with Wire(addr) as w:
        r = w.request(RequestCode.GET_BROKER_RUNTIME_INFO, EmptyHeader())
        assert r.code == R.SUCCESS
        return dict(r.header.table)


class NonReader:
    """A raw connection that writes ``count`` copies of ``request`` and reads nothing until
    :meth:`read_all` (its receive buffer is small, so the server's answers back up fast);
    ``answers``: responses expected in all (default ``count``)."""

    def __init__(self, addr: str, request: bytes, count: int, answers: int = 0) -> None:
        host, _, port = addr.rpartition(":")
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
        self.sock.connect((host, int(port)))
        self.count = count
        self.answers = answers or count
        self.sent = 0
        self.request = request
        self.thread = threading.Thread(target=self._write, daemon=True)
        self.thread.start()

    def _write(self) -> None:
        # In as few writes as possible: a server that handles a whole read before looking at
        # its output would queue the answers to all of them.
        chunk = max(256, (1 << 20) // len(self.request))
        try:
            while self.sent < self.count:
                n = min(chunk, self.count - self.sent)
                self.sock.sendall(self.request * n)
                self.sent += n
        except OSError:
            pass

    def stalled(self, quiet: float = 1.0, timeout: float = 30.0) -> bool:
        """True once the writer makes no progress for ``quiet`` seconds (the server stopped
        reading it) -- or finished."""
        deadline = time.monotonic() + timeout
        last, since = self.sent, time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.1)
            if self.sent >= self.count:
                return True
            if self.sent != last:
                last, since = self.sent, time.monotonic()
            elif time.monotonic() - since >= quiet:
                return True
        return False

    def read_all(self, timeout: float = 120.0) -> list[Frame]:
        """Read until all the responses arrived."""
        dec = FrameDecoder()
        frames: list[Frame] = []
        self.sock.settimeout(timeout)
        while len(frames) < self.answers:
            data = self.sock.recv(1 << 20)
            if not data:
                break
            for f in dec.feed(data):
                frames.append(Frame(f.code, f.opaque, f.flags, None, b""))  # drop the bytes
        self.thread.join(10)
        return frames

    def close(self) -> None:
        self.sock.close()


def still_served(addr: str, topic: str) -> float:
    """A bystander's send and pull on the broker; returns the seconds both took."""
    t0 = time.monotonic()
    with Wire(addr, timeout=10) as w:
        r = w.send_messages(topic, [b"bystander"])
        assert r.code == R.SUCCESS, r
        assert w.pull(topic, 0).code == R.SUCCESS
    return time.monotonic() - t0


# -- a client that never reads its responses --------------------------------------------------


def test_broker_stops_reading_a_client_that_does_not_read(broker):
    """Pipelined requests with large answers (the whole topic table, ~70 KB, 2,000 times:
    ~140 MB of answers): the broker handles them until the client's buffers are full, then
    stops reading it -- memory stays put, bystanders are served, and once the client reads,
    every answer arrives."""
    with Wire(broker.addr) as w:
        for i in range(800):
            tc = TopicConfig(topic_name=f"limits-{i:04d}-{'x' * 40}", read_queue_nums=1,
                             write_queue_nums=1)
            assert w.request(RequestCode.UPDATE_AND_CREATE_TOPIC, tc).code == R.SUCCESS
        one = w.request(RequestCode.GET_ALL_TOPIC_CONFIG, EmptyHeader())
        answer = len(encode_frame(Frame(one.code, 1, 1, one.header)))
    count = 2000
    assert answer * count > 100 * MiB  # what an unbounded queue would hold
    before = rss_anon(broker.proc.pid)
    req = encode_frame(Frame.request(RequestCode.GET_ALL_TOPIC_CONFIG, 1, EmptyHeader()))
    nr = NonReader(broker.addr, req, count)
    try:
        assert nr.stalled(), "the broker kept reading a client that reads nothing"
        grown = rss_anon(broker.proc.pid) - before
        assert grown < 32 * MiB, f"RssAnon grew {grown >> 20} MiB"
        assert still_served(broker.addr, "limits-0000-" + "x" * 40) < 2.0
        frames = nr.read_all()
        assert len(frames) == count and {f.code for f in frames} == {R.SUCCESS}
    finally:
        nr.close()
    assert broker.alive()


def _register_many_topics(w: Wire, n: int) -> None:
    topics = {
        f"ns-limits-{i:05d}-{'y' * 60}": TopicConfig(topic_name=f"ns-limits-{i:05d}-{'y' * 60}")
        for i in range(n)
    }
    h = RegisterBrokerRequestHeader(cluster_name="c", broker_name="fake", broker_id=0,
                                    broker_addr="127.0.0.1:1", topics=topics)
    assert w.request(RequestCode.REGISTER_BROKER, h).code == R.SUCCESS


def test_name_server_stops_reading_a_client_that_does_not_read(namesrv):
    """The issue's critical row: a client asking for the topic list (~160 KB) over and over
    and reading nothing made the name server buffer without limit; now it stops reading it,
    stays small and keeps answering routes."""
    with Wire(namesrv.addr) as reg:  # the registration lives as long as this connection
        _register_many_topics(reg, 2000)
        r = reg.request(RequestCode.GET_ALL_TOPIC_LIST_FROM_NAMESERVER, EmptyHeader())
        answer = len(encode_frame(Frame(r.code, 1, 1, r.header)))
        count = 1500
        assert answer * count > 200 * MiB
        before = rss_anon(namesrv.proc.pid)
        req = encode_frame(Frame.request(RequestCode.GET_ALL_TOPIC_LIST_FROM_NAMESERVER, 1,
                                         EmptyHeader()))
        nr = NonReader(namesrv.addr, req, count)
        try:
            assert nr.stalled(), "the name server kept reading a client that reads nothing"
            grown = rss_anon(namesrv.proc.pid) - before
            assert grown < 32 * MiB, f"RssAnon grew {grown >> 20} MiB"
            t0 = time.monotonic()
            with Wire(namesrv.addr, timeout=5) as w:
                route = w.request(RequestCode.GET_ROUTEINFO_BY_TOPIC,
                                  GetRouteInfoRequestHeader(topic="ns-limits-00007-" + "y" * 60))
            assert route.code == R.SUCCESS and time.monotonic() - t0 < 2.0
            frames = nr.read_all()
            assert len(frames) == count and {f.code for f in frames} == {R.SUCCESS}
        finally:
            nr.close()


def test_held_pulls_woken_together_wait_for_a_client_that_does_not_read(broker):
    """40 held pulls of one non-reading connection woken by one send: their ~10 MB of answers
    are produced as the client reads, not all at once -- and none is lost."""
    topic = "limits-held"
    with Wire(broker.addr) as w:
        assert w.create_topic(topic, 1).code == R.SUCCESS
        pulls = b"".join(
            encode_frame(Frame.request(RequestCode.PULL_MESSAGE, i + 1, w.pull_header(
                topic, 0, max_msgs=32, suspend_ms=20_000)))
            for i in range(40)
        )
    nr = NonReader(broker.addr, pulls, 1, answers=40)  # one write of 40 pulls
    try:
        assert wait_until(lambda: runtime_info(broker.addr)["held_pulls"] >= 40, 5)
        before = rss_anon(broker.proc.pid)
        with Wire(broker.addr) as w:
            assert w.send_messages(topic, [b"b" * 8192] * 32).code == R.SUCCESS
        assert wait_until(lambda: runtime_info(broker.addr)["held_pulls"] == 0, 5)
        time.sleep(0.5)
        assert rss_anon(broker.proc.pid) - before < 16 * MiB
        frames = nr.read_all(timeout=30)
        assert len(frames) == 40 and {f.code for f in frames} == {R.SUCCESS}
    finally:
        nr.close()


def test_held_pulls_per_connection_are_capped(broker):
    topic = "limits-held-cap"
    with Wire(broker.addr) as w:
        assert w.create_topic(topic, 1).code == R.SUCCESS
        ops = [w.send(RequestCode.PULL_MESSAGE, w.pull_header(topic, 0, suspend_ms=10_000))
               for _ in range(51)]
        busy = w.recv(ops[-1], timeout=5)
        assert busy.code == R.SYSTEM_BUSY
        assert busy.header.retry_after_ms == BUSY_MS
        assert "max_held_pulls_per_connection" in error_message(busy)
        with Wire(broker.addr) as other:  # another connection has its own allowance
            assert other.send_messages(topic, [b"wake"]).code == R.SUCCESS
        answers = [w.recv(o, timeout=5) for o in ops[:-1]]
        assert {a.code for a in answers} == {R.SUCCESS}


# -- partial frames ------------------------------------------------------------------------


def _prefix(total: int, code: int = RequestCode.GET_BROKER_RUNTIME_INFO, opaque: int = 1) -> bytes:
    """The 18-byte prefix of a request frame of ``total`` bytes with no header."""
    return FRAME_PREFIX.pack(total - 4, FRAME_MAGIC, FRAME_VERSION, 0, 0, code, opaque, 0)


def test_partial_frame_is_dropped_after_the_timeout(broker):
    with Wire(broker.addr) as w:
        t0 = time.monotonic()
        w.send_raw(_prefix(MiB) + bytes(1000))
        assert w.is_closed_by_peer(timeout=6)
        took = time.monotonic() - t0
        assert 1.4 < took < 4.0, took
    assert runtime_info(broker.addr)["partial_frame_timeouts"] >= 1


def test_partial_frames_respect_the_global_cap(broker):
    """20 connections each hold 3 MiB of a 4 MiB frame (60 MiB) against a cap of 8 MiB: the
    oldest frames are dropped, memory stays near the cap, and each dropped frame is answered
    SYSTEM_BUSY with the retry hint once its last byte is in; the kept ones are served."""
    before = rss_anon(broker.proc.pid)
    size = 4 * MiB
    wires = [Wire(broker.addr) for _ in range(20)]
    try:
        for i, w in enumerate(wires):
            w.send_raw(_prefix(size, opaque=1000 + i) + bytes(3 * MiB))
            time.sleep(0.01)  # distinct ages
        info = runtime_info(broker.addr)
        assert info["partial_frame_bytes"] <= 8 * MiB
        assert info["frames_dropped_busy"] >= 14
        grown = rss_anon(broker.proc.pid) - before
        assert grown < 30 * MiB, f"RssAnon grew {grown >> 20} MiB"
        for w in wires:
            w.send_raw(bytes(size - 18 - 3 * MiB))
        codes = []
        for i, w in enumerate(wires):
            w._pending[1000 + i] = RequestCode.GET_BROKER_RUNTIME_INFO
            r = w.recv(1000 + i, timeout=10)
            codes.append(r.code)
            if r.code == R.SYSTEM_BUSY:
                assert r.header.retry_after_ms == BUSY_MS
                assert "max_partial_frame_bytes" in error_message(r)
        assert codes[0] == R.SYSTEM_BUSY  # the oldest went first
        assert codes[-1] == R.SUCCESS  # the newest fit
        for w in wires:  # every connection is still usable
            assert w.request(RequestCode.GET_BROKER_RUNTIME_INFO, EmptyHeader()).code == R.SUCCESS
    finally:
        for w in wires:
            w.close()


def test_name_server_partial_frames_time_out(namesrv):
    with Wire(namesrv.addr) as w:
        w.send_raw(_prefix(MiB, RequestCode.GET_ROUTEINFO_BY_TOPIC) + bytes(1000))
        assert w.is_closed_by_peer(timeout=6)


# -- the connection cap ----------------------------------------------------------------------


def test_max_connections_refuses_with_system_busy(tmp_path):
    srv = start_broker(tmp_path, "", *LIMITS, "-o", "max_connections=3")
    try:
        held = [Wire(srv.addr) for _ in range(3)]
        for w in held:
            assert w.request(RequestCode.GET_BROKER_RUNTIME_INFO, EmptyHeader()).code == R.SUCCESS
        with Wire(srv.addr) as extra:
            r = extra.request(RequestCode.GET_BROKER_RUNTIME_INFO, EmptyHeader(), timeout=5)
            assert r.code == R.SYSTEM_BUSY
            assert r.header.retry_after_ms == BUSY_MS
            assert "max_connections" in error_message(r) and "3" in error_message(r)
            assert extra.is_closed_by_peer(timeout=3)
        with Wire(srv.addr) as silent:  # refused and silent: closed after about a second
            assert silent.is_closed_by_peer(timeout=5)
        for w in held:  # the connections it had are served as before
            assert w.send_messages("capped", [b"x"]).code == R.SUCCESS
        held.pop().close()
        assert wait_until(lambda: _served(srv.addr), 5)
        info = dict(held[0].request(RequestCode.GET_BROKER_RUNTIME_INFO,
                                    EmptyHeader()).header.table)
        assert info["connections_refused"] >= 2
        for w in held:
            w.close()
    finally:
        srv.stop()


def _served(addr: str) -> bool:
    with Wire(addr) as w:
        return w.request(RequestCode.GET_BROKER_RUNTIME_INFO, EmptyHeader(),
                         timeout=5).code == R.SUCCESS


def test_name_server_max_connections(tmp_path):
    srv = start_namesrv(tmp_path, *LIMITS, "-o", "max_connections=1")
    try:
        with Wire(srv.addr) as first, Wire(srv.addr) as second:
            q = GetRouteInfoRequestHeader(topic="none")
            assert first.request(RequestCode.GET_ROUTEINFO_BY_TOPIC, q).code == R.TOPIC_NOT_EXIST
            r = second.request(RequestCode.GET_ROUTEINFO_BY_TOPIC, q, timeout=5)
            assert r.code == R.SYSTEM_BUSY and "name server" in error_message(r)
            assert first.request(RequestCode.GET_ROUTEINFO_BY_TOPIC, q).code == R.TOPIC_NOT_EXIST
    finally:
        srv.stop()


# -- settings ---------------------------------------------------------------------------------


def test_limits_are_settings_with_clear_errors(tmp_path):
    with pytest.raises(RuntimeError, match="max_connections must be > 0"):
        start_namesrv(tmp_path, "-o", "max_connections=0")
    with pytest.raises(RuntimeError, match="unknown name server setting 'bogus'"):
        start_namesrv(tmp_path, "-o", "bogus=1")
    with pytest.raises(RuntimeError, match="write_buffer_low_water"):
        start_broker(tmp_path, "", "-o", "write_buffer_low_water=999999999")
    # tidemq dev: -o namesrv.KEY sets the embedded name server's settings
    with pytest.raises(RuntimeError, match="name server setting busy_retry_ms"):
        start(["dev", "--data-dir", str(tmp_path / "dev"), "--namesrv-port", "0",
               "--broker-port", "0", "-o", "namesrv.busy_retry_ms=-1"], str(tmp_path / "d.log"))
    dev = start(["dev", "--data-dir", str(tmp_path / "dev"), "--namesrv-port", "0",
                 "--broker-port", "0", "-o", "namesrv.max_connections=1"],
                str(tmp_path / "d.log"))
    try:
        with Wire(dev.addrs["namesrv"]) as a, Wire(dev.addrs["namesrv"]) as b:
            q = GetRouteInfoRequestHeader(topic="none")
            a.request(RequestCode.GET_ROUTEINFO_BY_TOPIC, q)
            assert b.request(RequestCode.GET_ROUTEINFO_BY_TOPIC, q).code == R.SYSTEM_BUSY
    finally:
        dev.stop()



def test_producer_waits_out_a_full_broker(tmp_path):
    """The client honours SYSTEM_BUSY's hint: with the broker's only connection slot taken,
    a send with 10 retries does not burn them at once but waits as asked between them, and
    succeeds once the slot is free."""
    from tidemq.client.message import Message
    from tidemq.client.producer import Producer

    ns = start_namesrv(tmp_path)
    br = start_broker(tmp_path, ns.addr, "-o", "max_connections=1", "-o",
                      f"busy_retry_ms={BUSY_MS}")
    try:
        with Wire(br.addr) as w:
            assert w.create_topic("busy", 1).code == R.SUCCESS
        time.sleep(0.2)  # the slot is free again once the broker saw the close
        hog = Wire(br.addr)
        assert hog.request(RequestCode.GET_BROKER_RUNTIME_INFO, EmptyHeader()).code == R.SUCCESS

        async def main() -> float:
            loop = asyncio.get_running_loop()
            async with Producer(ns.addr, send_timeout=6, retries=10) as p:
                loop.call_later(1.2, hog.close)
                t0 = loop.time()
                r = await p.send(Message("busy", b"x"), queue_id=0)
                assert r.queue_offset == 0
                return loop.time() - t0

        took = asyncio.run(main())
        assert 1.1 < took < 4.0, took
        with Wire(br.addr) as w:
            info = dict(w.request(RequestCode.GET_BROKER_RUNTIME_INFO,
                                  EmptyHeader()).header.table)
        # about one refusal per hint (300 ms) while the slot was taken, not 11 at once
        assert 2 <= info["connections_refused"] <= 6, info["connections_refused"]
    finally:
        br.stop()
        ns.stop()
