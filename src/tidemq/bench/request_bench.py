"""`tidemq bench request`: what one small send request costs the broker -- its CPU per request
and the round trip -- measured with a raw socket, so no client library is in the measure.

A `tidemq dev` child process (ASYNC_FLUSH, on a temporary directory) serves SEND_MESSAGE
frames of one message each, built once before the measure exactly as the producer builds them
(a header ``SendMessageRequestHeader``, a body of one batch: a varied message of
``bench/app_messages.py`` -- 100..2000 bytes, a tag, a key, two properties -- or ``--size``
bytes). The socket keeps ``INFLIGHT`` requests outstanding: 1 is one blocking send at a time
(every request its own read and write on the broker), more is a pipelined window on one
connection (the broker then reads several frames per wake-up, as under many coroutines).

Broker CPU is the run time of all the broker process's threads (``/proc/<pid>/task/*/
schedstat``, nanoseconds) over the measured requests; round trips are timed on the client
(``--inflight 1`` only). ``--broker HOST:PORT --pid PID`` measures a broker already running
(to profile it meanwhile, e.g. ``py-spy record --pid PID``). The best of ``ROUNDS`` rounds is
kept: the machine's other load only ever adds to a round.

The floor (``floor=True``, the default): the same rounds, in the same run, against the least a
Python server of the broker's design does per request -- an ``asyncio.BufferedProtocol`` on
uvloop in a process of its own that finds each whole frame by its length prefix and answers
it with the very bytes the broker answered (captured in the warm-up): one ``epoll_pwait``, one
``read`` and one ``write`` per request, as the broker's (strace), and no work between them.
What the broker costs above it is its own work; the floor itself is the kernel's and the
interpreter's, and on this kind of virtual machine it moves with the machine's load (an idle
CPU woken per request costs more than a busy one), which is why it is measured in the same
minutes rather than quoted.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import socket
import statistics
import struct
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgspec

from tidemq.bench.app_messages import fields
from tidemq.protocol.codes import RequestCode
from tidemq.protocol.frame import FRAME_PREFIX, Frame, encode_frame
from tidemq.protocol.headers import SendMessageRequestHeader
from tidemq.protocol.record import MessageData, encode_batch

__all__ = ["bench_request"]

_TOPIC = "BenchRequest"
_FRAMES = 1024  # distinct frames, sent round-robin


def _frames(size: int | None) -> list[bytes]:
    """Wire bytes of SEND_MESSAGE frames of one message each, as the producer sends them."""
    out = []
    now = int(time.time() * 1000)
    for i in range(_FRAMES):
        if size is None:
            body, tag, key, props = fields(i)
            msg = MessageData(body, tags=tag, keys=key, properties=props, born_ts=now)
        else:
            msg = MessageData(os.urandom(size), born_ts=now)
        batch = encode_batch(_TOPIC, [msg], queue_id=0, producer_id=42, base_seq=i,
                             born_host="127.0.0.1", born_port=40000)
        header = SendMessageRequestHeader(producer_group="bench_request", topic=_TOPIC,
                                          queue_id=0, born_timestamp=now)
        out.append(encode_frame(Frame(int(RequestCode.SEND_MESSAGE), i + 1, 0, header,
                                      bytes(batch))))
    return out


def _threads_ns(pid: int) -> dict[str, int]:
    """Run time of each live thread of ``pid`` so far, in nanoseconds, by thread id."""
    out: dict[str, int] = {}
    base = f"/proc/{pid}/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/schedstat") as f:
                out[tid] = int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended meanwhile
    return out


def _cpu_ns_since(pid: int, before: dict[str, int]) -> int:
    """CPU time of ``pid``'s threads since ``before`` (:func:`_threads_ns`), per thread: a
    thread that ended meanwhile takes its time with it, so summing all threads before and
    after could go negative (seen: a broker's short-lived worker thread ending in a round).
    What such a thread ran in the round is missed; a thread born in it counts from zero."""
    return sum(ns - before.get(tid, 0) for tid, ns in _threads_ns(pid).items())


class _Reader:
    """Reads whole response frames off a blocking socket; counts failures."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.errors = 0
        self.first_error = ""
        self.keep = False  # keep the last response frame's bytes (the warm-up, for the floor)
        self.last = b""

    def read(self, n: int) -> None:
        """Read ``n`` whole response frames."""
        while n:
            n -= self.read_some(n)

    def read_some(self, most: int) -> int:
        """Read at least one and at most ``most`` whole response frames, as many as have
        arrived; returns how many."""
        buf = self.buf
        unpack = FRAME_PREFIX.unpack_from
        got = 0
        pos = 0
        while got < most:
            if len(buf) - pos < 4 or len(buf) - pos < 4 + struct.unpack_from("<I", buf, pos)[0]:
                if got:
                    break
                buf = buf[pos:] + self._recv()
                pos = 0
                continue
            total, _m, _v, _f, _r, code, _o, hlen = unpack(buf, pos)
            if code != 0:
                self.errors += 1
                if not self.first_error:
                    self.first_error = f"code {code}: " + repr(
                        msgspec.msgpack.decode(buf[pos + 18 : pos + 18 + hlen]))
            if self.keep:
                self.last = bytes(buf[pos : pos + 4 + total])
            pos += 4 + total
            got += 1
        self.buf = buf[pos:]
        return got

    def _recv(self) -> bytes:
        data = self.sock.recv(1 << 16)
        if not data:
            raise ConnectionError("the broker closed the connection")
        return data


def _round(sock: socket.socket, reader: _Reader, frames: list[bytes], count: int,
           inflight: int, pid: int) -> dict[str, float]:
    rtts: list[float] = []
    nf = len(frames)
    clock = time.perf_counter_ns
    cpu0 = _threads_ns(pid)
    t0 = clock()
    if inflight == 1:
        send = sock.sendall
        read = reader.read
        for i in range(count):
            s = clock()
            send(frames[i % nf])
            read(1)
            rtts.append(clock() - s)
    else:
        window = min(inflight, count)
        sock.sendall(b"".join(frames[i % nf] for i in range(window)))
        sent = window
        done = 0
        while done < count:
            got = reader.read_some(count - done)
            done += got
            more = min(got, count - sent)
            if more > 0:  # refill the window with one write, as a client's coroutines would
                sock.sendall(b"".join(frames[(sent + i) % nf] for i in range(more)))
                sent += more
    wall = clock() - t0
    cpu = _cpu_ns_since(pid, cpu0)
    out = {"broker_cpu_us_per_request": cpu / count / 1000,
           "requests_per_s": count / (wall / 1e9)}
    if rtts:
        rtts.sort()
        out["rtt_p50_us"] = rtts[len(rtts) // 2] / 1000
        out["rtt_p99_us"] = rtts[int(len(rtts) * 0.99)] / 1000
        out["rtt_mean_us"] = statistics.fmean(rtts) / 1000
    return out


class _FloorProtocol(asyncio.BufferedProtocol):
    """One connection of the floor server: whole frames found by their 4-byte length prefix,
    each answered with ``answer``; nothing else (the module docstring's floor)."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.buf = bytearray(1 << 16)
        self.view = memoryview(self.buf)
        self.have = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.have == len(self.buf):  # a frame longer than the buffer: grow it
            self.view.release()
            self.buf.extend(bytes(len(self.buf)))
            self.view = memoryview(self.buf)
        return self.view[self.have :]

    def buffer_updated(self, nbytes: int) -> None:
        have = self.have + nbytes
        buf = self.buf
        pos = n = 0
        while have - pos >= 4:
            total = 4 + int.from_bytes(buf[pos : pos + 4], "little")
            if have - pos < total:
                break
            pos += total
            n += 1
        if pos:
            buf[: have - pos] = buf[pos:have]
            have -= pos
        self.have = have
        if n:
            assert self.transport is not None
            self.transport.write(self.answer if n == 1 else self.answer * n)


def _floor_main(conn: Any, answer: bytes) -> None:
    """The floor server's process: serve on 127.0.0.1 (the port goes back through ``conn``)
    until ``conn`` is written to or closed."""
    import uvloop  # the broker's event loop

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _FloorProtocol(answer), "127.0.0.1", 0)
        conn.send(server.sockets[0].getsockname()[1])
        stop = asyncio.Event()
        loop.add_reader(conn.fileno(), stop.set)
        await stop.wait()
        server.close()

    uvloop.run(serve())


def _measure(addr: str, pid: int, frames: list[bytes], count: int, inflight: int, rounds: int,
             tick: Callable[[], None]) -> tuple[list[dict[str, float]], _Reader]:
    """A warm-up (every frame once), then ``rounds`` rounds against the server at ``addr``."""
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = _Reader(sock)
        # warm-up: creates the topic, fills the broker's caches
        reader.keep = True
        for f in frames:
            sock.sendall(f)
            reader.read(1)
        reader.keep = False
        if reader.errors:
            raise RuntimeError(f"the broker refused the benchmark's sends: {reader.first_error}")
        results = []
        for _ in range(rounds):
            results.append(_round(sock, reader, frames, count, inflight, pid))
            tick()
    return results, reader


def _floor(answer: bytes, frames: list[bytes], count: int, inflight: int, rounds: int,
           tick: Callable[[], None]) -> list[dict[str, float]]:
    """The same rounds against the floor server (module docstring), in a process of its own."""
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_floor_main, args=(theirs, answer), daemon=True)
    proc.start()
    try:
        if not mine.poll(30):
            raise RuntimeError("the floor server did not start within 30 s")
        port = mine.recv()
        assert proc.pid is not None
        return _measure(f"127.0.0.1:{port}", proc.pid, frames, count, inflight, rounds, tick)[0]
    finally:
        mine.send(None)
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def _summary(results: list[dict[str, float]], inflight: int, prefix: str) -> dict[str, Any]:
    best = min(results, key=lambda r: r["broker_cpu_us_per_request"])
    out: dict[str, Any] = {
        f"{prefix}cpu_us_per_request": round(best["broker_cpu_us_per_request"], 2),
        f"{prefix}cpu_us_per_request_median": round(statistics.median(
            r["broker_cpu_us_per_request"] for r in results), 2),
        f"{prefix}requests_per_s": round(max(r["requests_per_s"] for r in results)),
    }
    if inflight == 1:
        for k in ("rtt_p50_us", "rtt_p99_us", "rtt_mean_us"):
            out[f"{prefix}{k}"] = round(min(r[k] for r in results), 1)
    return out


def bench_request(*, count: int = 20_000, inflight: int = 1, size: int | None = None,
                  rounds: int = 5, broker: str | None = None, pid: int | None = None,
                  options: tuple[str, ...] = (), floor: bool = True,
                  progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Broker CPU per one-message SEND_MESSAGE and its round trip, and (``floor``) the same
    against the floor server in the same run (module docstring). ``progress`` gets the rounds
    done so far, of ``rounds`` (twice that with the floor)."""
    from tidemq.bench.dev_process import DevProcess

    frames = _frames(size)
    done = [0]

    def tick() -> None:
        done[0] += 1
        if progress is not None:
            progress(done[0])

    dev = None
    tmp = None
    if broker is None:
        tmp = tempfile.TemporaryDirectory(prefix="tidemq-bench-request-")
        dev = DevProcess(tmp.name, *options).start()
        assert dev.proc is not None
        broker, pid = dev.broker, dev.proc.pid
    elif pid is None:
        raise ValueError("--broker needs --pid (whose CPU to measure)")
    try:
        results, reader = _measure(broker, pid, frames, count, inflight, rounds, tick)
    finally:
        if dev is not None:
            dev.stop()
        if tmp is not None:
            tmp.cleanup()
    out: dict[str, Any] = {
        "workload": "SEND_MESSAGE, 1 message per request, raw socket",
        "message": f"{size} B" if size is not None else "varied (100..2000 B, tag, key, 2 props)",
        "inflight": inflight,
        "requests_per_round": count,
        "rounds": rounds,
        **_summary(results, inflight, "broker_"),
        "errors": reader.errors,
    }
    # the names the figures had before the floor (requests_per_s, rtt_*: the broker's)
    out["requests_per_s"] = out.pop("broker_requests_per_s")
    for k in ("rtt_p50_us", "rtt_p99_us", "rtt_mean_us"):
        if f"broker_{k}" in out:
            out[k] = out.pop(f"broker_{k}")
    if floor:
        out.update(_summary(_floor(reader.last, frames, count, inflight, rounds, tick),
                            inflight, "floor_"))
        out["broker_cpu_us_above_floor"] = round(
            out["broker_cpu_us_per_request"] - out["floor_cpu_us_per_request"], 2)
    return out
