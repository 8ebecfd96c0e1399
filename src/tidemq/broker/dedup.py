"""Message deduplication by producer name and sequence id (Pulsar's MessageDeduplication;
ref BR12, PR6; docs/producer-path.md).

A named producer stamps every batch with ``producer_id = dedup_producer_id(name)`` (bit 63 set)
and ``base_seq``; message ``i`` has sequence ``base_seq + i``. Per producer id this broker keeps

- ``pushed``: the highest sequence of a batch handed to the store (it may not be durable yet);
- ``persisted``: the highest sequence of a batch the store has made durable (SYNC_FLUSH: after
  the fsync; ASYNC_FLUSH: when the put returned -- the bytes are in the CommitLog mapping and
  survive a kill -9 of the broker, as every ASYNC_FLUSH write does).

and classifies each incoming batch (:meth:`check`), exactly as Pulsar's ``isDuplicate``::

    base_seq <= persisted              -> DUPLICATE  (acknowledged, not stored)
    persisted < base_seq <= pushed     -> UNCERTAIN  (RETRY_LATER: the first copy may still fail)
    otherwise                          -> NEW        (stored; pushed = base_seq + count - 1)

Producers without a name (random ids, bit 63 clear) are never looked at, so the table holds one
entry per producer *name*, not per producer instance.

Durability of the table (snapshot + replay): every ``snapshot_interval_s`` the table is copied
together with the CommitLog offset it covers; the copy is written (``<config>/dedup.json``,
tmp -> fsync -> rename -> fsync dir) only once the CommitLog is flushed past that offset, so a
snapshot never claims a sequence whose batch could be lost. At start the snapshot is loaded and
the CommitLog from its offset to the end is replayed batch by batch from the batch headers
(producer_id, base_seq, count): no message is decoded. Replay takes the maximum, so batches the
broker re-puts itself (retries, schedules) with an old sequence do no harm.

Inactive producers (Pulsar's brokerDeduplicationProducerInactivityTimeoutMinutes, 6 h): a
producer name not seen for ``inactivity_s`` is dropped from the table when the next snapshot is
taken, so names that are used once -- every Spark task attempt, say -- do not accumulate
forever. The last-seen time of each producer is kept in the snapshot (replayed batches count as
seen at their store time). A resend of a dropped producer's old sequence after that would be
stored again, exactly as in Pulsar; producers that come back later continue from sequence -1.

Threads: the broker's event loop only; the snapshot file is written in a worker thread.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from tidemq.base.atomic_file import read_file, write_atomic
from tidemq.broker.connection import decode_request
from tidemq.broker.errors import RequestRejected
from tidemq.protocol.batch.fields import dedup_fields_at
from tidemq.protocol.codes import ResponseCode
from tidemq.protocol.headers import (
    LastSequenceRequestHeader,
    LastSequenceResponseHeader,
    dedup_producer_id,
    is_dedup_producer,
)
from tidemq.protocol.record import BATCH_MAGIC, FILLER_MAGIC

if TYPE_CHECKING:
    from tidemq.broker.connection import BrokerConnection
    from tidemq.protocol.frame import Frame
    from tidemq.store.message_store import MessageStore

__all__ = ["MessageDeduplication", "DupStatus"]

log = logging.getLogger(__name__)



class DupStatus(enum.Enum):
    NEW = "new"
    DUPLICATE = "duplicate"
    UNCERTAIN = "uncertain"


class _Snapshot(msgspec.Struct):
    #: CommitLog offset this table covers: every batch before it is reflected.
    commitlog_offset: int
    #: producer id (decimal string: JSON keys) -> highest persisted sequence
    producers: dict[str, int] = {}
    written_at: int = 0
    #: producer id -> ms since the epoch it last sent (absent in files of older versions)
    last_seen: dict[str, int] = {}


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(_Snapshot)


class MessageDeduplication:
    """Highest pushed / persisted sequence per named producer (event loop only)."""

    def __init__(self, path: str, *, enabled: bool = True, snapshot_interval_s: float = 10.0,
                 inactivity_s: float = 6 * 3600.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.enabled = enabled
        self.snapshot_interval_s = snapshot_interval_s
        self.inactivity_s = inactivity_s
        self._clock = clock
        self.pushed: dict[int, int] = {}
        self.persisted: dict[int, int] = {}
        #: producer id -> clock() when it last sent a batch (refreshed once per batch)
        self.last_seen: dict[int, float] = {}
        self.expired = 0  # producers dropped for inactivity
        self.duplicates = 0  # batches acknowledged without storing
        self.uncertain = 0  # batches answered RETRY_LATER
        self.replayed_batches = 0
        self.replay_seconds = 0.0
        self._pending: tuple[int, bytes] | None = None  # (covered offset, snapshot bytes)
        self._written_offset = -1  # offset covered by the snapshot last written periodically
        #: CommitLog offset the replay reached (a slave's table follows its replicated log)
        self.replayed_to = 0
        #: a slave: the table is folded from the replicated CommitLog before every snapshot
        self.follow_store = False
        self._writing: asyncio.Future[None] | None = None

    # -- the send path -------------------------------------------------------------------------
    def check(self, producer_id: int, base_seq: int, count: int) -> DupStatus:
        """Classify a batch and, when NEW, record it as pushed. Call only for batches that will
        be put right after (see :meth:`failed`)."""
        self.last_seen[producer_id] = self._clock()
        last = self.pushed.get(producer_id)
        if last is not None and base_seq <= last:
            if base_seq <= self.persisted.get(producer_id, -1):
                self.duplicates += 1
                return DupStatus.DUPLICATE
            self.uncertain += 1
            return DupStatus.UNCERTAIN
        self.pushed[producer_id] = base_seq + count - 1
        return DupStatus.NEW

    def persisted_up_to(self, producer_id: int, highest: int) -> None:
        """The batch ending at ``highest`` is durable."""
        if highest > self.persisted.get(producer_id, -1):
            self.persisted[producer_id] = highest

    def failed(self, producer_id: int) -> None:
        """A pushed batch was not stored (or its durability is unknown): forget what was
        pushed beyond the persisted sequence, so a resend is taken (Pulsar's
        resetHighestSequenceIdPushed)."""
        p = self.persisted.get(producer_id)
        if p is None:
            self.pushed.pop(producer_id, None)
        else:
            self.pushed[producer_id] = p

    def last_sequence(self, producer_id: int) -> int:
        return self.persisted.get(producer_id, -1)

    def handle_last_sequence(self, conn: BrokerConnection, frame: Frame) -> None:
        """GET_LAST_SEQUENCE."""
        h: LastSequenceRequestHeader = decode_request(frame, LastSequenceRequestHeader)
        if not h.producer_name:
            raise RequestRejected(
                ResponseCode.INVALID_ARGUMENT,
                "producer_name is empty; GET_LAST_SEQUENCE names a deduplicated producer",
            )
        pid = dedup_producer_id(h.producer_name)
        if frame.is_oneway:
            return
        conn.respond(frame.opaque, ResponseCode.SUCCESS,
                     LastSequenceResponseHeader(producer_id=pid,
                                                last_sequence_id=self.last_sequence(pid)))

    # -- recovery ------------------------------------------------------------------------------
    def recover(self, store: MessageStore) -> None:
        """Load the snapshot, then replay the CommitLog from the offset it covers."""
        t0 = time.perf_counter()
        start = store.min_phys_offset
        raw = read_file(self.path)
        if raw is not None:
            try:
                snap = _decoder.decode(raw)
                if snap.commitlog_offset > store.max_phys_offset:
                    # The CommitLog lost data the snapshot covers (a torn tail cut): trusting
                    # it would acknowledge resends of lost batches as duplicates.
                    raise ValueError(
                        f"it covers the CommitLog up to {snap.commitlog_offset} but the "
                        f"CommitLog ends at {store.max_phys_offset}"
                    )
                self.persisted = {int(k): v for k, v in snap.producers.items()}
                # Files without last_seen: the producers count as seen when the file was written.
                seen_ms = {int(k): v for k, v in snap.last_seen.items()}
                self.last_seen = {pid: seen_ms.get(pid, snap.written_at) / 1000
                                  for pid in self.persisted}
                start = max(start, snap.commitlog_offset)
            except (msgspec.DecodeError, ValueError) as exc:
                log.error("dedup snapshot %s is unreadable (%s); rebuilding it from the whole "
                          "CommitLog", self.path, exc)
                self.persisted = {}
                self.last_seen = {}
        self.replayed_batches = self._replay(store, start)
        self.pushed = dict(self.persisted)
        self.replay_seconds = time.perf_counter() - t0
        if self.replayed_batches or self.persisted:
            log.info("deduplication: %d producers, replayed %d batches from offset %d in %.3f s",
                     len(self.persisted), self.replayed_batches, start, self.replay_seconds)

    def _replay(self, store: MessageStore, start: int) -> int:
        """Fold the headers of every batch from ``start`` to the end into ``persisted``."""
        cl = store.commitlog
        end = cl.write_pos
        persisted = self.persisted
        last_seen = self.last_seen
        n = 0
        for seg, rel, _total, magic in cl.iter_positions(start):
            if seg.start + rel >= end:
                break
            if magic == FILLER_MAGIC:
                continue
            if magic != BATCH_MAGIC:
                break
            got = dedup_fields_at(memoryview(seg.mm), rel, seg.size)
            if got is None:
                break
            pid, base, count, stored_ms = got
            n += 1
            if not is_dedup_producer(pid):
                continue
            hi = base + count - 1
            if hi > persisted.get(pid, -1):
                persisted[pid] = hi
            last_seen[pid] = max(last_seen.get(pid, 0.0), stored_ms / 1000)
        self.replayed_to = end
        return n

    def catch_up(self, store: MessageStore) -> int:
        """A slave's table follows the CommitLog its master streams (the slave stores no
        sends of its own): fold the batches stored since the last replay; returns how many.
        After a promotion the table is then exactly what the old master's would be."""
        start = max(self.replayed_to, store.min_phys_offset)
        if store.max_phys_offset <= start:
            return 0
        n = self._replay(store, start)
        pushed = self.pushed
        for pid, hi in self.persisted.items():
            if hi > pushed.get(pid, -1):
                pushed[pid] = hi
        return n

    def rebuild(self, store: MessageStore) -> None:
        """Forget everything and replay the whole CommitLog (a slave whose log was cut or
        restarted: sequences of batches it no longer holds must not count as stored)."""
        self.pushed = {}
        self.persisted = {}
        self.last_seen = {}
        self._pending = None
        self.replayed_to = 0
        self.catch_up(store)

    # -- snapshots -----------------------------------------------------------------------------
    def expire_inactive(self) -> int:
        """Drop producers silent for ``inactivity_s`` whose every pushed batch is persisted."""
        horizon = self._clock() - self.inactivity_s
        gone = [pid for pid, seen in self.last_seen.items()
                if seen < horizon and self.pushed.get(pid, -1) <= self.persisted.get(pid, -1)]
        for pid in gone:
            self.last_seen.pop(pid, None)
            self.pushed.pop(pid, None)
            self.persisted.pop(pid, None)
        if gone:
            self.expired += len(gone)
            log.info("deduplication: dropped %d producers inactive for %.0f s", len(gone),
                     self.inactivity_s)
        return len(gone)

    def _take(self, store: MessageStore) -> tuple[int, bytes]:
        """The table and the CommitLog offset it covers (every put so far is in the table:
        both change only on the event loop)."""
        if self.follow_store:
            self.catch_up(store)  # a slave: the table covers what was replicated so far
        self.expire_inactive()
        offset = store.max_phys_offset
        seen = self.last_seen
        snap = _Snapshot(offset, {str(k): v for k, v in self.pushed.items()},
                         time.time_ns() // 1_000_000,
                         {str(k): int(seen.get(k, 0) * 1000) for k in self.pushed})
        return offset, _encoder.encode(snap)

    async def run_snapshots(self, store: MessageStore) -> None:
        """Every interval: write the previous copy if the CommitLog is durable past the offset
        it covers, then take a new copy."""
        while True:
            await asyncio.sleep(self.snapshot_interval_s)
            try:
                await self._snapshot_step(store)
            except OSError as exc:
                log.error("writing the dedup snapshot %s failed: %s", self.path, exc)

    async def _snapshot_step(self, store: MessageStore) -> None:
        pending = self._pending
        if pending is not None and store.flushed_phys_offset >= pending[0]:
            self._pending = None
            # Nothing stored since the snapshot on disk: it already covers this offset, and
            # the replay from it rebuilds the same table (an idle broker writes nothing).
            if pending[0] != self._written_offset:
                self._written_offset = -1
                await asyncio.to_thread(write_atomic, self.path, pending[1])
                self._written_offset = pending[0]
        # Written even with no named producer: the snapshot's offset is also where the next
        # start's replay begins (without it, every start replayed the whole CommitLog).
        if self._pending is None:
            self._pending = self._take(store)

    def save_now(self, store: MessageStore) -> None:
        """At shutdown, after the store flushed: the table as it is (blocking)."""
        store.flush()
        write_atomic(self.path, self._take(store)[1])

    def stats(self) -> dict[str, int | float]:
        return {
            "dedup_producers": len(self.pushed),
            "dedup_expired_producers": self.expired,
            "dedup_duplicates": self.duplicates,
            "dedup_uncertain": self.uncertain,
            "dedup_replayed_batches": self.replayed_batches,
            "dedup_replay_seconds": round(self.replay_seconds, 3),
        }
