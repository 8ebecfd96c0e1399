"""A slave's link to its master (RocketMQ's HAClient; ref BR15; wire format ``protocol/ha.py``).

One thread: connect to the master's replication address, say hello (what this broker holds and
its epoch history), do what the welcome says (continue, cut a divergent tail, or start over at
the master's oldest byte), then read TRANSFER frames and hand their bytes to the store
(:class:`~tidemq.store.replica.ReplicaAppender`: whole records only, byte for byte at the same
offsets; the store dispatches them to its consume queues and index as a master's puts). After
every read that stored something, and at least every ``ha_heartbeat_interval_ms``, it
acknowledges its write position. A master silent for ``ha_housekeeping_interval_ms`` is given
up and the link reconnects (every second, to whatever address the name servers name as the
group's master by then).

Threads: its own; the callbacks it is given run on it and must hop to the event loop
themselves.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tidemq.broker.ha.epoch import EpochFile
from tidemq.broker.ha.master import read_message
from tidemq.broker.registration import parse_addr
from tidemq.protocol.errors import TidemqError
from tidemq.protocol.ha import (
    TRANSFER,
    HaAction,
    HaHello,
    HaWelcome,
    decode_transfer,
    encode_ack,
    encode_hello,
)
from tidemq.store.replica import ReplicaAppender

if TYPE_CHECKING:
    from tidemq.broker.config import BrokerConfig
    from tidemq.store.message_store import MessageStore

__all__ = ["MasterLink", "Refused"]

log = logging.getLogger(__name__)

_RECV = 4 << 20


class Refused(Exception):
    """The master refused this slave (its welcome named why)."""


class MasterLink:
    """Follows the master: see the module doc."""

    def __init__(
        self,
        store: MessageStore,
        cfg: BrokerConfig,
        epochs: EpochFile,
        *,
        broker_id: Callable[[], int],
        broker_addr: str,
        master_addr: Callable[[], str],
        on_reset: Callable[[str], object],
        on_meta_version: Callable[[int], object],
        on_connected: Callable[[bool], object],
        min_epoch: Callable[[], int] | None = None,
    ) -> None:
        self.store = store
        #: the newest epoch this slave knows of (election: the group's epoch in etcd); a master
        #: of an older epoch was replaced and is not followed (its bytes are not acknowledged)
        self.min_epoch = min_epoch or (lambda: 0)
        self.cfg = cfg
        self.epochs = epochs
        self.broker_id = broker_id
        self.broker_addr = broker_addr
        self.master_addr = master_addr
        self.on_reset = on_reset
        self.on_meta_version = on_meta_version
        self.on_connected = on_connected
        self.appender = ReplicaAppender(store)
        self.connected = False
        self.current_addr = ""
        self.master_broker_addr = ""
        self.master_role = ""
        self.master_max = 0  # the master's write position in the last frame heard
        self.master_ms = 0
        self.last_heard = 0.0  # monotonic
        self.meta_version = -1
        self.sessions = 0
        self.failures = 0
        self.refused = ""
        self.received_bytes = 0
        #: CommitLog bytes cut because the master never had them (a divergent tail)
        self.truncated_bytes = 0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._sock: socket.socket | None = None
        self._thread = threading.Thread(target=self._run, name="ha-client", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def kick(self) -> None:
        """The master's address may have changed: try it now rather than within a second."""
        self._wake.set()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def lag_bytes(self) -> int:
        return max(0, self.master_max - self.store.max_phys_offset) if self.master_max else -1

    # -- the loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            addr = self.master_addr()
            if not addr:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            try:
                self._session(addr)
                delay = 1.0
            except Refused as exc:
                self.refused = str(exc)
                log.error("master %s refused this slave: %s", addr, exc)
                delay = 5.0
            except (OSError, TidemqError, ValueError) as exc:
                if not self._stop.is_set():
                    level = logging.WARNING if self.failures == 0 else logging.DEBUG
                    log.log(level, "replication from master %s: %s", addr,
                            str(exc) or type(exc).__name__)
                self.failures += 1
                delay = 1.0
            except Exception:
                log.exception("replication from master %s failed", addr)
                delay = 1.0
            finally:
                if self.connected:
                    self.connected = False
                    self.on_connected(False)
                sock, self._sock = self._sock, None
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.close()
            self._wake.wait(delay)
            self._wake.clear()

    def _session(self, addr: str) -> None:
        cfg = self.cfg
        host, port = parse_addr(addr)
        sock = socket.create_connection((host, port), timeout=3.0)
        self._sock = sock
        if self._stop.is_set():
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        store = self.store
        cl = store.commitlog
        hello = HaHello(
            cluster_name=cfg.cluster_name, broker_name=cfg.broker_name,
            broker_id=self.broker_id(), broker_addr=self.broker_addr,
            segment_size=store.config.segment_size, min_offset=store.min_phys_offset,
            max_offset=store.max_phys_offset, empty=not cl.segments,
            epochs=list(self.epochs.entries),
        )
        sock.sendall(encode_hello(hello))
        welcome = read_message(sock)
        if not isinstance(welcome, HaWelcome):
            raise Refused("the master answered the hello with something else")
        if welcome.error:
            raise Refused(welcome.error)
        self._check_epoch(welcome.epochs[-1][0] if welcome.epochs else 0, addr)
        self._apply(welcome)
        self.refused = ""
        self.current_addr = addr
        self.master_broker_addr = welcome.master_addr
        self.master_role = welcome.master_role
        self.master_max = welcome.master_max
        self.sessions += 1
        self.failures = 0
        self.connected = True
        self.last_heard = time.monotonic()
        self.on_connected(True)
        log.info("following master %s (%s) from CommitLog offset %d (%s)", addr,
                 welcome.master_role, store.max_phys_offset, welcome.action.value)
        self._stream(sock)

    @property
    def _min_epoch(self) -> int:
        return self.min_epoch()

    def _check_epoch(self, epoch: int, addr: str) -> None:
        known = self.min_epoch()
        if epoch < known:
            raise ConnectionError(
                f"master {addr} is at epoch {epoch} but the group is at epoch {known}: it was "
                "replaced, so this slave does not follow it"
            )

    def _apply(self, w: HaWelcome) -> None:
        store = self.store
        self.appender.reset()
        if w.action is HaAction.RESET:
            if store.commitlog.segments or store.max_phys_offset != w.offset:
                log.warning(
                    "starting over: the master holds [%d, %d) and this slave's CommitLog "
                    "[%d, %d) cannot continue it; copying everything from %d",
                    w.master_min, w.master_max, store.min_phys_offset, store.max_phys_offset,
                    w.offset,
                )
                store.reset_to(w.offset)
                self.on_reset("reset")
            self.epochs.replace(w.epochs)
        elif w.action is HaAction.TRUNCATE:
            if not self.cfg.ha_truncate_divergent:
                raise Refused(
                    f"this slave holds CommitLog bytes [{w.offset}, {store.max_phys_offset}) "
                    "that its master never had (written under an older master); "
                    "ha_truncate_divergent is off, so it does not follow -- turn it on, or "
                    "remove its data directory"
                )
            log.warning(
                "cutting the divergent tail [%d, %d) the master does not have (epochs: master "
                "%s, here %s)", w.offset, store.max_phys_offset, w.epochs, self.epochs.entries,
            )
            self.truncated_bytes += store.max_phys_offset - w.offset
            store.truncate_to(w.offset)
            self.on_reset("truncate")
            self.epochs.replace([e for e in w.epochs if e[1] <= w.offset])
        else:
            if w.offset != store.max_phys_offset:
                raise Refused(
                    f"the master would continue at {w.offset} but this slave ends at "
                    f"{store.max_phys_offset}"
                )
            self.epochs.replace([e for e in w.epochs if e[1] <= w.offset] or w.epochs[:1])

    def _stream(self, sock: socket.socket) -> None:
        cfg = self.cfg
        store = self.store
        heartbeat = cfg.ha_heartbeat_interval_ms / 1000
        silence = cfg.ha_housekeeping_interval_ms / 1000
        sock.settimeout(min(1.0, heartbeat))
        buf = bytearray(_RECV)
        mv = memoryview(buf)
        have = 0  # bytes in buf
        pos = 0  # next unparsed byte
        body_left = 0
        body_phys = 0
        appender = self.appender
        acked = store.max_phys_offset
        last_ack = 0.0

        def written(pos: int) -> None:
            # acknowledged as soon as the CommitLog has the bytes, before their dispatch (the
            # master's SYNC_MASTER sends wait for this, not for our consume queues)
            nonlocal acked, last_ack
            sock.sendall(encode_ack(pos, time.time_ns() // 1_000_000))
            acked = pos
            last_ack = time.monotonic()

        while not self._stop.is_set():
            now = time.monotonic()
            if now - last_ack >= heartbeat:
                sock.sendall(encode_ack(store.max_phys_offset, time.time_ns() // 1_000_000))
                last_ack = now
            try:
                k = sock.recv_into(mv[have:])
            except TimeoutError:
                if time.monotonic() - self.last_heard > silence:
                    raise TimeoutError(
                        f"nothing from the master for {silence:g} s (ha_housekeeping_interval_ms)"
                    ) from None
                continue
            if not k:
                raise ConnectionError("the master closed the replication connection")
            have += k
            self.received_bytes += k
            self.last_heard = time.monotonic()
            while pos < have:
                if body_left:
                    n = min(body_left, have - pos)
                    appender.feed(body_phys, mv[pos : pos + n], written)
                    body_phys += n
                    body_left -= n
                    pos += n
                    continue
                if have - pos < TRANSFER.size:
                    break
                t = decode_transfer(buf, pos)
                pos += TRANSFER.size
                self.master_max = t.master_max
                self.master_ms = t.master_ms
                if t.epoch < self._min_epoch:
                    self._check_epoch(t.epoch, self.current_addr)
                if t.epoch > self.epochs.last_epoch:
                    self.epochs.follow(t.epoch, t.epoch_start)
                if t.meta_version != self.meta_version:
                    # the first frame too: the sync at connect time may predate a change
                    self.meta_version = t.meta_version
                    self.on_meta_version(t.meta_version)
                body_left, body_phys = t.body_size, t.phys_offset
            # keep the unparsed tail at the front of the buffer
            if pos == have:
                pos = have = 0
            elif pos > len(buf) // 2 or have == len(buf):
                buf[: have - pos] = buf[pos:have]
                have -= pos
                pos = 0
            mx = store.max_phys_offset
            if mx != acked:
                acked = mx
                sock.sendall(encode_ack(mx, time.time_ns() // 1_000_000))
                last_ack = time.monotonic()

