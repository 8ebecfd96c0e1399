"""Shrinking a topic's queues without hiding messages (ref BR11), as RocketMQ operators do it.

RocketMQ keeps read and write queue counts apart so that a topic can shrink safely: lower
``write_queue_nums`` first (producers stop writing to the queues above it), let consumers drain
those queues, then lower ``read_queue_nums``. Lowering the read count at once would hide the
messages left in the removed queues. tidemq does the second step by itself:

- an update that lowers ``read_queue_nums`` keeps the read count where it is and records the
  wanted count in ``TopicConfig.shrinking_to`` (persisted with the topic table; the name
  servers see the read count still in use, so consumers keep pulling those queues);
- every second, the read count of a shrinking topic drops past each top queue that is
  *drained* -- no longer written (its id is at or above the write count) and either empty
  (min offset = max offset) or consumed to its end by every consumer group that has an offset
  for the topic (and there is at least one); once it reaches ``shrinking_to`` the topic is an
  ordinary one again. Queues are removed from the top, one by one, never a queue below one
  still holding messages;
- raising the read count again (or setting it to what it is) cancels a shrink.

Only a master decides (a slave adopts its master's table).

Threads: the broker's event loop only.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import msgspec

from tidemq.broker.topic_config import config_problem
from tidemq.protocol.headers import TopicConfig

if TYPE_CHECKING:
    from tidemq.broker.broker import Broker

__all__ = ["QueueShrinker", "CHECK_INTERVAL_S"]

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 1.0


class QueueShrinker:
    """Plans and completes read-queue shrinks of one broker's topics (see the module doc)."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    def plan(self, new: TopicConfig) -> TopicConfig:
        """The config to store for an update to ``new``: a lower read count is kept until the
        queues above it are drained (as far as they are now)."""
        old = self.broker.topics.get(new.topic_name)
        new = msgspec.structs.replace(new, shrinking_to=0)  # the broker's to set, not a client's
        if (old is None or new.read_queue_nums >= old.read_queue_nums
                or config_problem(new) is not None):  # refused by the table, as it is
            return new
        want = new.read_queue_nums
        kept = self._drain_to(new.topic_name, old.read_queue_nums, want, new.write_queue_nums)
        if kept == want:
            return new
        log.info("topic %s: read queues %d..%d are kept until drained (asked: %d read queues)",
                 new.topic_name, want, kept - 1, want)
        return msgspec.structs.replace(new, read_queue_nums=kept, shrinking_to=want)

    def _drained(self, topic: str, queue_id: int, write_queues: int) -> bool:
        if queue_id < write_queues:
            return False  # still written to
        store = self.broker.store
        mx = store.max_offset(topic, queue_id)
        if store.min_offset(topic, queue_id) >= mx:
            return True  # holds nothing (never written, or everything aged out)
        offsets = self.broker.offsets
        groups = offsets.groups_of_topic(topic)
        return bool(groups) and all(offsets.query(g, topic, queue_id) >= mx for g in groups)

    def _drain_to(self, topic: str, have: int, want: int, write_queues: int) -> int:
        """The read count after dropping drained queues from the top, from ``have`` down to
        at most ``want``."""
        n = have
        while n > want and self._drained(topic, n - 1, write_queues):
            n -= 1
        return n

    def check(self) -> bool:
        """One pass over the shrinking topics (only those: the table keeps their names, so a
        pass costs nothing per other topic); True when a topic changed."""
        changed = False
        topics = self.broker.topics
        for tc in topics.shrinking():
            n = self._drain_to(tc.topic_name, tc.read_queue_nums, tc.shrinking_to,
                               tc.write_queue_nums)
            if n == tc.read_queue_nums:
                continue
            done = n <= tc.shrinking_to
            topics.update(msgspec.structs.replace(
                tc, read_queue_nums=n, shrinking_to=0 if done else tc.shrinking_to))
            log.info("topic %s: drained read queues removed, %d read queues now%s",
                     tc.topic_name, n, "" if done else f" (going to {tc.shrinking_to})")
            changed = True
        return changed

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            if self.broker.ha.is_slave:
                continue
            try:
                if self.check():
                    self.broker.topics_changed()
            except Exception:  # never stop checking because of one bad pass
                log.exception("queue shrink check failed")
