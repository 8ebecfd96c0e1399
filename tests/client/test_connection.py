"""Connection, pool, route and producer retry logic against a fake frame server."""

from __future__ import annotations

import asyncio
import socket

import pytest

from tidemq.client import connection as connection_mod
from tidemq.client.connection import ConnectionPool, parse_address, raise_for_error
from tidemq.client.errors import ConnectError, ConnectionLostError, RequestTimeoutError
from tidemq.client.message import Message
from tidemq.client.producer import Producer
from tidemq.client.route import RouteCache, parse_namesrv
from tidemq.protocol.codes import RequestCode, ResponseCode
from tidemq.protocol.errors import BrokerError
from tidemq.protocol.frame import (
    FLAG_RESPONSE,
    FRAME_MAGIC,
    FRAME_PREFIX,
    FRAME_VERSION,
    Frame,
    FrameDecoder,
    encode_frame,
)
from tidemq.protocol.headers import (
    BrokerData,
    EmptyHeader,
    ErrorResponseHeader,
    PullMessageRequestHeader,
    QueueData,
    SendMessageRequestHeader,
    SendMessageResponseHeader,
    TopicRouteData,
    error_response,
)
from tidemq.protocol.record import BatchView

from .fake_server import FakeServer


def run(coro):
    return asyncio.run(coro)


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_addresses_are_checked():
    assert parse_address("127.0.0.1:9876") == ("127.0.0.1", 9876)
    assert parse_namesrv("a:1; b:2,c:3") == ["a:1", "b:2", "c:3"]
    for bad in ("localhost", "a:b", "a:0", ":1"):
        with pytest.raises(ValueError):
            parse_address(bad)
    with pytest.raises(ValueError):
        parse_namesrv(" ; ")


def test_responses_match_requests_out_of_order_and_timeouts_keep_the_connection():
    async def handler(frame: Frame):
        delay = frame.header["delay"]
        if delay < 0:
            return None  # never answer
        await asyncio.sleep(delay)
        return frame.response(0, {"echo": frame.header["n"]})

    async def main():
        srv = await FakeServer(handler).start()
        pool = ConnectionPool()
        conn = await pool.get(srv.address)
        slow = conn.request(999, {"n": 1, "delay": 0.2})
        fast = conn.request(999, {"n": 2, "delay": 0.0})
        a, b = await asyncio.gather(slow, fast)
        assert (a.header["echo"], b.header["echo"]) == (1, 2)
        with pytest.raises(RequestTimeoutError, match="no response within 0.1 s"):
            await conn.request(999, {"n": 3, "delay": -1}, timeout=0.1)
        ok = await conn.request(999, {"n": 4, "delay": 0})
        assert ok.header["echo"] == 4 and conn.in_flight == 0
        assert await pool.get(srv.address) is conn
        pool.close()
        await srv.close()

    run(main())


def test_garbage_from_the_peer_fails_in_flight_requests_and_the_pool_reconnects():
    calls = 0

    async def handler(frame: Frame):
        nonlocal calls
        calls += 1
        if calls == 1:
            return b"\x20\x00\x00\x00\xffgarbage-garbage-garbage-garbage"
        return frame.response(0, {"ok": True})

    async def main():
        srv = await FakeServer(handler).start()
        pool = ConnectionPool()
        conn = await pool.get(srv.address)
        with pytest.raises(ConnectionLostError, match="break the frame format"):
            await conn.request(999, {"x": 1})
        assert conn.is_closed
        f = await pool.request(srv.address, 999, {"x": 2})
        assert f.header == {"ok": True}
        pool.close()
        await srv.close()

    run(main())


def test_connect_failure_is_clear():
    async def main():
        pool = ConnectionPool(connect_timeout=1)
        with pytest.raises(ConnectError, match="check that the broker"):
            await pool.get(f"127.0.0.1:{free_port()}")

    run(main())


def _route(brokers: dict[str, str], queues: int = 2) -> TopicRouteData:
    return TopicRouteData(
        queue_datas=[QueueData(broker_name=n, read_queue_nums=queues, write_queue_nums=queues)
                     for n in brokers],
        broker_datas=[BrokerData(cluster="c", broker_name=n, broker_addrs={0: a})
                      for n, a in brokers.items()],
    )


def test_route_fails_over_to_the_next_name_server_and_maps_unknown_topics():
    async def namesrv(frame: Frame):
        if frame.header.topic == "missing":
            return error_response(frame, ResponseCode.TOPIC_NOT_EXIST)
        return frame.response(0, _route({"b1": "127.0.0.1:1"}))

    async def main():
        srv = await FakeServer(namesrv).start()
        pool = ConnectionPool(connect_timeout=1)
        routes = RouteCache(pool, [f"127.0.0.1:{free_port()}", srv.address])
        r = await routes.get("t")
        assert [q.queue_id for q in r.write_queues] == [0, 1]
        assert routes.namesrv[routes._current] == srv.address
        from tidemq.client.errors import NoRouteError

        with pytest.raises(NoRouteError, match="does not exist"):
            await routes.get("missing")
        pool.close()
        await srv.close()

    run(main())


def test_producer_retries_on_another_broker_and_avoids_the_failed_one():
    sent: dict[str, list[int]] = {"b1": [], "b2": []}

    def broker(name: str, fail: bool):
        async def handler(frame: Frame):
            h: SendMessageRequestHeader = frame.header
            v = BatchView(frame.body)
            v.verify()
            assert v.queue_id == h.queue_id
            sent[name].append(v.base_seq)
            if fail:
                return error_response(frame, ResponseCode.SYSTEM_BUSY, "busy")
            return frame.response(0, SendMessageResponseHeader(
                msg_id=v.unique_id(0), queue_id=h.queue_id, queue_offset=5, count=v.count))
        return handler

    async def main():
        b1 = await FakeServer(broker("b1", True)).start()
        b2 = await FakeServer(broker("b2", False)).start()
        route = _route({"b1": b1.address, "b2": b2.address})

        async def namesrv(frame: Frame):
            return frame.response(0, route)

        ns = await FakeServer(namesrv).start()
        async with Producer(ns.address) as p:
            results = [await p.send(Message("t", b"x")) for _ in range(4)]
        assert all(r.broker_name == "b2" for r in results)
        assert len(sent["b1"]) == 1  # failed once, then avoided
        # The retry re-sent the same sequence (deduplication-friendly).
        assert sent["b1"][0] in sent["b2"]
        assert sent["b1"][0] in {r.base_seq for r in results}
        # A pinned send is never moved to another broker.
        async with Producer(ns.address) as p:
            with pytest.raises(BrokerError, match="busy"):
                await p.send(Message("t", b"x"), queue_id=0)
        for s in (b1, b2, ns):
            await s.close()

    run(main())


def test_request_codes_are_named_in_timeouts():
    async def handler(frame: Frame):
        return None

    async def main():
        srv = await FakeServer(handler).start()
        pool = ConnectionPool()
        with pytest.raises(RequestTimeoutError, match="PULL_MESSAGE"):
            await pool.request(srv.address, RequestCode.PULL_MESSAGE, PullMessageRequestHeader(
                consumer_group="g", topic="t", queue_id=0, queue_offset=0), timeout=0.05)
        pool.close()
        await srv.close()

    run(main())


def test_latency_fault_table_follows_rocketmqs_steps(monkeypatch):
    from tidemq.client import latency_fault

    now = [1000.0]
    monkeypatch.setattr(latency_fault.time, "monotonic", lambda: now[0])
    t = latency_fault.LatencyFaultTable()
    t.update("b", 80)  # fast enough: never avoided
    assert t.available("b")
    t.update("b", 600)  # >= 550 ms: avoided for 30 s
    assert not t.available("b")
    now[0] += 30.1
    assert t.available("b")
    t.update("b", latency_fault.FAILURE_LATENCY_MS)  # a failure: 10 minutes
    now[0] += 599
    assert not t.available("b")
    t.update("b", 10)  # a good answer clears it at once
    assert t.available("b")


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_one_deadline_timer_per_connection_still_times_out_every_request(loop_kind):
    """Deadlines are swept by one timer per connection (not one per request): a shorter
    deadline than the armed one re-arms it, requests with equal deadlines all fail, answered
    and cancelled ones are forgotten, late answers are dropped, and the connection stays up."""

    async def handler(frame: Frame):
        delay = frame.header["delay"]
        if delay < 0:
            return None  # never answer
        await asyncio.sleep(delay)
        return frame.response(0, {"echo": frame.header["n"]})

    async def main():
        srv = await FakeServer(handler).start()
        pool = ConnectionPool()
        conn = await pool.get(srv.address)
        loop = asyncio.get_running_loop()
        # A long deadline arms the timer at 5 s; a shorter one must still fire on time.
        long = asyncio.ensure_future(conn.request(999, {"n": 0, "delay": -1}, timeout=5))
        await asyncio.sleep(0)
        t0 = loop.time()
        with pytest.raises(RequestTimeoutError, match="within 0.1 s"):
            await conn.request(999, {"n": 1, "delay": -1}, timeout=0.1)
        assert 0.09 <= loop.time() - t0 < 1.0
        # Many requests, same deadline: the unanswered all fail, the answered all succeed.
        futs = [conn.start_request(999, {"n": i, "delay": -1 if i % 2 else 0}, b"", 0.2)
                for i in range(40)]
        res = await asyncio.gather(*futs, return_exceptions=True)
        for i, r in enumerate(res):
            if i % 2:
                assert isinstance(r, RequestTimeoutError)
            else:
                assert r.header["echo"] == i
        # An answer after the deadline is dropped; a cancelled request leaves nothing behind.
        with pytest.raises(RequestTimeoutError):
            await conn.request(999, {"n": 98, "delay": 0.15}, timeout=0.05)
        cancelled = asyncio.ensure_future(conn.request(999, {"n": 99, "delay": -1}))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        await asyncio.sleep(0.2)  # the late answer of n=98 arrives and is ignored
        assert conn.in_flight == 1  # only the 5 s request
        long.cancel()
        await asyncio.gather(long, return_exceptions=True)
        assert conn.in_flight == 0
        ok = await conn.request(999, {"n": 5, "delay": 0})
        assert ok.header["echo"] == 5 and not conn.is_closed
        pool.close()
        await srv.close()

    if loop_kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(main())
    else:
        run(main())


def test_a_send_that_gets_no_answer_times_out_and_is_retried():
    """The producer's own deadline (send_timeout covers every attempt) fires on the
    connection's deadline timer; each attempt re-sends the same sequence."""
    seen: list[int] = []

    async def broker(frame: Frame):
        seen.append(BatchView(frame.body).base_seq)
        return None  # never answers

    async def main():
        b1 = await FakeServer(broker).start()
        route = _route({"b1": b1.address})

        async def namesrv(frame: Frame):
            return frame.response(0, route)

        ns = await FakeServer(namesrv).start()
        async with Producer(ns.address, send_timeout=0.3, retries=2) as p:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(RequestTimeoutError):
                await p.send(Message("t", b"x"))
            assert 0.25 <= loop.time() - t0 < 1.5
        assert len(seen) >= 1 and len(set(seen)) == 1
        for s in (b1, ns):
            await s.close()

    run(main())


@pytest.mark.parametrize("header", [
    SendMessageRequestHeader(producer_group="g", topic="t", queue_id=3, born_timestamp=17),
    {"n": 1}, b"\x81\xa1n\x01", bytearray(b"\x81\xa1n\x01"), None,
])
@pytest.mark.parametrize("body", [b"", b"x" * 100, bytearray(300), b"y" * (16 * 1024 + 1),
                                  memoryview(b"z" * 50)])
@pytest.mark.parametrize("flags", [0, 2])
def test_connection_frames_exactly_as_the_protocol_encodes(header, body, flags):
    """Connection frames small requests itself (one pack and one join); the bytes queued must
    be encode_frame's, whatever the header and body types, and bad frames still raise."""
    from tidemq.client.connection import Connection
    from tidemq.protocol.errors import LocalProtocolError
    from tidemq.protocol.frame import encode_frame

    async def main():
        conn = Connection("127.0.0.1:1")
        conn._write(42, 7, flags, header, body)
        assert b"".join(conn._wbuf) == encode_frame(Frame(42, 7, flags, header, body))
        with pytest.raises(LocalProtocolError):
            conn._write(70000, 7, 0, header, body)  # a code that does not fit u16
        small = Connection("127.0.0.1:1", max_frame_size=64)
        with pytest.raises(LocalProtocolError):
            small._write(42, 7, 0, header, b"x" * 100)

    run(main())


# -- SYSTEM_BUSY's retry hint and peers that stall ---------------------------------------------


def _busy(frame: Frame, retry_after_ms: int) -> Frame:
    return frame.response(ResponseCode.SYSTEM_BUSY, ErrorResponseHeader(
        message="busy", retry_after_ms=retry_after_ms))


def test_busy_hint_reaches_the_error():
    f = _busy(Frame.request(RequestCode.SEND_MESSAGE, 5), 250)
    with pytest.raises(BrokerError) as info:
        raise_for_error(f)
    assert info.value.code == "SYSTEM_BUSY" and info.value.retry_after == 0.25
    assert BrokerError.from_response(ResponseCode.SYSTEM_BUSY).retry_after == 0.0


def test_producer_waits_out_the_busy_hint_before_resending_to_the_same_broker():
    attempts: list[float] = []

    async def broker(frame: Frame):
        attempts.append(asyncio.get_running_loop().time())
        if len(attempts) == 1:
            return _busy(frame, 400)
        v = BatchView(frame.body)
        return frame.response(0, SendMessageResponseHeader(
            msg_id=v.unique_id(0), queue_id=frame.header.queue_id, queue_offset=0, count=1))

    async def main():
        b = await FakeServer(broker).start()
        route = _route({"b1": b.address})

        async def namesrv(frame: Frame):
            return frame.response(0, route)

        ns = await FakeServer(namesrv).start()
        async with Producer(ns.address, send_timeout=3) as p:
            r = await p.send(Message("t", b"x"))
        assert r.broker_name == "b1" and len(attempts) == 2
        assert attempts[1] - attempts[0] >= 0.38  # as asked, not at once

        # a hint past the send's deadline: the error at once, no pointless wait
        attempts.clear()

        async def always_busy(frame: Frame):
            attempts.append(0.0)
            return _busy(frame, 10_000)

        b.handler = always_busy
        async with Producer(ns.address, send_timeout=2) as p:
            t0 = asyncio.get_running_loop().time()
            with pytest.raises(BrokerError) as info:
                await p.send(Message("t", b"x"))
            assert info.value.retry_after == 10.0
            assert asyncio.get_running_loop().time() - t0 < 1.0 and len(attempts) == 1
        await b.close()
        await ns.close()

    run(main())


def test_route_query_waits_out_a_busy_name_server():
    asked: list[float] = []

    async def namesrv(frame: Frame):
        asked.append(asyncio.get_running_loop().time())
        if len(asked) == 1:
            return _busy(frame, 300)
        return frame.response(0, _route({"b1": "127.0.0.1:1"}))

    async def main():
        srv = await FakeServer(namesrv).start()
        pool = ConnectionPool()
        routes = RouteCache(pool, [srv.address])
        r = await routes.get("t")
        assert r.write_queues and len(asked) == 2 and asked[1] - asked[0] >= 0.28
        pool.close()
        await srv.close()

    run(main())


def test_a_peer_that_stops_mid_frame_is_dropped_not_held():
    """A response whose prefix promises 8 MiB and then nothing: the request times out, and
    since the frame started before the request was sent the connection is closed (the bytes
    held are released) instead of waiting for the rest forever."""
    async def server(frame: Frame):
        head = FRAME_PREFIX.pack(8 * 1024 * 1024 - 4, FRAME_MAGIC, FRAME_VERSION, FLAG_RESPONSE,
                                 0, 0, frame.opaque, 0)
        return head + bytes(100_000)

    async def main():
        srv = await FakeServer(server).start()
        pool = ConnectionPool()
        conn = await pool.get(srv.address)
        with pytest.raises(RequestTimeoutError):  # the frame starts: it was sent before
            await conn.request(RequestCode.GET_BROKER_RUNTIME_INFO, EmptyHeader(), timeout=0.3)
        assert not conn.is_closed  # the frame began after that request was sent
        with pytest.raises((RequestTimeoutError, ConnectionLostError)):
            await conn.request(RequestCode.GET_BROKER_RUNTIME_INFO, EmptyHeader(), timeout=0.3)
        await asyncio.sleep(0.05)
        assert conn.is_closed
        with pytest.raises(ConnectionLostError, match="stopped sending in the middle"):
            await conn.request(RequestCode.GET_BROKER_RUNTIME_INFO, EmptyHeader())
        assert conn._decoder.buffered == 0
        assert conn._frame_view is None and conn._frame_buf is None  # nothing of it is held
        pool.close()
        await srv.close()

    run(main())


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_large_responses_arrive_whole_whatever_the_reads(seed):
    """Responses larger than one read (received into one buffer of the frame's size) mixed with
    small ones, written in pieces cut at random points (prefixes split too, several frames in
    one piece): every response arrives byte for byte, in order. The large-frame buffer is kept
    for the next large frame up to KEEP_FRAME_BUFFER, and a larger frame's is not kept."""
    import random

    rnd = random.Random(seed)
    read = connection_mod.READ_SIZE
    keep = connection_mod.KEEP_FRAME_BUFFER
    sizes = [10, read * 5, 0, read + 1, 3, keep + 12345, read * 3, 77]
    bodies = [rnd.randbytes(n) for n in sizes]

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        dec = FrameDecoder()
        frames: list[Frame] = []
        want = len(bodies)  # answered together once all of them are in, then one at a time
        while data := await reader.read(65536):
            frames += dec.feed(data)
            if len(frames) < want:
                continue
            wire = b"".join(encode_frame(f.response(0, {"i": f.header["i"]},
                                                    bodies[f.header["i"]])) for f in frames)
            frames, want = [], 1
            pos = 0
            while pos < len(wire):
                n = rnd.choice([1, 7, 20, 1000, read - 1, read + 9, 300_000])
                writer.write(wire[pos : pos + n])
                pos += n
                await writer.drain()
                if rnd.random() < 0.3:
                    await asyncio.sleep(0.001)  # let the client read what is there

    async def main():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        host, port = server.sockets[0].getsockname()[:2]
        pool = ConnectionPool()
        conn = await pool.get(f"{host}:{port}")
        got = await asyncio.gather(*(conn.request(999, {"i": i}, timeout=20)
                                     for i in range(len(bodies))))
        for i, frame in enumerate(got):
            assert frame.header["i"] == i
            assert bytes(frame.body) == bodies[i], f"response {i} ({sizes[i]} bytes) differs"
        assert conn._frame_view is None and conn._decoder.buffered == 0
        kept = conn._frame_buf
        assert kept is not None and len(kept) <= keep  # the largest frame's buffer was not kept
        again = await conn.request(999, {"i": 1}, timeout=20)  # another large one ...
        assert bytes(again.body) == bodies[1]
        assert conn._frame_buf is kept  # ... received into the kept buffer
        pool.close()
        server.close()

    run(main())


def test_a_corked_pool_writes_at_flush_now_and_schedules_nothing():
    """cork(): a frame written meanwhile goes out at flush_now, with no end-of-iteration write
    scheduled (the blocking facade's hand-over); after flush_now writes are scheduled as
    before (nothing stays corked), even when a connection's write raises."""

    async def handler(frame: Frame):
        return frame.response(0, {"echo": frame.header["n"]})

    async def main():
        srv = await FakeServer(handler).start()
        pool = ConnectionPool()
        conn = await pool.get(srv.address)
        loop = asyncio.get_running_loop()
        scheduled: list[object] = []
        real_call_soon = loop.call_soon

        def call_soon(cb, *args, **kw):
            scheduled.append(cb)
            return real_call_soon(cb, *args, **kw)

        loop.call_soon = call_soon  # type: ignore[method-assign]
        try:
            pool.cork()
            fut = conn.start_request(999, {"n": 1})
            assert conn._wbuf and not scheduled  # queued, nothing scheduled
            pool.flush_now()
            assert not conn._wbuf  # written by flush_now itself
            assert (await fut).header["echo"] == 1
            del scheduled[:]
            # uncorked: the next frame is written at the end of the loop iteration again
            fut = conn.start_request(999, {"n": 2})
            assert conn._flush in scheduled
            assert (await fut).header["echo"] == 2
        finally:
            loop.call_soon = real_call_soon  # type: ignore[method-assign]
        # a write that raises at flush_now leaves no connection corked
        other = await pool.get(srv.address)
        assert other is conn
        pool.cork()
        conn.start_request(999, {"n": 3})

        def boom() -> None:
            raise RuntimeError("write failed")

        conn.flush_now = boom  # type: ignore[method-assign]
        with pytest.raises(RuntimeError):
            pool.flush_now()
        assert not conn._corked and not conn._flush_scheduled
        del conn.flush_now
        pool.close()
        await srv.close()

    run(main())


def test_drain_lets_waiters_write_one_at_a_time_into_a_full_transport():
    """Many senders wait for a full transport (a send_async backlog): each writes only when
    the buffer is below its mark, so it never holds more than about one frame over the mark
    (it once returned to all of them at once, and a backlog's frames were buffered
    together: their send timeouts ran while they waited in the client)."""

    async def main():
        release = asyncio.Event()

        async def slow_reader(reader, writer):
            await release.wait()
            while await reader.read(256 << 10):
                await asyncio.sleep(0.002)
            writer.close()

        srv = await asyncio.start_server(slow_reader, "127.0.0.1", 0)
        addr = f"127.0.0.1:{srv.sockets[0].getsockname()[1]}"
        conn = await ConnectionPool().get(addr)
        transport = conn._transport
        high = transport.get_write_buffer_limits()[1]
        big = b"x" * (1 << 20)
        while conn.writable:  # fill the socket and the transport past its mark
            conn.send_oneway(999, None, big)
            await asyncio.sleep(0)
        buffered: list[int] = []

        async def sender():
            await conn.drain()
            conn.send_oneway(999, None, big)
            buffered.append(transport.get_write_buffer_size())
            await asyncio.sleep(0)
            buffered.append(transport.get_write_buffer_size())

        waiters = [asyncio.create_task(sender()) for _ in range(8)]
        await asyncio.sleep(0.05)
        assert buffered == []  # nobody writes into a full transport
        release.set()
        await asyncio.wait_for(asyncio.gather(*waiters), 60)
        assert max(buffered) <= high + len(big) + 1024, (high, buffered)
        conn.close()
        srv.close()

    run(main())
