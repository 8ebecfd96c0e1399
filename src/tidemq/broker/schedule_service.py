"""Delay levels: RocketMQ's ScheduleMessageService (ref BR8).

A batch whose attributes carry delay level ``L`` (1..18 by default) is parked in an envelope
(``broker/envelope.py``) on ``SCHEDULE_TOPIC_XXXX``, queue ``L - 1``. Every message of one level
waits the same time, so each level queue is due in store order: only its head matters. Each
level has one progress offset (the next unit to deliver) and at most one loop timer, armed for
the head's due time ``store_ts + delay + 1 ms`` (store times are truncated to the millisecond:
the extra millisecond keeps delivery from ever being early). A level with nothing pending has
no timer; :meth:`hold` wakes it when a message arrives -- no polling loop.

Delivery puts the inner batch to its real topic/queue, then advances the level's offset. The
offsets table (``<config>/delay_offset.json``, written like consumer offsets: tmp, fsync,
rename, fsync dir) is persisted soon after each delivery burst and at shutdown. A crash
between a delivery and the next persist leaves a few delivered units before the persisted
offset; on start, :meth:`start` skips the due head units whose delivered copy the id index
already shows (``envelope.delivered_copy_exists``), so a restart neither loses nor doubles them.

Levels come from ``BrokerConfig.message_delay_level`` ("1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m
10m 20m 30m 1h 2h"; units ms, s, m, h, d). A level above the highest is clamped to it (RocketMQ).

Threads: the broker's event loop only (the offsets file is written from a worker thread).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from typing import TYPE_CHECKING

from tidemq.base.atomic_file import read_file, write_atomic
from tidemq.broker.envelope import REAL_QID, REAL_TOPIC, delivered_copy_exists, wrap
from tidemq.protocol.errors import CorruptBatchError, MessageTooLargeError, TidemqError
from tidemq.protocol.record import BatchView
from tidemq.store.message_store import GetStatus, MessageStore, PutResult

if TYPE_CHECKING:
    from tidemq.store.flush import FlushCallback

__all__ = ["SCHEDULE_TOPIC", "ScheduleMessageService", "parse_delay_levels"]

log = logging.getLogger(__name__)

SCHEDULE_TOPIC = "SCHEDULE_TOPIC_XXXX"
DELAY = "DELAY"
_UNITS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_BURST = 256  # deliveries per loop turn before yielding to other work


def parse_delay_levels(text: str) -> list[int]:
    """"1s 5s 1m" -> [1000, 5000, 60000] (ms); ValueError naming the bad item."""
    out = []
    for item in text.split():
        unit = "ms" if item.endswith("ms") else item[-1:]
        num = item[: -len(unit)]
        if unit not in _UNITS or not num.replace(".", "", 1).isdigit():
            raise ValueError(
                f"delay level {item!r} in message_delay_level is not a number followed by one "
                "of ms, s, m, h, d (e.g. '1s 5s 10s 30s 1m')"
            )
        out.append(int(float(num) * _UNITS[unit]))
    if not out:
        raise ValueError("message_delay_level needs at least one level")
    return out


class ScheduleMessageService:
    """One per broker. Event loop only."""

    def __init__(self, store: MessageStore, levels_ms: list[int], offsets_path: str) -> None:
        self.store = store
        self.levels_ms = levels_ms
        self.max_level = len(levels_ms)
        self.path = offsets_path
        #: Per level, the next queue offset to deliver ...
        self.offsets: dict[int, int] = {}
        #: ... and what is known to be delivered durably: only this is persisted, so a crash
        #: never skips a delivery that did not reach the disk (SYNC_FLUSH delivers without
        #: waiting for each fsync; a restart re-checks from here, _skip_delivered).
        self.durable_offsets: dict[int, int] = {}
        self.delivered = 0
        self.dropped = 0  # envelopes that could not be delivered (see _deliver)
        self.lateness_ms: list[int] = []  # recent (delivery - due), for stats and tests
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._persisting: asyncio.Task[None] | None = None
        self._dirty = False
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        raw = read_file(self.path)
        if raw:
            self.offsets = {int(k): int(v) for k, v in json.loads(raw)["offsets"].items()}
            self.durable_offsets = dict(self.offsets)
        for level in range(1, self.max_level + 1):
            self._skip_delivered(level)
            self._arm(level, 0)

    def close(self) -> None:
        """Cancel timers and persist the offsets (blocking; at shutdown)."""
        self._closed = True
        for t in self._timers.values():
            t.cancel()
        self._timers.clear()
        self.persist()

    def persist(self) -> None:
        self._dirty = False
        write_atomic(self.path, self._snapshot())

    def _snapshot(self) -> bytes:
        return json.dumps(
            {"offsets": {str(k): v for k, v in self.durable_offsets.items()}}
        ).encode()

    # -- holding ---------------------------------------------------------------------------------
    def hold(
        self, data: bytes | bytearray | memoryview, v: BatchView, queue_id: int,
        on_durable: FlushCallback | None,
    ) -> PutResult:
        """Park the batch on its level's queue (level clamped to the highest) and wake it."""
        level = min(v.delay_level, self.max_level)
        env = wrap(
            SCHEDULE_TOPIC, level - 1, data, real_topic=v.topic, real_qid=queue_id,
            producer_id=v.producer_id, base_seq=v.base_seq, count=v.count,
            born_ts=int(time.time() * 1000), extra={DELAY: str(level)},
        )
        r = self.store.put(env, queue_id=level - 1, on_durable=on_durable)
        if level not in self._timers and not self._closed:
            self._arm(level, 0)
        return r

    def pending(self) -> int:
        return sum(
            max(0, self.store.max_offset(SCHEDULE_TOPIC, lv - 1) - self.offsets.get(lv, 0))
            for lv in range(1, self.max_level + 1)
        )

    # -- delivering ------------------------------------------------------------------------------
    def _arm(self, level: int, delay_s: float) -> None:
        old = self._timers.pop(level, None)
        if old is not None:
            old.cancel()
        assert self._loop is not None
        self._timers[level] = self._loop.call_later(delay_s, self._run, level)

    def _due(self, v: BatchView, level: int) -> int:
        return v.store_ts + self.levels_ms[level - 1] + 1

    def _run(self, level: int) -> None:
        self._timers.pop(level, None)
        if self._closed:
            return
        store = self.store
        qid = level - 1
        off = self.offsets.get(level, 0)
        delivered = handled = 0
        try:
            while handled < _BURST:
                r = store.get_messages(SCHEDULE_TOPIC, qid, off, 32)
                if r.status is not GetStatus.FOUND:
                    if r.next_begin_offset > off and r.status in (
                            GetStatus.OFFSET_TOO_SMALL, GetStatus.NO_MATCHED_MESSAGE):
                        # retention removed the head, or the store skipped damaged units
                        # (quarantined, counted there): skip ahead
                        off = r.next_begin_offset
                        continue
                    break  # nothing pending: hold() wakes the level
                for rb in r.batches:
                    handled += 1
                    try:
                        v = BatchView(rb.data)
                    except CorruptBatchError as exc:
                        self._drop(level, rb.queue_offset, exc)
                        off = rb.queue_offset + 1
                        continue
                    now = time.time_ns() // 1_000_000
                    due = self._due(v, level)
                    if due > now:
                        self._arm(level, (due - now) / 1000)
                        return
                    if self._deliver(v, level, rb.queue_offset):
                        self.lateness_ms.append(now - due)
                        delivered += 1
                    off = rb.queue_offset + 1
                if r.next_begin_offset > off:
                    off = r.next_begin_offset
            else:
                self._arm(level, 0)  # a backlog: continue after other work had its turn
        except TidemqError as exc:  # the store refused for now (disk full, closing)
            log.error("delay level %d: delivery failed (%s); retrying in 1 s", level, exc)
            self._arm(level, 1.0)
        except Exception:  # a bug must not stop the level for good
            log.exception("delay level %d: delivery failed unexpectedly; retrying in 1 s", level)
            self._arm(level, 1.0)
        finally:
            if off != self.offsets.get(level, 0):
                self.offsets[level] = off
                self.delivered += delivered
                # One durability wait per burst, not one blocking fsync per delivery.
                store.when_durable(functools.partial(self._made_durable, level, off))
            if len(self.lateness_ms) > 100_000:
                del self.lateness_ms[:50_000]

    def _deliver(self, v: BatchView, level: int, queue_offset: int) -> bool:
        """Put the envelope's inner batch to its real queue (True). One that cannot be
        delivered because of what it holds (an unreadable envelope, an inner batch the store
        refuses as corrupt or too large) is dropped, counted and logged (False): the level
        moves on past it and never blocks on it, across restarts too. A store refusal for now
        raises (the level retries in 1 s)."""
        try:
            m = next(v.messages())
            qid = int(m.properties[REAL_QID])
            self.store.put(m.body, queue_id=qid, on_durable=_ignore_durable)
        except (CorruptBatchError, MessageTooLargeError, KeyError, ValueError) as exc:
            self._drop(level, queue_offset, exc)
            return False
        return True

    def _drop(self, level: int, queue_offset: int, exc: Exception) -> None:
        self.dropped += 1
        self.store.corrupt.skipped(
            "delay", f"{SCHEDULE_TOPIC} level {level} (queue {level - 1}) offset {queue_offset}",
            f"dropped: {exc}")

    def _made_durable(self, level: int, off: int, err: object) -> None:
        """The deliveries below ``off`` are durable (event loop, or inside the call under
        ASYNC_FLUSH): record and persist the progress."""
        if err is not None:
            log.error("delay level %d: deliveries below %d may not be durable (%s); a restart "
                      "re-checks them", level, off, err)
            return
        if off > self.durable_offsets.get(level, 0):
            self.durable_offsets[level] = off
            self._schedule_persist()

    def _skip_delivered(self, level: int) -> None:
        """After a crash: advance past due head units whose delivery is already stored."""
        off = self.offsets.get(level, 0)
        now = time.time_ns() // 1_000_000
        while True:
            r = self.store.get_messages(SCHEDULE_TOPIC, level - 1, off, 1)
            if r.status is not GetStatus.FOUND:
                break
            try:
                v = BatchView(r.batches[0].data)
                if self._due(v, level) > now:
                    break
                m = next(v.messages())
                inner = BatchView(m.body)
                real_topic = m.properties[REAL_TOPIC]
            except (TidemqError, KeyError):
                break  # unreadable: _run reads it again and drops it
            if not delivered_copy_exists(self.store, inner.producer_id, inner.base_seq,
                                         real_topic, v.store_ts, inner.reconsume_times):
                break
            off = r.batches[0].queue_offset + 1
        if off != self.offsets.get(level, 0):
            log.info("delay level %d: %d delivered units found past the persisted offset",
                     level, off - self.offsets.get(level, 0))
            self.offsets[level] = off
            self.durable_offsets[level] = off  # the copies are in the recovered CommitLog
            self._dirty = True

    def _schedule_persist(self) -> None:
        self._dirty = True
        if self._persisting is None or self._persisting.done():
            assert self._loop is not None
            self._persisting = self._loop.create_task(self._persist_soon())

    async def _persist_soon(self) -> None:
        while self._dirty and not self._closed:
            self._dirty = False
            try:
                await asyncio.to_thread(write_atomic, self.path, self._snapshot())
            except OSError as exc:
                log.error("persisting delay offsets to %s failed: %s", self.path, exc)
                self._dirty = True
                await asyncio.sleep(1)


def _ignore_durable(err: object) -> None:
    """on_durable of a delivery: the burst's when_durable answers for all of them."""
