"""POP_MESSAGE, ACK_MESSAGE, CHANGE_INVISIBLE_TIME: server-side dispatch (docs/pop-dispatch.md).

A POP group's members take messages from any queue of a topic; each popped message is invisible
to the group for ``invisible_ms`` and comes back with its delivery attempt + 1 unless acked in
time. The state of one (group, topic, queue) is a :class:`PopWindow`; this module is the wire
around it:

- **pop**: queues walked round robin from a per-(group, topic) cursor (or the one named);
  per queue the window hands out revived deliveries first, then new offsets; the batches that
  hold them are read from the store and answered whole, with one member bitmap (and, for
  redeliveries, the attempts) per batch (``protocol/pop.py``). Messages the subscription
  (tag or SQL92) does not select are acked on the spot, never delivered. A revived delivery
  past the group's ``retry_max_times`` attempts is copied into ``%DLQ%<group>`` (as a push
  consumer's message is, ``send_back.py``) and acked instead of delivered.
- **long polling**: an empty pop with ``poll_ms`` is held (``pop_hold.py``) and tried again
  when a message arrives for its topic, when an in-flight message's invisible time runs out
  (one timer per window) or after an ack of its (group, topic) in orderly mode; PULL_NOT_FOUND
  when its time is up.
- **ack**: many handles per frame; per handle SUCCESS, NO_MESSAGE (stale) or
  INVALID_ARGUMENT. The acked prefix of a queue (``PopWindow.start``) is the group's consumer
  offset, committed to the offset table (so ``tidemq group`` shows the lag).
- **change invisible time**: a new handle for the same delivery attempt; the old is stale.

One group name, one consumption mode: a group that pulled (push / lite pull consumers, or with
heartbeating members) cannot pop, and a group that popped cannot pull, on this broker
(CONSUME_MODE_CONFLICT, with the reason) -- their offsets would fight.

Durable: every pop, ack and invisible-time change is appended to ``rmq_sys_POP_LOG`` before
its answer leaves, and replayed at start (``pop_log.py``).

Threads: the broker's event loop only.
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from tidemq.broker.connection import decode_request
from tidemq.broker.consume_switches import check_consume_allowed
from tidemq.broker.errors import RequestRejected, check_group
from tidemq.broker.pop_hold import HeldPop, PopHoldService, WindowKey
from tidemq.broker.pop_log import POP_LOG_TOPIC, PopLog, PopSnapshots
from tidemq.broker.pop_notification import NotificationHandler
from tidemq.broker.pop_orderly import pop_orderly, poppable_orderly
from tidemq.broker.pop_window import Popped, PopWindow
from tidemq.broker.send_back import store_copy
from tidemq.broker.sql_select import sql_filter_for
from tidemq.broker.subscription_types import SubscriptionTypes
from tidemq.protocol.codes import DLQ_PREFIX, RequestCode, ResponseCode
from tidemq.protocol.errors import CorruptBatchError, TidemqError
from tidemq.protocol.headers import Perm, TopicConfig
from tidemq.protocol.members import bitmap, filter_fields
from tidemq.protocol.pop import (
    ANY_QUEUE,
    INIT_EARLIEST,
    INIT_LATEST,
    AckMessageRequestHeader,
    AckMessageResponseHeader,
    ChangeInvisibleRequestHeader,
    ChangeInvisibleResponseHeader,
    NotificationRequestHeader,
    PopMessageRequestHeader,
    PopMessageResponseHeader,
    PoppedBatch,
)
from tidemq.protocol.receipt import ReceiptError, ReceiptHandle, decode_receipt, encode_receipt
from tidemq.protocol.record import BatchView
from tidemq.store.message_store import GetStatus

if TYPE_CHECKING:
    from tidemq.broker.broker import Broker
    from tidemq.broker.connection import BrokerConnection
    from tidemq.protocol.frame import Frame

__all__ = ["PopProcessor", "POP", "PULL"]

log = logging.getLogger(__name__)

POP = "POP"
PULL = "PULL"
_R = ResponseCode
_SCAN = 256  # offsets read per store call when gathering popped batches


def _is_num(x: str) -> bool:
    """``protocol/receipt.py``'s rule for a number field: ASCII digits, no leading zero."""
    return x.isdigit() and x.isascii() and len(x) <= 19 and (x[0] != "0" or len(x) == 1)


def _now_ms() -> int:
    return int(time.time() * 1000)


class _Selector:
    """A pop's subscription: None = every message; else matches(tag, props)."""

    __slots__ = ("tags", "sql")

    def __init__(self, h: PopMessageRequestHeader | NotificationRequestHeader) -> None:
        self.tags: frozenset[str] | None = None
        self.sql = None
        kind = (h.expression_type or "TAG").upper()
        expr = (h.subscription or "").strip()
        if kind == "SQL92":
            self.sql = sql_filter_for(expr)
        elif kind != "TAG":
            raise RequestRejected(
                _R.SUBSCRIPTION_PARSE_FAILED,
                f"expression type {h.expression_type!r} is not supported; use TAG or SQL92")
        elif expr and expr != "*":
            tags = frozenset(t.strip() for t in expr.split("||") if t.strip())
            if not tags:
                raise RequestRejected(
                    _R.SUBSCRIPTION_PARSE_FAILED,
                    f"tag expression {expr!r} names no tag; use '*' or 'TagA || TagB'")
            if "*" not in tags:
                self.tags = tags

    @property
    def everything(self) -> bool:
        return self.tags is None and self.sql is None

    def matches(self, tag: str | None, props: dict[str, str] | None) -> bool:
        if props is None:
            return False  # undecodable: nobody's (the reader reports it)
        if self.sql is not None:
            return self.sql.matches(props, tag)
        return self.tags is None or tag in self.tags


class PopProcessor:
    """The POP requests of one broker (event loop only)."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.windows: dict[tuple[str, str, int], PopWindow] = {}
        self.modes: dict[str, str] = {}  # group -> POP or PULL (first use on this broker)
        self.orderly: dict[str, bool] = {}  # group -> pops orderly (first pop on this broker)
        self._cursor: dict[tuple[str, str], int] = {}
        self.hold = PopHoldService(broker.loop, self._windows_of, self._fail)
        self.notifications = NotificationHandler(self)
        self.popped = 0
        self.requests = 0  # POP_MESSAGE frames handled (held ones once)
        self.answers = 0  # pop answers that carried messages (first tries and held ones)
        self.acked = 0
        self.stale = 0
        self.dead = 0  # copied to %DLQ%<group> after retry_max_times deliveries
        self.log = PopLog(broker.store)
        self.types = SubscriptionTypes(self)  # Pulsar subscription types (their own module)
        self.snapshots = PopSnapshots(
            os.path.join(broker.config.config_path, "pop_windows.snapshot"), broker.store)

    async def run_snapshots(self) -> None:
        await self.snapshots.run(self._snapshot_source,
                                 self.broker.config.offset_persist_interval_ms / 1000)

    def _snapshot_source(self) -> tuple[dict[Any, PopWindow], int]:
        """The windows and the log offset they cover. A slave's windows follow the log its
        master streams (:meth:`catch_up`) first: its snapshot is as good as the master's."""
        if self.broker.ha.is_slave:
            self.catch_up(commit=False)
            return self.windows, self.log.replayed_to
        return self.windows, self.broker.store.max_offset(POP_LOG_TOPIC, 0)

    def _window_for(self, group: str, topic: str, qid: int, first: int) -> PopWindow:
        """The window a replayed record applies to (a new one starts at the committed offset,
        else at the first offset the log names)."""
        key = (group, topic, qid)
        w = self.windows.get(key)
        if w is None:
            start = self.broker.offsets.query(group, topic, qid)
            w = self.windows[key] = PopWindow(start if start >= 0 else first)
            self.modes.setdefault(group, POP)
        return w

    def _seek_window(self, group: str, topic: str, qid: int, offset: int) -> None:
        """A replayed seek record: the window starts over at ``offset``."""
        self.windows[(group, topic, qid)] = PopWindow(offset)
        self.modes.setdefault(group, POP)

    def catch_up(self, *, commit: bool) -> int:
        """Apply the ``rmq_sys_POP_LOG`` records stored since the last replay: a slave's log
        grows by replication while its windows stand still. At a promotion (``commit``: the
        acked prefixes become the committed offsets) the windows are then exactly the old
        master's, as far as the log reached this slave. A log cut back (a slave's unreplicated
        tail dropped) rebuilds everything."""
        if self.broker.store.max_offset(POP_LOG_TOPIC, 0) < self.log.replayed_to:
            self.windows.clear()
            return self.recover()
        n = self.log.replay(self._window_for, self.log.replayed_to, self._seek_window)
        if commit:
            for (group, topic, qid), w in self.windows.items():
                self._commit(group, topic, qid, w)
        if n:
            log.info("POP state caught up: %d records, %d windows", n, len(self.windows))
        return n

    def recover(self) -> int:
        """Rebuild the windows from ``rmq_sys_POP_LOG`` (at start, before serving)."""
        window_for = self._window_for
        snap = self.snapshots.load()
        if snap is not None and snap[0] > self.broker.store.max_offset(POP_LOG_TOPIC, 0):
            # the log was cut back below it (a slave's tail the new master never had)
            log.warning("POP snapshot covers log offset %d, past the log's end: replaying "
                        "the whole log", snap[0])
            snap = None
        start = 0
        if snap is not None:
            start, saved = snap
            for group, topic, qid, state in saved:
                self.windows[(group, topic, qid)] = PopWindow.from_state(state)
                self.modes.setdefault(group, POP)
        n = self.log.replay(window_for, start, self._seek_window)
        for (group, topic, qid), w in self.windows.items():
            self._commit(group, topic, qid, w)
        if n:
            log.info("POP state recovered: %d records, %d windows", n, len(self.windows))
        return n

    def handlers(self) -> dict[int, Any]:
        return {
            RequestCode.POP_MESSAGE: self.handle_pop,
            RequestCode.ACK_MESSAGE: self.handle_ack,
            RequestCode.CHANGE_INVISIBLE_TIME: self.handle_change,
            RequestCode.SEEK_SUBSCRIPTION: self.types.handle_seek,
            RequestCode.NOTIFICATION: self.notifications.handle,
        }

    # -- consumption mode ----------------------------------------------------------------------
    def check_mode(self, group: str, mode: str, client_id: str | None = None) -> None:
        """Refuse ``group`` consumed in ``mode`` when it is consumed in the other mode here
        (by pops or pulls, or by heartbeating members other than ``client_id``)."""
        have = self.modes.get(group)
        if have is None:
            info = self.broker.consumers.group_of(group)
            if info is not None and any(c != client_id for c in info.members):
                have = POP if info.consume_type == "POP" else PULL
        if have is None:
            self.modes[group] = mode
            return
        if have != mode:
            what = {POP: "POP consumers (SimpleConsumer)", PULL: "pull/push consumers"}
            raise RequestRejected(
                _R.CONSUME_MODE_CONFLICT,
                f"consumer group {group!r} is consumed by {what[have]} on broker "
                f"{self.broker.config.broker_name}; {what[mode]} cannot join it: one group "
                "name has one consumption mode, use another group name")

    # -- POP_MESSAGE ---------------------------------------------------------------------------
    def handle_pop(self, conn: BrokerConnection, frame: Frame) -> None:
        h: PopMessageRequestHeader = decode_request(frame, PopMessageRequestHeader)
        if frame.is_oneway:
            raise RequestRejected(_R.INVALID_ARGUMENT, "a pop cannot be one-way")
        self.requests += 1
        self._admit(h)
        if self._answer(conn, frame.opaque, h):
            return
        if h.poll_ms > 0:
            self.hold.hold(HeldPop(conn, frame.opaque, h, self._attempt_pop, self._expire_pop,
                                   h.poll_ms / 1000.0, self.broker.loop.time()))
        else:
            self._empty(conn, frame.opaque, h)

    def _admit(self, h: PopMessageRequestHeader | NotificationRequestHeader) -> None:
        group = h.consumer_group
        check_group(group)
        check_consume_allowed(self.broker, group)
        self.readable_topic(h.topic, h.queue_id)
        if h.init_mode.upper() not in (INIT_EARLIEST, INIT_LATEST):
            raise RequestRejected(
                _R.INVALID_ARGUMENT,
                f"init mode {h.init_mode!r} is not EARLIEST or LATEST")
        if self.broker.non_persistent.owns(h.topic):
            raise RequestRejected(
                _R.NO_PERMISSION, f"topic {h.topic!r} is non-persistent: it cannot be popped")
        _Selector(h)  # a bad subscription is refused at the door
        self.check_mode(group, POP)
        self.types.admit(h)
        self.check_order(group, h.order)

    def readable_topic(self, topic: str, queue_id: int) -> TopicConfig:
        """The config of ``topic`` when this broker may serve ``queue_id`` of it (or -1: every
        queue) to POP consumers; else the refusal, naming the topic and the broker."""
        tc = self.broker.topics.get(topic)
        name = self.broker.config.broker_name
        if tc is None:
            raise RequestRejected(
                _R.TOPIC_NOT_EXIST, f"topic {topic!r} does not exist on broker {name}")
        if not tc.perm & Perm.READ or topic.startswith(DLQ_PREFIX):
            raise RequestRejected(
                _R.NO_PERMISSION, f"topic {topic!r} is not readable on broker {name}")
        if queue_id != ANY_QUEUE and queue_id >= tc.read_queue_nums:
            raise RequestRejected(
                _R.INVALID_ARGUMENT,
                f"queue id {queue_id} is out of range: topic {topic!r} has "
                f"{tc.read_queue_nums} read queues on broker {name} (or -1: all of them)")
        return tc

    def check_order(self, group: str, order: bool) -> None:
        """One group pops either orderly or not (an unordered pop would hand out the messages
        an orderly one holds back)."""
        have = self.orderly.setdefault(group, order)
        if have != order:
            kind = {True: "orderly (FIFO)", False: "unordered"}
            raise RequestRejected(
                _R.CONSUME_MODE_CONFLICT,
                f"consumer group {group!r} pops {kind[have]} on broker "
                f"{self.broker.config.broker_name}; an {kind[order]} pop cannot join it: "
                "use another group name")

    def _answer(self, conn: BrokerConnection, opaque: int, h: PopMessageRequestHeader) -> bool:
        """Pop and answer SUCCESS when something was popped (True); else nothing sent."""
        tc = self.broker.topics.get(h.topic)
        if tc is None or not self.types.may_pop(h):
            return False
        sel = _Selector(h)
        now = _now_ms()
        if h.queue_id == ANY_QUEUE:
            n = tc.read_queue_nums
            key = (h.consumer_group, h.topic)
            first = self._cursor.get(key, 0) % max(n, 1)
            self._cursor[key] = first + 1
            qids = [(first + i) % n for i in range(n)]
        else:
            qids = [h.queue_id]
        qids = self.types.own_queues(h, qids)  # a failover consumer's active queues
        bodies: list[memoryview] = []
        batches: list[PoppedBatch] = []
        want = h.max_msg_nums
        for qid in qids:
            if want <= 0:
                break
            want -= self._pop_queue(h, qid, want, now, sel, bodies, batches)
            if self.types.ended_early:  # at a stored batch's start: the rest, next time
                break
        if not batches:
            return False
        header = PopMessageResponseHeader(
            broker=self.broker.config.broker_name, pop_time=now, invisible_ms=h.invisible_ms,
            batches=batches)
        conn.respond(opaque, _R.SUCCESS, header, bodies)
        self.answers += 1
        return True

    def _empty(self, conn: BrokerConnection, opaque: int, h: PopMessageRequestHeader) -> None:
        conn.respond(opaque, _R.PULL_NOT_FOUND, PopMessageResponseHeader(
            broker=self.broker.config.broker_name, pop_time=_now_ms(),
            invisible_ms=h.invisible_ms))

    def window(self, group: str, topic: str, qid: int, init_mode: str = INIT_LATEST
               ) -> PopWindow:
        key = (group, topic, qid)
        w = self.windows.get(key)
        if w is None:
            store = self.broker.store
            start = self.broker.offsets.query(group, topic, qid)
            if start is None or start < 0:
                if init_mode.upper() == INIT_EARLIEST:
                    start = store.min_offset(topic, qid)
                else:
                    start = store.max_offset(topic, qid)
            w = self.windows[key] = PopWindow(max(start, store.min_offset(topic, qid)))
        return w

    def poppable(self, group: str, topic: str, qid: int, init_mode: str, order: bool) -> bool:
        """Would a pop of queue ``qid`` find something now (filters not applied)?"""
        w = self.window(group, topic, qid, init_mode)
        if order:
            return poppable_orderly(self, w, topic, qid, _now_ms())
        return w.poppable(_now_ms(), self.broker.store.max_offset(topic, qid))

    def _pop_queue(self, h: PopMessageRequestHeader, qid: int, want: int, now: int,
                   sel: _Selector, bodies: list[Any], batches: list[PoppedBatch]) -> int:
        """Pop up to ``want`` messages of queue ``qid`` into ``bodies``/``batches``; how many."""
        self.types.ended_early = False  # set by a key-shared choice (an orderly pop makes none)
        if h.order:
            return pop_orderly(self, h, qid, want, now, sel, bodies, batches)
        group, topic = h.consumer_group, h.topic
        w = self.window(group, topic, qid, h.init_mode)
        store = self.broker.store
        max_off = store.max_offset(topic, qid)
        got = 0
        sg = None
        logged: list[Popped] = []
        acks: list[tuple[int, int]] = []
        for _round in range(8):  # filtered-out and dead messages make room for more
            popped = self.types.choose(h, w, qid, want - got, now, max_off)
            if not popped:
                break
            logged += popped
            by_off = {p.offset: p for p in popped}
            for data, base, idx in self._read(topic, qid, sorted(by_off)):
                keep: list[int] = []
                attempts: list[int] = []
                view = None
                if not sel.everything:
                    view = BatchView(data)
                    try:
                        fields = {i: (t, p) for i, t, p in filter_fields(view, idx[0])}
                    except CorruptBatchError:
                        fields = {}
                for i in idx:
                    p = by_off.pop(base + i)
                    if view is not None and not sel.matches(*fields.get(i, (None, None))):
                        w.ack(p.offset, p.pop_time)  # not this subscription's
                        acks.append((p.offset, p.pop_time))
                        continue
                    if p.attempt > 1:
                        if sg is None:
                            sg = self.broker.subscription_groups.ensure(group)
                        if p.attempt > sg.retry_max_times:
                            self._dead_letter(group, data, i, p)
                            w.ack(p.offset, p.pop_time)
                            acks.append((p.offset, p.pop_time))
                            continue
                    keep.append(i)
                    attempts.append(p.attempt)
                if keep:
                    bodies.append(data)
                    batches.append(PoppedBatch(
                        qid, bitmap(keep),
                        attempts if any(a != 1 for a in attempts) else []))
                    got += len(keep)
            for p in by_off.values():  # gone from the store (retention): nothing to deliver
                w.ack(p.offset, p.pop_time)
                acks.append((p.offset, p.pop_time))
            if got >= want or self.types.ended_early:
                break
        self.log.append(group, topic, qid, logged, acks)  # durable before the answer leaves
        self.types.hold(group, h.consumer, (group, topic, qid), logged)
        if logged:  # a held pop of the group waits for these deadlines too
            self.hold.deadline_set((group, topic, qid), now + h.invisible_ms)
        self.popped += got
        self._commit(group, topic, qid, w)
        return got

    def _read(self, topic: str, qid: int, offsets: Sequence[int]) -> Any:
        """(batch bytes, base offset, member indices) of the batches holding ``offsets``
        (increasing; a list or a range). Per stored batch, not per offset: its offsets are
        found by bisection, and a contiguous run of them becomes its indices at once."""
        store = self.broker.store
        i, n = 0, len(offsets)
        while i < n:
            off = offsets[i]
            span = min(offsets[-1] - off + 1, _SCAN)
            r = store.get_messages(topic, qid, off, span)
            if r.status is not GetStatus.FOUND or not r.batches:
                i += 1  # not readable: left to the caller (acked as gone)
                continue
            progressed = False
            for b in r.batches:
                base = b.queue_offset - b.first_index
                j = bisect.bisect_left(offsets, b.queue_offset + b.count, i)
                if j > i:
                    progressed = True
                    k = bisect.bisect_left(offsets, base, i, j)
                    if k < j:
                        lo, hi = offsets[k] - base, offsets[j - 1] - base
                        yield b.data, base, (list(range(lo, hi + 1)) if hi - lo == j - 1 - k
                                             else [o - base for o in offsets[k:j]])
                    i = j
                if i >= n:
                    break
            if not progressed:
                i += 1

    def _dead_letter(self, group: str, data: memoryview, index: int, p: Popped) -> None:
        broker = self.broker
        try:
            view = BatchView(data)
            m = next(view.messages(index, broker.store.config.max_batch_bytes))
            broker.ensure_dlq_topic(group)
            store_copy(broker, view, index, m, DLQ_PREFIX + group, delay=0,
                       reconsume_times=p.attempt - 1)
            self.dead += 1
            log.info("message at offset %d of group %s goes to %s%s after %d deliveries",
                     p.offset, group, DLQ_PREFIX, group, p.attempt - 1)
        except (TidemqError, StopIteration, ValueError) as exc:
            log.warning("dead-letter copy of offset %d (group %s) failed: %s; dropped",
                        p.offset, group, exc)

    def _commit(self, group: str, topic: str, qid: int, w: PopWindow) -> None:
        self.broker.offsets.commit(group, topic, qid, w.start)

    # -- long polling (pop_hold.py) ------------------------------------------------------------
    def _attempt_pop(self, held: HeldPop) -> bool:
        return self._answer(held.conn, held.opaque, held.header)

    def _expire_pop(self, held: HeldPop) -> None:
        self._empty(held.conn, held.opaque, held.header)

    def _fail(self, held: HeldPop, exc: BaseException) -> None:
        self.broker.answer_failure(held.conn, held.opaque, "POP_MESSAGE", exc)

    def _windows_of(self, group: str, topic: str, queue_id: int
                    ) -> Iterator[tuple[WindowKey, PopWindow]]:
        """The existing windows a held request of ``queue_id`` (-1: any) covers."""
        if queue_id != ANY_QUEUE:
            qids: Any = (queue_id,)
        else:
            tc = self.broker.topics.get(topic)
            qids = range(tc.read_queue_nums if tc is not None else 0)
        windows = self.windows
        for q in qids:
            key = (group, topic, q)
            w = windows.get(key)
            if w is not None:
                yield key, w

    def drop_connection(self, conn: BrokerConnection) -> None:
        self.hold.drop_connection(conn)

    def stats(self) -> dict[str, int]:
        return {"pop_popped": self.popped, "pop_requests": self.requests,
                "pop_answers": self.answers, "pop_acked": self.acked, "pop_stale": self.stale,
                "pop_dead": self.dead, "pop_windows": len(self.windows), **self.hold.stats()}

    # -- ACK_MESSAGE -----------------------------------------------------------------------------
    def _handle_of(self, text: str) -> ReceiptHandle:
        h = decode_receipt(text)
        if h.broker != self.broker.config.broker_name:
            raise ReceiptError(f"receipt handle of broker {h.broker!r}, this is "
                               f"{self.broker.config.broker_name!r}")
        return h

    def handle_ack(self, conn: BrokerConnection, frame: Frame) -> None:
        h: AckMessageRequestHeader = decode_request(frame, AckMessageRequestHeader)
        check_group(h.consumer_group)
        results: list[int] = []
        touched: dict[tuple[str, str, int], list[tuple[int, int]]] = {}
        group = h.consumer_group
        name = self.broker.config.broker_name
        windows = self.windows
        for text in h.handles:
            # Fast path, one split and no regex (one handle per acked message): a well-formed
            # handle of this broker whose delivery is in flight. Anything else is decoded in
            # full below, to tell a malformed handle from a stale one.
            p = text.split(" ")
            if len(p) == 9 and p[0] == "v1" and p[1] == name and all(map(_is_num, p[3:9])):
                key = (group, p[2], int(p[3]))
                w = windows.get(key)
                off, pop_time = int(p[4]), int(p[5])
                if w is not None and w.ack(off, pop_time):
                    results.append(_R.SUCCESS)
                    touched.setdefault(key, []).append((off, pop_time))
                    self.acked += 1
                    continue
            try:
                rh = self._handle_of(text)
            except ReceiptError:
                results.append(_R.INVALID_ARGUMENT)
                continue
            key = (group, rh.topic, rh.queue_id)
            w = windows.get(key)
            if w is not None and w.ack(rh.offset, rh.pop_time):
                results.append(_R.SUCCESS)
                touched.setdefault(key, []).append((rh.offset, rh.pop_time))
                self.acked += 1
            else:
                results.append(_R.NO_MESSAGE)
                self.stale += 1
        for key, acked in touched.items():
            try:
                self.log.append(*key, [], acked)  # before the answer: an ack survives kill -9
            except TidemqError as exc:
                log.error("ack records of %s not stored (%s): these acks may be lost in a "
                          "restart (the messages are then delivered again)", key, exc)
            self._commit(*key, self.windows[key])
        self.types.acked(group, touched)
        if touched and self.orderly.get(group):
            for topic in {k[1] for k in touched}:
                self.hold.wake(group, topic)  # an ack may free a message group
        if not frame.is_oneway:
            conn.respond(frame.opaque, _R.SUCCESS, AckMessageResponseHeader(results=results))

    # -- CHANGE_INVISIBLE_TIME ------------------------------------------------------------------
    def handle_change(self, conn: BrokerConnection, frame: Frame) -> None:
        h: ChangeInvisibleRequestHeader = decode_request(frame, ChangeInvisibleRequestHeader)
        check_group(h.consumer_group)
        if bool(h.handle) == bool(h.handles) or len(h.handles) != len(h.invisible):
            raise RequestRejected(
                _R.INVALID_ARGUMENT,
                "CHANGE_INVISIBLE_TIME names one receipt handle (handle, invisible_ms) or many "
                "(handles with one invisible time each in invisible), not both or neither")
        if h.handles:
            self._change_many(conn, frame, h)
            return
        try:
            rh = self._handle_of(h.handle)
        except ReceiptError as exc:
            raise RequestRejected(_R.INVALID_ARGUMENT, str(exc)) from None
        w = self.windows.get((h.consumer_group, rh.topic, rh.queue_id))
        now = _now_ms()
        if w is not None and now <= rh.pop_time:
            now = rh.pop_time + 1  # a new handle must differ from the old (pop time)
        p = w.change_invisible(rh.offset, rh.pop_time, h.invisible_ms, now) if w else None
        if p is None:
            raise RequestRejected(
                _R.NO_MESSAGE,
                f"receipt handle of {rh.topic} queue {rh.queue_id} offset {rh.offset} is "
                "stale: acked already, or delivered again since")
        self.log.append(h.consumer_group, rh.topic, rh.queue_id, [p], [])
        self.hold.deadline_set((h.consumer_group, rh.topic, rh.queue_id),
                               p.pop_time + p.invisible_ms)
        new = ReceiptHandle(rh.broker, rh.topic, rh.queue_id, rh.offset, p.pop_time,
                            p.invisible_ms, rh.revive_queue_id, p.attempt)
        conn.respond(frame.opaque, _R.SUCCESS,
                     ChangeInvisibleResponseHeader(handle=encode_receipt(new)))

    def _change_many(self, conn: BrokerConnection, frame: Frame,
                     h: ChangeInvisibleRequestHeader) -> None:
        """The grouped form: one code and new handle per handle, one POP_LOG append per queue
        touched (like ACK_MESSAGE's), then one answer."""
        group = h.consumer_group
        results: list[int] = []
        handles: list[str] = []
        touched: dict[tuple[str, int], list[Popped]] = {}
        now0 = _now_ms()
        for text, inv in zip(h.handles, h.invisible, strict=True):
            try:
                rh = self._handle_of(text)
            except ReceiptError:
                results.append(_R.INVALID_ARGUMENT)
                handles.append("")
                continue
            w = self.windows.get((group, rh.topic, rh.queue_id))
            now = max(now0, rh.pop_time + 1)  # a new handle must differ from the old
            p = w.change_invisible(rh.offset, rh.pop_time, inv, now) if w else None
            if p is None:
                results.append(_R.NO_MESSAGE)
                handles.append("")
                continue
            touched.setdefault((rh.topic, rh.queue_id), []).append(p)
            results.append(_R.SUCCESS)
            handles.append(encode_receipt(ReceiptHandle(
                rh.broker, rh.topic, rh.queue_id, rh.offset, p.pop_time, p.invisible_ms,
                rh.revive_queue_id, p.attempt)))
        for (topic, qid), ps in touched.items():
            self.log.append(group, topic, qid, ps, [])
            self.hold.deadline_set((group, topic, qid),
                                   min(p.pop_time + p.invisible_ms for p in ps))
        conn.respond(frame.opaque, _R.SUCCESS,
                     ChangeInvisibleResponseHeader(handles=handles, results=results))
