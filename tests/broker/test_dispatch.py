"""An in-process broker (its loop on a thread) for what a subprocess cannot show: a handler that
fails unexpectedly is answered SYSTEM_ERROR and logged, and a put from a foreign thread still
wakes a held pull."""

from __future__ import annotations

import asyncio
import logging
import select
import threading
import time

import pytest

from tidemq.broker.broker import Broker
from tidemq.broker.config import BrokerConfig
from tidemq.protocol.codes import RequestCode, ResponseCode
from tidemq.protocol.frame import Frame, encode_frame
from tidemq.protocol.headers import SendMessageRequestHeader, SendMultiQueueRequestHeader

from .wire import Wire, batch, decode_pull, error_message


@pytest.fixture
def inproc(tmp_path):
    cfg = BrokerConfig(listen_port=0, data_dir=str(tmp_path / "data"),
                       store={"segment_size": 1 << 24, "index_slots": 1024,
                              "index_max_entries": 4096, "cq_units_per_file": 1024})
    broker = Broker(cfg)
    loop = asyncio.new_event_loop()
    started = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(broker.start())
        started.set()
        loop.run_forever()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(10)
    yield broker, loop
    asyncio.run_coroutine_threadsafe(broker.stop(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    t.join(10)
    loop.close()


def test_unexpected_handler_failure_is_system_error_and_logged(inproc, caplog):
    broker, loop = inproc

    def boom(conn, frame):
        raise ZeroDivisionError("simulated bug")

    broker._handlers[RequestCode.GET_MAX_OFFSET] = boom
    with caplog.at_level(logging.ERROR, logger="tidemq.broker.broker"), \
            Wire(f"127.0.0.1:{broker.port}") as w:
        r = w.request(RequestCode.GET_MAX_OFFSET, {"topic": "t", "queue_id": 0})
        assert r.code == ResponseCode.SYSTEM_ERROR
        assert "ZeroDivisionError: simulated bug" in error_message(r)
        assert "broker log" in error_message(r)
        assert w.send_messages("t", [b"x"]).code == ResponseCode.SUCCESS  # still usable
    assert any("simulated bug" in rec.getMessage() and "Traceback" in rec.getMessage()
               for rec in caplog.records)


def test_a_put_from_another_thread_wakes_a_held_pull(inproc):
    broker, loop = inproc
    with Wire(f"127.0.0.1:{broker.port}") as w:
        assert w.create_topic("xt", 1).code == ResponseCode.SUCCESS
        opaque = w.send(RequestCode.PULL_MESSAGE, w.pull_header("xt", 0, suspend_ms=5000))
        time.sleep(0.1)
        assert broker.hold.held_count() == 1
        t0 = time.perf_counter()
        broker.store.put(bytes(batch("xt", [b"from-a-thread"])))  # not the loop's thread
        p = w.recv(opaque, timeout=5)
        assert time.perf_counter() - t0 < 0.5
        assert p.code == ResponseCode.SUCCESS
        assert [m.body for m in decode_pull(p, 0)] == [b"from-a-thread"]


def _hold_a_pull(broker: Broker, w: Wire, topic: str) -> int:
    """Create ``topic`` and leave a pull of its queue 0 held on ``broker``; its opaque."""
    assert w.create_topic(topic, 1).code == ResponseCode.SUCCESS
    opaque = w.send(RequestCode.PULL_MESSAGE, w.pull_header(topic, 0, suspend_ms=5000))
    deadline = time.monotonic() + 5
    while broker.hold.held_count() != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert broker.hold.held_count() == 1
    return opaque


def test_a_woken_pull_is_answered_within_the_read_that_woke_it(inproc):
    """The pull a send wakes is answered (written to its connection) before the broker's loop
    takes another turn: answered a turn later, the requests read in between went first (the
    e2e tail, docs/benchmarks.md). Checked with the loop held: the send's read is fed to its
    connection on the loop thread, and the held pull's answer must be on the puller's socket
    before that callback returns."""
    broker, loop = inproc
    with Wire(f"127.0.0.1:{broker.port}") as puller, Wire(f"127.0.0.1:{broker.port}") as sender:
        opaque = _hold_a_pull(broker, puller, "wk")
        port = sender.sock.getsockname()[1]
        frame = encode_frame(Frame.request(
            RequestCode.SEND_MESSAGE, 99,
            SendMessageRequestHeader(producer_group="pg", topic="wk", queue_id=0, batch=False),
            bytes(batch("wk", [b"wake"]))))

        def read_the_send() -> bool:
            conn = next(c for c in broker.frames.connections if c.peer.endswith(f":{port}"))
            conn.data_received(frame)  # what the transport does with the bytes it read
            # the loop is held here: only an answer written inside that read can arrive
            return bool(select.select([puller.sock], [], [], 0.5)[0])

        async def on_loop() -> bool:
            return read_the_send()

        assert asyncio.run_coroutine_threadsafe(on_loop(), loop).result(10), \
            "the woken pull was not answered within the read that stored its message"
        p = puller.recv(opaque, timeout=5)
        assert p.code == ResponseCode.SUCCESS
        assert [m.body for m in decode_pull(p, 0)] == [b"wake"]
        assert sender.recv(99, timeout=5).code == ResponseCode.SUCCESS


def test_a_pull_woken_on_the_senders_connection_shares_the_sends_write(inproc):
    """A client whose producer and consumer share a connection gets the send's answer and the
    answer of the pull it woke in one write (one wake-up for the client), with the loop held
    right after the read -- as the woken pull's answer used to follow a loop turn later."""
    broker, loop = inproc
    with Wire(f"127.0.0.1:{broker.port}") as w:
        pull = _hold_a_pull(broker, w, "wk1")
        port = w.sock.getsockname()[1]
        send = 1000
        w._pending[send] = RequestCode.SEND_MESSAGE  # the Wire decodes its answer's header
        frame = encode_frame(Frame.request(
            RequestCode.SEND_MESSAGE, send,
            SendMessageRequestHeader(producer_group="pg", topic="wk1", queue_id=0, batch=False),
            bytes(batch("wk1", [b"same-conn"]))))

        def read_the_send() -> int:
            conn = next(c for c in broker.frames.connections if c.peer.endswith(f":{port}"))
            t = conn.transport
            writes: list[str] = []
            real_write, real_writelines = t.write, t.writelines

            def write(data):
                if not writes or writes[-1] != "writelines...":
                    writes.append("write")
                real_write(data)

            def writelines(parts):  # asyncio's may call write itself: one write all the same
                writes.append("writelines...")
                real_writelines(parts)
                writes[-1] = "writelines"

            t.write, t.writelines = write, writelines
            try:
                conn.data_received(frame)  # what the transport does with the bytes it read
            finally:
                del t.write, t.writelines
            return len(writes)

        async def on_loop() -> int:
            return read_the_send()

        assert asyncio.run_coroutine_threadsafe(on_loop(), loop).result(10) == 1
        assert w.recv(send, timeout=5).code == ResponseCode.SUCCESS
        p = w.recv(pull, timeout=5)
        assert p.code == ResponseCode.SUCCESS
        assert [m.body for m in decode_pull(p, 0)] == [b"same-conn"]


def test_a_frame_of_spread_single_messages_is_stored_in_one_write(inproc):
    """SEND_MULTI_QUEUE of plain one-message batches for many queues (spread traffic) takes
    the frame path: one put_frame (one CommitLog write) for all of them, each batch its own
    result and queue offset; a batch with keys in the middle goes through the per-batch door
    and splits the frame in two runs (issue 17)."""
    broker, _loop = inproc
    with Wire(f"127.0.0.1:{broker.port}") as w:
        assert w.create_topic("fp", 8).code == ResponseCode.SUCCESS
        plain = [bytes(batch("fp", [b"m%d" % q], queue_id=q)) for q in range(8)]
        keyed = bytes(batch("fp", [b"k"], keys="a-key", queue_id=0))
        before = broker.store.stats["put_frames"]
        h = SendMultiQueueRequestHeader(producer_group="pg", batches=9)
        r = w.request(RequestCode.SEND_MULTI_QUEUE, h, b"".join(plain[:4] + [keyed] + plain[4:]))
        assert r.code == ResponseCode.SUCCESS, error_message(r)
        assert [x.code for x in r.header.results] == [ResponseCode.SUCCESS] * 9
        assert [x.queue_offset for x in r.header.results] == [0, 0, 0, 0, 1, 0, 0, 0, 0]
        assert broker.store.stats["put_frames"] - before == 2  # the runs before and after
        for q in range(8):
            got = decode_pull(w.pull("fp", 0, queue_id=q), 0)
            assert [m.body for m in got] == ([b"m0", b"k"] if q == 0 else [b"m%d" % q])
