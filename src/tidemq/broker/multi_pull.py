"""PULL_MULTI_QUEUE (issue 17): one request, and one long poll, serving many queues.

A consumer with 10,000 assigned queues would otherwise keep 10,000 pulls in flight (each a
request, a held entry and a response). Here each queue of the request goes through exactly the
door and the read of a PULL_MESSAGE (``PullProcessor.admit`` and ``process``, answered into the
queue's slot instead of the connection); the response carries one result per queue and, as
body, the found batches of every queue back to back.

Held as one: when every queue answers PULL_NOT_FOUND and the request asks to ``suspend``, each
queue is filed with long polling (``long_polling.PullRequestHoldService``) like a held pull,
all pointing at one aggregate; the first queue woken with messages answers the whole request
(the other queues keep the answers of the first pass, and are taken out of the hold). The
timeout is one timer for the request; nothing is read again when it fires.

Threads: the broker's event loop only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tidemq.broker.connection import decode_request
from tidemq.broker.errors import RequestRejected
from tidemq.broker.long_polling import HeldPull
from tidemq.protocol.codes import ResponseCode
from tidemq.protocol.headers import (
    MultiQueuePull,
    MultiQueuePullResult,
    PullMessageRequestHeader,
    PullMessageResponseHeader,
    PullMultiQueueRequestHeader,
    PullMultiQueueResponseHeader,
    PullSysFlag,
)

if TYPE_CHECKING:
    from tidemq.broker.broker import Broker
    from tidemq.broker.connection import BrokerConnection
    from tidemq.protocol.frame import Frame

__all__ = ["MultiPullProcessor"]

_NOT_FOUND = int(ResponseCode.PULL_NOT_FOUND)
_FAR = 86_400.0  # held queues of a multi pull time out with the request, not one by one


class _MultiPull:
    """One PULL_MULTI_QUEUE between its arrival and its answer."""

    __slots__ = ("proc", "conn", "opaque", "results", "bodies", "held", "holding", "sent",
                 "timer", "nbytes", "starts", "held_set", "woken")

    def __init__(self, proc: MultiPullProcessor, conn: BrokerConnection, opaque: int,
                 n: int) -> None:
        self.proc = proc
        self.conn = conn
        self.opaque = opaque
        self.results: list[MultiQueuePullResult | None] = [None] * n
        self.bodies: list[list[Any] | None] = [None] * n  # found batches, by queue
        #: what long polling files as the held pulls of each queue's "connection" (one set
        #: for all the queues of the request, not one per queue)
        self.held_set: set[Any] = set()
        self.held: list[HeldPull] = []
        self.holding = False
        self.woken = False
        self.sent = False
        self.timer: Any = None
        self.nbytes = 0  # body bytes so far
        self.starts: dict[int, tuple[int, bool]] = {}  # resolved start offsets by index

    def put(self, i: int, code: int, header: Any, bodies: list[Any] | None) -> None:
        if self.sent:
            return
        if isinstance(header, PullMessageResponseHeader):
            n = sum(len(b) for b in bodies) if bodies else 0
            r = MultiQueuePullResult(code, header.next_begin_offset, header.min_offset,
                                     header.max_offset, n, "", list(header.members),
                                     header.suggest_which_broker_id)
        else:
            r = MultiQueuePullResult(code, message=getattr(header, "message", ""))
        start = self.starts.get(i)
        if start is not None:
            r.start_offset, r.start_committed = start
        self.results[i] = r
        self.bodies[i] = list(bodies) if bodies else None
        self.nbytes += r.body_bytes
        if self.holding and code != _NOT_FOUND and not self.woken:
            # woken: answer after the linger (queues woken meanwhile join the answer)
            self.woken = True
            linger = self.proc.config.multi_pull_linger_ms
            if linger > 0:
                self.proc.loop.call_later(linger / 1000.0, self.send)
            else:
                self.proc.loop.call_soon(self.send)

    def send(self) -> None:
        if self.sent:
            return
        self.sent = True
        self.proc.holding.discard(self)
        hold = self.proc.hold
        for h in self.held:
            hold._finish(h)  # noqa: SLF001 - out of the hold table (pruned lazily)
        if self.timer is not None:
            self.timer.cancel()
        bodies = [b for bs in self.bodies if bs for b in bs]
        self.conn.respond(self.opaque, ResponseCode.SUCCESS,
                          PullMultiQueueResponseHeader(results=self.results),  # type: ignore[arg-type]
                          bodies or None)


class _PullSlot:
    """Stands in for the connection while one queue of a PULL_MULTI_QUEUE is read."""

    __slots__ = ("agg", "i")

    def __init__(self, agg: _MultiPull, i: int) -> None:
        self.agg = agg
        self.i = i

    @property
    def held(self) -> set[Any]:
        """Long polling files held pulls per "connection": the request's one set."""
        return self.agg.held_set

    @property
    def closed(self) -> bool:
        return bool(self.agg.conn.closed) or self.agg.sent

    @property
    def write_paused(self) -> bool:
        return bool(self.agg.conn.write_paused)

    def when_writable(self, cb: Any) -> None:
        self.agg.conn.when_writable(cb)

    def respond(self, opaque: int, code: int, header: Any, bodies: Any = None) -> None:
        self.agg.put(self.i, code, header, bodies)

    def respond_error(self, opaque: int, code: int, message: str) -> None:
        self.agg.put(self.i, code, _Msg(message), None)


class _Msg:
    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


class MultiPullProcessor:
    def _start(self, group: str, p: MultiQueuePull) -> tuple[int, bool]:
        """Where a queue without a start begins: the group's committed offset, else what
        ``p.resolve`` says (as the consumer's own lookups would)."""
        committed = self.broker.offsets.query(group, p.topic, p.queue_id)
        if committed >= 0:
            return committed, True
        store = self.broker.store
        if p.resolve == 1:
            return store.min_offset(p.topic, p.queue_id), False
        if p.resolve == 2:
            return store.max_offset(p.topic, p.queue_id), False
        return max(0, store.offset_for_timestamp(p.topic, p.queue_id, p.timestamp)), False

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.pull = broker.pull_processor
        self.hold = broker.hold
        self.loop = broker.loop
        self.config = broker.config
        #: the multi pulls held now (runtime info ``held_multi_pulls``)
        self.holding: set[_MultiPull] = set()

    def held_counts(self) -> tuple[int, int]:
        """(held multi pulls, queues held by them)."""
        return len(self.holding), sum(
            sum(1 for h in agg.held if not h.done) for agg in self.holding)

    def handle(self, conn: BrokerConnection, frame: Frame) -> None:
        h: PullMultiQueueRequestHeader = decode_request(frame, PullMultiQueueRequestHeader)
        if frame.is_oneway:
            raise RequestRejected(
                ResponseCode.INVALID_ARGUMENT, "a pull cannot be one-way: it exists to answer")
        if not h.pulls:
            raise RequestRejected(ResponseCode.INVALID_ARGUMENT,
                                  "PULL_MULTI_QUEUE names no queue")
        agg = _MultiPull(self, conn, frame.opaque, len(h.pulls))
        admitted: list[tuple[int, PullMessageRequestHeader, frozenset[int] | None]] = []
        budget = self.broker.store.config.max_read_bytes
        for i, p in enumerate(h.pulls):
            if agg.nbytes >= budget:
                # A response stays within one read's bytes (and the frame limit): the queues
                # not read answer PULL_RETRY_IMMEDIATELY at their offset (pull again at once;
                # a queue still to be resolved is resolved then).
                agg.results[i] = MultiQueuePullResult(
                    ResponseCode.PULL_RETRY_IMMEDIATELY, p.queue_offset,
                    message="not read: this answer is full; pull again")
                continue
            offset = p.queue_offset
            if p.resolve and not self.broker.non_persistent.owns(p.topic):
                offset, committed = self._start(h.consumer_group, p)
                agg.starts[i] = (offset, committed)
            one = PullMessageRequestHeader(
                consumer_group=h.consumer_group, topic=p.topic, queue_id=p.queue_id,
                queue_offset=offset, max_msg_nums=p.max_msg_nums,
                sys_flag=p.sys_flag & ~PullSysFlag.SUSPEND, commit_offset=p.commit_offset,
                suspend_timeout_millis=h.suspend_timeout_millis, subscription=p.subscription,
                expression_type=p.expression_type,
            )
            slot = _PullSlot(agg, i)
            try:
                tags = self.pull.admit(one, agg.conn)
                self.pull.process(slot, i, one, tags, allow_suspend=False)  # type: ignore[arg-type]
            except RequestRejected as exc:
                agg.put(i, exc.response_code, _Msg(exc.message), None)
                continue
            admitted.append((i, one, tags))
        all_empty = all(r is not None and r.code == _NOT_FOUND for r in agg.results)
        if not (h.suspend and all_empty and admitted):
            agg.send()
            return
        cfg = self.config
        if cfg.long_polling_enable:
            timeout_ms = min(h.suspend_timeout_millis, cfg.max_suspend_ms)
        else:
            timeout_ms = cfg.short_polling_time_ms
        agg.holding = True
        self.holding.add(agg)
        now = self.loop.time()
        for i, one, tags in admitted:
            held = HeldPull(_PullSlot(agg, i), i, one, tags, _FAR, now)
            agg.held.append(held)
            self.hold.suspend(held, timed=False)
        agg.timer = self.loop.call_later(timeout_ms / 1000.0, agg.send)
