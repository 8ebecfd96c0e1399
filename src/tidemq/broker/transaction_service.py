"""Transactional messages: half messages, END_TRANSACTION and the check service (ref BR9,
RocketMQ 4.9's transactional messages).

Flow (RocketMQ's TransactionalMessageServiceImpl / EndTransactionProcessor /
TransactionalMessageCheckService)::

    producer --SEND (attributes txn=PREPARED)--> half envelope on RMQ_SYS_TRANS_HALF_TOPIC/0
             (hidden: consumers never read system topics; properties REAL_TOPIC, REAL_QID,
              PGROUP, TRAN_ID, TRANSACTION_CHECK_TIMES, FIRST_BORN)
    producer runs its local transaction, then --END_TRANSACTION (commit|rollback|unknown)-->
      commit   -> the inner batch is put to its real topic/queue (store header prepared_offset =
                  the half envelope's CommitLog offset), then an op record
      rollback -> an op record only
    op record: RMQ_SYS_TRANS_OP_HALF_TOPIC/0, tag "d", body = the half queue offset of the
               transaction's latest half copy, property TRAN_ID (RocketMQ's REMOVETAG record)

Resolution is by transaction id (the message id of the half's message 0), not by offset: a
transaction resolved once is never resolved again (a late or repeated END_TRANSACTION, or one
answering an older check, is acknowledged and ignored), so a commit is stored exactly once.

The check service runs every ``transaction_check_interval_ms`` over the half queue from its
progress offset: a resolved entry (or one superseded by a later copy) is finished; an entry
checked ``transaction_check_max`` times goes to TRANS_CHECK_MAX_TIME_TOPIC (with an op record);
one older than ``transaction_skip_ms`` (72 h) is dropped; one younger than its immunity time
(``transaction_timeout_ms``, or the message's CHECK_IMMUNITY_TIME_IN_SECONDS property) waits;
any other is *put back* (a new half copy with TRANSACTION_CHECK_TIMES + 1, as RocketMQ's
putBackHalfMsgQueue) and a CHECK_TRANSACTION_STATE request (one-way, body = the inner batch)
goes to one live producer connection of its group, whose answer is an END_TRANSACTION. The
progress offsets of the half and op queues are persisted in
``<config>/transaction_progress.json`` after every round, once the round's puts are durable
(they are made without waiting for their fsyncs); on start the resolved set is rebuilt
from the op queue and the latest copy of each pending transaction from the half queue.

Producers of a group are known from their connections: a half send, an END_TRANSACTION, or a
HEART_BEAT listing the group (``register_producer``); a closed connection is forgotten.

Threads: the broker's event loop only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from tidemq.base.atomic_file import read_file, write_atomic
from tidemq.broker.envelope import REAL_QID, REAL_TOPIC, wrap
from tidemq.broker.errors import RequestRejected, check_group
from tidemq.protocol.batch import fields
from tidemq.protocol.codes import RequestCode, ResponseCode
from tidemq.protocol.errors import OffsetOutOfRangeError, TidemqError
from tidemq.protocol.frame import FLAG_ONEWAY, Frame, encode_frame_parts
from tidemq.protocol.headers import (
    CheckTransactionStateRequestHeader,
    EndTransactionRequestHeader,
    HeartbeatRequestHeader,
)
from tidemq.protocol.record import (
    BatchView,
    MessageData,
    StoredMessage,
    TxnType,
    encode_batch,
    unique_id,
)
from tidemq.store.message_store import GetStatus, PutResult

if TYPE_CHECKING:
    from tidemq.broker.broker import Broker
    from tidemq.broker.connection import BrokerConnection
    from tidemq.store.flush import FlushCallback

__all__ = ["TransactionService", "HALF_TOPIC", "OP_TOPIC", "DISCARD_TOPIC", "with_topic"]

log = logging.getLogger(__name__)

HALF_TOPIC = "RMQ_SYS_TRANS_HALF_TOPIC"
OP_TOPIC = "RMQ_SYS_TRANS_OP_HALF_TOPIC"
DISCARD_TOPIC = "TRANS_CHECK_MAX_TIME_TOPIC"
REMOVE_TAG = "d"
PGROUP = "PGROUP"
TRAN_ID = "TRAN_ID"
CHECK_TIMES = "TRANSACTION_CHECK_TIMES"
FIRST_BORN = "FIRST_BORN"
IMMUNITY = "CHECK_IMMUNITY_TIME_IN_SECONDS"
_SLICE = 256  # half messages judged per turn of the event loop in a check round


def with_topic(data: bytes | bytearray | memoryview, topic: str) -> bytearray:
    """A copy of the batch with another topic in its store header (the producer section and
    its CRC unchanged): how a batch is moved to the discard topic."""
    v = BatchView(data)
    return fields.with_topic(data, topic, v.producer_start, v.total_size)


def _now() -> int:
    return time.time_ns() // 1_000_000


class TransactionService:
    """One per broker. Event loop only."""

    def __init__(self, broker: Broker, progress_path: str) -> None:
        self.broker = broker
        self.store = broker.store
        self.config = broker.config
        self.path = progress_path
        self.half_progress = 0
        self.op_progress = 0
        self._written: tuple[int, int] | None = None  # (half, op) the file holds, if known
        self.producers: dict[str, dict[Any, float]] = {}  # group -> {connection: last seen}
        self.resolved: dict[str, int] = {}  # txn id -> half offset of its latest copy
        self.latest_copy: dict[str, int] = {}  # txn id -> offset of its latest put-back copy
        self._ops: deque[tuple[int, int, str]] = deque()  # (op offset, half offset, txn id)
        self.stats = {"prepared": 0, "committed": 0, "rolled_back": 0, "checks_sent": 0,
                      "discarded": 0, "skipped": 0, "duplicate_ends": 0, "corrupt_skipped": 0}
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        raw = read_file(self.path)
        if raw:
            data = json.loads(raw)
            self.half_progress, self.op_progress = int(data["half"]), int(data["op"])
            self._written = (self.half_progress, self.op_progress)
        self._rebuild()
        self._task = loop.create_task(self._check_forever(), name="transaction-check")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.persist()

    def persist(self) -> None:
        write_atomic(self.path, self._snapshot())

    def _snapshot(self) -> bytes:
        return json.dumps({"half": self.half_progress, "op": self.op_progress}).encode()

    def _rebuild(self) -> None:
        off = self.op_progress
        for q, v in self._scan(OP_TOPIC, off):
            try:
                m = next(v.messages())
                txn, half = m.properties.get(TRAN_ID, ""), int(m.body)
            except (TidemqError, ValueError) as exc:  # never a reason not to start
                self._skipped(OP_TOPIC, q, exc)
                continue
            self.resolved[txn] = max(half, self.resolved.get(txn, -1))
            self._ops.append((q, half, txn))
        for q, v in self._scan(HALF_TOPIC, self.half_progress):
            try:
                m = next(v.messages())
                self.latest_copy[m.properties[TRAN_ID]] = q
            except (TidemqError, KeyError) as exc:
                self._skipped(HALF_TOPIC, q, exc)

    def _skipped(self, topic: str, queue_offset: int, exc: Exception) -> None:
        """A half or op record that does not decode: counted, logged, passed over."""
        self.stats["corrupt_skipped"] += 1
        self.store.corrupt.skipped("transaction", f"{topic} queue 0 offset {queue_offset}",
                                   f"passed over: {exc}")

    def _scan(
        self, topic: str, off: int, end: int | None = None
    ) -> Iterator[tuple[int, BatchView]]:
        """(queue offset, batch view) of every single-message batch of ``topic``/0 from
        ``off`` up to ``end`` (the queue's end when None)."""
        end = self.store.max_offset(topic, 0) if end is None else end
        while off < end:
            r = self.store.get_messages(topic, 0, off, 64)
            if r.status is not GetStatus.FOUND:
                if r.next_begin_offset > off:
                    off = r.next_begin_offset
                    continue
                return
            for rb in r.batches:
                if rb.queue_offset >= end:
                    return
                yield rb.queue_offset, BatchView(rb.data)
                off = rb.queue_offset + 1

    # -- producers -------------------------------------------------------------------------------
    def register_producer(self, group: str, conn: BrokerConnection) -> None:
        if group:
            self.producers.setdefault(group, {})[conn] = time.monotonic()

    def wrap_heartbeat(
        self, inner: Callable[[BrokerConnection, Frame], None] | None
    ) -> Callable[[BrokerConnection, Frame], None]:
        """A HEART_BEAT handler that records the producer groups it lists, then runs
        ``inner`` (the consumer-group handler) or answers SUCCESS itself when there is none."""

        def handle(conn: BrokerConnection, frame: Frame) -> None:
            from tidemq.broker.connection import decode_request

            # The broker keeps request headers raw (msgspec.Raw) until a handler decodes them:
            # read the producer groups from the decoded header, never from the raw frame.
            h: HeartbeatRequestHeader = decode_request(frame, HeartbeatRequestHeader)
            for g in h.producer_groups:
                check_group(g, "producer_groups[]", "producer group")
            for g in h.producer_groups:
                self.register_producer(g, conn)
            if inner is not None:
                inner(conn, frame)
            elif not frame.flags & FLAG_ONEWAY:
                conn.respond(frame.opaque, ResponseCode.SUCCESS, None)

        return handle

    def _live_producer(self, group: str) -> BrokerConnection | None:
        conns = self.producers.get(group)
        if not conns:
            return None
        for c in [c for c in conns if c.closed]:
            del conns[c]
        return max(conns, key=conns.__getitem__) if conns else None

    # -- half messages ---------------------------------------------------------------------------
    def prepare(
        self, data: bytes | bytearray | memoryview, v: BatchView, queue_id: int, group: str,
        on_durable: FlushCallback | None,
    ) -> PutResult:
        """Store the half message (hidden) and return the envelope's place."""
        txn = unique_id(v.producer_id, v.base_seq)
        now = _now()
        env = wrap(
            HALF_TOPIC, 0, data, real_topic=v.topic, real_qid=queue_id,
            producer_id=v.producer_id, base_seq=v.base_seq, count=v.count, born_ts=now,
            extra={PGROUP: group, TRAN_ID: txn, CHECK_TIMES: "0", FIRST_BORN: str(now)},
        )
        r = self.store.put(env, queue_id=0, on_durable=on_durable)
        self.stats["prepared"] += 1
        return r

    def handle_end(self, conn: BrokerConnection, frame: Frame) -> None:
        """END_TRANSACTION (one-way or not)."""
        from tidemq.broker.connection import decode_request

        h: EndTransactionRequestHeader = decode_request(frame, EndTransactionRequestHeader)
        check_group(h.producer_group, "producer_group", "producer group")
        self.register_producer(h.producer_group, conn)
        try:
            v = self.store.read_batch(h.commit_log_offset)
            v.verify()
        except (TidemqError, OffsetOutOfRangeError) as exc:
            raise RequestRejected(
                ResponseCode.TRANSACTION_FAILED,
                f"no half message at CommitLog offset {h.commit_log_offset} ({exc}); the "
                "offset comes from the half send's result",
            ) from None
        if v.topic != HALF_TOPIC or v.queue_offset != h.tran_state_table_offset:
            raise RequestRejected(
                ResponseCode.TRANSACTION_FAILED,
                f"CommitLog offset {h.commit_log_offset} holds no half message at half queue "
                f"offset {h.tran_state_table_offset}",
            )
        try:
            m = next(v.messages())
            props = m.properties
            txn = props[TRAN_ID]
            real_qid = int(props[REAL_QID])
        except (TidemqError, KeyError, ValueError) as exc:
            raise RequestRejected(
                ResponseCode.TRANSACTION_FAILED,
                f"the half message at CommitLog offset {h.commit_log_offset} is unreadable "
                f"({exc})",
            ) from None
        if h.msg_id and h.msg_id != txn:
            raise RequestRejected(
                ResponseCode.TRANSACTION_FAILED,
                f"the half message at offset {h.commit_log_offset} belongs to transaction "
                f"{txn}, not {h.msg_id}",
            )
        state = h.commit_or_rollback
        # Answered once the op record is durable (SYNC_FLUSH: its fsync also covers the
        # committed message, written before it; ASYNC_FLUSH: at once), never by blocking the
        # loop on an fsync: other sends keep sharing the group commits meanwhile.
        answer = (
            _ignore_durable if frame.flags & FLAG_ONEWAY
            else _AnswerWhenDurable(conn, frame.opaque)
        )
        if txn in self.resolved or (
            v.queue_offset < self.half_progress and txn not in self.latest_copy
        ):
            # resolved before (the check round only passes a copy once it is resolved or
            # superseded): acknowledge, never store a commit twice
            self.stats["duplicate_ends"] += 1
            answer(None)
        elif state == TxnType.COMMIT:
            inner = bytearray(m.body)
            # the committed copy names its half message (RocketMQ's prepared offset)
            fields.set_prepared_offset(inner, h.commit_log_offset)
            self.broker.put_internal(inner, real_qid, on_durable=_ignore_durable)
            self._resolve(txn, v.queue_offset, "commit")
            # durable, and under SYNC_MASTER held by the slaves, like a send (RocketMQ)
            self.store.when_durable(answer)
            self.stats["committed"] += 1
        elif state == TxnType.ROLLBACK:
            self._resolve(txn, v.queue_offset, "rollback")
            self.store.when_durable(answer)
            self.stats["rolled_back"] += 1
        else:
            answer(None)

    def _resolve(
        self, txn: str, half_offset: int, result: str, on_durable: FlushCallback | None = None
    ) -> None:
        half = max(half_offset, self.latest_copy.pop(txn, -1))
        op = encode_batch(
            OP_TOPIC,
            [MessageData(str(half).encode(), tags=REMOVE_TAG,
                         properties={TRAN_ID: txn, "RESULT": result})],
        )
        r = self.store.put(op, queue_id=0, on_durable=on_durable)
        self.resolved[txn] = half
        self._ops.append((r.queue_offset, half, txn))

    # -- checking --------------------------------------------------------------------------------
    async def _check_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.transaction_check_interval_ms / 1000)
            try:
                await self.check_round()
            except Exception:
                log.exception("transaction check round failed")
            # The round's puts (copies, discards, op records) did not wait for their fsyncs:
            # its progress is persisted once they are durable, never ahead of them.
            err = await self._all_durable()
            if err is not None:
                log.error("transaction check round: its puts may not be durable (%s); progress "
                          "not persisted", err)
                continue
            progress = (self.half_progress, self.op_progress)
            if progress == self._written:
                continue  # nothing moved since the file was written: an idle broker writes nothing
            try:
                self._written = None
                await asyncio.to_thread(write_atomic, self.path, self._snapshot())
                self._written = progress
            except OSError as exc:
                log.error("persisting transaction progress to %s failed: %s", self.path, exc)

    async def _all_durable(self) -> object:
        """Wait until everything put so far is durable; the flush error or None."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[object] = loop.create_future()

        def done(err: object) -> None:  # the loop, or a closing store's thread
            loop.call_soon_threadsafe(_set_result, fut, err)

        self.store.when_durable(done)
        return await fut

    def check_once(self) -> None:
        """One round over the pending half messages (see the module docstring), at once."""
        for _ in self._round():
            pass

    async def check_round(self) -> None:
        """One round, giving the event loop a turn every ``_SLICE`` half messages: a backlog
        of a million half messages must not stall sends and pulls for the whole round."""
        for i, _ in enumerate(self._round()):
            if i % _SLICE == _SLICE - 1:
                await asyncio.sleep(0)

    def _round(self) -> Iterator[None]:
        """The check round as a generator that yields after each half message. Safe to
        suspend at a yield: each entry is judged from the state at that moment (an
        END_TRANSACTION handled in between resolves its transaction before the round gets to
        it; one for an entry already passed is seen through ``resolved``)."""
        cfg = self.config
        now = _now()
        end = self.store.max_offset(HALF_TOPIC, 0)
        prefix = True
        for q, v in self._scan(HALF_TOPIC, self.half_progress, end):
            try:
                m = next(v.messages())
                props = m.properties
                txn = props[TRAN_ID]
                age = now - int(props[FIRST_BORN])
                checks = int(props[CHECK_TIMES])
                BatchView(m.body)  # the inner batch's framing (put back, committed)
            except (TidemqError, KeyError, ValueError) as exc:
                # A half message that cannot be read can never be checked or committed:
                # passed over (counted, logged) so the round and its progress go on.
                self._skipped(HALF_TOPIC, q, exc)
                if prefix:
                    self.half_progress = q + 1
                yield
                continue
            finished = txn in self.resolved or self.latest_copy.get(txn, q) > q
            if not finished:
                if checks >= cfg.transaction_check_max:
                    self.store.put(with_topic(m.body, DISCARD_TOPIC), queue_id=0,
                                   on_durable=_ignore_durable)
                    self._resolve(txn, q, "discard", _ignore_durable)
                    self.stats["discarded"] += 1
                    log.warning("transaction %s checked %d times: moved to %s", txn, checks,
                                DISCARD_TOPIC)
                    finished = True
                elif age > cfg.transaction_skip_ms:
                    self._resolve(txn, q, "skip", _ignore_durable)
                    self.stats["skipped"] += 1
                    finished = True
                elif age >= self._immunity_ms(m.body):
                    self._check(v, m, q, checks)
                    finished = True
            if prefix and finished:
                self.half_progress = q + 1
            else:
                prefix = False
            yield
        while self._ops and self._ops[0][1] < self.half_progress:
            op_off, half, txn = self._ops.popleft()
            if self.resolved.get(txn) == half:
                del self.resolved[txn]
            self.op_progress = op_off + 1

    def _immunity_ms(self, inner: bytes) -> int:
        base = self.config.transaction_timeout_ms
        try:
            first = next(BatchView(inner).messages(0, self.store.config.max_batch_bytes))
        except TidemqError:
            return base
        sec = first.properties.get(IMMUNITY)
        if sec and sec.isdigit():
            return max(base, int(sec) * 1000)
        return base

    def _check(self, v: BatchView, m: StoredMessage, q: int, checks: int) -> None:
        """Put the half back with one more check, and ask a live producer of its group."""
        props = dict(m.properties)
        props[CHECK_TIMES] = str(checks + 1)
        inner = BatchView(m.body)
        env = wrap(
            HALF_TOPIC, 0, m.body, real_topic=props.pop(REAL_TOPIC),
            real_qid=int(props.pop(REAL_QID)), producer_id=inner.producer_id,
            base_seq=inner.base_seq, count=inner.count, born_ts=m.born_ts,
            extra={k: val for k, val in props.items() if k != "COUNT"},
        )
        r = self.store.put(env, queue_id=0, on_durable=_ignore_durable)
        txn = props[TRAN_ID]
        self.latest_copy[txn] = r.queue_offset
        conn = self._live_producer(props.get(PGROUP, ""))
        if conn is None:
            log.info("transaction %s: no live producer of group %r to check", txn,
                     props.get(PGROUP))
            return
        header = CheckTransactionStateRequestHeader(
            producer_group=props.get(PGROUP, ""), tran_state_table_offset=r.queue_offset,
            commit_log_offset=r.phys_offset, msg_id=txn, transaction_id=txn,
        )
        conn.write(encode_frame_parts(
            Frame(RequestCode.CHECK_TRANSACTION_STATE, 0, FLAG_ONEWAY, header, bytes(m.body))
        ))
        self.stats["checks_sent"] += 1

    def pending(self) -> int:
        return max(0, self.store.max_offset(HALF_TOPIC, 0) - self.half_progress)


def _ignore_durable(err: object) -> None:
    """on_durable of a put nobody waits for (a one-way END_TRANSACTION; the committed message,
    whose durability the op record's answers for; the check round's puts, whose progress is
    persisted after _all_durable)."""


def _set_result(fut: asyncio.Future[object], value: object) -> None:
    if not fut.done():
        fut.set_result(value)


class _AnswerWhenDurable:
    """on_durable of END_TRANSACTION's op record: answer the producer (event loop: the broker
    hands group commits to its loop; ASYNC_FLUSH calls it inside the put)."""

    __slots__ = ("conn", "opaque")

    def __init__(self, conn: BrokerConnection, opaque: int) -> None:
        self.conn = conn
        self.opaque = opaque

    def __call__(self, err: object) -> None:
        if err is None:
            self.conn.respond(self.opaque, ResponseCode.SUCCESS, None)
        else:
            log.error("end of transaction stored, but its flush failed: %s", err)
            self.conn.respond_error(
                self.opaque, ResponseCode.SYSTEM_ERROR,
                f"the end of the transaction was stored but its fsync failed ({err}); it may "
                "be lost if the broker's machine fails",
            )
