"""ProcessQueue: what a push consumer holds of one queue (RocketMQ's ProcessQueue; ref CO3).

Messages pulled but not yet consumed sit here, keyed by queue offset, until a listener has
consumed them (or they were sent back). The offset committed for the queue is always the
*smallest offset still in flight* (or, when nothing is, the offset after the last message
pulled): a consumer that dies loses nothing, it only re-delivers what was in flight.

The dict keeps insertion order and pulls of one queue arrive in offset order, so its first key
is the minimum in-flight offset without any sorting (removal keeps the order of the rest).

Flow control reads ``msg_count``, ``msg_size`` and :meth:`max_span` (thresholds 1000 messages,
100 MiB and a span of 2000 offsets, checked by the pull service before every pull).

Chunked messages (PR5): :meth:`assemble` feeds pulled messages through the queue's
``ChunkAssembler`` (created at the first chunk seen), so listeners get whole messages. A
reassembled message sits here under the offset of its last chunk, and the offset committed never
passes the first chunk of a chunked message in flight or still being assembled
(:meth:`floor`): a consumer that dies re-reads every chunk of what it had not consumed.

Orderly consumption moves messages from ``msgs`` to ``consuming`` (:meth:`take_messages`) and
either commits them (:meth:`commit`) or puts them back to be consumed again
(:meth:`make_messages_to_consume_again`); ``locked`` / ``last_lock_ts`` mirror the broker lock.

Threads: the consumer's event loop only.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from tidemq.client.chunking import ChunkAssembler, first_chunk_offset, may_hold_chunks
from tidemq.client.message import MessageExt

__all__ = ["ProcessQueue", "LOCK_MAX_LIVE", "PULL_MAX_IDLE"]

#: A broker lock older than this on the client side is no longer trusted (RocketMQ 30 s).
LOCK_MAX_LIVE = 30.0
#: A queue not pulled for this long is dropped by the rebalance (RocketMQ 120 s).
PULL_MAX_IDLE = 120.0


class ProcessQueue:
    __slots__ = (
        "msgs", "msg_count", "msg_size", "queue_offset_max", "dropped", "locked",
        "last_lock_ts", "last_pull_ts", "last_consume_ts", "consuming", "orderly_running",
        "consume_lock", "batch_times", "local_retries", "try_unlock_times", "assembler",
        "chunk_starts", "standing",
    )

    def __init__(self) -> None:
        self.msgs: dict[int, MessageExt] = {}
        self.msg_count = 0
        self.msg_size = 0
        self.queue_offset_max = -1
        self.dropped = False
        self.locked = False
        self.last_lock_ts = 0.0
        now = time.monotonic()
        self.last_pull_ts = now
        #: held on the broker by a standing multi-queue pull (client/pull_driver.py): not
        #: pulled again until messages arrive, and not idle however long that takes
        self.standing = False
        self.last_consume_ts = now
        self.consuming: dict[int, MessageExt] = {}  # orderly: taken, not yet committed
        self.orderly_running = False  # orderly: a consume request is scheduled or running
        self.consume_lock = asyncio.Lock()  # orderly: held while a listener call runs
        self.batch_times: deque[tuple[int, float]] = deque()  # (first offset, put time)
        self.local_retries: dict[int, int] = {}  # orderly: offset -> local reconsume count
        self.try_unlock_times = 0
        self.assembler: ChunkAssembler | None = None
        #: offset of a reassembled message in flight -> offset of its first chunk
        self.chunk_starts: dict[int, int] = {}

    def assemble(self, msgs: list[MessageExt], expire_s: float) -> list[MessageExt]:
        """``msgs`` with chunks replaced by the whole messages they complete."""
        a = self.assembler
        if a is None:
            if not may_hold_chunks(msgs):
                return msgs
            a = self.assembler = ChunkAssembler(expire_s=expire_s)
        return a.feed(msgs)

    def floor(self, offset: int) -> int:
        """``offset`` lowered to the first chunk of a chunked message in flight or held."""
        if self.chunk_starts:
            offset = min(offset, min(self.chunk_starts.values()))
        a = self.assembler
        if a is not None:
            low = a.low_water()
            if low is not None and low < offset:
                offset = low
        return offset

    def put_messages(self, msgs: list[MessageExt]) -> bool:
        """Add pulled messages; True when an orderly consume request should be dispatched."""
        d = self.msgs
        chunks = self.assembler is not None  # no chunks seen on this queue: none to track
        if len(msgs) == 1 and not chunks:
            # One message, the usual pull of a queue at 10,000 queues with spread traffic
            # (issue 17): the same steps as below without a list built per step.
            m = msgs[0]
            off = m.queue_offset
            if off not in d:
                d[off] = m
                self.msg_count += 1
                self.msg_size += len(m.body)
                if off > self.queue_offset_max:
                    self.queue_offset_max = off
                self.batch_times.append((off, time.monotonic()))
            if self.orderly_running:
                return False
            self.orderly_running = True
            return True
        if not chunks and msgs and msgs[0].queue_offset > self.queue_offset_max:
            # Pulled past everything ever held (the usual case; a pull's messages come in
            # offset order): every message is new, added in order by one C-level update.
            new = len(msgs)
            size = sum([len(m.body) for m in msgs])
            d.update([(m.queue_offset, m) for m in msgs])
        else:
            size = 0
            new = 0
            for m in msgs:
                off = m.queue_offset
                if off not in d:
                    d[off] = m
                    new += 1
                    size += len(m.body)
                    if chunks:
                        first = first_chunk_offset(m)
                        if first is not None:
                            self.chunk_starts[off] = first
        if new:
            self.msg_count += new
            self.msg_size += size
            self.queue_offset_max = max(self.queue_offset_max, msgs[-1].queue_offset)
            self.batch_times.append((msgs[0].queue_offset, time.monotonic()))
        dispatch = bool(d) and not self.orderly_running
        if dispatch:
            self.orderly_running = True
        return dispatch

    def max_span(self) -> int:
        d = self.msgs
        if not d:
            return 0
        return self.queue_offset_max - next(iter(d))

    def remove_messages(self, msgs: list[MessageExt]) -> int:
        """Forget consumed messages; the offset to commit (-1 if nothing was ever held)."""
        d = self.msgs
        self.last_consume_ts = time.monotonic()
        starts = self.chunk_starts
        if len(msgs) == 1 and not starts:  # one message (see put_messages)
            m = d.pop(msgs[0].queue_offset, None)
            if m is not None:
                self.msg_count -= 1
                self.msg_size -= len(m.body)
        else:
            pop = d.pop
            # One comprehension (the messages actually held), not a loop of statements: this
            # runs once per consumed message on the consumer's event loop.
            gone = [m for m in msgs if pop(m.queue_offset, None) is not None]
            if starts:
                for m in gone:
                    starts.pop(m.queue_offset, None)
            self.msg_count -= len(gone)
            self.msg_size -= sum([len(m.body) for m in gone])
        if d:
            first = next(iter(d))
            bt = self.batch_times
            while len(bt) > 1 and bt[1][0] <= first:
                bt.popleft()
            return self.floor(first)
        self.batch_times.clear()
        return self.floor(self.queue_offset_max + 1) if self.queue_offset_max >= 0 else -1

    def oldest_age(self) -> float:
        """Seconds since the batch holding the smallest in-flight message was pulled."""
        if not self.msgs or not self.batch_times:
            return 0.0
        return time.monotonic() - self.batch_times[0][1]

    def first_message(self) -> MessageExt | None:
        d = self.msgs
        return d[next(iter(d))] if d else None

    # -- orderly -------------------------------------------------------------------------------
    def take_messages(self, n: int) -> list[MessageExt]:
        out: list[MessageExt] = []
        d = self.msgs
        while d and len(out) < n:
            off = next(iter(d))
            m = d.pop(off)
            self.consuming[off] = m
            out.append(m)
        if not out:
            self.orderly_running = False
        return out

    def commit(self) -> int:
        """Orderly: the taken messages are consumed; the offset to commit (-1 if none)."""
        c = self.consuming
        if not c:
            return -1
        last = max(c)
        self.msg_count -= len(c)
        self.msg_size -= sum(len(m.body) for m in c.values())
        for off in c:
            self.local_retries.pop(off, None)
            self.chunk_starts.pop(off, None)
        c.clear()
        if self.msgs:
            return self.floor(next(iter(self.msgs)))
        return self.floor(last + 1)

    def make_messages_to_consume_again(self, msgs: list[MessageExt]) -> None:
        """Orderly: put taken messages back, in front, and count a local retry each."""
        rest = self.msgs
        back = {}
        for m in msgs:
            off = m.queue_offset
            self.consuming.pop(off, None)
            back[off] = m
            self.local_retries[off] = self.local_retries.get(off, 0) + 1
        back.update(rest)
        self.msgs = dict(sorted(back.items()))

    def lock_expired(self) -> bool:
        return time.monotonic() - self.last_lock_ts > LOCK_MAX_LIVE

    def pull_expired(self) -> bool:
        return not self.standing and time.monotonic() - self.last_pull_ts > PULL_MAX_IDLE
