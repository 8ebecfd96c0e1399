"""SEND_MESSAGE / SEND_BATCH / SEND_MULTI_QUEUE (RocketMQ's SendMessageProcessor; ref BR1, ST9).

The body is exactly one batch as the producer encoded it (``record.encode_batch``). Per batch,
never per message, the processor checks, in this order:

- the frame has a body, no larger than ``max_message_size`` (4 MiB) plus the batch headers'
  allowance -> MESSAGE_TOO_LARGE;
- the producer group is a valid group name (``protocol.names``) -> INVALID_ARGUMENT;
- the topic is not a system topic nor a dead-letter topic, and a retry topic ``%RETRY%<g>``
  only from a connection that is a live member of group ``g`` (RocketMQ's consumers send a
  failed message there directly when the send-back fails) -> NO_PERMISSION;
- the topic exists, or auto-create is on and the name is valid (RocketMQ's
  ``^[%|a-zA-Z0-9_-]{1,127}$``) -> TOPIC_NOT_EXIST / MESSAGE_ILLEGAL; the topic is writable ->
  NO_PERMISSION; the queue id is below its write queue count -> INVALID_ARGUMENT;
- the body is a well-formed batch whose topic and queue id equal the header's, and whose
  content a reader can decode (``protocol.batch_rules.validate_batch``: UTF-8 tags, keys and
  properties, properties within ``max_properties_size`` for every message, a compressed
  batch's declared raw size within the limit and exactly what its records decompress to,
  records that tile their section) -> MESSAGE_ILLEGAL / MESSAGE_TOO_LARGE, the message naming
  the first problem (a batch whose CRC also fails is answered with the CRC error: it was
  damaged on its way, not built wrong);

then hands the bytes to ``MessageStore.put``, which verifies the batch CRC (MESSAGE_ILLEGAL),
stamps the store fields in place and dispatches the consume queue. The response carries the
unique id of message 0, the queue id, the queue offset of message 0 and the message count
(message ``i`` has offset ``queue_offset + i`` and id ``producer_id:base_seq + i``).

Flush modes: ASYNC_FLUSH answers right after the put. SYNC_FLUSH passes ``on_durable`` to the
put; the store calls it on its flush thread after the group-commit fsync, and the response is
sent from the event loop (``call_soon_threadsafe``, one hop per flush, not per send). A send not
durable within ``sync_flush_timeout_ms`` is answered FLUSH_DISK_TIMEOUT (stored, not yet on
disk -- not retryable, a resend would store it twice). One-way sends are stored the same way and
never answered, errors included.

SYNC_MASTER (docs/cluster.md): the answer also waits until ``min_in_sync_replicas`` slaves hold
the batch -- the HA service completes the waiting sends of a whole acknowledgement round in one
loop wake-up (``HAService.expect_replicas``), and SYNC_FLUSH + SYNC_MASTER answers when both
hold. Too few slaves in sync: SLAVE_NOT_AVAILABLE at once; not replicated within
``sync_flush_timeout_ms``: FLUSH_SLAVE_TIMEOUT. Both mean "stored on the master only".

Threads: the broker's event loop only (the durability callback hops onto it).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from tidemq.broker.connection import decode_request
from tidemq.broker.dedup import DupStatus, MessageDeduplication
from tidemq.broker.errors import RequestRejected, rejection_for_store_error
from tidemq.protocol.batch.columns import BatchColumns, read_columns
from tidemq.protocol.batch_rules import BatchLimits, plain_batches, validate_batch
from tidemq.protocol.codes import ResponseCode
from tidemq.protocol.errors import CorruptBatchError, MessageTooLargeError, TidemqError
from tidemq.protocol.frame import FLAG_ONEWAY
from tidemq.protocol.headers import (
    DEDUP_PRODUCER_BIT,
    MultiQueueSendResult,
    Perm,
    SendMessageRequestHeader,
    SendMessageResponseHeader,
    SendMultiQueueRequestHeader,
    SendMultiQueueResponseHeader,
    TopicConfig,
)
from tidemq.protocol.multi_queue import split_offsets
from tidemq.protocol.names import (
    dlq_group,
    group_name_problem,
    is_system_topic,
    retry_group,
    topic_name_problem,
)
from tidemq.protocol.record import (
    ATTR_DELAY_MASK,
    ATTR_TXN_MASK,
    ATTR_TXN_SHIFT,
    STORE_HEADER_SIZE,
    BatchView,
    TxnType,
    unique_id,
)
from tidemq.store.flush import FlushMode
from tidemq.store.message_store import PutResult, PutStatus

if TYPE_CHECKING:
    import asyncio

    from tidemq.broker.broker import Broker
    from tidemq.broker.connection import BrokerConnection
    from tidemq.protocol.frame import Frame

__all__ = ["SendProcessor"]

log = logging.getLogger(__name__)

_perf_counter = time.perf_counter
# enum members looked up once: an IntEnum / StrEnum member lookup costs ~0.2 us, per send
_SUCCESS = ResponseCode.SUCCESS
_FLUSH_TIMEOUT = ResponseCode.FLUSH_DISK_TIMEOUT
_PUT_OK = PutStatus.PUT_OK
_WRITE = int(Perm.WRITE)
_DELAY_BITS = ATTR_DELAY_MASK
_TXN_BITS = ATTR_TXN_MASK
_PREPARED_BITS = TxnType.PREPARED << ATTR_TXN_SHIFT  # a half message's txn bits
#: topics remembered as plain (no reserved-name checks) at most: every existing topic in
#: practice (100,000 queues are 12,500 topics of 8), bounded all the same
_PLAIN_MAX = 1 << 20


class _TopicDoor:
    """What the door and the stats need of one plain, persistent topic for a SEND_MULTI_QUEUE
    frame's plain batch, reached with one lookup by the topic's bytes (issue 17: at 100,000
    queues every batch is of another of 12,500 topics, and the decoded name, the plain-topic
    set, the topic table and the stats counter were four lookups, each a few cache misses).
    Valid while the topic table's ``changes`` is ``changes`` (any create, update or delete
    sends the next batch of every topic through the full door again, which renews it)."""

    __slots__ = ("topic", "tc", "changes", "stat")

    def __init__(self, topic: str, tc: TopicConfig, changes: int, stat: list[int]) -> None:
        self.topic = topic
        self.tc = tc
        self.changes = changes
        self.stat = stat


def _ignore_durability(err: object) -> None:
    """on_durable of a one-way SYNC_FLUSH send: nobody to tell (but never block the loop)."""


class _PendingSend:
    """A SYNC_FLUSH or SYNC_MASTER send between its put and its response: answered once the
    fsync covering it is done (``durable``) and, under SYNC_MASTER, once the in-sync slaves
    hold it (``replica``: None = not waited for, False = waiting, True = replicated, or the
    response code that says why not -- SLAVE_NOT_AVAILABLE)."""

    __slots__ = ("waiters", "conn", "opaque", "header", "durable", "error", "answered", "dedup",
                 "replica")

    def __init__(self, waiters: _DurabilityWaiters, conn: BrokerConnection, opaque: int) -> None:
        self.waiters = waiters
        self.conn = conn
        self.opaque = opaque
        self.header: SendMessageResponseHeader | None = None
        self.durable = False
        self.error: object = None
        self.answered = False
        # (MessageDeduplication, producer id, highest sequence) of a deduplicated batch
        self.dedup: tuple[MessageDeduplication, int, int] | None = None
        self.replica: bool | int | None = None

    def __call__(self, err: object) -> None:  # the store's on_durable, any thread
        self.waiters.arrive(self, err)

    def stored(self, header: SendMessageResponseHeader) -> None:
        """The put returned (loop thread)."""
        self.header = header
        if self.durable and self.replica is not False:
            self._answer()
        else:
            self.waiters.expect(self)

    def made_durable(self, err: object) -> None:
        """The fsync covering this batch finished (loop thread)."""
        self.durable = True
        self.error = err
        if self.dedup is not None:
            dedup, pid, highest = self.dedup
            if err is None:
                dedup.persisted_up_to(pid, highest)
            else:
                dedup.failed(pid)
        if self.header is not None and self.replica is not False:
            self._answer()

    def replicated(self, code: int | None) -> None:
        """SYNC_MASTER: the in-sync slaves hold the batch (None), or they cannot (a response
        code); loop thread."""
        self.replica = True if code is None else code
        if self.header is not None and self.durable:
            self._answer()

    def time_out(self) -> None:
        """Not durable, or not replicated, within the sync flush timeout (loop thread)."""
        if not self.answered:
            self.answered = True
            if not self.durable:
                log.warning("send to %s not durable within the sync flush timeout", self.conn.peer)
                self.conn.respond(self.opaque, ResponseCode.FLUSH_DISK_TIMEOUT, self.header)
            else:
                log.warning("send to %s not replicated within the sync flush timeout",
                            self.conn.peer)
                self.conn.respond(self.opaque, ResponseCode.FLUSH_SLAVE_TIMEOUT, self.header)

    def _answer(self) -> None:
        if self.answered:
            return
        self.answered = True
        if self.error is not None:
            # Stored, but the fsync failed or the store closed: durability is unknown.
            log.error("flush after a send failed: %s", self.error)
            self.conn.respond(self.opaque, ResponseCode.FLUSH_DISK_TIMEOUT, self.header)
        elif self.replica is None or self.replica is True:
            self.conn.respond(self.opaque, ResponseCode.SUCCESS, self.header)
        elif self.replica == ResponseCode.SERVICE_NOT_AVAILABLE:
            # fenced (election): this master's etcd lease lapsed, another may have been elected
            self.conn.respond_error(
                self.opaque, ResponseCode.SERVICE_NOT_AVAILABLE,
                "this broker's mastership lease in etcd lapsed before the slaves confirmed the "
                "batch: it is not acknowledged (send it again; the group's master may have "
                "changed)",
            )
        else:  # stored here, but not on the slaves: the code says why (SLAVE_NOT_AVAILABLE)
            self.conn.respond(self.opaque, self.replica, self.header)


class _DurabilityWaiters:
    """SYNC_FLUSH sends between their put and their fsync (event loop).

    Durability callbacks arrive on the loop in one hop per group commit (the store's flush
    service hands each round to the loop; ``arrive`` also copes with a callback from another
    thread). The sync flush timeout is one timer for all pending sends, not a ``call_later``
    per send (a libuv timer each, plus its cancel, was a tenth of a single send's broker time):
    sends wait in a deque in the order they were stored, so they also expire in that order, and
    a sweep at most every SWEEP_S drops the answered ones from the head and times out the
    expired ones (at most SWEEP_S late)."""

    SWEEP_S = 0.1

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self.loop = loop
        self.timeout_s = timeout_s
        self._loop_thread = threading.get_ident()
        self._arrived: collections.deque[tuple[_PendingSend, object]] = collections.deque()
        self._scheduled = False
        self._expiring: collections.deque[tuple[float, _PendingSend]] = collections.deque()
        self._sweep_handle: asyncio.TimerHandle | None = None

    def arrive(self, pending: _PendingSend, err: object) -> None:
        if threading.get_ident() == self._loop_thread:
            pending.made_durable(err)
            return
        self._arrived.append((pending, err))
        if not self._scheduled:
            self._scheduled = True
            try:
                self.loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is closed: the broker is gone, nobody to answer
                pass

    def _drain(self) -> None:
        self._scheduled = False
        arrived = self._arrived
        while arrived:
            pending, err = arrived.popleft()
            pending.made_durable(err)

    def expect(self, pending: _PendingSend) -> None:
        """Time ``pending`` out unless it is answered within timeout_s (loop thread)."""
        now = self.loop.time()
        self._expiring.append((now + self.timeout_s, pending))
        if self._sweep_handle is None:
            self._sweep_handle = self.loop.call_at(
                min(now + self.timeout_s, now + self.SWEEP_S), self._sweep
            )

    def _sweep(self) -> None:
        self._sweep_handle = None
        q = self._expiring
        now = self.loop.time()
        while q:
            deadline, pending = q[0]
            if not pending.answered and deadline > now:
                break
            q.popleft()
            pending.time_out()  # a no-op for one answered meanwhile
        if q:
            self._sweep_handle = self.loop.call_at(
                min(q[0][0], now + self.SWEEP_S), self._sweep
            )

class _MultiResponse:
    """The one response of a SEND_MULTI_QUEUE: a slot per batch, sent when all are filled
    (never for a one-way request: the connection drops that answer)."""

    __slots__ = ("conn", "opaque", "results", "left", "is_armed", "sent")

    def __init__(self, conn: BrokerConnection, opaque: int, n: int) -> None:
        self.conn = conn
        self.opaque = opaque
        self.results: list[MultiQueueSendResult | None] = [None] * n
        self.left = n
        self.is_armed = False
        self.sent = False

    def put(self, i: int, result: MultiQueueSendResult) -> None:
        if self.results[i] is not None:
            return
        self.results[i] = result
        self.left -= 1
        if not self.left and self.is_armed:
            self._send()

    def armed(self) -> None:
        self.is_armed = True
        if not self.left:
            self._send()

    def _send(self) -> None:
        if self.sent:
            return
        self.sent = True
        self.conn.respond(self.opaque, ResponseCode.SUCCESS,
                          SendMultiQueueResponseHeader(results=self.results))  # type: ignore[arg-type]


class _Slot:
    """Stands in for the connection while one batch of a SEND_MULTI_QUEUE goes through
    ``SendProcessor._handle_send``: its answer fills the batch's slot. ``real`` is the
    connection (membership and transaction checks use it); anything else is forwarded."""

    __slots__ = ("agg", "i")

    def __init__(self, agg: _MultiResponse, i: int) -> None:
        self.agg = agg
        self.i = i

    @property
    def real(self) -> BrokerConnection:
        return self.agg.conn

    def __getattr__(self, name: str) -> object:
        return getattr(self.agg.conn, name)

    def respond(self, opaque: int, code: int, header: object, bodies: object = None) -> None:
        if isinstance(header, SendMessageResponseHeader):
            r = MultiQueueSendResult(code, header.queue_offset, header.count,
                                     header.commit_log_offset)
        else:
            r = MultiQueueSendResult(code, message=getattr(header, "message", ""))
        self.agg.put(self.i, r)

    def respond_error(self, opaque: int, code: int, message: str) -> None:
        self.agg.put(self.i, MultiQueueSendResult(code, message=message))


class SendProcessor:
    """Handles SEND_MESSAGE / SEND_BATCH (event loop only)."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.store = broker.store
        self.topics = broker.topics
        self.stats = broker.stats
        cfg = self.config = broker.config
        self.sync_flush = cfg.flush is FlushMode.SYNC
        #: SYNC_MASTER: answer once min_in_sync_replicas slaves hold the batch (the HA service
        #: sets it, also when a promotion changes the role)
        self.sync_master = False
        self.max_batch = cfg.max_message_size + cfg.batch_overhead_allowance
        self.waiters = _DurabilityWaiters(
            broker.loop, self.store.config.sync_flush_timeout_ms / 1000.0
        )
        self._topic_bytes: dict[str, bytes] = {}
        self._topic_names: dict[bytes, str] = {}  # a frame's topic bytes, decoded once
        self._groups_ok: set[str] = set()  # producer group names already checked
        #: topics any connection may send to (not system, dead-letter nor retry topics): the
        #: door's name checks run once per topic, not per frame
        self._plain_topics: set[str] = set()
        #: topic bytes -> _TopicDoor: a frame's plain batch of a known topic in one lookup
        self._doors: dict[bytes, _TopicDoor] = {}
        self.limits = BatchLimits(
            max_batch_bytes=self.max_batch, max_properties_size=cfg.max_properties_size
        )
        self.dedup = broker.dedup
        self.non_persistent = broker.non_persistent

    def handle(self, conn: BrokerConnection, frame: Frame) -> None:
        h: SendMessageRequestHeader = decode_request(frame, SendMessageRequestHeader)
        body = frame.body
        topic = h.topic
        qid = h.queue_id
        size = len(body)
        # _admit's two halves, called directly (one call less per send)
        self._admit_queue(conn, h.producer_group, topic, qid, size)
        v = self._admit_content(topic, qid, body, size, None)
        if frame.flags or not self._stored_at_once(v, topic):
            self._accept(conn, h, body, v, frame.flags, frame.opaque)
            return
        # The everyday send, answered right after its put (not one-way either): what _accept
        # does for it, without its branches (a one-message send costs the broker a few calls
        # per layer it crosses).
        t0 = _perf_counter()
        try:
            r = self.store.put(body, queue_id=qid, view=v, topic=topic)  # the door compared it
        except TidemqError as exc:
            raise rejection_for_store_error(exc) from None
        count = r.count
        self.stats.record_put(topic, count, size, _perf_counter() - t0)
        conn.respond(frame.opaque, _SUCCESS if r.status is _PUT_OK else _FLUSH_TIMEOUT,
                     SendMessageResponseHeader(
                         msg_id=unique_id(v.producer_id, v.base_seq), queue_id=qid,
                         queue_offset=r.queue_offset, count=count))

    def _stored_at_once(self, v: BatchView, topic: str) -> bool:
        """Whether an admitted batch is simply stored and answered: ASYNC_FLUSH, not
        replicated synchronously, not held (delay level, deliver_at, half message), not
        deduplicated, persistent. Such batches skip ``_accept`` (a single send) or go into
        one ``put_many`` run (SEND_MULTI_QUEUE); ``_accept`` handles every other one."""
        a = v.attributes  # delay level and txn type read from their bits (no property calls)
        return not (self.sync_flush or self.sync_master or a & _DELAY_BITS or v.deliver_at
                    or a & _TXN_BITS == _PREPARED_BITS
                    or (v.producer_id >= DEDUP_PRODUCER_BIT and self.dedup.enabled)
                    or self.non_persistent.owns(topic))

    def handle_multi(self, conn: BrokerConnection, frame: Frame) -> None:
        """SEND_MULTI_QUEUE: every batch of the body through exactly the door and the put of
        a SEND_BATCH (``_handle_send``), each answered into its slot of one response, which
        leaves once every batch has its outcome (SYNC_FLUSH / SYNC_MASTER batches when
        durable / replicated).

        The frame is one unit where it can be (issue 17): the header columns of all its
        batches are read at once (``protocol.batch.columns``), ``batch_rules.plain_batches``
        passes the plain batches (spread traffic's: a few messages, no keys) in one vectorised
        step, and those are stored by one ``MessageStore.put_frame``. Every other batch (keys,
        compressed, held,
        deduplicated, anything the vectorised step does not pass) takes the per-batch door,
        which words any refusal; a refusal answers only that batch's slot."""
        h: SendMultiQueueRequestHeader = decode_request(frame, SendMultiQueueRequestHeader)
        body = frame.body
        try:
            starts, sizes = split_offsets(body, h.batches, self.max_batch)
        except CorruptBatchError as exc:
            raise RequestRejected(
                ResponseCode.MESSAGE_ILLEGAL,
                f"SEND_MULTI_QUEUE body is not {h.batches} whole batches: {exc.message}",
            ) from None
        mv = memoryview(body).cast("B")
        agg = _MultiResponse(conn, frame.opaque, len(starts))
        flags = frame.flags
        group = h.producer_group
        cols, plain, qids = self._plain_rows(mv, starts, sizes)
        # Stored in body order, in runs: ``fast`` (plain batches, one put_frame), ``run``
        # (other batches stored at once, one put_many); any other batch goes alone through
        # _accept, after the runs before it.
        fast: list[int] = []
        fast_doors: list[_TopicDoor] = []
        run: list[tuple[int, memoryview, BatchView, str]] = []
        names = self._topic_names
        doors = self._doors
        table = self.topics
        # the group is the frame's: a checked one lets its batches take their topic's door
        group_ok = group in self._groups_ok
        max_batch = self.max_batch
        for i, (start, size) in enumerate(zip(starts, sizes, strict=True)):
            if plain is not None and plain[i]:
                tl = plain[i]
                tb = mv[start + STORE_HEADER_SIZE : start + STORE_HEADER_SIZE + tl].tobytes()
                d = doors.get(tb)
                if d is not None and not (
                        d.changes == table.changes and group_ok and size <= max_batch
                        and d.tc.perm & _WRITE and qids[i] < d.tc.write_queue_nums):
                    d = None  # (_admit_queue's checks that can fail for a known plain topic)
                if d is None:  # the full door
                    topic = names.get(tb)
                    known = topic is not None
                    if not known:
                        try:
                            topic = tb.decode()
                        except UnicodeDecodeError:
                            topic = None  # the per-batch door words it
                    if topic is not None and not self.non_persistent.owns(topic):
                        try:
                            self._admit_queue(conn, group, topic, qids[i], size)
                        except RequestRejected as exc:
                            agg.put(i, MultiQueueSendResult(exc.response_code,
                                                            message=exc.message))
                            continue
                        if not known and len(names) < _PLAIN_MAX:
                            names[tb] = topic  # only names the door let in: bounded
                        d = self._door(topic, tb)
                        group_ok = True  # _admit_queue passed it
                if d is not None:
                    if run:
                        self._put_run(agg, run)
                        run = []
                    fast.append(i)
                    fast_doors.append(d)
                    continue
            if fast:
                self._put_fast(agg, mv, cols, fast, fast_doors)  # type: ignore[arg-type]
                fast, fast_doors = [], []
            part = mv[start : start + size]
            try:
                v = BatchView(part)
                topic, qid = v.topic, v.queue_id
            except CorruptBatchError as exc:
                agg.put(i, MultiQueueSendResult(
                    ResponseCode.MESSAGE_ILLEGAL,
                    message=f"the body is not a valid batch: {exc.message}"))
                continue
            try:
                self._admit(conn, group, topic, qid, part, v)
            except RequestRejected as exc:
                agg.put(i, MultiQueueSendResult(exc.response_code, message=exc.message))
                continue
            if self._stored_at_once(v, topic):
                run.append((i, part, v, topic))
                continue
            if run:
                self._put_run(agg, run)
                run = []
            sub = SendMessageRequestHeader(
                producer_group=group, topic=topic, queue_id=qid,
                born_timestamp=h.born_timestamp, batch=True,
            )
            try:
                self._accept(_Slot(agg, i), sub, part, v, flags, i)  # type: ignore[arg-type]
            except RequestRejected as exc:
                agg.put(i, MultiQueueSendResult(exc.response_code, message=exc.message))
        if fast:
            self._put_fast(agg, mv, cols, fast, fast_doors)  # type: ignore[arg-type]
        if run:
            self._put_run(agg, run)
        agg.armed()

    def _plain_rows(self, mv: memoryview, starts: list[int], sizes: list[int]
                    ) -> tuple[BatchColumns | None, list[int] | None, list[int]]:
        """The frame's columns; per batch, its topic length when it may take the frame path
        (a plain batch that ``_stored_at_once`` would store at once), else 0; per batch its
        queue id. (None, None, []) when no batch can (SYNC_FLUSH, SYNC_MASTER)."""
        if self.sync_flush or self.sync_master:
            return None, None, []
        cols = read_columns(mv, starts, sizes)
        ok = plain_batches(mv, cols, self.limits)
        if self.dedup.enabled:
            ok &= cols.producer["producer_id"] < DEDUP_PRODUCER_BIT
        return (cols, np.where(ok, cols.store["topic_len"], 0).tolist(),
                cols.store["queue_id"].tolist())

    def _door(self, topic: str, tb: bytes) -> _TopicDoor:
        """The door of an admitted persistent topic: remembered (by its bytes) when the topic
        is plain, so its next batches skip the lookups of ``_admit_queue``."""
        table = self.topics
        tc = table.get(topic)
        assert tc is not None  # admitted: the topic exists (or was just created)
        d = _TopicDoor(topic, tc, table.changes, self.stats.put_counter(topic))
        if topic in self._plain_topics and len(self._doors) < _PLAIN_MAX:
            self._doors[tb] = d
        return d

    def _put_fast(self, agg: _MultiResponse, mv: memoryview, cols: BatchColumns,
                  rows: list[int], doors: list[_TopicDoor]) -> None:
        """Store plain batches of a SEND_MULTI_QUEUE with one put_frame; each answered into
        its slot (a batch the store refuses as a SEND_BATCH of it would be)."""
        t0 = time.perf_counter()
        qoffs, errors = self.store.put_frame(mv, cols, rows, [d.topic for d in doors])
        each = (time.perf_counter() - t0) / len(rows)
        sizes = cols.sizes[rows].tolist()
        counts = cols.producer["count"][rows].tolist()
        stored: list[tuple[str, list[int], int, int]] = []
        ok = ResponseCode.SUCCESS
        put = agg.put
        for j, (i, q) in enumerate(zip(rows, qoffs, strict=True)):
            if q >= 0:
                d = doors[j]
                stored.append((d.topic, d.stat, counts[j], sizes[j]))
                put(i, MultiQueueSendResult(ok, q, counts[j]))
            else:
                exc = rejection_for_store_error(errors[j])
                put(i, MultiQueueSendResult(exc.response_code, message=exc.message))
        self.stats.record_put_counters(stored, each)

    def _put_run(self, agg: _MultiResponse, run: list[tuple[int, memoryview, BatchView, str]]
                 ) -> None:
        """Store admitted batches of a SEND_MULTI_QUEUE with one put_many; each answered
        into its slot (a batch the store refuses as a SEND_BATCH of it would be)."""
        t0 = time.perf_counter()
        # the topics decoded at the door, not decoded again by the store
        results = self.store.put_many([(part, v) for _i, part, v, _t in run],
                                      [t for _i, _part, _v, t in run])
        each = (time.perf_counter() - t0) / len(run)
        stored: list[tuple[str, int, int]] = []
        ok = ResponseCode.SUCCESS
        for (i, _part, _v, _t), r in zip(run, results, strict=True):
            if isinstance(r, PutResult):
                stored.append((r.topic, r.count, r.size))
                agg.put(i, MultiQueueSendResult(ok, r.queue_offset, r.count))
            else:
                exc = rejection_for_store_error(r)
                agg.put(i, MultiQueueSendResult(exc.response_code, message=exc.message))
        self.stats.record_puts(stored, each)

    def _handle_send(self, conn: BrokerConnection, h: SendMessageRequestHeader,
                     body: bytes | bytearray | memoryview, flags: int, opaque: int) -> None:
        """One batch through the door and into the store; answered on ``conn`` (a real
        connection, or a SEND_MULTI_QUEUE slot)."""
        v = self._admit(conn, h.producer_group, h.topic, h.queue_id, body)
        self._accept(conn, h, body, v, flags, opaque)

    def _admit(self, conn: BrokerConnection, producer_group: str, topic: str, qid: int,
               body: bytes | bytearray | memoryview, v: BatchView | None = None) -> BatchView:
        """The door of one batch (the checks of the module docstring, in that order):
        RequestRejected, or the batch's view. ``v``: the view of ``body`` already parsed, whose
        own topic and queue id the caller passes (SEND_MULTI_QUEUE: nothing to compare)."""
        size = len(body)
        self._admit_queue(conn, producer_group, topic, qid, size)
        return self._admit_content(topic, qid, body, size, v)

    def _admit_queue(self, conn: BrokerConnection, producer_group: str, topic: str, qid: int,
                     size: int) -> None:
        """The door's checks of the size, the group, the topic and the queue (the first ones
        of the module docstring): RequestRejected."""
        cfg = self.config
        if size == 0:
            raise RequestRejected(
                ResponseCode.INVALID_ARGUMENT,
                "send request has no body; the body is one batch (record.encode_batch)",
            )
        if size > self.max_batch:
            raise RequestRejected(
                ResponseCode.MESSAGE_TOO_LARGE,
                f"batch of {size} bytes exceeds the broker's limit of {cfg.max_message_size} "
                f"bytes (max_message_size, plus {cfg.batch_overhead_allowance} for batch "
                "headers); send fewer or smaller messages per batch",
            )
        if producer_group not in self._groups_ok:
            problem = group_name_problem(producer_group, "producer group")
            if problem:
                raise RequestRejected(ResponseCode.INVALID_ARGUMENT, problem)
            if len(self._groups_ok) < 4096:
                self._groups_ok.add(producer_group)
        plain = topic in self._plain_topics
        if not plain:
            self._check_reserved_topic(getattr(conn, "real", conn), topic)
        tc = self.topics.get(topic)
        if tc is None:
            problem = topic_name_problem(topic)
            if problem:
                raise RequestRejected(ResponseCode.MESSAGE_ILLEGAL, problem)
            if not cfg.auto_create_topic:
                raise RequestRejected(
                    ResponseCode.TOPIC_NOT_EXIST,
                    f"topic {topic!r} does not exist on broker {cfg.broker_name} and "
                    f"auto-create is off; create it first (tidemq topic create {topic})",
                )
            tc = self.broker.auto_create_topic(topic)
        if not plain and retry_group(topic) is None and len(self._plain_topics) < _PLAIN_MAX:
            # a topic that exists (so the set is bounded by the topic table, not by the names
            # clients try) and that any connection may send to: checked once
            self._plain_topics.add(topic)
        if not tc.perm & _WRITE:
            raise RequestRejected(
                ResponseCode.NO_PERMISSION,
                f"topic {topic!r} is not writable on broker {cfg.broker_name} "
                f"(perm {tc.perm:#x})",
            )
        if qid >= tc.write_queue_nums:
            raise RequestRejected(
                ResponseCode.INVALID_ARGUMENT,
                f"queue id {qid} is out of range: topic {topic!r} has {tc.write_queue_nums} "
                f"write queues (0..{tc.write_queue_nums - 1}) on broker {cfg.broker_name}",
            )

    def _admit_content(self, topic: str, qid: int, body: bytes | bytearray | memoryview,
                       size: int, v: BatchView | None) -> BatchView:
        """The door's checks of the batch itself (the last ones of the module docstring):
        RequestRejected, or the batch's view."""
        own = v is not None  # topic and queue id were read from this very view
        if v is None:
            try:
                v = BatchView(body)
            except CorruptBatchError as exc:
                raise RequestRejected(
                    ResponseCode.MESSAGE_ILLEGAL, f"the body is not a valid batch: {exc.message}"
                ) from None
        if v.total_size != size:
            raise RequestRejected(
                ResponseCode.MESSAGE_ILLEGAL,
                f"the batch says it is {v.total_size} bytes but the body has {size}; a send "
                "carries exactly one batch",
            )
        if not own:
            tb = self._topic_bytes.get(topic)
            if tb is None:
                tb = self._topic_bytes[topic] = topic.encode()
            if v.topic_bytes != tb:
                raise RequestRejected(
                    ResponseCode.MESSAGE_ILLEGAL,
                    f"header topic {topic!r} differs from the batch's topic {v.topic!r}",
                )
            if v.queue_id != qid:
                raise RequestRejected(
                    ResponseCode.MESSAGE_ILLEGAL,
                    f"header queue id {qid} differs from the batch's queue id {v.queue_id}",
                )
        try:
            validate_batch(v, self.limits)
        except (CorruptBatchError, MessageTooLargeError) as exc:
            if not v.batch_crc_ok():
                raise RequestRejected(
                    ResponseCode.MESSAGE_ILLEGAL,
                    "batch rejected: batch CRC32C mismatch: the batch was damaged on its way",
                ) from None
            if isinstance(exc, MessageTooLargeError):
                raise RequestRejected(ResponseCode.MESSAGE_TOO_LARGE, exc.message) from None
            raise RequestRejected(
                ResponseCode.MESSAGE_ILLEGAL, f"batch rejected: {exc.message}"
            ) from None
        return v

    def _accept(self, conn: BrokerConnection, h: SendMessageRequestHeader,
                body: bytes | bytearray | memoryview, v: BatchView, flags: int,
                opaque: int) -> None:
        """Store (or hold, or publish) one admitted batch and answer it."""
        topic = h.topic
        qid = h.queue_id
        size = len(body)
        oneway = flags & FLAG_ONEWAY
        if self.non_persistent.owns(topic):
            if v.delay_level or v.deliver_at or v.txn == TxnType.PREPARED:
                raise RequestRejected(
                    ResponseCode.MESSAGE_ILLEGAL,
                    f"topic {topic!r} is non-persistent: it cannot take delayed, timed or "
                    "transactional messages (the broker holds those on disk); send them to a "
                    "persistent topic",
                )
            self.non_persistent.publish(conn, opaque, oneway, body, v, qid)
            return
        pending = None
        pid = v.producer_id
        dedup = self.dedup if pid >= DEDUP_PRODUCER_BIT and self.dedup.enabled else None
        if dedup is not None and not self._dedup_admits(dedup, conn, opaque, oneway, v):
            return
        t0 = time.perf_counter()
        sync_master = self.sync_master
        try:
            if self.sync_flush:
                if oneway:
                    r = self._put(h, conn, body, qid, v, on_durable=_ignore_durability)
                else:
                    pending = _PendingSend(self.waiters, conn, opaque)
                    if dedup is not None:
                        pending.dedup = (dedup, pid, v.base_seq + v.count - 1)
                    if sync_master:
                        pending.replica = False
                    r = self._put(h, conn, body, qid, v, on_durable=pending)
            elif sync_master and not oneway:
                pending = _PendingSend(self.waiters, conn, opaque)
                pending.durable = True  # ASYNC_FLUSH: only the slaves are waited for
                pending.replica = False
                r = self._put(h, conn, body, qid, v)
            else:
                r = self._put(h, conn, body, qid, v)
        except TidemqError as exc:
            if dedup is not None:
                dedup.failed(pid)
            raise rejection_for_store_error(exc) from None
        if dedup is not None and (not self.sync_flush or oneway):
            # ASYNC_FLUSH: the batch is in the CommitLog mapping (survives a broker crash).
            # A one-way SYNC_FLUSH send has no durability callback; the same holds for it.
            dedup.persisted_up_to(pid, v.base_seq + v.count - 1)
        self.stats.record_put(topic, r.count, size, time.perf_counter() - t0)
        if oneway:
            return
        header = SendMessageResponseHeader(
            msg_id=unique_id(v.producer_id, v.base_seq),
            queue_id=r.queue_id,
            queue_offset=r.queue_offset,
            count=v.count,
        )
        if v.txn == TxnType.PREPARED:
            header.commit_log_offset = r.phys_offset
            header.transaction_id = header.msg_id
        if pending is not None:
            if pending.replica is False:
                self.broker.ha.expect_replicas(pending, r.phys_offset + r.size)
            pending.stored(header)
        elif r.status is PutStatus.PUT_OK:
            conn.respond(opaque, ResponseCode.SUCCESS, header)
        else:
            conn.respond(opaque, ResponseCode.FLUSH_DISK_TIMEOUT, header)

    def _check_reserved_topic(self, conn: BrokerConnection, topic: str) -> None:
        """NO_PERMISSION unless this connection may send to ``topic`` (names.py's rule for
        system, dead-letter and retry topics)."""
        if is_system_topic(topic):
            raise RequestRejected(
                ResponseCode.NO_PERMISSION,
                f"topic {topic!r} is a system topic the broker writes itself (delayed, timed "
                "or transactional messages); clients cannot send to it -- send to the real "
                "topic with delay_level / deliver_at, or through a TransactionProducer",
            )
        group = dlq_group(topic)
        if group is not None:
            raise RequestRejected(
                ResponseCode.NO_PERMISSION,
                f"topic {topic!r} is the dead-letter topic of consumer group {group!r}; only "
                "the broker writes it (a consumer's send-back after the last retry)",
            )
        group = retry_group(topic)
        if group is None:
            return
        if not self.broker.consumers.is_member(group, conn):
            raise RequestRejected(
                ResponseCode.NO_PERMISSION,
                f"topic {topic!r} is the retry topic of consumer group {group!r}; only a "
                f"connection of a live member of {group!r} (one that sent HEART_BEAT for it) "
                "may send to it -- a consumer sends a failed message back with "
                "CONSUMER_SEND_MSG_BACK",
            )

    def _put(
        self, h: SendMessageRequestHeader, conn: BrokerConnection,
        body: bytes | bytearray | memoryview, qid: int, v: BatchView, on_durable: Any = None,
    ) -> PutResult:
        """Half messages to the transaction service; everything else through
        ``Broker.put_internal`` (which holds delayed and timed batches)."""
        if v.txn == TxnType.PREPARED:
            self.broker.transactions.register_producer(h.producer_group,
                                                       getattr(conn, "real", conn))
            return self.broker.transactions.prepare(body, v, qid, h.producer_group, on_durable)
        return self.broker.put_internal(body, qid, on_durable=on_durable, view=v)

    def _dedup_admits(
        self, dedup: MessageDeduplication, conn: BrokerConnection, opaque: int, oneway: int,
        v: BatchView,
    ) -> bool:
        """BR12: False when the batch must not be stored (answered here: DUPLICATE or
        RETRY_LATER); True when it is new (and now counts as pushed)."""
        status = dedup.check(v.producer_id, v.base_seq, v.count)
        if status is DupStatus.NEW:
            return True
        if oneway:
            return False
        if status is DupStatus.DUPLICATE:
            conn.respond_error(
                opaque, ResponseCode.DUPLICATE,
                f"sequence {v.base_seq} of producer {v.producer_id:016X} is already stored "
                f"(highest persisted {dedup.last_sequence(v.producer_id)}); not stored again",
            )
        else:
            conn.respond_error(
                opaque, ResponseCode.RETRY_LATER,
                f"sequence {v.base_seq} of producer {v.producer_id:016X} was received but is "
                "not durable yet; retry the same batch shortly",
            )
        return False
