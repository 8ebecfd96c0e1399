"""A master's replication port: slaves connect, the CommitLog streams to them (RocketMQ's
HAService / HAConnection; SPEC BR15; the wire format is ``protocol/ha.py``).

::

    slave --connect--> HAServer (accept thread)
                          | one SlaveLink per slave, two threads:
                          |   writer: hello -> welcome, then TRANSFER frames: the bytes of one
                          |           segment from where the slave is, up to the write position
                          |           (os.sendfile from the segment file: no copy through Python)
                          |   reader: ACK frames -> acked offset, caught-up time, lag samples
                          v
                       in-sync set -> replicated offset -> SYNC_MASTER sends answered

Per transfer, not per message: the writer sends whatever is new in one frame (at most
``ha_transfer_batch_bytes``), so a burst of puts costs one frame. It sleeps when the slave has
everything and is woken by the store's dispatch listener (:meth:`HAServer.on_put`: one flag test
per put, a wake-up only when a writer sleeps), and sends a heartbeat frame when idle for
``ha_heartbeat_interval_ms``.

In sync (RocketMQ 4.9's haMaxGapNotInSync, RocketMQ 5's haMaxTimeSlaveNotCatchup): a slave
counts for SYNC_MASTER while it is connected, acknowledged within
``ha_housekeeping_interval_ms``, lags at most ``ha_max_gap_bytes`` and has held everything the
master had at some moment within the last ``ha_max_catchup_ms``. The replicated offset is the
``min_in_sync_replicas``-th highest acknowledged offset among those.

Threads: the accept thread, two per slave, and the callers: :meth:`on_put` on the putting
thread, the rest (status, replicated offset) from the broker's event loop. Shared fields are
single values written by one thread (the GIL makes each read and write whole).
"""

from __future__ import annotations

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

__all__ = ["HAServer", "SlaveLink", "plan_welcome", "recv_exact"]

log = logging.getLogger(__name__)

#: Below this, a transfer is sent with one sendmsg of header + bytes (one syscall); above it,
#: the header then os.sendfile from the segment file (no copy through the process).
_SENDMSG_MAX = 64 * 1024


def recv_exact(sock: socket.socket, n: int) -> bytes:
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


class SlaveLink:
    """One connected slave (see the module doc for its two threads)."""

    def __init__(self, server: HAServer, sock: socket.socket, peer: str) -> None:
        self.server = server
        self.sock = sock
        self.peer = peer
        self.hello: HaHello | None = None
        self.acked = -1
        self.start_offset = -1
        self.connected_at = time.monotonic()
        self.last_ack_at = self.connected_at
        self.caught_up_at = 0.0
        self.sent_bytes = 0
        self.transfers = 0
        self.next = 0
        #: (master write position a transfer was read up to, when): acked ones are dropped
        self._rounds: collections.deque[tuple[int, float]] = collections.deque()
        self.wake = threading.Event()
        self.waiting = False
        self.closed = False
        self._reader: threading.Thread | None = None
        self._writer = threading.Thread(target=self._serve, name=f"ha-send-{peer}", daemon=True)

    def start(self) -> None:
        self._writer.start()

    @property
    def name(self) -> str:
        h = self.hello
        return f"{h.broker_name}/{h.broker_id} ({self.peer})" if h else self.peer

    def close(self, why: str = "") -> None:
        if self.closed:
            return
        self.closed = True
        if why:
            log.warning("replication to slave %s stopped: %s", self.name, why)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()
        self.wake.set()
        self.server._forget(self)

    def join(self, timeout: float) -> None:
        for t in (self._writer, self._reader):
            if t is not None and t is not threading.current_thread() and t.is_alive():
                t.join(timeout)

    # -- writer ----------------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            self._handshake()
            if self.closed:
                return
            self._reader = threading.Thread(
                target=self._read_acks, name=f"ha-ack-{self.peer}", daemon=True
            )
            self._reader.start()
            self._stream()
        except (OSError, TidemqError, ValueError) as exc:
            self.close("" if self.closed or self.server.stopping else f"{exc}")
        except Exception:  # never let the thread die silently
            log.exception("replication to slave %s failed", self.name)
            self.close()

    def _handshake(self) -> None:
        srv = self.server
        self.sock.settimeout(srv.housekeeping_s)
        hello = read_message(self.sock)
        if not isinstance(hello, HaHello):
            raise RemoteProtocolError("a slave must start with a hello")
        self.hello = hello
        store = srv.store
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
        self.sock.sendall(encode_welcome(welcome))
        if error:
            log.error("refused slave %s: %s", self.name, error)
            self.close()
            return
        self.next = self.start_offset = offset
        log.info("slave %s joined: %s, streaming from %d (master at %d)", self.name,
                 action.value, offset, store.max_phys_offset)

    def _stream(self) -> None:
        srv = self.server
        store = srv.store
        cl = store.commitlog
        sock = self.sock
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        batch = srv.transfer_batch
        heartbeat = srv.heartbeat_s
        last_send = 0.0
        while not self.closed:
            end = cl.write_pos
            nxt = self.next
            now = time.monotonic()
            if nxt < end:
                try:
                    seg = cl.segment_for(nxt)
                except OffsetOutOfRangeError:
                    self.close(
                        f"it needs CommitLog offset {nxt}, which this master no longer holds "
                        f"(oldest {store.min_phys_offset}); it starts over when it reconnects"
                    )
                    return
                n = min(end, seg.end, nxt + batch) - nxt
                self._rounds.append((nxt + n, now))
                self._send(seg, nxt, n, end)
                self.next = nxt + n
                last_send = now
                continue
            if now - last_send >= heartbeat:
                self._send(None, nxt, 0, end)
                last_send = now
                continue
            self.waiting = True
            if cl.write_pos > nxt or self.closed:  # a put landed since we looked
                self.waiting = False
                continue
            self.wake.wait(min(1.0, heartbeat - (now - last_send)))
            self.wake.clear()
            self.waiting = False

    def _send(self, seg: Any, phys: int, n: int, end: int) -> None:
        srv = self.server
        header = encode_transfer(Transfer(
            n, phys, end, srv.epochs.last_epoch, srv.meta_version(), srv.epochs.last_start,
            time.time_ns() // 1_000_000,
        ))
        sock = self.sock
        if seg is None:
            sock.sendall(header)
            return
        rel = phys - seg.start
        try:
            pin = memoryview(seg.mm)  # keeps retention from unmapping and closing it meanwhile
        except ValueError:
            raise OffsetOutOfRangeError(f"segment {seg.path} was removed while sending") from None
        try:
            if n <= _SENDMSG_MAX or not srv.use_sendfile:
                parts = [header, pin[rel : rel + n]]
                total = len(header) + n
                sent = sock.sendmsg(parts)
                if sent < total:  # rare: the socket buffer was full
                    sock.sendall(b"".join(bytes(p) for p in parts)[sent:])
            else:
                sock.sendall(header)
                off, left = rel, n
                fd = sock.fileno()
                while left:
                    try:
                        k = os.sendfile(fd, seg.fd, off, left)
                    except BlockingIOError:  # the socket has a timeout, so it is non-blocking
                        if not select.select([], [sock], [], srv.housekeeping_s)[1]:
                            raise TimeoutError("the slave stopped reading") from None
                        continue
                    if not k:
                        raise ConnectionError("the slave stopped reading")
                    off += k
                    left -= k
        finally:
            pin.release()
        self.sent_bytes += n
        self.transfers += 1

    # -- reader ----------------------------------------------------------------------------
    def _read_acks(self) -> None:
        srv = self.server
        sock = self.sock
        buf = bytearray(ACK.size * 256)
        mv = memoryview(buf)
        have = 0
        try:
            while not self.closed:
                try:
                    k = sock.recv_into(mv[have:])
                except TimeoutError:
                    self.close(
                        f"no acknowledgement for {srv.housekeeping_s:g} s "
                        "(ha_housekeeping_interval_ms)"
                    )
                    return
                if not k:
                    self.close("" if self.closed else "the slave closed the connection")
                    return
                have += k
                last = None
                pos = 0
                while have - pos >= ACK.size:
                    last = decode_ack(buf, pos)
                    pos += ACK.size
                if pos:
                    buf[: have - pos] = buf[pos:have]
                    have -= pos
                if last is not None:
                    self._acked(last[0])
        except (OSError, TidemqError) as exc:
            self.close("" if self.closed or srv.stopping else str(exc))
        except Exception:
            log.exception("reading acknowledgements of slave %s failed", self.name)
            self.close()

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
            srv.record_lag(prev, now)
        srv.acked_changed()

    # -- state -------------------------------------------------------------------------------
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
    """Accepts slaves and serves them (see the module doc)."""

    def __init__(
        self,
        store: MessageStore,
        cfg: BrokerConfig,
        epochs: EpochFile,
        *,
        role: Callable[[], str],
        meta_version: Callable[[], int],
        broker_addr: str,
        on_acked: Callable[[], None],
    ) -> None:
        self.store = store
        self.epochs = epochs
        self.broker_name = cfg.broker_name
        self.broker_addr = broker_addr
        self.role = role
        self.meta_version = meta_version
        self.on_acked = on_acked
        self.transfer_batch = cfg.ha_transfer_batch_bytes
        self.heartbeat_s = cfg.ha_heartbeat_interval_ms / 1000
        self.housekeeping_s = cfg.ha_housekeeping_interval_ms / 1000
        self.max_gap_bytes = cfg.ha_max_gap_bytes
        self.max_catchup_s = cfg.ha_max_catchup_ms / 1000
        self.use_sendfile = True
        self.links: list[SlaveLink] = []  # replaced, never mutated (readers iterate freely)
        self.port = 0
        self.stopping = False
        #: recent replication lags (ms from store to acknowledgement), one per acknowledgement
        self.lag_samples: collections.deque[int] = collections.deque(maxlen=20_000)
        self._sock: socket.socket | None = None
        self._accept: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self, host: str, port: int) -> int:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(16)
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._accept = threading.Thread(target=self._accept_loop, name="ha-accept", daemon=True)
        self._accept.start()
        return self.port

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self.stopping:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                if self.stopping:
                    return
                time.sleep(0.1)
                continue
            link = SlaveLink(self, conn, f"{peer[0]}:{peer[1]}")
            with self._lock:
                self.links = [*self.links, link]
            link.start()

    def _forget(self, link: SlaveLink) -> None:
        with self._lock:
            self.links = [x for x in self.links if x is not link]
        self.acked_changed()

    def on_put(self, topic: str, queue_id: int, new_max: int, batch: object) -> None:
        """Store dispatch listener (the putting thread, inside the put lock): wake sleeping
        writers. A flag test per slave when they are busy, an Event.set when one sleeps."""
        for link in self.links:
            if link.waiting:
                link.waiting = False
                link.wake.set()

    def wake_all(self) -> None:
        for link in self.links:
            link.wake.set()

    def acked_changed(self) -> None:
        try:
            self.on_acked()
        except Exception:
            log.exception("replication acknowledgement callback failed")

    def record_lag(self, prev_acked: int, now: float) -> None:
        ts = _store_ts_from(self.store, prev_acked)
        if ts:
            self.lag_samples.append(max(0, time.time_ns() // 1_000_000 - ts))

    # -- queries (event loop) ------------------------------------------------------------------
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
                "connected_s": round(now - x.connected_at, 1),
            })
        return out

    def lag_percentiles(self) -> dict[str, int]:
        s = sorted(self.lag_samples)
        if not s:
            return {}
        n = len(s)
        return {"p50": s[n // 2], "p99": s[min(n - 1, (n * 99) // 100)], "max": s[-1]}

    def stop(self) -> None:
        self.stopping = True
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                self._sock.close()
        links = list(self.links)
        for link in links:
            link.close()
        if self._accept is not None:
            self._accept.join(2)
        for link in links:
            link.join(2)
