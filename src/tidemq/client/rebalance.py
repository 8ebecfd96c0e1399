"""Rebalance: which member of a group consumes which queue (RocketMQ's RebalanceImpl and
AllocateMessageQueueStrategy; ref CO4).

Every member runs the same pure function over the same *sorted* views -- all queues of the
topic, all member ids of the group (GET_CONSUMER_LIST_BY_GROUP) -- so the members agree on an
assignment without talking to each other. It runs at start, every 20 s, and at once when the
broker notifies the group that its membership changed (NOTIFY_CONSUMER_IDS_CHANGED).

Strategies (:class:`AllocateStrategy`):

- ``AVG`` (default, AllocateMessageQueueAveragely): contiguous blocks; the first
  ``len(mqs) % len(cids)`` members get one more queue.
- ``AVG_BY_CIRCLE``: round robin: member i gets queues i, i + n, i + 2n, ...
- ``CONSISTENT_HASH``: a hash ring of members (10 virtual nodes each, MD5); a queue goes to the
  first node at or after its hash. Few queues move when a member joins or leaves.
- ``CONFIG``: the queues given in ``allocate_config`` (a list of MessageQueue), whatever the
  group looks like.
- ``MACHINE_ROOM``: only queues on brokers named ``<room>@<name>`` whose room is in
  ``consumer_rooms``, then averaged (AllocateMessageQueueByMachineRoom).

Applying an assignment (:meth:`Rebalance.update_process_queues`): a queue no longer ours is
*dropped* -- for orderly consumers first up to 1 s is spent waiting for the listener call in
progress to end and commit; then its ProcessQueue is marked dropped (pulls and consumes of it
stop committing), its offset persisted, and, for orderly consumers, its broker lock released
(once the consume in progress finished, if it outlasted the wait); a new queue is *added* --
locked first if orderly (skipped if another member still holds the lock: it will be retried at
the next rebalance), its start offset computed (the group's committed offset, else by
consume-from: LAST = the max offset, 0 for a retry topic; FIRST = 0; TIMESTAMP = the first
offset stored at or after the timestamp) and a pull started. A pass that added
``FREEZE_MIN_ADDED`` queues or more ends with ``tidemq.base.gc_tune.freeze_long_lived``: one
collection, then what is alive is left out of every later one (issue 17: at 10,000 queues the
collections walked the new queues' objects in one stretch: a full one 27-33 ms of CPU).

Threads: the consumer's event loop only.
"""

from __future__ import annotations

import asyncio
import bisect
import enum
import hashlib
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tidemq.base.gc_tune import freeze_long_lived
from tidemq.client import offsets
from tidemq.client.errors import NoRouteError
from tidemq.client.loop_share import Slicer
from tidemq.client.message import ConsumeFrom, MessageQueue
from tidemq.client.process_queue import ProcessQueue
from tidemq.protocol.codes import RETRY_PREFIX, RequestCode
from tidemq.protocol.errors import TidemqError
from tidemq.protocol.headers import (
    ConsumerGroupRequestHeader,
    ConsumerListResponseHeader,
    LockBatchRequestHeader,
    LockBatchResponseHeader,
    QueueRef,
)

if TYPE_CHECKING:
    from tidemq.client.connection import ConnectionPool
    from tidemq.client.push_consumer import PushConsumer

__all__ = ["AllocateStrategy", "allocate", "find_consumer_ids", "Rebalance", "RETRY_PREFIX"]

log = logging.getLogger(__name__)

#: Orderly: how long dropping a queue waits for the listener call in progress (RocketMQ 1 s).
DROP_WAIT = 1.0
#: A pass that added this many queues or more ends with tidemq.base.gc_tune.freeze_long_lived:
#: their objects are long-lived, and at 10,000 queues a full collection walking them held the
#: consumer's loop 27-33 ms of CPU (0.2-0.7 ms once they are frozen; issue 17).
FREEZE_MIN_ADDED = 1000


class AllocateStrategy(enum.StrEnum):
    AVG = "avg"
    AVG_BY_CIRCLE = "avg_by_circle"
    CONSISTENT_HASH = "consistent_hash"
    CONFIG = "config"
    MACHINE_ROOM = "machine_room"


def _avg(cid: str, mqs: Sequence[MessageQueue], cids: Sequence[str]) -> list[MessageQueue]:
    i = cids.index(cid)
    n, m = len(cids), len(mqs)
    mod = m % n
    if m <= n:
        size = 1
    else:
        size = m // n + 1 if mod > 0 and i < mod else m // n
    start = i * size if mod > 0 and i < mod else i * size + mod
    rng = min(size, m - start)
    return [mqs[(start + k) % m] for k in range(max(rng, 0))]


def _circle(cid: str, mqs: Sequence[MessageQueue], cids: Sequence[str]) -> list[MessageQueue]:
    i = cids.index(cid)
    return list(mqs[i::len(cids)])


def _hash(key: str) -> int:
    return int.from_bytes(hashlib.md5(key.encode()).digest()[:8], "little")


def _consistent(cid: str, mqs: Sequence[MessageQueue], cids: Sequence[str],
                virtual_nodes: int = 10) -> list[MessageQueue]:
    ring = sorted((_hash(f"{c}-{v}"), c) for c in cids for v in range(virtual_nodes))
    keys = [h for h, _ in ring]
    out = []
    for mq in mqs:
        k = bisect.bisect_left(keys, _hash(f"{mq.topic}@{mq.broker_name}:{mq.queue_id}"))
        owner = ring[k % len(ring)][1]
        if owner == cid:
            out.append(mq)
    return out


def allocate(
    strategy: AllocateStrategy | str,
    cid: str,
    mqs: Sequence[MessageQueue],
    cids: Sequence[str],
    *,
    config: Sequence[MessageQueue] = (),
    rooms: Sequence[str] = (),
) -> list[MessageQueue]:
    """The queues of ``mqs`` member ``cid`` consumes; ``mqs`` and ``cids`` must be sorted.

    A member missing from ``cids`` (its heartbeat has not arrived yet) gets nothing."""
    strategy = AllocateStrategy(strategy)
    if strategy is AllocateStrategy.CONFIG:
        return [mq for mq in mqs if mq in set(config)]
    if not mqs or cid not in cids:
        return []
    if strategy is AllocateStrategy.MACHINE_ROOM:
        room_set = set(rooms)
        mqs = [mq for mq in mqs if mq.broker_name.split("@", 1)[0] in room_set]
        return _avg(cid, mqs, cids) if mqs else []
    if strategy is AllocateStrategy.AVG_BY_CIRCLE:
        return _circle(cid, mqs, cids)
    if strategy is AllocateStrategy.CONSISTENT_HASH:
        return _consistent(cid, mqs, cids)
    return _avg(cid, mqs, cids)


async def find_consumer_ids(pool: ConnectionPool, group: str, broker_addrs: dict[str, str],
                            timeout: float) -> list[str]:
    """The member ids of ``group`` from the first of ``broker_addrs`` that answers (push and
    lite pull consumers alike); [] when none does."""
    for addr in sorted(broker_addrs.values()):
        try:
            f = await pool.request(addr, RequestCode.GET_CONSUMER_LIST_BY_GROUP,
                                   ConsumerGroupRequestHeader(consumer_group=group),
                                   timeout=timeout)
        except TidemqError as exc:
            log.info("member list of %s from %s failed: %s", group, addr, exc)
            continue
        h: Any = f.header
        if isinstance(h, ConsumerListResponseHeader):
            return list(h.consumer_ids)
        return list(h.get("consumer_ids", []))
    return []


class Rebalance:
    """The queue -> ProcessQueue table of one push consumer and the rebalance over it."""

    def __init__(self, consumer: PushConsumer) -> None:
        self.c = consumer
        self.table: dict[MessageQueue, ProcessQueue] = {}
        self.rebalances = 0
        #: Something could not be done (a route missing, a lock still held by the previous
        #: owner): rebalance again in 0.5 s instead of 20 s.
        self.retry_soon = False
        #: GET_CONSUMER_LIST_BY_GROUP requests sent by passes (tests read it)
        self.member_queries = 0
        #: queues added by the pass in progress (update_process_queues)
        self._added = 0
        #: long-lived objects frozen after a pass (tidemq.base.gc_tune.freeze_long_lived)
        self.gc_freezes = 0

    async def do_rebalance(self) -> None:
        """One pass over the subscribed topics. Within it the member list is asked once per
        set of brokers, not once per topic, and the table's queues are listed by topic once
        (not a scan of the table per topic: 1,250 topics x 10,000 queues was 12.5 million
        steps a pass)."""
        c = self.c
        self.retry_soon = False
        members: dict[frozenset[tuple[str, str]], list[str]] = {}
        by_topic: dict[str, list[MessageQueue]] = {}
        for mq in self.table:
            by_topic.setdefault(mq.topic, []).append(mq)
        c.pull_service.defer_starts()
        sl = Slicer()
        try:
            for topic in list(c.subscriptions):
                if sl.due():  # a pass over 1,250 topics is not one stretch of the loop
                    await asyncio.sleep(0)
                try:
                    await self._rebalance_topic(topic, members, by_topic.get(topic, []))
                except NoRouteError as exc:
                    self.retry_soon = True
                    log.info("rebalance of %s for group %s: %s", topic, c.group, exc)
                except TidemqError as exc:
                    self.retry_soon = True
                    log.warning("rebalance of %s for group %s failed: %s", topic, c.group, exc)
        finally:
            c.pull_service.start_deferred()
        # Queues of topics no longer subscribed.
        for mq in [mq for mq in self.table if mq.topic not in c.subscriptions]:
            await self._drop(mq)
        self.rebalances += 1
        added, self._added = self._added, 0
        if added >= FREEZE_MIN_ADDED and freeze_long_lived():
            self.gc_freezes += 1

    async def _rebalance_topic(self, topic: str,
                               members: dict[frozenset[tuple[str, str]], list[str]],
                               have: list[MessageQueue]) -> None:
        c = self.c
        route = await c.routes.get(topic)
        mqs = sorted(route.read_queues)
        if c.broadcasting:
            mine = mqs
        else:
            key = frozenset(route.read_addrs.items())
            cids = members.get(key)
            if cids is None:
                cids = await self.find_consumer_ids(route.read_addrs)
                if cids:  # an empty answer is asked again for the next topic
                    members[key] = cids
            if not cids:
                log.info("group %s has no member on the brokers of %s yet", c.group, topic)
                return
            mine = allocate(c.allocate_strategy, c.client_id, mqs, sorted(cids),
                            config=c.allocate_config, rooms=c.consumer_rooms)
        await self.update_process_queues(topic, set(mine), have)

    async def find_consumer_ids(self, broker_addrs: dict[str, str]) -> list[str]:
        c = self.c
        self.member_queries += 1
        return await find_consumer_ids(c.pool, c.group, broker_addrs, c.request_timeout)

    async def update_process_queues(self, topic: str, mine: set[MessageQueue],
                                    have: list[MessageQueue] | None = None) -> bool:
        """Drop the queues of ``topic`` that are no longer ``mine``, add the new ones;
        ``have``: the table's queues of ``topic`` (listed from the table when None)."""
        changed = False
        if have is None:
            have = [mq for mq in self.table if mq.topic == topic]
        for mq in have:
            pq = self.table.get(mq)
            if pq is None:
                continue
            if mq not in mine:
                await self._drop(mq)
                changed = True
            elif pq.pull_expired() and not self.c.orderly:
                log.warning("queue %s was not pulled for 120 s; re-adding it", mq)
                await self._drop(mq)
        new = sorted(mq for mq in mine if mq not in self.table)
        if new and self.c.orderly and not self.c.broadcasting:
            locked = await self.lock(new)
            if len(locked) < len(new):
                self.retry_soon = True  # the previous owner still finishes a consume
            new = [mq for mq in new if mq in locked]
        for mq in new:
            try:
                offset = await self.compute_pull_from(mq)
            except TidemqError as exc:
                log.warning("start offset of %s failed: %s; retrying soon", mq, exc)
                self.retry_soon = True
                continue
            pq = ProcessQueue()
            if self.c.orderly:
                pq.locked = True
                pq.last_lock_ts = time.monotonic()
            self.table[mq] = pq
            self.c.offset_store.update(mq, offset, False)
            self.c.pull_service.start_queue(mq, pq, offset)
            self._added += 1
            changed = True
        if changed:
            n = sum(1 for m in have if m in self.table) + sum(1 for m in new if m in self.table)
            log.info("group %s member %s now consumes %d queues of %s", self.c.group,
                     self.c.client_id, n, topic)
        return changed

    async def compute_pull_from(self, mq: MessageQueue) -> int:
        c = self.c
        store = c.offset_store
        off: int = await store.read_from_store(mq)
        if off >= 0:
            return off
        addr = await c.routes.addr_for_admin(mq)
        t = c.request_timeout
        if mq.topic.startswith(RETRY_PREFIX) or c.consume_from is ConsumeFrom.FIRST:
            return await offsets.min_offset(c.pool, addr, mq, timeout=t)
        if c.consume_from is ConsumeFrom.TIMESTAMP:
            return await offsets.search_offset(c.pool, addr, mq, c.consume_timestamp, timeout=t)
        return await offsets.max_offset(c.pool, addr, mq, timeout=t)

    async def _drop(self, mq: MessageQueue) -> None:
        pq = self.table.pop(mq, None)
        if pq is None:
            return
        c = self.c
        ordered = c.orderly and not c.broadcasting
        held = await self.quiesce(pq) if ordered else False
        pq.dropped = True
        if held:
            pq.consume_lock.release()
        try:
            await c.offset_store.persist(mq)
        except TidemqError as exc:
            log.warning("persisting the offset of dropped queue %s failed: %s", mq, exc)
        c.offset_store.remove(mq)
        if ordered:
            if held:
                try:
                    await self.unlock([mq])
                except TidemqError as exc:
                    log.info("unlock of %s failed (%s); the broker lock expires by itself",
                             mq, exc)
            else:
                asyncio.get_running_loop().create_task(self._unlock_when_idle(mq, pq))

    @staticmethod
    async def quiesce(pq: ProcessQueue, timeout: float = DROP_WAIT) -> bool:
        """Orderly: wait (up to 1 s, as RocketMQ's tryLock) for the listener call in progress
        to end and commit, and hold the queue's consume lock; False if the call goes on."""
        try:
            async with asyncio.timeout(timeout):  # not wait_for: see _rebalance_loop
                await pq.consume_lock.acquire()
        except TimeoutError:
            return False
        return True

    async def _unlock_when_idle(self, mq: MessageQueue, pq: ProcessQueue) -> None:
        # The consume in progress must end before another member may take the queue.
        try:
            async with pq.consume_lock:
                await self.unlock([mq])
        except TidemqError as exc:
            log.info("unlock of %s failed (%s); the broker lock expires by itself", mq, exc)

    # -- broker locks (orderly) ----------------------------------------------------------------
    async def _by_broker(self, mqs: list[MessageQueue]) -> dict[str, list[MessageQueue]]:
        out: dict[str, list[MessageQueue]] = {}
        for mq in mqs:
            out.setdefault(await self.c.routes.addr_of(mq), []).append(mq)
        return out

    async def lock(self, mqs: list[MessageQueue]) -> set[MessageQueue]:
        c = self.c
        got: set[MessageQueue] = set()
        for addr, group in (await self._by_broker(mqs)).items():
            h = LockBatchRequestHeader(
                consumer_group=c.group, client_id=c.client_id,
                queues=[QueueRef(topic=m.topic, broker_name=m.broker_name, queue_id=m.queue_id)
                        for m in group],
            )
            try:
                f = await c.pool.request(addr, RequestCode.LOCK_BATCH_MQ, h,
                                         timeout=c.request_timeout)
            except TidemqError as exc:
                log.warning("locking queues on %s failed: %s", addr, exc)
                continue
            r: Any = f.header
            refs = r.locked if isinstance(r, LockBatchResponseHeader) else []
            got |= {MessageQueue(q.topic, q.broker_name, q.queue_id) for q in refs}
        return got

    async def unlock(self, mqs: list[MessageQueue]) -> None:
        c = self.c
        for addr, group in (await self._by_broker(mqs)).items():
            h = LockBatchRequestHeader(
                consumer_group=c.group, client_id=c.client_id,
                queues=[QueueRef(topic=m.topic, broker_name=m.broker_name, queue_id=m.queue_id)
                        for m in group],
            )
            await c.pool.request(addr, RequestCode.UNLOCK_BATCH_MQ, h, timeout=c.request_timeout)

    async def lock_all(self) -> None:
        """Renew every held queue's lock (every 20 s); a queue not granted stops consuming."""
        mqs = list(self.table)
        if not mqs:
            return
        got = await self.lock(mqs)
        now = time.monotonic()
        for mq in mqs:
            pq = self.table.get(mq)
            if pq is None:
                continue
            if mq in got:
                if not pq.locked:
                    log.info("queue %s locked again", mq)
                pq.locked = True
                pq.last_lock_ts = now
            else:
                pq.locked = False
