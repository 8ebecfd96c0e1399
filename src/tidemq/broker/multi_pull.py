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

import msgspec

from tidemq.broker.connection import decode_request
from tidemq.broker.errors import RequestRejected
from tidemq.broker.long_polling import HeldPull, hold_key
from tidemq.protocol.codes import ResponseCode
from tidemq.protocol.headers import (
    MultiQueuePull,
    MultiQueuePullResult,
    PullMessageRequestHeader,
    PullMessageResponseHeader,
    PullMultiQueueRequestHeader,
    PullMultiQueueResponseHeader,
    PullSysFlag,
    WokenPull,
)

if TYPE_CHECKING:
    from tidemq.broker.broker import Broker
    from tidemq.broker.connection import BrokerConnection
    from tidemq.protocol.frame import Frame

__all__ = ["MultiPullProcessor"]

_NOT_FOUND = int(ResponseCode.PULL_NOT_FOUND)
_SUCCESS = int(ResponseCode.SUCCESS)
_FAR = 86_400.0  # held queues of a multi pull time out with the request, not one by one


class _MultiPull:
    """One PULL_MULTI_QUEUE between its arrival and its answer."""

    __slots__ = ("proc", "conn", "opaque", "results", "bodies", "held", "holding", "sent",
                 "timer", "nbytes", "starts", "held_set", "woken", "standing")

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
        self.standing: _Standing | None = None
        self.timer: Any = None
        self.nbytes = 0  # body bytes so far
        self.starts: dict[int, tuple[int, bool]] = {}  # resolved start offsets by index

    def put(self, i: int, code: int, header: Any, bodies: list[Any] | None) -> None:
        if self.sent:
            return
        r = _result(code, header, bodies)
        start = self.starts.get(i)
        if start is not None:
            r.start_offset, r.start_committed = start
        self.results[i] = r
        self.bodies[i] = list(bodies) if bodies else None
        self.nbytes += r.body_bytes
        if self.holding and code != _NOT_FOUND:
            self.wake()

    def wake(self) -> None:
        """A queue received messages: answer after the linger (``multi_pull_linger_ms``;
        queues woken meanwhile join the answer)."""
        if self.woken or self.sent:
            return
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
        header = PullMultiQueueResponseHeader(results=self.results)  # type: ignore[arg-type]
        st = self.standing
        if st is not None:
            # Answers leave in the order of their requests: a held older request goes first.
            # Its queues stood when it arrived, but its client learns that only from its
            # answer; a woken answer of one of them that overtook it (in a newer request
            # answered at once, during the older one's linger) found no standing pull there
            # and was dropped -- the queue then waited for the periodic check (issue 17).
            while st.waiting and st.waiting[0] is not self:
                st.waiting.pop(0).send()
            if st.waiting:
                st.waiting.pop(0)
            header.standing = True
            header.woken, more = st.take(self.proc.broker.store.config.max_read_bytes
                                         - self.nbytes)
            bodies.extend(more)
        self.conn.respond(self.opaque, ResponseCode.SUCCESS, header, bodies or None)


def _result(code: int, header: Any, bodies: list[Any] | None) -> MultiQueuePullResult:
    if isinstance(header, PullMessageResponseHeader):
        n = sum(len(b) for b in bodies) if bodies else 0
        return MultiQueuePullResult(code, header.next_begin_offset, header.min_offset,
                                    header.max_offset, n, "", list(header.members),
                                    header.suggest_which_broker_id)
    return MultiQueuePullResult(code, message=getattr(header, "message", ""))


#: what a queue standing with permits stands with: its pull (at the offset it waits for),
#: its filter and the permits left (messages it may still be answered without a re-pull)
_Kept = tuple[PullMessageRequestHeader, "frozenset[int] | None", int]


class _Standing:
    """The standing pulls of one connection and group (``standing`` requests): the queues
    held after their request was answered, the answers of those woken since, and the
    requests waiting to carry them.

    Queues pulled with ``keep`` permits (docs/protocol.md 4.0, "kept standing") stand on
    after an answer with messages: at the answer's next offset, with the permits left
    (``kept``), so their client does not pull them again per answer; out of permits, or
    answered with an error, they are answered once as before."""

    __slots__ = ("proc", "conn", "held", "held_set", "ready", "waiting", "kept")

    def __init__(self, proc: MultiPullProcessor, conn: BrokerConnection) -> None:
        self.proc = proc
        self.conn = conn
        self.held: dict[tuple[str, int], HeldPull] = {}
        self.held_set: set[Any] = set()  # what long polling files as this "connection's"
        self.ready: dict[tuple[str, int], tuple[MultiQueuePullResult, list[Any] | None]] = {}
        self.waiting: list[_MultiPull] = []
        self.kept: dict[tuple[str, int], _Kept] = {}

    def drop(self, key: tuple[str, int]) -> None:
        """The client pulls ``key`` anew: its standing pull and unsent answer are void."""
        old = self.held.pop(key, None)
        if old is not None:
            self.proc.hold._finish(old)  # noqa: SLF001
        self.ready.pop(key, None)
        self.kept.pop(key, None)

    def stand(self, key: tuple[str, int], one: PullMessageRequestHeader,
              tags: frozenset[int] | None, permits: int = 0) -> None:
        self.drop(key)
        held = HeldPull(_StandSlot(self, key), 0, one, tags, _FAR, self.proc.loop.time())
        self.held[key] = held
        if permits > 0:
            self.kept[key] = (one, tags, permits)
        self.proc.hold.suspend(held, timed=False)

    def stand_on(self, key: tuple[str, int], r: MultiQueuePullResult,
                 kept: _Kept | None) -> bool:
        """After its answer ``r`` leaves, ``key`` stands on at ``r``'s next offset if it has
        ``kept`` permits left (True; ``r.stands`` says so to the client)."""
        if kept is None:
            return False
        one, tags, permits = kept
        left = permits - max(0, r.next_begin_offset - one.queue_offset)
        if r.code != _SUCCESS or left <= 0:
            return False
        nxt = msgspec.structs.replace(
            one, queue_offset=r.next_begin_offset, max_msg_nums=min(one.max_msg_nums, left),
            sys_flag=one.sys_flag & ~PullSysFlag.COMMIT_OFFSET, commit_offset=0)
        self.stand(key, nxt, tags, left)
        r.stands = True
        # messages that arrived since the read would otherwise wait for the next arrival
        hold = self.proc.hold
        top = hold.max_offset(key[0], key[1])
        if top > nxt.queue_offset:
            hold.notify_message_arriving(hold_key(key[0], key[1]), top, None)
        return True

    def put(self, key: tuple[str, int], code: int, header: Any,
            bodies: list[Any] | None) -> None:
        if self.held.pop(key, None) is None:
            return  # superseded meanwhile
        r = _result(code, header, bodies)
        kept = self.kept.get(key)
        if kept is not None and code == _NOT_FOUND and r.next_begin_offset == kept[0].queue_offset:
            # woken by the periodic check with nothing new: nothing to answer, it stands on
            # (a read that moved the offset, past filtered messages, is answered as before)
            self.stand(key, *kept)
            return
        self.ready[key] = (r, list(bodies) if bodies else None)
        if self.waiting:
            self.waiting[0].wake()

    def take(self, budget: int) -> tuple[list[WokenPull], list[Any]]:
        """Woken answers within ``budget`` body bytes (at least one), out of ``ready``; each
        queue with permits left stands on (:meth:`stand_on`)."""
        woken: list[WokenPull] = []
        bodies: list[Any] = []
        for key in list(self.ready):
            r, bs = self.ready[key]
            if woken and r.body_bytes > budget:
                break
            del self.ready[key]
            self.stand_on(key, r, self.kept.pop(key, None))
            woken.append(WokenPull(key[0], key[1], r))
            if bs:
                bodies.extend(bs)
            budget -= r.body_bytes
        return woken, bodies


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


class _StandSlot(_PullSlot):
    """Stands in for the connection while a standing queue is read again (woken)."""

    __slots__ = ("st", "key")

    def __init__(self, st: _Standing, key: tuple[str, int]) -> None:  # noqa: D107
        self.st = st
        self.key = key

    @property
    def held(self) -> set[Any]:
        return self.st.held_set

    @property
    def closed(self) -> bool:
        return bool(self.st.conn.closed)

    @property
    def write_paused(self) -> bool:
        return bool(self.st.conn.write_paused)

    def when_writable(self, cb: Any) -> None:
        self.st.conn.when_writable(cb)

    def respond(self, opaque: int, code: int, header: Any, bodies: Any = None) -> None:
        self.st.put(self.key, code, header, bodies)

    def respond_error(self, opaque: int, code: int, message: str) -> None:
        self.st.put(self.key, code, _Msg(message), None)


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
        #: standing pulls by (connection, group)
        self.standing: dict[tuple[Any, str], _Standing] = {}

    def held_counts(self) -> tuple[int, int]:
        """(held multi pulls, queues held by them or standing)."""
        return len(self.holding), sum(
            sum(1 for h in agg.held if not h.done) for agg in self.holding) + sum(
            len(st.held) for st in self.standing.values() if not st.conn.closed)

    def handle(self, conn: BrokerConnection, frame: Frame) -> None:
        h: PullMultiQueueRequestHeader = decode_request(frame, PullMultiQueueRequestHeader)
        if frame.is_oneway:
            raise RequestRejected(
                ResponseCode.INVALID_ARGUMENT, "a pull cannot be one-way: it exists to answer")
        standing = h.standing and h.suspend
        if not h.pulls and not standing:
            raise RequestRejected(ResponseCode.INVALID_ARGUMENT,
                                  "PULL_MULTI_QUEUE names no queue")
        agg = _MultiPull(self, conn, frame.opaque, len(h.pulls))
        st: _Standing | None = None
        if standing:
            st = self._standing_of(conn, h.consumer_group)
            agg.standing = st
            for p in h.pulls:
                st.drop((p.topic, p.queue_id))
        admitted: list[tuple[int, PullMessageRequestHeader, frozenset[int] | None]] = []
        budget = self.broker.store.config.max_read_bytes
        # the group's part of the door once for the request (each queue then answers it)
        refused: RequestRejected | None = None
        try:
            self.pull.admit_group(h.consumer_group)
        except RequestRejected as exc:
            refused = exc
        admit_queue = self.pull.admit_queue
        read = self.pull.read
        results = agg.results
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
            try:
                if refused is not None:
                    raise refused
                tags = admit_queue(one, conn)
                # the read of a PULL_MESSAGE, its answer straight into this queue's slot
                code, got, bodies, members, nb, suggest = read(one, tags)
            except RequestRejected as exc:
                agg.put(i, exc.response_code, _Msg(exc.message), None)
                continue
            res = results[i] = MultiQueuePullResult(
                code, got.next_begin_offset, got.min_offset, got.max_offset, nb, "", members,
                suggest)
            if p.resolve and i in agg.starts:
                res.start_offset, res.start_committed = agg.starts[i]
            if bodies:
                agg.bodies[i] = bodies
                agg.nbytes += nb
            admitted.append((i, one, tags))
        all_empty = all(r is not None and r.code == _NOT_FOUND for r in agg.results)
        if st is not None:
            # the queues that found nothing stand (held past this answer), and those with
            # messages and ``keep`` permits stand on past theirs; the request waits for a
            # woken one unless it has answers already
            for i, one, tags in admitted:
                r = agg.results[i]
                keep = h.pulls[i].keep
                if r.code == _NOT_FOUND:  # type: ignore[union-attr]
                    st.stand((one.topic, one.queue_id), one, tags, keep)
                elif keep:
                    st.stand_on((one.topic, one.queue_id), r, (one, tags, keep))  # type: ignore[arg-type]
            if not all_empty or st.ready:
                agg.send()
                return
            # one held request per connection and group: an older one is answered now (its
            # queues stand all the same), so its client holds one request, not one per call
            for older in list(st.waiting):
                older.send()
            agg.holding = True
            self.holding.add(agg)
            st.waiting.append(agg)
            agg.timer = self.loop.call_later(self._timeout_ms(h) / 1000.0, agg.send)
            return
        if not (h.suspend and all_empty and admitted):
            agg.send()
            return
        timeout_ms = self._timeout_ms(h)
        agg.holding = True
        self.holding.add(agg)
        now = self.loop.time()
        for i, one, tags in admitted:
            held = HeldPull(_PullSlot(agg, i), i, one, tags, _FAR, now)
            agg.held.append(held)
            self.hold.suspend(held, timed=False)
        agg.timer = self.loop.call_later(timeout_ms / 1000.0, agg.send)

    def _timeout_ms(self, h: PullMultiQueueRequestHeader) -> int:
        cfg = self.config
        if cfg.long_polling_enable:
            return min(h.suspend_timeout_millis, cfg.max_suspend_ms)
        return cfg.short_polling_time_ms

    def _standing_of(self, conn: BrokerConnection, group: str) -> _Standing:
        """The standing pulls of ``conn`` and ``group``."""
        st = self.standing.get((conn, group))
        if st is None:
            st = self.standing[(conn, group)] = _Standing(self, conn)
        return st

    def drop_connection(self, conn: BrokerConnection) -> None:
        """The connection closed: its standing pulls leave the hold."""
        for key in [k for k in self.standing if k[0] is conn]:
            st = self.standing.pop(key)
            for held in st.held.values():
                self.hold._finish(held)  # noqa: SLF001
            st.held.clear()
            st.ready.clear()
            st.kept.clear()
