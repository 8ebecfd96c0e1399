"""A master's replication port: slaves connect, the CommitLog streams to them (RocketMQ's
HAService / HAConnection; ref BR15; the wire format is ``protocol/ha.py``).

::

    slave --connect--> HAServer (the broker's event loop)
                          | one SlaveLink (asyncio.Protocol) per slave:
                          |   hello -> welcome, then TRANSFER frames: the bytes of one segment
                          |   from where the slave is up to the write position
                          |   ACK frames in -> acked offset, caught-up time, lag samples
                          v
                       in-sync set -> replicated offset -> SYNC_MASTER sends answered

Per transfer, not per message: every put the loop makes marks the links dirty, and once per
loop iteration (``call_soon``) each link sends everything new in one frame of at most
``ha_transfer_batch_bytes``, written straight from the segment's mapping (one writev of header
and bytes; the transport keeps what the socket does not take, and ``pause_writing`` stops the
pump until it drained). An idle link sends a heartbeat frame every ``ha_heartbeat_interval_ms``.

Why the loop and not a thread per slave, as RocketMQ: on a busy broker a Python thread woken by
its socket waits for the GIL up to the interpreter's switch interval (5 ms), twice per SYNC_MASTER
round (a writer woken by a put, a reader woken by the acknowledgement). On the loop the round
costs no hand-off: the acknowledgement is read where the waiting sends are answered. A slave far
behind (a new or wiped one copying gigabytes) is different: there the bytes are sent with
``os.sendfile`` from the segment file in a worker thread, ``ha_sendfile_min_bytes`` at a time
(no copy through the process, the loop keeps serving), until it is near the tail again.

In sync (RocketMQ 4.9's haMaxGapNotInSync, RocketMQ 5's haMaxTimeSlaveNotCatchup): a slave
counts for SYNC_MASTER while it is connected, acknowledged within
``ha_housekeeping_interval_ms``, lags at most ``ha_max_gap_bytes`` and has held everything the
master had at some moment within the last ``ha_max_catchup_ms``. The replicated offset is the
``min_in_sync_replicas``-th highest acknowledged offset among those.

Threads: the broker's event loop; :meth:`HAServer.on_put` may be called on another putting
thread (it hops); the bulk sends run in the default executor.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tidemq.broker.ha.epoch import EpochFile, consistent_offset
from tidemq.protocol.errors import OffsetOutOfRangeError, RemoteProtocolError, TidemqError
from tidemq.protocol.ha import (
    ACK,
    MAX_MESSAGE,
    MESSAGE_PREFIX,
    HaAction,
    HaHello,
    HaWelcome,
    Transfer,
    decode_ack,
    decode_message,
    encode_transfer,
    encode_welcome,
)

if TYPE_CHECKING:
    from tidemq.broker.config import BrokerConfig
    from tidemq.store.message_store import MessageStore

__all__ = ["HAServer", "SlaveLink", "plan_welcome", "read_message", "recv_exact"]

log = logging.getLogger(__name__)

#: Most bytes one sendfile job sends before the link looks at its state again.
_BULK_MAX = 64 << 20


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from a blocking socket (the slave's handshake)."""
    buf = bytearray(n)
    mv = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(mv[got:])
        if not k:
            raise ConnectionError("the peer closed the replication connection")
        got += k
    return bytes(buf)


def read_message(sock: socket.socket) -> HaHello | HaWelcome:
    length, magic = MESSAGE_PREFIX.unpack(recv_exact(sock, MESSAGE_PREFIX.size))
    if not 4 <= length <= MAX_MESSAGE:
        raise RemoteProtocolError(f"replication handshake of {length} bytes is not plausible")
    return decode_message(magic, recv_exact(sock, length - 4))


def plan_welcome(
    hello: HaHello, *, broker_name: str, segment_size: int, epochs: list[tuple[int, int]],
    master_min: int, master_max: int,
) -> tuple[HaAction, int, str]:
    """(action, offset, error) for a slave's hello: where its stream starts and what it does
    first. See docs/cluster.md "Joining a master"."""
    if hello.broker_name != broker_name:
        return HaAction.APPEND, 0, (
            f"this is the master of {broker_name!r}, the slave belongs to {hello.broker_name!r}; "
            "check the slave's --name and its master address"
        )
    if hello.segment_size != segment_size:
        return HaAction.APPEND, 0, (
            f"segment sizes differ: master {segment_size}, slave {hello.segment_size}; start the "
            f"slave with -o store.segment_size={segment_size}"
        )
    if hello.empty or hello.max_offset <= hello.min_offset and not hello.epochs:
        return HaAction.RESET, master_min, ""
    point = consistent_offset(epochs, master_max, hello.epochs, hello.max_offset)
    if point is None:
        if not hello.epochs:
            return HaAction.APPEND, 0, (
                "the slave holds data but no epoch history, so nothing says it matches this "
                "master's; remove its data directory to make it copy everything"
            )
        return HaAction.APPEND, 0, (
            f"the slave's epochs {hello.epochs} share nothing with the master's {epochs}: its "
            "data is from another group; remove its data directory to make it a slave here"
        )
    end = hello.max_offset
    action = HaAction.APPEND
    if end > point:
        end, action = point, HaAction.TRUNCATE
    if end < master_min or end < hello.min_offset:
        return HaAction.RESET, master_min, ""
    return action, end, ""


class SlaveLink(asyncio.Protocol):
    """One connected slave (see the module doc)."""

    def __init__(self, server: HAServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.hello: HaHello | None = None
        self.acked = -1
        self.start_offset = -1
        self.connected_at = time.monotonic()
        self.last_ack_at = self.connected_at
        self.caught_up_at = 0.0
        self.sent_bytes = 0
        self.sendfile_bytes = 0
        self.transfers = 0
        self.next = 0
        self.streaming = False
        self.closed = False
        self._paused = False
        self._bulk = False
        self._last_send = 0.0
        self._buf = bytearray()
        #: (master write position a transfer was read up to, when): acked ones are dropped
        self._rounds: collections.deque[tuple[int, float]] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None

    @property
    def name(self) -> str:
        h = self.hello
        return f"{h.broker_name}/{h.broker_id} ({self.peer})" if h else self.peer

    # -- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        if peer:
            self.peer = f"{peer[0]}:{peer[1]}"
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server._add(self)
        self._timer = self.server.loop.call_later(self.server.housekeeping_s, self._tick)

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        try:
            if not self.streaming:
                if len(buf) < MESSAGE_PREFIX.size:
                    return
                length, magic = MESSAGE_PREFIX.unpack_from(buf)
                if not 4 <= length <= MAX_MESSAGE:
                    raise RemoteProtocolError(f"a hello of {length} bytes is not plausible")
                if len(buf) < 4 + length:
                    return
                hello = decode_message(magic, bytes(buf[8 : 4 + length]))
                del buf[: 4 + length]
                if not isinstance(hello, HaHello):
                    raise RemoteProtocolError("a slave must start with a hello")
                self._handshake(hello)
                if not self.streaming:
                    return
            n = len(buf) - len(buf) % ACK.size
            if n:
                acked = -1
                for pos in range(0, n, ACK.size):
                    acked = max(acked, decode_ack(buf, pos)[0])
                del buf[:n]
                self._acked(acked)
        except (TidemqError, ValueError) as exc:
            self.close(str(exc))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed and not self.server.stopping:
            log.warning("replication to slave %s stopped: %s", self.name,
                        exc or "the slave closed the connection")
        self._closed()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self.pump()

    # -- handshake and stream ------------------------------------------------------------------
    def _handshake(self, hello: HaHello) -> None:
        srv = self.server
        store = srv.store
        self.hello = hello
        action, offset, error = plan_welcome(
            hello, broker_name=srv.broker_name, segment_size=store.config.segment_size,
            epochs=srv.epochs.entries, master_min=store.min_phys_offset,
            master_max=store.max_phys_offset,
        )
        welcome = HaWelcome(
            error=error, action=action, offset=offset, epochs=list(srv.epochs.entries),
            master_role=srv.role(), master_addr=srv.broker_addr,
            master_min=store.min_phys_offset, master_max=store.max_phys_offset,
        )
        assert self.transport is not None
        self.transport.write(encode_welcome(welcome))
        if error:
            log.error("refused slave %s: %s", self.name, error)
            self.transport.close()
            self.closed = True
            return
        self.next = self.start_offset = offset
        self.streaming = True
        log.info("slave %s joined: %s, streaming from %d (master at %d)", self.name,
                 action.value, offset, store.max_phys_offset)
        self.pump()

    def pump(self) -> None:
        """Send what is new (loop thread): one frame per segment piece, until the transport
        asks to pause or the slave has everything."""
        if not self.streaming or self.closed or self._paused or self._bulk:
            return
        srv = self.server
        cl = srv.store.commitlog
        transport = self.transport
        assert transport is not None
        batch = srv.transfer_batch
        while not self._paused:
            end = cl.write_pos
            nxt = self.next
            if nxt >= end:
                return
            try:
                seg = cl.segment_for(nxt)
            except OffsetOutOfRangeError:
                self.close(
                    f"it needs CommitLog offset {nxt}, which this master no longer holds "
                    f"(oldest {srv.store.min_phys_offset}); it starts over when it reconnects"
                )
                return
            now = time.monotonic()
            left = min(end, seg.end) - nxt
            if (srv.sendfile_min and left >= srv.sendfile_min
                    and transport.get_write_buffer_size() == 0):
                self._start_bulk(seg, nxt, min(left, _BULK_MAX), end)
                return
            n = min(left, batch)
            rel = nxt - seg.start
            header = self._header(n, nxt, end)
            try:
                view = memoryview(seg.mm)[rel : rel + n]
            except ValueError:  # unmapped by retention meanwhile
                self.close(f"segment {seg.path} was removed while sending")
                return
            self._rounds.append((nxt + n, now))
            # the transport may keep the view until the socket took it (it pins the mapping)
            transport.writelines((header, view))
            self.next = nxt + n
            self.sent_bytes += n
            self.transfers += 1
            self._last_send = now

    def _header(self, n: int, phys: int, end: int) -> bytes:
        srv = self.server
        return encode_transfer(Transfer(
            n, phys, end, srv.epochs.last_epoch, srv.meta_version(), srv.epochs.last_start,
            time.time_ns() // 1_000_000,
        ))

    # -- bulk catch-up with sendfile ------------------------------------------------------------
    def _start_bulk(self, seg: Any, phys: int, n: int, end: int) -> None:
        assert self.transport is not None
        sock = self.transport.get_extra_info("socket")
        if sock is None:
            self.server.sendfile_min = 0  # no socket to sendfile into: always the loop path
            self.pump()
            return
        self._bulk = True
        self._rounds.append((phys + n, time.monotonic()))
        header = self._header(n, phys, end)
        fut = self.server.loop.run_in_executor(
            None, _sendfile, sock.fileno(), header, seg, phys - seg.start, n,
            self.server.housekeeping_s,
        )

        def done(f: asyncio.Future[None]) -> None:
            self._bulk = False
            exc = f.exception()
            if exc is not None:
                self.close(f"sending {n} bytes with sendfile failed: {exc}")
                return
            self.next = phys + n
            self.sent_bytes += n
            self.sendfile_bytes += n
            self.transfers += 1
            self._last_send = time.monotonic()
            self.pump()

        fut.add_done_callback(done)

    # -- acknowledgements ----------------------------------------------------------------------
    def _acked(self, acked: int) -> None:
        srv = self.server
        now = time.monotonic()
        prev = self.acked
        if acked > prev:
            self.acked = acked
        self.last_ack_at = now
        rounds = self._rounds
        t = None
        while rounds and rounds[0][0] <= acked:
            t = rounds.popleft()[1]
        if acked >= srv.store.max_phys_offset:
            t = now
        if t is not None and t > self.caught_up_at:
            self.caught_up_at = t
        if prev >= 0 and acked > prev:
            srv.record_lag(prev)
        srv.acked_changed()

    def _tick(self) -> None:
        """Heartbeat when idle; give up a slave silent for the housekeeping interval."""
        srv = self.server
        if self.closed:
            return
        now = time.monotonic()
        if now - self.last_ack_at > srv.housekeeping_s and not self._bulk:
            self.close(f"no acknowledgement for {srv.housekeeping_s:g} s "
                       "(ha_housekeeping_interval_ms)")
            return
        if (self.streaming and not self._bulk and not self._paused
                and now - self._last_send >= srv.heartbeat_s and self.transport is not None):
            self.transport.write(self._header(0, self.next, srv.store.max_phys_offset))
            self._last_send = now
        self.pump()
        self._timer = srv.loop.call_later(min(srv.heartbeat_s, 1.0), self._tick)

    # -- state ---------------------------------------------------------------------------------
    def close(self, why: str = "") -> None:
        if self.closed:
            return
        if why:
            log.warning("replication to slave %s stopped: %s", self.name, why)
        self.closed = True
        if self.transport is not None:
            self.transport.close()
        self._closed()

    def _closed(self) -> None:
        self.closed = True
        self.streaming = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.server._forget(self)

    def in_sync(self, now: float, write_pos: int) -> bool:
        srv = self.server
        return (
            not self.closed and self.acked >= 0
            and now - self.last_ack_at <= srv.housekeeping_s
            and write_pos - self.acked <= srv.max_gap_bytes
            and now - self.caught_up_at <= srv.max_catchup_s
        )

    def lag_ms(self) -> int:
        """Age of the oldest byte the slave does not have (0 when it has everything)."""
        store = self.server.store
        if self.acked < 0:
            return -1
        if self.acked >= store.max_phys_offset:
            return 0
        ts = _store_ts_from(store, self.acked)
        return max(0, time.time_ns() // 1_000_000 - ts) if ts else -1


def _sendfile(fd: int, header: bytes, seg: Any, rel: int, n: int, timeout: float) -> None:
    """Worker thread: ``header`` then ``n`` bytes of ``seg`` from ``rel`` into the non-blocking
    socket ``fd`` (the transport's; it writes nothing meanwhile)."""
    pin = memoryview(seg.mm)  # keeps retention from unmapping and closing the file meanwhile
    try:
        view = memoryview(header)
        while view:
            try:
                k = os.write(fd, view)
            except BlockingIOError:
                _wait_writable(fd, timeout)
                continue
            view = view[k:]
        off, left = rel, n
        while left:
            try:
                k = os.sendfile(fd, seg.fd, off, left)
            except BlockingIOError:
                _wait_writable(fd, timeout)
                continue
            if not k:
                raise ConnectionError("the slave stopped reading")
            off += k
            left -= k
    finally:
        pin.release()


def _wait_writable(fd: int, timeout: float) -> None:
    # poll, not select: a broker with many connections has descriptors past FD_SETSIZE (1024)
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    if not poller.poll(timeout * 1000):
        raise TimeoutError(f"the slave read nothing for {timeout:g} s")


def _store_ts_from(store: MessageStore, phys: int) -> int:
    """Store time of the first batch at or after ``phys`` (skipping a filler), 0 if none."""
    cl = store.commitlog
    for _ in range(2):
        try:
            return cl.read_batch(phys).store_ts
        except TidemqError:
            try:
                phys = cl.segment_for(phys).end
            except TidemqError:
                return 0
        except (ValueError, IndexError):
            return 0
    return 0


class HAServer:
    """Accepts slaves and serves them (see the module doc). Event loop only."""

    def __init__(
        self,
        store: MessageStore,
        cfg: BrokerConfig,
        epochs: EpochFile,
        *,
        loop: asyncio.AbstractEventLoop,
        role: Callable[[], str],
        meta_version: Callable[[], int],
        broker_addr: str,
        on_acked: Callable[[], None],
    ) -> None:
        self.store = store
        self.epochs = epochs
        self.loop = loop
        self.broker_name = cfg.broker_name
        self.broker_addr = broker_addr
        self.role = role
        self.meta_version = meta_version
        self.on_acked = on_acked
        self.transfer_batch = cfg.ha_transfer_batch_bytes
        self.sendfile_min = cfg.ha_sendfile_min_bytes
        self.heartbeat_s = cfg.ha_heartbeat_interval_ms / 1000
        self.housekeeping_s = cfg.ha_housekeeping_interval_ms / 1000
        self.max_gap_bytes = cfg.ha_max_gap_bytes
        self.max_catchup_s = cfg.ha_max_catchup_ms / 1000
        self.links: list[SlaveLink] = []
        self.port = 0
        self.stopping = False
        #: recent replication lags (ms from store to acknowledgement), one per acknowledgement
        self.lag_samples: collections.deque[int] = collections.deque(maxlen=20_000)
        self._server: asyncio.Server | None = None
        self._loop_thread = threading.get_ident()
        self._pump_scheduled = False

    async def start(self, host: str, port: int) -> int:
        self._loop_thread = threading.get_ident()
        self._server = await self.loop.create_server(
            lambda: SlaveLink(self), host, port, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def _add(self, link: SlaveLink) -> None:
        self.links = [*self.links, link]

    def _forget(self, link: SlaveLink) -> None:
        if link in self.links:
            self.links = [x for x in self.links if x is not link]
            self.acked_changed()

    def on_put(self, topic: str, queue_id: int, new_max: int, batch: object) -> None:
        """Store dispatch listener (the putting thread, inside the put lock): every link
        sends once this loop iteration's puts are done (one transfer for all of them)."""
        if self._pump_scheduled or not self.links:
            return
        self._pump_scheduled = True
        if threading.get_ident() == self._loop_thread:
            self.loop.call_soon(self._pump_all)
        else:
            try:
                self.loop.call_soon_threadsafe(self._pump_all)
            except RuntimeError:  # the loop is closed
                pass

    def _pump_all(self) -> None:
        self._pump_scheduled = False
        for link in self.links:
            link.pump()

    def acked_changed(self) -> None:
        try:
            self.on_acked()
        except Exception:
            log.exception("replication acknowledgement callback failed")

    def record_lag(self, prev_acked: int) -> None:
        ts = _store_ts_from(self.store, prev_acked)
        if ts:
            self.lag_samples.append(max(0, time.time_ns() // 1_000_000 - ts))

    # -- queries -------------------------------------------------------------------------------
    def in_sync_links(self) -> list[SlaveLink]:
        now = time.monotonic()
        wp = self.store.max_phys_offset
        return [x for x in self.links if x.in_sync(now, wp)]

    def replicated_offset(self, k: int) -> int:
        """Offset that at least ``k`` in-sync slaves hold (-1 when fewer are in sync)."""
        acks = sorted((x.acked for x in self.in_sync_links()), reverse=True)
        return acks[k - 1] if len(acks) >= k else -1

    def status(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        wp = self.store.max_phys_offset
        out = []
        for x in self.links:
            h = x.hello
            out.append({
                "broker_id": h.broker_id if h else -1,
                "addr": h.broker_addr if h else "",
                "peer": x.peer,
                "acked_offset": x.acked,
                "lag_bytes": max(0, wp - x.acked) if x.acked >= 0 else -1,
                "lag_ms": x.lag_ms(),
                "in_sync": x.in_sync(now, wp),
                "sent_bytes": x.sent_bytes,
                "sendfile_bytes": x.sendfile_bytes,
                "connected_s": round(now - x.connected_at, 1),
            })
        return out

    def lag_percentiles(self) -> dict[str, int]:
        s = sorted(self.lag_samples)
        if not s:
            return {}
        n = len(s)
        return {"p50": s[n // 2], "p99": s[min(n - 1, (n * 99) // 100)], "max": s[-1]}

    async def stop(self) -> None:
        self.stopping = True
        if self._server is not None:
            self._server.close()
        for link in list(self.links):
            link.close()
