"""The push consumer's pulls to one broker, for all its queues there (issue 17).

A push consumer of many queues (``multi_queue_min``) does not keep a pull, a task and a future
per queue: one :class:`PullDriver` per broker address keeps one standing PULL_MULTI_QUEUE in
flight for every queue it pulls from that broker (docs/protocol.md 4.0, "standing"):

- ``due``: the queues to pull now (just assigned, just answered with messages, resumed after
  flow control, a pause or an error). The next event-loop iteration sends them together, up
  to ``max_queues`` a request, each at its next offset with its commit offset;
- ``standing``: the queues the broker answered PULL_NOT_FOUND. They stay held there past the
  answer, and come back in ``woken`` of a later answer of this connection when messages
  arrive; while any stand, one request (empty if nothing is due) is kept in flight to carry
  them. A queue pulled with permits (``keep``: what the service's ``keep_permits`` grants;
  docs/protocol.md 4.0, "kept standing") also stands on after an answer with messages while
  permits are left (the result says ``stands``): it is not pulled again per answer, only
  when the broker says it no longer stands.

Each answer is handled here by the pull service's own result handling (``PullService.on_result``:
ProcessQueue, consume service, offsets, OFFSET_ILLEGAL, refusals), the same as a PULL_MESSAGE's;
a queue to pull again at once is due again. Which queues stand is settled when the answer
arrives; the queue results follow oldest first, for the push consumer (``slice_answers``) a
slice of the loop at a time (``loop_share.SLICE``), so that an answer of a thousand woken queues
is not one stretch of the loop (:meth:`PullDriver._drain`); the lite consumer's all at once.
Flow control, pause, orderly locks and retry delays stay the pull service's
(``PullService.multi_pull_of`` checks them when a due queue is sent; a queue held back returns
through ``PullService.execute_now``).
A queue dropped by a rebalance is skipped when due and forgotten when answered; assigned again
it is a new pull request that replaces the old one here and on the broker. A failed request
returns its queues and every standing one to the pull service's error handling (retry after
its delay); a broker without PULL_MULTI_QUEUE makes them pull queue by queue.

The lite pull consumer drives its queues with the same class (client/lite_pulls.py): the
"pull service" and "pull request" above are then ``LitePulls`` and the consumer's ``_Queue``,
which offer the same calls (``multi_pull_of``, ``on_result``, ``on_standing``, ``execute_now``,
``failed``; ``mq``, ``broker_id``, ``pq.standing``, ``pq.dropped``).

Threading: the consumer's event loop only.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import TYPE_CHECKING, Any

from tidemq.client import loop_share
from tidemq.client.connection import raise_for_error
from tidemq.protocol.codes import RequestCode, ResponseCode
from tidemq.protocol.errors import BrokerError, TidemqError
from tidemq.protocol.headers import (
    MASTER_ID,
    MultiQueuePull,
    MultiQueuePullResult,
    PullMultiQueueRequestHeader,
    PullMultiQueueResponseHeader,
)

if TYPE_CHECKING:
    from tidemq.client.pull_service import PullRequest, PullService

__all__ = ["PullDriver"]

log = logging.getLogger(__name__)

_NOT_FOUND = int(ResponseCode.PULL_NOT_FOUND)
# A queue's part of an answer up to this size is handed over as a copy: ~1 us for 11 KiB,
# where decoding a view of the shared body first finds the view's offset in it (5-8 us, per
# queue of the answer: codec._base_bytes), and its messages then do not keep the whole answer
# alive.
_COPY_MAX = 64 * 1024
# The body bytes a broker puts in one answer at most (its max_read_bytes, 4 MiB by default):
# the queues of a request beyond it are answered "not read" and pulled again (see _per_request)
_ANSWER_BYTES = 4 << 20
# Before any answer says how large a queue's part is, one request of this many queues goes
# first and the other due queues wait for its answer (at most _PROBE_WAIT: a request whose
# queues all found nothing is held on the broker) to be sized by it: sent unsized, a backlog
# of 11 KiB a queue at 10,000 queues went as 10 requests of 1,000, ~6,600 of whose queues came
# back "not read" and were sent again (issue 17). Only for a service that asks for it
# (``probe_first``: the lite consumer; the push consumer's first pulls go as before).
_PROBE = 64
_PROBE_WAIT = 0.05

Key = tuple[str, int]


class PullDriver:
    """Pulls of every queue one push consumer pulls from broker ``addr``."""

    def __init__(self, service: PullService, addr: str, *, max_queues: int = 1000) -> None:
        self.s = service
        self.addr = addr
        self.max_queues = max_queues
        self.loop = asyncio.get_running_loop()
        self.due: dict[Key, PullRequest] = {}
        self.standing: dict[Key, PullRequest] = {}
        #: the newest pull request of each queue: an older one answered later (the queue was
        #: dropped and assigned again while it was held) is void
        self.latest: dict[Key, PullRequest] = {}
        self.in_flight = 0
        self.requests = 0
        self.unsupported = False
        #: body bytes of a queue's answer with messages, smoothed (sizes the requests)
        self.bytes_per_queue = 0.0
        self._scheduled = False
        self._closed = False
        #: sizing the first requests: 0 not yet, 1 the probe is out (others wait in
        #: ``_unsized``), 2 sized (an answer came, or _PROBE_WAIT passed)
        self._probe = 0 if getattr(service, "probe_first", False) else 2
        self._unsized: dict[Key, PullRequest] = {}
        self._probe_timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: queue results of the answers received, not handled yet (key, request, result,
        #: its part of the body, stands on), oldest first; and whether ``_drain`` is due
        self._work: collections.deque[
            tuple[Key, PullRequest, MultiQueuePullResult, Any, bool]] = collections.deque()
        self._draining = False
        #: whether the answers' handling gives the loop back every loop_share.SLICE
        #: (``slice_answers``: the push consumer's service; the lite consumer's does not)
        self._sliced = bool(getattr(service, "slice_answers", False))

    def add(self, req: PullRequest) -> None:
        """Pull ``req``'s queue with the next request."""
        key = (req.mq.topic, req.mq.queue_id)
        self.latest[key] = req
        self.standing.pop(key, None)
        req.pq.standing = False
        self.due[key] = req
        self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled and not self._closed:
            self._scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        if self._closed:
            return
        due, self.due = self.due, {}
        if self._probe == 1:  # wait for the probe's answer
            self._unsized.update(due)
            return
        probing = self._probe == 0 and self.bytes_per_queue <= 0 and len(due) > _PROBE
        items: list[tuple[PullRequest, MultiQueuePull]] = []
        keep = getattr(self.s, "keep_permits", None)  # both services grant (their rules)
        for key, req in due.items():
            if probing and len(items) >= _PROBE:
                self._unsized[key] = req
                continue
            if self.latest.get(key) is not req:
                continue
            p = self.s.multi_pull_of(req)
            if p is not None:
                if keep is not None:
                    p.keep = keep(req)
                items.append((req, p))
        if probing and self._unsized:
            self._probe = 1
            self._probe_timer = self.loop.call_later(_PROBE_WAIT, self._sized)
        if not items:
            if self.standing and self.in_flight == 0:
                self._start(items)  # only waits for the standing queues
            return
        n = self._per_request()
        for i in range(0, len(items), n):
            self._start(items[i : i + n])

    def _sized(self) -> None:
        """The probe answered (or _PROBE_WAIT passed): the queues it kept waiting are due."""
        if self._probe == 2:
            return
        self._probe = 2
        if self._probe_timer is not None:
            self._probe_timer.cancel()
            self._probe_timer = None
        waiting, self._unsized = self._unsized, {}
        for key, req in waiting.items():
            self.due.setdefault(key, req)
        if self.due:
            self._schedule()

    def _per_request(self) -> int:
        """Queues per request: ``max_queues``, fewer when the answers of that many would not
        fit one answer's bytes (a backlog of 10 KiB a queue: about 380), so that queues are
        not sent only to come back "not read" and be sent again."""
        per = self.bytes_per_queue
        if per <= 0:
            return self.max_queues
        return max(16, min(self.max_queues, int(_ANSWER_BYTES * 0.9 / per)))

    def _start(self, items: list[tuple[PullRequest, MultiQueuePull]]) -> None:
        """Send a request of ``items`` (empty: only to carry the standing queues' answers).

        Written now, not from a task of its own a loop iteration later, and its answer is
        handled by ``_Answer`` from the connection's read itself: a carrier started while an
        answer of 1,000 woken queues is handled then is on the broker while it is handled,
        not after it (issue 17: the slow messages at 10,000 queues waited for that)."""
        c = self.s.c
        conn = c.pool.get_nowait(self.addr)
        if conn is None:  # not connected yet: connect in a task, then send
            t = self.loop.create_task(self._connect_and_start(items))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
            self.in_flight += 1  # counted from now: no second carrier meanwhile
            return
        self.in_flight += 1
        self._request(conn, items)

    async def _connect_and_start(self, items: list[tuple[PullRequest, MultiQueuePull]]) -> None:
        try:
            conn = await self.s.c.pool.get(self.addr)
        except asyncio.CancelledError:
            self.in_flight -= 1
            raise
        except Exception as exc:  # noqa: BLE001 - every queue of it goes to error handling
            self.in_flight -= 1
            self._lost(items, exc)
            self._sized()
            return
        self._request(conn, items)

    def _request(self, conn: Any, items: list[tuple[PullRequest, MultiQueuePull]]) -> None:
        """Write the request of ``items`` on ``conn`` now (``in_flight`` counts it)."""
        c = self.s.c
        header = PullMultiQueueRequestHeader(
            consumer_group=c.group, pulls=[p for _r, p in items], suspend=True,
            suspend_timeout_millis=c.suspend_ms, standing=True)
        try:
            conn.start_request(RequestCode.PULL_MULTI_QUEUE, header,
                               timeout=c.suspend_ms / 1000 + 10.0, sink=_Answer(self, items))
            conn.flush_now()
        except Exception as exc:  # noqa: BLE001 - closed meanwhile: error handling
            self.in_flight -= 1
            self._lost(items, exc)
            self._sized()
            return
        self.requests += 1

    def _on_frame(self, items: list[tuple[PullRequest, MultiQueuePull]], frame: Any) -> None:
        """The answer of a request (from the connection's read)."""
        self.in_flight -= 1
        if self._closed:
            return
        try:
            if frame.code == ResponseCode.REQUEST_CODE_NOT_SUPPORTED:
                self.unsupported = True
                self._lost(items, None)
                self._sized()
                return
            raise_for_error(frame)
            h = frame.header
            if (not isinstance(h, PullMultiQueueResponseHeader)
                    or len(h.results) != len(items)):
                raise BrokerError("PULL_MULTI_QUEUE answered a different number of results",
                                  response_code=ResponseCode.SYSTEM_ERROR)
        except Exception as exc:  # noqa: BLE001 - every queue of it goes to error handling
            self._lost(items, exc)
            self._sized()
            return
        if self.in_flight == 0 and (self.standing or h.standing and any(
                r.code == _NOT_FOUND or r.stands for r in h.results)):
            # the next carrier goes before this answer is handled (see _start); the queues
            # this answer leaves due go in a request of their own after it
            self._start([])
        self._answered(items, h, memoryview(frame.body))
        if self._probe != 2:
            self._sized()

    def _on_error(self, items: list[tuple[PullRequest, MultiQueuePull]],
                  exc: BaseException) -> None:
        self.in_flight -= 1
        if self._closed:
            return
        self._lost(items, exc if isinstance(exc, Exception) else TidemqError(str(exc)))
        self._sized()

    def _lost(self, items: list[tuple[PullRequest, MultiQueuePull]],
              exc: Exception | None) -> None:
        """The request failed (``exc``; None: the broker has no PULL_MULTI_QUEUE): its queues,
        and the standing ones (which may be gone with the connection), are pulled again by the
        pull service after its error delay (or queue by queue at once)."""
        reqs = [r for r, _p in items]
        reqs += self.standing.values()
        self.standing.clear()
        if exc is not None and reqs and not self._closed:
            # once for all of them (10,000 queues would be 10,000 warnings)
            log.warning("multi-queue pull of %d queues from %s failed: %s; retrying them",
                        len(reqs), self.addr, exc,
                        exc_info=None if isinstance(exc, TidemqError) else exc)
        for req in reqs:
            key = (req.mq.topic, req.mq.queue_id)
            if self.latest.get(key) is not req or req.pq.dropped:
                continue
            del self.latest[key]
            req.pq.standing = False
            if exc is None:
                self.s.execute_now(req)
            else:
                self.s.failed(req, exc, self.addr, quiet=True)

    def _answered(self, items: list[tuple[PullRequest, MultiQueuePull]],
                  h: PullMultiQueueResponseHeader, body: memoryview) -> None:
        """An answer: which queues stand is settled now, in the answer's order; each queue's
        result (decode, ProcessQueue, hand-over: the cost) is handled by :meth:`_drain`."""
        pos = 0
        stand = h.standing
        latest = self.latest
        standing = self.standing
        work = self._work
        for (req, _p), r in zip(items, h.results, strict=True):
            n = r.body_bytes
            part = bytes(body[pos : pos + n]) if n <= _COPY_MAX else body[pos : pos + n]
            pos += n
            if n:
                self.bytes_per_queue = n if not self.bytes_per_queue else (
                    0.9 * self.bytes_per_queue + 0.1 * n)
            key = (req.mq.topic, req.mq.queue_id)
            if latest.get(key) is not req:
                continue
            if stand and r.code == _NOT_FOUND:
                if not self.s.on_standing(req, r):
                    continue  # the service pulls it otherwise (its woken answer is ignored)
                standing[key] = req  # held on the broker: answered when woken
                req.pq.standing = True
                continue
            stands = stand and r.stands
            if stands:
                standing[key] = req
                req.pq.standing = True
            work.append((key, req, r, part, stands))
        for w in h.woken:
            n = w.result.body_bytes
            part = bytes(body[pos : pos + n]) if n <= _COPY_MAX else body[pos : pos + n]
            pos += n
            key = (w.topic, w.queue_id)
            got = standing.pop(key, None)
            if got is not None:
                stands = w.result.stands
                if stands:
                    # standing on at its next offset from now: a later answer may wake it
                    # again before this result is handled (answers are handled in order)
                    standing[key] = got
                # else ``pq.standing`` stays until the result is handled (_result): the
                # queue is not idle meanwhile (ProcessQueue.pull_expired)
                work.append((key, got, w.result, part, stands))
        if self.standing and self.in_flight == 0:
            self._schedule()  # keep a request in flight for the next woken queues
        if not self._draining:
            self._drain()

    def _drain(self) -> None:
        """Handle the queue results of the answers received, oldest first, for at most
        ``loop_share.SLICE`` of the loop (sliced answers only), then give the loop back and go
        on in the next iteration: an answer of 1,000 woken queues is otherwise one stretch of
        the loop (41-108 ms measured at 10,000 queues), during which no listener runs and no
        other answer is read (issue 17)."""
        self._draining = False
        work = self._work
        if self._closed:
            work.clear()
            return
        sl = loop_share.Slicer() if self._sliced else None
        result = self._result
        while work:
            result(*work.popleft())
            if sl is not None and work and sl.due():
                self._draining = True
                self.loop.call_soon(self._drain)
                return

    def _result(self, key: Key, req: PullRequest, r: MultiQueuePullResult, part: Any,
                stands: bool = False) -> None:
        if not stands:
            req.pq.standing = False
        if req.pq.dropped:
            self.latest.pop(key, None)
            self._not_standing(key, req)
            return
        if self.s.on_result(req, r, part, self.addr):
            if req.broker_id == MASTER_ID:
                if stands:  # still held on the broker at its next offset: no re-pull
                    return  # (in ``standing`` since the answer came: _answered)
                self.due[key] = req
                self._schedule()
                return
            self._not_standing(key, req)
            self.latest.pop(key, None)  # pulled from a slave from now on (suggested)
            self.s.execute_now(req)
            return
        self._not_standing(key, req)
        if self.latest.get(key) is req and key not in self.due:
            del self.latest[key]  # rescheduled by the pull service (delay, park) or ended

    def _not_standing(self, key: Key, req: PullRequest) -> None:
        """``req`` was taken as standing on when its answer came, but is not pulled on here."""
        if self.standing.get(key) is req:
            del self.standing[key]
            req.pq.standing = False

    def close(self) -> None:
        self._closed = True
        if self._probe_timer is not None:
            self._probe_timer.cancel()
        for t in list(self._tasks):
            t.cancel()


class _Answer:
    """The sink of one PULL_MULTI_QUEUE's answer (``Connection.start_request``): handled in
    the connection's read, with no future and no loop iteration before it."""

    __slots__ = ("d", "items", "_done")

    def __init__(self, d: PullDriver, items: list[tuple[PullRequest, MultiQueuePull]]) -> None:
        self.d = d
        self.items = items
        self._done = False

    def done(self) -> bool:
        return self._done

    def set_result(self, frame: Any) -> None:
        self._done = True
        try:
            self.d._on_frame(self.items, frame)  # noqa: SLF001
        except Exception:  # a bug here must not break the connection's read
            log.exception("handling a PULL_MULTI_QUEUE answer from %s failed", self.d.addr)

    def set_exception(self, exc: BaseException) -> None:
        self._done = True
        try:
            self.d._on_error(self.items, exc)  # noqa: SLF001
        except Exception:
            log.exception("handling a failed PULL_MULTI_QUEUE to %s failed", self.d.addr)
