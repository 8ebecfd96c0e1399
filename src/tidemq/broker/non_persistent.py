"""Non-persistent topics: never written to disk (Pulsar's NonPersistentTopic; ref BR13).

A topic whose name starts with ``%NP%`` (``NON_PERSISTENT_PREFIX``; RocketMQ marks its system
topics with ``%`` the same way, and Pulsar spells it ``non-persistent://``) is non-persistent:
its batches go to a bounded in-memory window per queue instead of the CommitLog, are stamped
with queue offsets like stored ones (physical offset 0, no id or key index), wake held pulls at
once and are served to pulls from memory in exactly the format of stored batches, so consumers
need nothing special. Nothing of them survives a broker restart.

The pending limit: each queue keeps at most ``max_pending_messages`` messages and
``max_pending_bytes`` bytes. A publish past the limit evicts the oldest batches; an evicted batch
no pull had fetched yet is *dropped* (counted per topic in ``dropped`` and in the broker's
runtime info as ``np_dropped_msgs``), as Pulsar drops non-persistent messages its consumers
cannot keep up with. A pull below the window gets PULL_OFFSET_MOVED to the window's start.
A producer is always answered SEND_OK (Pulsar answers a dropped publish with a receipt too).

Threads: the broker's event loop only.
"""

from __future__ import annotations

import bisect
import collections
import logging
import time
from typing import TYPE_CHECKING

from tidemq.protocol.batch.fields import stamp_store_fields
from tidemq.protocol.codes import ResponseCode
from tidemq.protocol.headers import SendMessageResponseHeader
from tidemq.protocol.record import (
    BatchView,
    unique_id,
)
from tidemq.store.pull_outcome import GetResult, ReadBatch, position_outcome, read_outcome

if TYPE_CHECKING:
    from collections.abc import Callable

    from tidemq.broker.connection import BrokerConnection

__all__ = ["NonPersistentTopics", "NON_PERSISTENT_PREFIX", "is_non_persistent"]

log = logging.getLogger(__name__)

NON_PERSISTENT_PREFIX = "%NP%"


def is_non_persistent(topic: str) -> bool:
    return topic.startswith(NON_PERSISTENT_PREFIX)


class _Window:
    """The in-memory batches of one queue, oldest first."""

    __slots__ = ("batches", "offs", "head", "min_offset", "max_offset", "bytes", "read_upto")

    def __init__(self) -> None:
        # (queue offset of message 0, count, stamped batch); live entries from ``head`` on
        # (a list, not a deque, so a pull finds its batch by bisect on ``offs``)
        self.batches: list[tuple[int, int, bytearray]] = []
        self.offs: list[int] = []
        self.head = 0
        self.min_offset = 0
        self.max_offset = 0
        self.bytes = 0
        self.read_upto = 0  # highest offset any pull has fetched up to


class NonPersistentTopics:
    """In-memory queues of the non-persistent topics (event loop only; see module doc)."""

    def __init__(
        self,
        *,
        max_pending_messages: int,
        max_pending_bytes: int,
        on_arrival: Callable[[str, int, int, BatchView], None] | None = None,
        store_host: bytes = bytes(18),
    ) -> None:
        self.max_pending_messages = max_pending_messages
        self.max_pending_bytes = max_pending_bytes
        self.on_arrival = on_arrival
        self.store_host = store_host  # store_port u16 + store_host 16s, as the store stamps
        self._queues: dict[tuple[str, int], _Window] = {}
        self.published: collections.Counter[str] = collections.Counter()
        self.dropped: collections.Counter[str] = collections.Counter()

    @staticmethod
    def owns(topic: str) -> bool:
        return topic.startswith(NON_PERSISTENT_PREFIX)

    # -- publish -------------------------------------------------------------------------------
    def publish(
        self, conn: BrokerConnection, opaque: int, oneway: int,
        body: bytes | bytearray | memoryview, v: BatchView, queue_id: int,
    ) -> None:
        topic = v.topic
        w = self._queues.get((topic, queue_id))
        if w is None:
            w = self._queues[(topic, queue_id)] = _Window()
        qoff = w.max_offset
        buf = bytearray(body)
        now = time.time_ns() // 1_000_000
        stamp_store_fields(buf, phys_offset=0, queue_offset=qoff, store_ts=now,
                           queue_id=queue_id, store_addr=self.store_host,
                           producer_start=v.producer_start)
        w.batches.append((qoff, v.count, buf))
        w.offs.append(qoff)
        w.max_offset = qoff + v.count
        w.bytes += len(buf)
        self.published[topic] += v.count
        self._evict(topic, w)
        if self.on_arrival is not None:
            self.on_arrival(topic, queue_id, w.max_offset, BatchView(buf))
        if not oneway:
            conn.respond(opaque, ResponseCode.SUCCESS, SendMessageResponseHeader(
                msg_id=unique_id(v.producer_id, v.base_seq), queue_id=queue_id,
                queue_offset=qoff, count=v.count,
            ))

    def _evict(self, topic: str, w: _Window) -> None:
        batches = w.batches
        while len(batches) - w.head > 1 and (
            w.max_offset - w.min_offset > self.max_pending_messages
            or w.bytes > self.max_pending_bytes
        ):
            qoff, count, buf = batches[w.head]
            batches[w.head] = (qoff, count, bytearray())
            w.head += 1
            w.min_offset = qoff + count
            w.bytes -= len(buf)
            unread = min(count, max(0, qoff + count - w.read_upto))
            if unread:
                self.dropped[topic] += unread
                log.debug("non-persistent %s: dropped %d unread messages", topic, unread)
        if w.head > 1024 and w.head * 2 > len(batches):
            del batches[: w.head]
            del w.offs[: w.head]
            w.head = 0

    # -- reads ---------------------------------------------------------------------------------
    def min_offset(self, topic: str, queue_id: int) -> int:
        w = self._queues.get((topic, queue_id))
        return w.min_offset if w else 0

    def max_offset(self, topic: str, queue_id: int) -> int:
        w = self._queues.get((topic, queue_id))
        return w.max_offset if w else 0

    def get_messages(
        self, topic: str, queue_id: int, offset: int, max_messages: int = 32,
        tag_hashes: frozenset[int] | None = None,
    ) -> GetResult:
        """Same contract as ``MessageStore.get_messages`` over the in-memory window."""
        w = self._queues.get((topic, queue_id))
        mn, mx = (w.min_offset, w.max_offset) if w is not None else (0, 0)
        early = position_outcome(w is not None, offset, mn, mx)
        if early is not None or w is None:
            return early  # type: ignore[return-value]
        out: list[ReadBatch] = []
        n = 0
        q = offset
        batches = w.batches
        i = max(w.head, bisect.bisect_right(w.offs, offset) - 1)
        while i < len(batches):
            qoff, count, buf = batches[i]
            i += 1
            if n >= max_messages:
                break
            first = max(0, offset - qoff)
            if tag_hashes is not None:
                v = BatchView(buf)
                hits = [i for i in range(first, count) if v.tag_hash_at(i) in tag_hashes]
                q = qoff + count
                if not hits:
                    continue
                first = hits[0]
            out.append(ReadBatch(memoryview(buf), first, qoff + first, count - first))
            n += count - first
            q = qoff + count
        w.read_upto = max(w.read_upto, q)
        return read_outcome(q, mn, mx, out)

    def delete_topic(self, topic: str) -> None:
        for key in [k for k in self._queues if k[0] == topic]:
            del self._queues[key]

    def stats(self) -> dict[str, int]:
        return {
            "np_queues": len(self._queues),
            "np_published_msgs": sum(self.published.values()),
            "np_dropped_msgs": sum(self.dropped.values()),
            "np_pending_bytes": sum(w.bytes for w in self._queues.values()),
        }
