"""Delivery at any time, to the millisecond (ref BR8 "beyond"; RocketMQ 5's timer messages).

A batch whose ``deliver_at`` is in the future (at most ``timer_max_delay_ms`` ahead, 40 days by
default) is parked in an envelope (``broker/envelope.py``) on the timer topic
``rmq_sys_wheel_timer`` queue 0, and its due time goes into the durable time index
(``store/timer_log.py``: time-bucket files of fixed-size entries pointing at the envelope; only
the earliest bucket is in memory). One loop timer is armed for the earliest due time; a hold
with an earlier time re-arms it. When it fires, every entry due is delivered (the inner batch
put to its real topic/queue), then marked DONE in its bucket.

Never early: the timer is armed from the wall clock and, when it fires, entries are taken only
if ``deliver_at <= now`` (wall ms); a timer that fires early re-arms for the rest.

Restart (including kill -9): the timer topic's consume queue is the write-ahead record of every
hold. The TimerLog checkpoint says how many of its units are indexed; start-up re-indexes the
rest. Entries due before the crash that have no DONE mark are checked against the id index
(``envelope.delivered_copy_exists``): delivered ones are marked DONE, the others delivered. So a
restart neither loses nor doubles due messages.

Cancel: :meth:`cancel` finds the envelope by the message id the producer got back (the id
index), and appends a CANCEL entry if the entry is still pending -- and a cancellation record
(a message with ``deliver_at`` 0 naming the envelope) to the timer queue, so a restart's
re-indexing and a slave's copy of the CommitLog know of it too.

Threads: the broker's event loop only (checkpoints run in a worker thread; see TimerLog).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import TYPE_CHECKING

from tidemq.broker.envelope import (
    REAL_QID,
    REAL_TOPIC,
    delivered_copy_exists,
    find_envelopes,
    unwrap,
    wrap,
)
from tidemq.protocol.errors import (
    CorruptBatchError,
    MessageTooLargeError,
    OffsetOutOfRangeError,
    TidemqError,
)
from tidemq.protocol.record import BatchView, MessageData, encode_batch, parse_unique_id
from tidemq.store.message_store import GetStatus, MessageStore, PutResult
from tidemq.store.timer_log import TimerLog

if TYPE_CHECKING:
    from tidemq.store.flush import FlushCallback

__all__ = ["TIMER_TOPIC", "TimerMessageService"]

log = logging.getLogger(__name__)

TIMER_TOPIC = "rmq_sys_wheel_timer"
#: Properties of a cancellation record on the timer queue: the envelope's CommitLog offset,
#: due time and size (RocketMQ 5 records a timer deletion as a message too).
CANCEL_OF = "TIMER_CANCEL_OF"
CANCEL_AT = "TIMER_CANCEL_AT"
CANCEL_SIZE = "TIMER_CANCEL_SIZE"
_BURST = 512


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class TimerMessageService:
    """One per broker. Event loop only."""

    def __init__(
        self, store: MessageStore, directory: str, *, bucket_ms: int, checkpoint_ms: int,
    ) -> None:
        self.store = store
        self.dir = directory
        self.bucket_ms = bucket_ms
        self.checkpoint_ms = checkpoint_ms
        self.index: TimerLog | None = None
        self.delivered = 0
        self.dropped = 0  # held batches that could not be delivered (see _deliver_one)
        self.recovered_done = 0
        self._reindexed_due = 0  # latest due time re-indexed at start-up (ms)
        self.lateness_ms: list[int] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._armed_for: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------------
    def start(
        self, loop: asyncio.AbstractEventLoop, *, done_before: int | None = None
    ) -> None:
        """Open the index, re-index what it lacks, settle what is due, arm the timer.

        ``done_before``: a slave promoted to master (docs/cluster.md) built its index from the
        replicated timer queue, without the old master's DONE and CANCEL marks; the old master
        had delivered (or cancelled) everything due before this time (it sent it with its
        metadata), so those entries are marked DONE unread, and every later due entry is
        checked against the id index before it is delivered."""
        self._loop = loop
        self.index = idx = TimerLog(self.dir, self.bucket_ms)
        self._reindex()
        horizon = idx.heartbeat_ms + 2 * self.checkpoint_ms + 1000 if idx.heartbeat_ms else 0
        if horizon:
            # An idle broker skips its checkpoints (docs/storage.md), so the heartbeat may be
            # older than the crash; what can have been delivered since it was written was
            # either held after it (re-indexed just now) or due within the margin kept by
            # _checkpoint_forever: both are below the horizon.
            horizon = max(horizon, self._reindexed_due + 1)
        if done_before is not None:
            settled = 0
            while done_before > 0:
                batch = idx.pop_due(min(_now_ms(), done_before - 1), 4096)
                if not batch:
                    break
                for d, phys, size in batch:
                    idx.done(d, phys, size)
                settled += len(batch)
            if settled:
                log.info("timer: %d entries were settled by the old master", settled)
            horizon = _now_ms()
        # Due entries the crash may have delivered without their DONE mark reaching the file.
        # Nothing here may keep the broker from starting: an entry whose delivery fails (the
        # store refuses it for now) is given back and retried by the loop's timer.
        while horizon:
            batch = idx.pop_due(min(_now_ms(), horizon), 4096)
            if not batch:
                break
            for i, (d, phys, size) in enumerate(batch):
                try:
                    if self._already_delivered(phys):
                        idx.done(d, phys, size)
                        self.recovered_done += 1
                    else:
                        self._deliver_one(d, phys, size)
                except Exception as exc:  # noqa: BLE001 - a start-up must go on
                    idx.release(batch[i:])
                    log.error("timer: delivery at start-up failed (%s); retrying once started",
                              exc)
                    horizon = 0
                    break
        if horizon:
            idx.sync()  # before serving: the marks of what start-up delivered are durable
        if self.recovered_done:
            log.info("timer: %d entries were delivered before the crash", self.recovered_done)
        self._rearm()
        self._task = loop.create_task(self._checkpoint_forever(), name="timer-checkpoint")

    def _reindex(self) -> None:
        """Add the timer queue's units the index has not recorded (after a crash)."""
        idx = self.index
        assert idx is not None
        off = idx.indexed
        mx = self.store.max_offset(TIMER_TOPIC, 0)
        added = 0
        self._reindexed_due = 0
        while off < mx:
            r = self.store.get_messages(TIMER_TOPIC, 0, off, 1024)
            if r.status is not GetStatus.FOUND:
                if r.next_begin_offset > off:
                    off = r.next_begin_offset
                    continue
                break
            for rb in r.batches:
                v = BatchView(rb.data)
                if v.deliver_at:
                    idx.add(v.deliver_at, v.phys_offset, v.total_size)
                    self._reindexed_due = max(self._reindexed_due, v.deliver_at)
                else:  # a cancellation record (deliver_at 0: never held itself)
                    with contextlib.suppress(KeyError, ValueError, TidemqError):
                        props = next(v.messages()).properties
                        idx.cancel(int(props[CANCEL_AT]), int(props[CANCEL_OF]),
                                   int(props[CANCEL_SIZE]))
                off = rb.queue_offset + 1
                added += 1
        idx.indexed = off
        if added:
            idx.reload()
            log.info("timer: re-indexed %d held batches from the timer queue", added)

    async def stop(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.index is not None:
            self._checkpoint()
            self.index.close()

    def _checkpoint(self) -> None:
        idx = self.index
        assert idx is not None
        finished, idx.pending_deletes = idx.pending_deletes, []
        idx.save_checkpoint(_now_ms())
        idx.delete_finished(finished)

    async def _checkpoint_forever(self) -> None:
        idx = self.index
        assert idx is not None
        while True:
            await asyncio.sleep(self.checkpoint_ms / 1000)
            if self._idle(idx):
                continue
            finished, idx.pending_deletes = idx.pending_deletes, []
            try:
                await asyncio.to_thread(idx.save_checkpoint, _now_ms())
            except OSError as exc:
                log.error("timer checkpoint in %s failed: %s", self.dir, exc)
                idx.pending_deletes += finished
                continue
            idx.delete_finished(finished)

    def _idle(self, idx: TimerLog) -> bool:
        """Skip this checkpoint: nothing changed since the last one, and nothing pending
        comes due before two more intervals and a second (the heartbeat then still bounds a
        crash for every delivery made before the next write; see :meth:`start`)."""
        if not idx.unchanged():
            return False
        nd = idx.next_due()
        return nd is None or nd > _now_ms() + 2 * self.checkpoint_ms + 1000

    # -- holding ---------------------------------------------------------------------------------
    def hold(
        self, data: bytes | bytearray | memoryview, v: BatchView, queue_id: int,
        on_durable: FlushCallback | None,
    ) -> PutResult:
        """Park the batch until ``v.deliver_at``."""
        idx = self.index
        assert idx is not None
        at = v.deliver_at
        env = wrap(
            TIMER_TOPIC, 0, data, real_topic=v.topic, real_qid=queue_id,
            producer_id=v.producer_id, base_seq=v.base_seq, count=v.count,
            born_ts=_now_ms(), deliver_at=at,
        )
        r = self.store.put(env, queue_id=0, on_durable=on_durable)
        idx.add(at, r.phys_offset, r.size)
        idx.indexed = r.queue_offset + 1
        if not self._closed and (self._armed_for is None or at < self._armed_for):
            self._arm(at)
        return r

    def cancel(self, msg_id: str) -> bool:
        """Cancel the pending held batch holding message ``msg_id``; False when there is none
        (unknown id, already delivered or cancelled). ValueError for a malformed id."""
        idx = self.index
        assert idx is not None
        pid, seq = parse_unique_id(msg_id)
        for phys, m in find_envelopes(self.store, TIMER_TOPIC, pid, seq):
            v = self.store.read_batch(phys)
            if idx.is_pending(v.deliver_at, phys):
                idx.cancel(v.deliver_at, phys, v.total_size)
                # ... and in the CommitLog, the timer queue's write-ahead record: a restart
                # re-indexes it, a slave copies it (its index would deliver it otherwise)
                record = encode_batch(TIMER_TOPIC, [MessageData(b"", properties={
                    CANCEL_OF: str(phys), CANCEL_AT: str(v.deliver_at),
                    CANCEL_SIZE: str(v.total_size),
                }, born_ts=_now_ms())], queue_id=0)
                r = self.store.put(record, queue_id=0, on_durable=_ignore_durable)
                idx.indexed = max(idx.indexed, r.queue_offset + 1)
                del m
                return True
        return False

    # -- delivering ------------------------------------------------------------------------------
    def _arm(self, at: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
        assert self._loop is not None
        self._armed_for = at
        self._timer = self._loop.call_later(max(0.0, (at - _now_ms()) / 1000), self._fire)

    def _rearm(self) -> None:
        assert self.index is not None
        nd = self.index.next_due()
        if nd is None:
            self._armed_for = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        else:
            self._arm(nd)

    def _fire(self) -> None:
        self._timer = None
        self._armed_for = None
        if self._closed:
            return
        idx = self.index
        assert idx is not None
        now = _now_ms()
        batch = idx.pop_due(now, _BURST)
        put: list[tuple[int, int, int]] = []  # delivered: DONE once their put is durable
        try:
            for i, (d, phys, size) in enumerate(batch):
                try:
                    if self._deliver_one(d, phys, size):
                        put.append((d, phys, size))
                except Exception as exc:
                    # The store refused the put (disk full, closing) or a bug: the undelivered
                    # ones are due again (not lost until a restart). What a message holds
                    # never lands here (_deliver_one drops and counts it).
                    idx.release(batch[i:])
                    if isinstance(exc, TidemqError):
                        log.error("timer delivery failed (%s); retrying in 1 s", exc)
                    else:
                        log.exception("timer delivery failed unexpectedly; retrying in 1 s")
                    self._arm(_now_ms() + 1000)
                    return
                self.lateness_ms.append(now - d)
        finally:
            # The burst's deliveries are put without waiting for each fsync; their DONE marks
            # are written once the group commit covering them is done (at once under
            # ASYNC_FLUSH), so a mark never outlives its delivery in a crash. Until then the
            # entries stay handed out (never delivered twice by this process); a restart
            # checks unmarked entries against the id index.
            if put:
                self.store.when_durable(functools.partial(self._mark_done, put))
        if len(self.lateness_ms) > 100_000:
            del self.lateness_ms[:50_000]
        if len(batch) == _BURST:
            self._arm(0)  # more due: continue after other work had its turn
        else:
            self._rearm()

    def _mark_done(self, entries: list[tuple[int, int, int]], err: object) -> None:
        """DONE marks of delivered entries whose puts are durable (event loop, or inside the
        call under ASYNC_FLUSH). The marks reach the page cache at once (one write per
        bucket), so a kill -9 cannot lose them; a power loss before the timer log's next
        fsync can, which the restart's id-index check covers."""
        idx = self.index
        if err is not None:
            log.error("timer: %d deliveries may not be durable (%s); a restart re-checks them",
                      len(entries), err)
            return
        if idx is None or self._closed:
            return  # shutting down: the restart's id-index check marks them
        for d, phys, size in entries:
            idx.done(d, phys, size)
        for start in {idx.bucket_of(d) for d, _p, _s in entries}:
            idx.write_now(start)

    def _deliver_one(self, d: int, phys: int, size: int) -> bool:
        """Put the held batch to its real queue (True). A held batch that cannot be delivered
        because of what it holds -- an unreadable envelope, an inner batch the store refuses
        as corrupt or too large -- is dropped: counted, logged, marked DONE at once (False),
        so it never blocks the timer or a restart. A store refusal for now (disk full,
        closing) raises: the caller retries."""
        idx = self.index
        assert idx is not None
        try:
            m = unwrap(self.store, phys)
            qid = int(m.properties[REAL_QID])
            self.store.put(m.body, queue_id=qid, on_durable=_ignore_durable)
        except (CorruptBatchError, MessageTooLargeError, OffsetOutOfRangeError, KeyError,
                ValueError) as exc:
            self.dropped += 1
            self.store.corrupt.skipped(
                "timer", f"held batch at CommitLog offset {phys} (due {d})",
                f"dropped: {exc}")
            idx.done(d, phys, size)
            idx.write_now(idx.bucket_of(d))
            return False
        self.delivered += 1
        return True

    def _already_delivered(self, phys: int) -> bool:
        try:
            env = self.store.read_batch(phys)
            m = unwrap(self.store, phys)
            inner = BatchView(m.body)
            real_topic = m.properties[REAL_TOPIC]
        except (TidemqError, KeyError, ValueError):
            return False  # _deliver_one reads it again and drops what it cannot deliver
        return delivered_copy_exists(self.store, inner.producer_id, inner.base_seq,
                                     real_topic, env.store_ts, inner.reconsume_times)

    def done_before(self) -> int:
        """Every entry due before this (ms since the epoch) is delivered or cancelled: the
        earliest pending due time, or now when nothing is pending (a slave keeps it for its
        promotion, see :meth:`start`)."""
        idx = self.index
        nd = idx.next_due() if idx is not None else None
        now = _now_ms()
        return min(nd, now) if nd is not None else now

    def stats(self) -> dict[str, int]:
        idx = self.index
        if idx is None:
            return {}
        return {"timer_index_bytes": idx.memory_bytes(), "timer_added": idx.added,
                "timer_cancelled": idx.cancelled, "timer_recovered_done": self.recovered_done,
                "timer_dropped": self.dropped}

    def pending_buckets(self) -> int:
        return self.index.pending_files() if self.index else 0


def _ignore_durable(err: object) -> None:
    """on_durable of a delivery: the burst's when_durable marks them DONE."""
