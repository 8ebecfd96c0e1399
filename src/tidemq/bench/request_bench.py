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
"""

from __future__ import annotations

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


def bench_request(*, count: int = 20_000, inflight: int = 1, size: int | None = None,
                  rounds: int = 5, broker: str | None = None, pid: int | None = None,
                  options: tuple[str, ...] = (),
                  progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Broker CPU per one-message SEND_MESSAGE and its round trip (module docstring)."""
    from tidemq.bench.dev_process import DevProcess

    frames = _frames(size)
    dev = None
    tmp = None
    if broker is None:
        tmp = tempfile.TemporaryDirectory(prefix="tidemq-bench-request-")
        dev = DevProcess(tmp.name, *options).start()
        assert dev.proc is not None
        broker, pid = dev.broker, dev.proc.pid
    elif pid is None:
        raise ValueError("--broker needs --pid (whose CPU to measure)")
    host, port = broker.rsplit(":", 1)
    try:
        sock = socket.create_connection((host, int(port)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = _Reader(sock)
        # warm-up: creates the topic, fills the broker's caches
        for f in frames:
            sock.sendall(f)
            reader.read(1)
        if reader.errors:
            raise RuntimeError(f"the broker refused the benchmark's sends: {reader.first_error}")
        results = []
        for r in range(rounds):
            results.append(_round(sock, reader, frames, count, inflight, pid))
            if progress is not None:
                progress(r + 1)
        sock.close()
    finally:
        if dev is not None:
            dev.stop()
        if tmp is not None:
            tmp.cleanup()
    best = min(results, key=lambda r: r["broker_cpu_us_per_request"])
    out: dict[str, Any] = {
        "workload": "SEND_MESSAGE, 1 message per request, raw socket",
        "message": f"{size} B" if size is not None else "varied (100..2000 B, tag, key, 2 props)",
        "inflight": inflight,
        "requests_per_round": count,
        "rounds": rounds,
        "broker_cpu_us_per_request": round(best["broker_cpu_us_per_request"], 2),
        "broker_cpu_us_per_request_median": round(statistics.median(
            r["broker_cpu_us_per_request"] for r in results), 2),
        "requests_per_s": round(max(r["requests_per_s"] for r in results)),
        "errors": reader.errors,
    }
    if inflight == 1:
        out["rtt_p50_us"] = round(min(r["rtt_p50_us"] for r in results), 1)
        out["rtt_p99_us"] = round(min(r["rtt_p99_us"] for r in results), 1)
        out["rtt_mean_us"] = round(min(r["rtt_mean_us"] for r in results), 1)
    return out
