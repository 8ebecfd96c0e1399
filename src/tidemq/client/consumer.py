"""The asyncio lite pull consumer (ref CO8; RocketMQ's DefaultLitePullConsumer).

The user calls :meth:`PullConsumer.poll`; underneath, one prefetch task per assigned queue keeps
a long-polling PULL_MESSAGE in flight (suspend 20 s: the broker holds the request until a
message arrives: long polling) and buffers what it gets, so ``poll`` usually returns at once.

Per queue three offsets matter:

- *pull offset*: where the next pull starts (the broker's next_begin_offset after each pull);
- *consume offset*: right after the last message ``poll`` returned (what ``commit`` stores);
- *committed offset*: what the broker holds for the group.

A new queue starts at the group's committed offset, else by ``consume_from`` (LAST: the max
offset; FIRST: the min offset; TIMESTAMP: the first message stored at or after
``consume_timestamp``). Pull statuses are handled as RocketMQ's push consumer does
(docs/protocol.md, "Pull"): FOUND buffers the messages (skipping those before the
requested offset and re-checking tags); NO_NEW_MSG and NO_MATCHED_MSG move on to
next_begin_offset; OFFSET_ILLEGAL jumps to the broker's corrected
offset (logged). Errors back off 1 s and retry, except the broker's refusals that no retry
can fix -- INVALID_ARGUMENT (a queue id the topic does not have, a bad group name),
NO_PERMISSION (a write-only topic), SUBSCRIPTION_PARSE_FAILED, REQUEST_CODE_NOT_SUPPORTED:
that queue stops being pulled and the next ``poll`` raises the broker's error (a BrokerError
naming the queue), once; ``assign`` again (or the next route refresh of ``subscribe``)
retries it.

Integrity (CO9, "tolerate on the way out"): every received batch's CRC32C is verified
(``check_crc``); a batch that fails it, or does not decode (records that do not decompress, or
would decompress to more than ``max_uncompressed_bytes``), is skipped, and so is one message
whose tag, keys or properties are not UTF-8 -- ``corrupt_batches`` counts the skips,
``stats()`` has them, and a rate-limited error log names the queue and offsets -- instead of
stopping the queue: the consumer moves on past it. Compressed batches are
decompressed transparently; chunked messages (PR5) are reassembled per queue
(``chunking.ChunkAssembler``, incomplete ones expire after ``chunk_expire`` s) and the committed
position never passes the first chunk of a message still being assembled.

Flow control: a queue stops pulling while it holds ``pull_threshold_per_queue`` unpolled
messages and resumes when ``poll`` drains it below that.

``subscribe`` makes this consumer a member of its group (``membership.py``): it heartbeats to
the brokers (``tidemq group describe`` lists it) and the group's members share the topic's
queues by the same rebalance as push consumers (``allocate_strategy``, AVG by default), every
``rebalance_interval`` (20 s) and at once when a member joins or leaves. A queue taken away is
committed at its consumed position and its unpolled messages dropped, so the next owner starts
right after what this consumer handed out. ``assign`` stays manual: no membership, exactly the
queues given.

Threading: one event loop. Use ``tidemq.PullConsumer`` from threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import deque
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from tidemq.client import chunking, offsets
from tidemq.client.chunking import ChunkAssembler
from tidemq.client.codec import decode_pull_body
from tidemq.client.connection import DEFAULT_TIMEOUT, ConnectionPool, raise_for_error
from tidemq.client.errors import ClientClosedError
from tidemq.client.lite_pulls import LitePulls
from tidemq.client.membership import GroupMembership, make_client_id
from tidemq.client.message import ConsumeFrom, MessageExt, MessageQueue
from tidemq.client.rebalance import AllocateStrategy
from tidemq.client.route import RouteCache
from tidemq.client.selection import EVERYTHING, Selection
from tidemq.protocol.codes import PullStatus, RequestCode, ResponseCode, pull_status
from tidemq.protocol.corrupt import CorruptRecords
from tidemq.protocol.errors import BrokerError, TidemqError
from tidemq.protocol.headers import (
    MASTER_ID,
    PullMessageRequestHeader,
    PullMessageResponseHeader,
    PullSysFlag,
)
from tidemq.protocol.names import group_name_problem
from tidemq.protocol.record import DEFAULT_MAX_RAW_SIZE

if TYPE_CHECKING:
    from tidemq.client.connection import Connection
    from tidemq.protocol.frame import Frame

__all__ = ["PullConsumer"]

#: Pull refusals that no retry fixes (see the module docstring).
_FATAL_CODES = frozenset({
    ResponseCode.INVALID_ARGUMENT, ResponseCode.NO_PERMISSION,
    ResponseCode.SUBSCRIPTION_PARSE_FAILED, ResponseCode.REQUEST_CODE_NOT_SUPPORTED,
})

log = logging.getLogger(__name__)



def _by_topic(mqs: Iterable[MessageQueue]) -> dict[str, list[MessageQueue]]:
    """``mqs`` by topic, each topic's queues sorted: walked in sorted topic order, the same
    order as ``sorted(mqs)``, in a fraction of its time (100,000 queues: 0.06-0.14 s against
    0.09-0.37 s on a loaded machine; sorting MessageQueue structs compares them field by
    field, here only topic names and each topic's few queues are sorted)."""
    by: dict[str, list[MessageQueue]] = {}
    for mq in mqs:
        lst = by.get(mq.topic)
        if lst is None:
            by[mq.topic] = [mq]
        else:
            lst.append(mq)
    for lst in by.values():
        if len(lst) > 1:
            lst.sort()
    return by


class _Queue:
    """State of one assigned queue (event loop only)."""

    __slots__ = (
        "mq", "pull_offset", "consume_offset", "committed", "chunks", "buffered", "task",
        "paused", "space", "ready", "assembler", "broker_id", "failed", "in_ready",
        "standing", "dropped", "parked",
    )

    def __init__(self, mq: MessageQueue) -> None:
        self.mq = mq
        self.pull_offset: int | None = None
        self.consume_offset: int | None = None
        self.committed: int | None = None
        # (messages, offset after them) in pull order; an empty list only moves the offset.
        self.chunks: deque[tuple[list[MessageExt], int]] = deque()
        self.buffered = 0
        self.task: asyncio.Task[None] | None = None
        self.paused = False
        # set when the queue may pull again; made the first time it must wait (a consumer of
        # 100,000 queues creates them all at once: every object per queue shows)
        self.space: asyncio.Event | None = None
        self.ready: asyncio.Future[None] | None = None  # resolved once the start offset is known
        self.assembler: ChunkAssembler | None = None  # created at the first chunk seen
        self.broker_id = MASTER_ID  # which broker of the group to pull from (the suggestion)
        self.failed: BrokerError | None = None  # a refusal no retry fixes stopped the queue
        self.in_ready = False  # listed in the consumer's queues with chunks to poll
        self.standing = False  # held on the broker by a pull driver's standing pull
        self.dropped = False  # no longer this consumer's (unassigned, or seeked: replaced)
        self.parked = False  # a pull driver's queue held back by flow control

    @property
    def pq(self) -> _Queue:
        """The pull driver's view of the queue's state (the push consumer's ProcessQueue)."""
        return self


class PullConsumer:
    """Lite pull consumer: subscribe or assign, then poll. An async context manager.

    Options: ``consume_from`` ("last", "first", "timestamp") and ``consume_timestamp`` (ms),
    ``auto_commit`` (True) every ``auto_commit_interval`` (5 s), ``pull_batch_size`` (32:
    messages per pull request), ``max_poll_records`` (messages per poll, default
    ``max(1000, pull_batch_size)``), ``pull_threshold_per_queue`` (buffered messages before a
    queue pauses; default ``max(1000, 4 * pull_batch_size)``), ``suspend_timeout`` (20 s: how
    long a broker holds a pull), ``check_crc`` (True: verify each batch's CRC32C),
    ``max_uncompressed_bytes`` (4 MiB + 64 KiB: the largest records section of one received
    batch, uncompressed; raise it with the broker's ``max_message_size``), ``request_timeout``
    (3 s for other requests), ``pull_threshold_for_all`` (buffered messages of all queues
    together before every queue pauses; default ``max(10000, 4 * max_poll_records)``:
    RocketMQ's pullThresholdForAll), ``pool``; group membership when subscribing:
    ``heartbeat_interval`` (30 s), ``rebalance_interval`` (20 s), ``allocate_strategy``
    (AllocateStrategy.AVG), ``instance_name`` (part of ``client_id``); ``multi_queue_min`` (256:
    with this many assigned queues or more, the pulls to one broker travel together in
    PULL_MULTI_QUEUE requests, held by the broker as one long poll; 0 = never).
    """

    def __init__(
        self,
        namesrv: str | Sequence[str],
        group: str,
        *,
        consume_from: str | ConsumeFrom = ConsumeFrom.LAST,
        consume_timestamp: int | None = None,
        auto_commit: bool = True,
        auto_commit_interval: float = 5.0,
        pull_batch_size: int = 32,
        max_poll_records: int | None = None,
        pull_threshold_per_queue: int | None = None,
        pull_threshold_for_all: int | None = None,
        suspend_timeout: float = 20.0,
        check_crc: bool = True,
        request_timeout: float = DEFAULT_TIMEOUT,
        route_refresh: float = 30.0,
        pool: ConnectionPool | None = None,
        chunk_expire: float = 60.0,
        max_uncompressed_bytes: int = DEFAULT_MAX_RAW_SIZE,
        heartbeat_interval: float = 30.0,
        rebalance_interval: float = 20.0,
        allocate_strategy: AllocateStrategy | str = AllocateStrategy.AVG,
        instance_name: str | None = None,
        multi_queue_min: int = 256,
    ) -> None:
        problem = group_name_problem(group)
        if problem:
            raise ValueError(problem)
        if max_uncompressed_bytes < 1:
            raise ValueError("max_uncompressed_bytes must be >= 1")
        if pull_batch_size < 1:
            raise ValueError("pull_batch_size must be >= 1")
        self.group = group
        self.consume_from = ConsumeFrom(consume_from)
        if self.consume_from is ConsumeFrom.TIMESTAMP and consume_timestamp is None:
            raise ValueError("consume_from='timestamp' needs consume_timestamp (ms since epoch)")
        self.consume_timestamp = consume_timestamp or 0
        self.auto_commit = auto_commit
        self.auto_commit_interval = auto_commit_interval
        self.pull_batch_size = pull_batch_size
        self.max_poll_records = max_poll_records or max(1000, pull_batch_size)
        self.pull_threshold = pull_threshold_per_queue or max(1000, 4 * pull_batch_size)
        #: buffered messages of all queues together at which no queue pulls (a consumer of
        #: 10,000 queues would otherwise buffer up to 10,000 x pull_threshold)
        self.pull_threshold_all = pull_threshold_for_all or max(10_000,
                                                                4 * self.max_poll_records)
        self.suspend_timeout = suspend_timeout
        self.suspend_ms = int(suspend_timeout * 1000)
        self.check_crc = check_crc
        self.chunk_expire = chunk_expire
        self.max_uncompressed_bytes = max_uncompressed_bytes
        #: CO9: records skipped for a CRC or decoding failure (see the module docstring)
        self.corrupt = CorruptRecords(log)
        self.request_timeout = request_timeout
        self._own_pool = pool is None
        self.client_id = make_client_id(instance_name)
        self.heartbeat_interval = heartbeat_interval
        self.rebalance_interval = rebalance_interval
        self.pool = pool if pool is not None else ConnectionPool(
            connect_timeout=request_timeout, on_request=self._on_request)
        self.routes = RouteCache(self.pool, namesrv, refresh_interval=route_refresh,
                                 timeout=request_timeout)
        self.membership = GroupMembership(
            group, self.client_id, self.pool, self.routes,
            consume_from=self.consume_from.value, strategy=AllocateStrategy(allocate_strategy),
            request_timeout=request_timeout)
        self.route_refresh = route_refresh
        #: with this many assigned queues or more, a broker's queues are pulled by one driver
        #: with standing PULL_MULTI_QUEUE requests (client/lite_pulls.py); 0 = never
        self.multi_queue_min = multi_queue_min
        #: the pull drivers of the brokers when pulling many queues (client/lite_pulls.py)
        self._lite = LitePulls(self)
        self._buffered = 0  # unpolled messages of every queue
        self._held: set[_Queue] = set()  # queues waiting for the consumer to buffer less
        self._no_resolve = False  # start offsets are looked up queue by queue
        #: start-offset lookups in flight at most (a consumer of 100,000 queues would
        #: otherwise ask for all of them at once and time out)
        self._lookups = asyncio.Semaphore(1024)
        self._subs: dict[str, Selection] = {}
        self._assigned: list[MessageQueue] | None = None
        self._queues: dict[MessageQueue, _Queue] = {}
        self._order: list[_Queue] = []  # the assigned queues, sorted
        self._topic_queues: dict[str, int] = {}  # topic -> assigned queues (by _apply)
        self._rr = 0
        # poll's round robin: only the queues holding pulled chunks (a poll's work follows what
        # arrived, not the number of assigned queues)
        self._ready_qs: deque[_Queue] = deque()
        self._ready = asyncio.Event()
        self._started = False
        self._closed = False
        self._tasks: list[asyncio.Task[None]] = []
        self._warned: set[str] = set()  # subscribed topics already reported as routeless
        self._errors: deque[BrokerError] = deque()  # refusals poll has not raised yet

    # -- configuration -------------------------------------------------------------------------
    def subscribe(self, topic: str, expression: str = "*", *, sql: str | None = None) -> None:
        """Consume every queue of ``topic``: ``expression`` is "*" or "TagA || TagB"; or
        ``sql="region = 'eu' AND amount > 100"`` selects by properties (SQL92,
        docs/consumer-groups.md). A bad SQL92 expression raises SqlFilterError here."""
        if self._assigned is not None:
            raise ValueError("this consumer uses assign(); subscribe and assign do not mix")
        self._subs[topic] = Selection(expression, sql=sql)
        if self._started:
            asyncio.get_running_loop().create_task(self._rebalance_quietly(heartbeat=True))

    def unsubscribe(self, topic: str) -> None:
        self._subs.pop(topic, None)
        if self._started:
            asyncio.get_running_loop().create_task(self._rebalance_quietly(heartbeat=True))

    def assign(self, queues: Iterable[MessageQueue]) -> None:
        """Consume exactly these queues (replacing any earlier assignment)."""
        if self._subs:
            raise ValueError("this consumer uses subscribe(); subscribe and assign do not mix")
        self._assigned = sorted(set(queues))
        if self._started:
            self._apply(set(self._assigned))

    def subscription(self) -> dict[str, str]:
        return {t: s.expression for t, s in self._subs.items()}

    def assignment(self) -> set[MessageQueue]:
        return set(self._queues)

    async def fetch_queues(self, topic: str) -> list[MessageQueue]:
        """The readable queues of ``topic`` (from the name server)."""
        return list((await self.routes.get(topic, refresh=True)).read_queues)

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> PullConsumer:
        if self._closed:
            raise ClientClosedError("this consumer was closed; create a new one")
        if self._started:
            return self
        self._started = True
        self.routes.start()
        loop = asyncio.get_running_loop()
        if self._assigned is not None:
            self._apply(set(self._assigned))
        elif self._subs:
            await self.membership.heartbeat(self._subs)  # a refused subscription raises here
            await self._rebalance()
        if self.auto_commit:
            self._tasks.append(loop.create_task(self._auto_commit_loop()))
        self._tasks.append(loop.create_task(self._rebalance_loop()))
        self._tasks.append(loop.create_task(self._heartbeat_loop()))
        return self

    async def close(self) -> None:
        """Stop pulling, commit (when auto-commit is on) and close connections. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for t in self._tasks:
            t.cancel()
        for q in self._queues.values():
            if q.task is not None:
                q.task.cancel()
        self._lite.close()
        tasks = self._tasks + [q.task for q in self._queues.values() if q.task is not None]
        if tasks:  # wait, not gather: no future wrapper per task (a task per queue: 100,000)
            await asyncio.wait(tasks)
            for t in tasks:  # retrieved, as gather(return_exceptions=True) did: not logged
                if not t.cancelled():
                    t.exception()
        if self.auto_commit and self._started:
            try:
                await self._commit(list(self._queues.values()))
            except TidemqError as exc:
                log.warning("final commit of group %s failed: %s", self.group, exc)
        if self._started and self._assigned is None and self.membership.heartbeats:
            # after the commit: the members that take these queues start where this one ended
            await self.membership.unregister(list(self._subs))
        await self.routes.close()
        if self._own_pool:
            self.pool.close()

    async def __aenter__(self) -> PullConsumer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- polling -------------------------------------------------------------------------------
    async def poll(self, timeout: float = 5.0) -> list[MessageExt]:
        """Messages ready now, or the first to arrive within ``timeout`` s; [] if none."""
        if not self._started:
            await self.start()
        if self._closed:
            raise ClientClosedError("this consumer was closed")
        if not self._subs and self._assigned is None:
            raise ValueError("call subscribe(topic) or assign(queues) before poll()")
        if self._errors:
            raise self._errors.popleft()
        out = self._drain()
        if out:
            return out
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            left = deadline - loop.time()
            if left <= 0:
                return []
            self._ready.clear()
            try:  # asyncio.timeout: 3.11's wait_for can swallow a cancel (see push_consumer)
                async with asyncio.timeout(left):
                    await self._ready.wait()
            except TimeoutError:
                return self._drain()
            if self._errors:
                raise self._errors.popleft()
            out = self._drain()
            if out:
                return out

    def _drain(self) -> list[MessageExt]:
        ready = self._ready_qs
        need = self.max_poll_records
        out: list[MessageExt] = []
        while ready and need > 0:
            q = ready.popleft()
            q.in_ready = False
            if q.dropped:
                continue  # no longer assigned, or replaced by a seek (retired: _retire)
            chunks = q.chunks
            while chunks and need > 0:
                msgs, nxt = chunks[0]
                if len(msgs) <= need:
                    chunks.popleft()
                    if out:
                        out.extend(msgs)
                    else:
                        out = msgs
                    need -= len(msgs)
                    q.buffered -= len(msgs)
                    q.consume_offset = nxt
                else:
                    out.extend(msgs[:need])
                    chunks[0] = (msgs[need:], nxt)
                    q.buffered -= need
                    q.consume_offset = min(msgs[need - 1].queue_offset + 1, nxt)
                    need = 0
            if chunks:  # the rest next time, after the others (round robin)
                q.in_ready = True
                ready.append(q)
            if q.buffered < self.pull_threshold:
                self._wake(q)
        self._buffered -= len(out)
        if self._held and self._buffered < self.pull_threshold_all:
            held, self._held = self._held, set()
            for q in held:
                self._wake(q)
        return out

    # -- flow control --------------------------------------------------------------------------
    def _held_back(self, q: _Queue) -> bool:
        """Whether ``q`` must not pull now: paused, at ``pull_threshold_per_queue``, or the
        consumer at ``pull_threshold_for_all`` (then woken when poll frees room)."""
        if q.paused or q.buffered >= self.pull_threshold:
            return True
        if self._buffered >= self.pull_threshold_all:
            self._held.add(q)
            return True
        return False

    def _wake(self, q: _Queue) -> None:
        """``q`` may pull again (if it waits): its task goes on, or its driver pulls it."""
        if q.space is not None:
            q.space.set()
        if q.parked:
            q.parked = False
            self._lite.execute_now(q)

    def _retire(self, q: _Queue) -> None:
        """``q`` is no longer pulled or polled (unassigned, or replaced by a seek)."""
        q.dropped = True
        if q.task is not None:
            q.task.cancel()
        self._buffered -= q.buffered
        self._held.discard(q)

    # -- positions -----------------------------------------------------------------------------
    def _state(self, mq: MessageQueue) -> _Queue:
        q = self._queues.get(mq)
        if q is None:
            raise ValueError(f"queue {mq} is not assigned to this consumer")
        return q

    async def seek(self, mq: MessageQueue, offset: int) -> None:
        """Continue ``mq`` at ``offset`` (within the queue's [min, max]); drops what was
        prefetched."""
        if not self._started:
            await self.start()
        q = self._state(mq)
        addr = await self.routes.addr_for_admin(mq)
        lo = await offsets.min_offset(self.pool, addr, mq, timeout=self.request_timeout)
        hi = await offsets.max_offset(self.pool, addr, mq, timeout=self.request_timeout)
        if not lo <= offset <= hi:
            raise ValueError(f"offset {offset} of {mq} is outside the queue's [{lo}, {hi}]")
        await self._reset(q, offset)

    async def seek_to_begin(self, mq: MessageQueue) -> None:
        if not self._started:
            await self.start()
        q = self._state(mq)
        addr = await self.routes.addr_for_admin(mq)
        await self._reset(q, await offsets.min_offset(self.pool, addr, mq,
                                                      timeout=self.request_timeout))

    async def seek_to_end(self, mq: MessageQueue) -> None:
        if not self._started:
            await self.start()
        q = self._state(mq)
        addr = await self.routes.addr_for_admin(mq)
        await self._reset(q, await offsets.max_offset(self.pool, addr, mq,
                                                      timeout=self.request_timeout))

    async def seek_to_timestamp(self, mq: MessageQueue, timestamp_ms: int) -> None:
        """Continue at the first message of ``mq`` stored at or after ``timestamp_ms``."""
        if not self._started:
            await self.start()
        q = self._state(mq)
        addr = await self.routes.addr_for_admin(mq)
        await self._reset(q, await offsets.search_offset(self.pool, addr, mq, timestamp_ms,
                                                         timeout=self.request_timeout))

    async def _reset(self, q: _Queue, offset: int) -> None:
        # A new state object: answers to pulls of the old one (a task's, or a pull driver's
        # in flight or standing) are void (they are checked against the current object).
        task = q.task
        self._retire(q)
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._queues.get(q.mq) is not q:
            return  # unassigned meanwhile
        n = self._queues[q.mq] = _Queue(q.mq)
        n.broker_id, n.committed, n.paused = q.broker_id, q.committed, q.paused
        n.pull_offset = n.consume_offset = offset
        self._lite.execute_now(n)

    def position(self, mq: MessageQueue) -> int | None:
        """The consume offset of ``mq``: right after the last message poll returned."""
        return self._state(mq).consume_offset

    async def committed(self, mq: MessageQueue) -> int | None:
        """The group's offset of ``mq`` on the broker, None when it has none."""
        addr = await self.routes.addr_for_admin(mq)
        return await offsets.query_consumer_offset(self.pool, addr, self.group, mq,
                                                   timeout=self.request_timeout)

    def pause(self, queues: Iterable[MessageQueue]) -> None:
        for mq in queues:
            self._state(mq).paused = True

    def resume(self, queues: Iterable[MessageQueue]) -> None:
        for mq in queues:
            q = self._state(mq)
            q.paused = False
            self._wake(q)

    # -- commits -------------------------------------------------------------------------------
    async def commit(self, offsets_: dict[MessageQueue, int] | None = None) -> None:
        """Store consume offsets on the brokers: every assigned queue's position, or the given
        ``{queue: next offset to consume}``."""
        if offsets_ is not None:
            states = []
            for mq, off in offsets_.items():
                q = self._state(mq)
                q.consume_offset = off
                states.append(q)
            await self._commit(states, force=True)
        else:
            await self._commit(list(self._queues.values()))

    async def _commit(self, states: list[_Queue], *, force: bool = False) -> None:
        todo = [q for q in states if q.consume_offset is not None
                and (force or q.consume_offset != q.committed)]
        if not todo:
            return

        async def one(q: _Queue) -> None:
            off = q.consume_offset
            assert off is not None
            addr = await self.routes.addr_for_admin(q.mq)
            await offsets.update_consumer_offset(self.pool, addr, self.group, q.mq, off,
                                                 timeout=self.request_timeout)
            q.committed = off

        results = await asyncio.gather(*(one(q) for q in todo), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    async def _auto_commit_loop(self) -> None:
        while True:
            await asyncio.sleep(self.auto_commit_interval)
            try:
                await self._commit(list(self._queues.values()))
            except TidemqError as exc:
                log.warning("auto-commit of group %s failed: %s", self.group, exc)

    # -- assignment ----------------------------------------------------------------------------
    async def _rebalance(self) -> None:
        if self._assigned is not None or self._closed:
            return
        have: dict[str, set[MessageQueue]] = {}
        for mq in self._queues:
            have.setdefault(mq.topic, set()).add(mq)
        # Topics without a route keep the queues we have: the name server may be briefly
        # unreachable.
        # The first rebalance fetches the routes 64 at a time (the consumer waits for it);
        # the periodic ones 4 at a time, so that they do not burst every 20 s.
        want, missing = await self.membership.share_all(
            list(self._subs), have, self._subs, concurrency=64 if not self._queues else 4)
        for topic, exc in missing.items():
            if topic not in self._warned:  # once: the loop retries every second
                self._warned.add(topic)
                log.warning("subscription to %r: %s", topic, exc.message)
        if self._closed:
            return
        self._apply(want)

    async def _rebalance_quietly(self, *, heartbeat: bool = False) -> None:
        try:
            if heartbeat and self._subs and self._assigned is None:
                await self.membership.heartbeat(self._subs)
            await self._rebalance()
        except Exception as exc:  # keep consuming what we have; the loop tries again
            log.warning("rebalance of group %s failed: %s", self.group, exc)

    async def _rebalance_loop(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        changed = self.membership.changed
        while True:
            # A subscribed topic without queues yet (just created, or the name server was
            # unreachable) is looked up again every second; the others every route_refresh
            # or rebalance_interval, and at once when a broker says the group changed.
            try:
                async with asyncio.timeout(min(self.route_refresh, 1.0)):
                    await changed.wait()
            except TimeoutError:
                pass
            woken = changed.is_set()
            changed.clear()
            # (the topics that have queues are kept by _apply: no walk over every queue here)
            missing = any(t not in self._topic_queues for t in self._subs)
            every = min(self.route_refresh, self.rebalance_interval)
            if woken or missing or loop.time() - last >= every:
                last = loop.time()
                await self._rebalance_quietly()

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            if self._subs and self._assigned is None:
                try:
                    await self.membership.heartbeat(self._subs)
                except TidemqError as exc:
                    log.warning("heartbeat of group %s failed: %s", self.group, exc)

    def _on_request(self, conn: Connection, frame: Frame) -> None:
        self.membership.on_request(conn, frame)

    def _apply(self, want: set[MessageQueue]) -> None:
        loop = asyncio.get_running_loop()
        if want == self._queues.keys() and not any(
                q.failed is not None for q in self._queues.values()):
            return  # nothing changed (the usual periodic rebalance): no sorting of every queue
        for mq in [m for m in self._queues if m not in want]:
            q = self._queues.pop(mq)
            self._retire(q)
            if self.auto_commit:
                loop.create_task(self._commit_quietly(q))
        added = []
        by_topic = _by_topic(want)
        order = [mq for t in sorted(by_topic) for mq in by_topic[t]]
        for mq in order:
            have = self._queues.get(mq)
            if have is None:
                q = _Queue(mq)
                self._queues[mq] = q
                added.append(q)
            elif have.failed is not None:  # assigned again: try again
                have.failed = None
                added.append(have)
        # after every queue is in: whether they are many (pull drivers) is known
        for q in added:
            self._lite.execute_now(q)
        self._order = [self._queues[mq] for mq in order]  # the queues are ``want`` now
        self._rr = 0
        self._topic_queues = {t: len(mqs) for t, mqs in by_topic.items()}

    async def _commit_quietly(self, q: _Queue) -> None:
        try:
            await self._commit([q])
        except TidemqError as exc:
            log.warning("commit of dropped queue %s failed: %s", q.mq, exc)

    # -- pulling -------------------------------------------------------------------------------
    async def _start_offset(self, mq: MessageQueue, addr: str) -> tuple[int, bool]:
        """(offset, committed?): the group's committed offset, else by consume_from."""
        t = self.request_timeout
        off = await offsets.query_consumer_offset(self.pool, addr, self.group, mq, timeout=t)
        if off is not None:
            return off, True
        return await self._offset_by_consume_from(mq, addr), False

    async def _offset_by_consume_from(self, mq: MessageQueue, addr: str) -> int:
        t = self.request_timeout
        if self.consume_from is ConsumeFrom.FIRST:
            return await offsets.min_offset(self.pool, addr, mq, timeout=t)
        if self.consume_from is ConsumeFrom.TIMESTAMP:
            return await offsets.search_offset(self.pool, addr, mq, self.consume_timestamp,
                                               timeout=t)
        return await offsets.max_offset(self.pool, addr, mq, timeout=t)

    def _start_task(self, q: _Queue) -> None:
        """Pull ``q`` queue by queue, with its own task (unless it has one)."""
        if q.task is None or q.task.done():
            q.task = asyncio.get_running_loop().create_task(self._pull_loop(q))

    def _many(self) -> bool:
        """Whether this consumer pulls through pull drivers (``multi_queue_min``)."""
        return self.multi_queue_min > 0 and len(self._queues) >= self.multi_queue_min

    async def _pull_loop(self, q: _Queue) -> None:
        """Pull ``q`` on its own, PULL_MESSAGE after PULL_MESSAGE, until it is handed to its
        broker's pull driver (many queues: client/lite_pulls.py) or cancelled."""
        mq = q.mq
        sel = self._subs.get(mq.topic, EVERYTHING)
        flags = PullSysFlag.SUSPEND | (PullSysFlag.SUBSCRIPTION if sel.filters else 0)
        suspend_ms = self.suspend_ms
        timeout = self.suspend_timeout + max(self.request_timeout, 10.0)
        subscription = sel.expression if sel.filters else None
        while True:
            addr = ""
            try:
                driver = None
                if q.broker_id == MASTER_ID and self._many():
                    got = (self.routes.addr_for_read_now(mq, MASTER_ID)
                           or await self.routes.addr_for_read(mq, MASTER_ID))
                    driver = None if got[1] else self._lite.driver(got[0])
                    if driver is not None and (q.pull_offset is not None
                                               or not self._no_resolve):
                        # the broker resolves the start; pulled by the driver from now on
                        q.task = None
                        driver.add(q)  # type: ignore[arg-type]
                        return
                if q.pull_offset is None:
                    async with self._lookups:  # thousands of queues: not all at once
                        off, committed = await self._start_offset(
                            mq, await self.routes.addr_for_admin(mq))
                    q.pull_offset = q.consume_offset = off
                    # A start chosen by consume_from is committed too, so a restart before
                    # the first poll does not skip what arrived in between.
                    q.committed = off if committed else None
                    if driver is not None:
                        continue  # to the driver, with its start
                if self._held_back(q):
                    if q.space is None:
                        q.space = asyncio.Event()
                    q.space.clear()
                    await q.space.wait()
                    continue
                known = self.routes.addr_for_read_now(mq, q.broker_id)
                addr, _slave = known or await self.routes.addr_for_read(mq, q.broker_id)
                conn = self.pool.get_nowait(addr) or await self.pool.get(addr)
                offset = q.pull_offset
                header = PullMessageRequestHeader(
                    consumer_group=self.group, topic=mq.topic, queue_id=mq.queue_id,
                    queue_offset=offset, max_msg_nums=self.pull_batch_size, sys_flag=flags,
                    suspend_timeout_millis=suspend_ms, subscription=subscription,
                    expression_type=sel.expression_type,
                )
                frame = await conn.request(RequestCode.PULL_MESSAGE, header, timeout=timeout)
                status = pull_status(frame.code)
                if status is None:
                    raise_for_error(frame)
                    raise BrokerError(f"pull refused ({frame.code})", response_code=frame.code)
                h = frame.header
                assert isinstance(h, PullMessageResponseHeader)
                self._handle(q, offset, status, h, frame.body)
            except asyncio.CancelledError:
                raise
            except TidemqError as exc:
                delay = self._pull_failed(q, exc, addr)
                if delay is None:
                    return
                await asyncio.sleep(delay)
            except Exception:  # a bug must not silently stop a queue forever
                log.exception("pull of %s failed unexpectedly; retrying in 1 s", mq)
                await asyncio.sleep(1.0)

    def _pull_failed(self, q: _Queue, exc: TidemqError, addr: str, *,
                     quiet: bool = False) -> float | None:
        """A pull of ``q`` failed: None if the queue stops (a refusal no retry fixes), else
        the seconds to wait before the next (``quiet``: the caller logged it)."""
        mq = q.mq
        if isinstance(exc, BrokerError) and exc.response_code in _FATAL_CODES:
            self._fail(q, exc)
            return None
        # SYSTEM_BUSY says when to come back (BrokerError.retry_after); else 1 s.
        delay: float = getattr(exc, "retry_after", 0.0) or 1.0
        if addr and not isinstance(exc, BrokerError):
            # unreachable: the next pull tries another broker of the group at once
            self.routes.mark_down(addr, mq.topic)
            if self.routes.group_size(mq.broker_name) > 1:
                delay = 0.2
        if not quiet:
            log.warning("pull of %s from %s failed: %s; retrying in %g s", mq, addr or "?",
                        exc, delay)
        return delay

    def _handle(self, q: _Queue, offset: int, status: PullStatus, h: Any, body: Any) -> None:
        """The answer to a pull of ``q`` from ``offset`` (a PULL_MESSAGE's header or a
        multi-queue result: the same fields)."""
        mq = q.mq
        q.broker_id = h.suggest_which_broker_id
        if status is PullStatus.FOUND:
            sel = self._subs.get(mq.topic, EVERYTHING)
            msgs, end = decode_pull_body(
                body, from_offset=offset, broker_name=mq.broker_name, tags=sel.tags,
                check_crc=self.check_crc, topic=mq.topic,
                on_corrupt=functools.partial(self._corrupt, mq),
                max_uncompressed=self.max_uncompressed_bytes,
            )
            if sel.sql is not None:
                msgs = sel.keep(msgs, body, h.members)
            nxt = max(h.next_begin_offset, end) if end > offset else h.next_begin_offset
            self._push(q, self._assemble(q, msgs), nxt)
        elif status is PullStatus.OFFSET_ILLEGAL:
            log.warning(
                "offset %d of %s is illegal (queue holds [%d, %d]); continuing at %d",
                offset, mq, h.min_offset, h.max_offset, h.next_begin_offset,
            )
            self._push(q, [], h.next_begin_offset)
        else:  # NO_NEW_MSG, NO_MATCHED_MSG
            if h.next_begin_offset != offset:
                self._push(q, [], h.next_begin_offset)

    @property
    def corrupt_batches(self) -> int:
        """Skips of undecodable records (a whole batch, or one message of a batch);
        ``stats()["corrupt_skipped"]`` counts the messages."""
        return self.corrupt.events

    def stats(self) -> dict[str, int]:
        return {
            "queues": len(self._queues),
            "buffered": self._buffered,
            "multi_pull_requests": self._lite.requests,
            "corrupt_skipped": self.corrupt.total,
            "chunks_assembled": sum(q.assembler.assembled for q in self._queues.values()
                                    if q.assembler is not None),
            "chunks_expired": sum(q.assembler.expired for q in self._queues.values()
                                  if q.assembler is not None),
        }

    def _fail(self, q: _Queue, exc: BrokerError) -> None:
        """Stop pulling ``q`` after a refusal no retry fixes; the next poll raises it."""
        err = BrokerError(
            f"pulling {q.mq} as group {self.group!r} was refused: {exc.message}; the queue is "
            "no longer pulled (assign it again to retry)",
            response_code=exc.response_code, code=exc.code,
        )
        q.failed = err
        self._errors.append(err)
        log.error("%s", err)
        self._ready.set()

    def _corrupt(self, mq: MessageQueue, queue_offset: int, count: int, why: str) -> None:
        where = (f"offsets {queue_offset}..{queue_offset + count - 1}" if count > 0
                 else f"offset {queue_offset} to the end of the pull")
        self.corrupt.skipped(
            "consumer", f"topic {mq.topic} queue {mq.broker_name}:{mq.queue_id} {where}", why,
            count,
        )

    def _assemble(self, q: _Queue, msgs: list[MessageExt]) -> list[MessageExt]:
        """Chunks (PR5) replaced by the messages they complete."""
        a = q.assembler
        if a is None:
            if not chunking.may_hold_chunks(msgs):
                return msgs
            a = q.assembler = ChunkAssembler(expire_s=self.chunk_expire)
        return a.feed(msgs)

    def _push(self, q: _Queue, msgs: list[MessageExt], nxt: int) -> None:
        q.pull_offset = nxt
        low = q.assembler.low_water() if q.assembler is not None else None
        if low is not None and low < nxt:
            nxt = low  # never commit past a chunked message still being assembled
        if not msgs and not q.chunks:
            q.consume_offset = nxt  # nothing pending before it: the position moves at once
            return
        q.chunks.append((msgs, nxt))
        q.buffered += len(msgs)
        self._buffered += len(msgs)
        if not q.in_ready:
            q.in_ready = True
            self._ready_qs.append(q)
        if msgs:
            self._ready.set()
