"""The hostile side of `tidemq bench hostile`: a process holding many connections to a broker
or a name server, half of them never reading what they ask for, half sending frames that never
complete.

    python -m tidemq.bench.hostile_driver --target HOST:PORT --kind broker|namesrv \\
        --connections N [--topic T] [--partial-rate BYTES_PER_S] [--seconds S]

- *Non-readers* connect, stop reading their own socket and write requests (pulls of 32
  messages to a broker, route queries to a name server) as fast as the connection takes them:
  the server's answers pile up until it stops reading them.
- *Partial senders* write the prefix of a frame as large as the server accepts, then its body
  at ``--partial-rate`` bytes per second, never the last byte; when the server closes the
  connection (``partial_frame_timeout_ms``) they connect again.

Each socket's own kernel buffers are kept small (``--socket-buffer``, 64 KiB): on one machine
the attacker's buffers come out of the same kernel memory as the server's, and a thousand
connections with autotuned multi-megabyte buffers push the kernel into TCP memory pressure,
where it drops loopback packets and every connection -- the well-behaved one too -- stalls in
retransmission backoff. That measures the kernel, not the server.

It prints one JSON line once every connection is open and every non-reader is blocked (the
server stopped reading it: its first burst of answers has filled the socket buffers), with the
seconds that took; then once per second a JSON line of counters; it stops after ``--seconds``
or on SIGTERM. Runs on uvloop when installed.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import signal
import socket
import sys
import time
from collections.abc import Callable

from tidemq.protocol.codes import RequestCode
from tidemq.protocol.frame import (
    DEFAULT_MAX_FRAME_SIZE,
    FRAME_MAGIC,
    FRAME_PREFIX,
    FRAME_VERSION,
    Frame,
    encode_frame,
)
from tidemq.protocol.headers import (
    GetRouteInfoRequestHeader,
    PullMessageRequestHeader,
)

__all__ = ["main"]

#: Requests a non-reader writes per write call.
_BATCH_BYTES = 64 * 1024


class Counters:
    def __init__(self) -> None:
        self.requests_written = 0
        self.bytes_written = 0
        self.closed_by_server = 0
        self.reconnects = 0
        self.connect_failures = 0
        self.bytes_received = 0
        self.nonreaders_blocked = 0  # non-readers whose writes stopped at least once


class NonReader(asyncio.Protocol):
    """Writes requests, never reads (its own transport's reading is paused)."""

    def __init__(self, payload: bytes, per_payload: int, counters: Counters,
                 on_lost: asyncio.Future[None]) -> None:
        self.payload = payload
        self.per_payload = per_payload
        self.c = counters
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self.paused = False
        self.blocked = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        # Not in connection_made itself: uvloop starts reading right after it returns.
        asyncio.get_running_loop().call_soon(self._stop_reading)
        transport.set_write_buffer_limits(high=_BATCH_BYTES)  # type: ignore[attr-defined]
        self._pump()

    def _stop_reading(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def _pump(self) -> None:
        # One write per turn of the loop: while the server keeps reading, a loop here would
        # starve every other connection of this process.
        t = self.transport
        if t is not None and not self.paused and not t.is_closing():
            t.write(self.payload)
            self.c.requests_written += self.per_payload
            self.c.bytes_written += len(self.payload)
            if not self.paused:
                asyncio.get_running_loop().call_soon(self._pump)

    def pause_writing(self) -> None:
        self.paused = True
        if not self.blocked:
            self.blocked = True
            self.c.nonreaders_blocked += 1

    def resume_writing(self) -> None:
        self.paused = False
        asyncio.get_running_loop().call_soon(self._pump)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.c.closed_by_server += 1
        if not self.on_lost.done():
            self.on_lost.set_result(None)


class PartialSender(asyncio.Protocol):
    """Writes the prefix of the largest frame the server accepts, then its body slowly, never
    its last byte."""

    def __init__(self, rate: int, frame_size: int, counters: Counters,
                 on_lost: asyncio.Future[None]) -> None:
        self.rate = rate
        self.frame_size = frame_size
        self.c = counters
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self.sent = 0
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        total = self.frame_size - 4
        head = FRAME_PREFIX.pack(total, FRAME_MAGIC, FRAME_VERSION, 0, 0,
                                 RequestCode.SEND_MESSAGE, 1, 0)
        transport.write(head)  # type: ignore[attr-defined]
        self.sent = len(head)
        self.c.bytes_written += len(head)
        self._tick()

    def _tick(self) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        left = self.frame_size - 1 - self.sent  # never the last byte
        n = min(self.rate // 10, left)
        if n > 0:
            t.write(bytes(n))
            self.sent += n
            self.c.bytes_written += n
        self.timer = asyncio.get_running_loop().call_later(0.1, self._tick)

    def data_received(self, data: bytes) -> None:
        self.c.bytes_received += len(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.timer is not None:
            self.timer.cancel()
        self.c.closed_by_server += 1
        if not self.on_lost.done():
            self.on_lost.set_result(None)


def _payload(kind: str, topic: str) -> tuple[bytes, int]:
    if kind == "broker":
        frames = [
            encode_frame(Frame.request(
                RequestCode.PULL_MESSAGE, i + 1,
                PullMessageRequestHeader(consumer_group="hostile", topic=topic,
                                         queue_id=i % 4, queue_offset=0, max_msg_nums=32),
            ))
            for i in range(64)
        ]
    else:
        frames = [
            encode_frame(Frame.request(RequestCode.GET_ROUTEINFO_BY_TOPIC, i + 1,
                                       GetRouteInfoRequestHeader(topic=topic)))
            for i in range(64)
        ]
    one = b"".join(frames)
    reps = max(1, _BATCH_BYTES // len(one))
    return one * reps, 64 * reps


Factory = Callable[[], asyncio.BaseProtocol]


async def _connect(factory: Factory, host: str, port: int, bufsize: int) -> None:
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, bufsize)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, bufsize)
        sock.setblocking(False)
        await loop.sock_connect(sock, (host, port))
        await loop.create_connection(factory, sock=sock)
    except BaseException:
        sock.close()
        raise


async def _keep(factory: Callable[[asyncio.Future[None]], asyncio.BaseProtocol], host: str,
                port: int, bufsize: int, c: Counters,
                stop: asyncio.Event, ready: asyncio.Future[None] | None) -> None:
    """One hostile connection, reconnected whenever the server closes it."""
    loop = asyncio.get_running_loop()
    first = True
    while not stop.is_set():
        lost: asyncio.Future[None] = loop.create_future()
        try:
            await _connect(lambda lost=lost: factory(lost), host, port, bufsize)  # type: ignore[misc]
        except OSError:
            c.connect_failures += 1
            await asyncio.sleep(0.5)
            continue
        if first:
            first = False
            if ready is not None:
                ready.set_result(None)
        else:
            c.reconnects += 1
        stop_wait: asyncio.Future[bool] = asyncio.ensure_future(stop.wait())
        await asyncio.wait([lost, stop_wait],  # type: ignore[type-var]
                           return_when=asyncio.FIRST_COMPLETED)
        stop_wait.cancel()
        if not lost.done():
            return
        await asyncio.sleep(0.1)


async def _run(args: argparse.Namespace) -> None:
    host, _, port_s = args.target.rpartition(":")
    port = int(port_s)
    t_start = time.monotonic()
    c = Counters()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    payload, per = _payload(args.kind, args.topic)
    n_nonreaders = args.connections // 2
    n_partial = args.connections - n_nonreaders
    readies: list[asyncio.Future[None]] = []
    tasks = []
    for i in range(args.connections):
        ready = loop.create_future()
        readies.append(ready)
        factory: Callable[[asyncio.Future[None]], asyncio.BaseProtocol]
        if i < n_nonreaders:
            factory = functools.partial(NonReader, payload, per, c)
        else:
            factory = functools.partial(PartialSender, args.partial_rate, args.frame_size, c)
        tasks.append(loop.create_task(
            _keep(factory, host, port, args.socket_buffer, c, stop, ready)))
        if i % 100 == 99:
            await asyncio.sleep(0.01)  # do not overrun the server's accept backlog
    await asyncio.wait(readies, timeout=120)
    while c.nonreaders_blocked < n_nonreaders and time.monotonic() - t_start < 180:
        await asyncio.sleep(0.1)
    print(json.dumps({"ready": sum(f.done() for f in readies), "nonreaders": n_nonreaders,
                      "nonreaders_blocked": c.nonreaders_blocked, "partial_senders": n_partial,
                      "seconds_to_ready": round(time.monotonic() - t_start, 1)}), flush=True)
    t_end = time.monotonic() + args.seconds
    while not stop.is_set() and time.monotonic() < t_end:
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except TimeoutError:
            pass
        print(json.dumps(vars(c)), flush=True)
    stop.set()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--kind", choices=["broker", "namesrv"], required=True)
    p.add_argument("--connections", type=int, default=1000)
    p.add_argument("--topic", default="hostile")
    p.add_argument("--partial-rate", type=int, default=64 * 1024)
    p.add_argument("--frame-size", type=int, default=DEFAULT_MAX_FRAME_SIZE)
    p.add_argument("--seconds", type=float, default=3600)
    p.add_argument("--socket-buffer", type=int, default=64 * 1024)
    args = p.parse_args(argv)
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(_run(args))


if __name__ == "__main__":
    main(sys.argv[1:])
