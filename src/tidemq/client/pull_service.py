"""The pull loop of a push consumer (RocketMQ's PullMessageService and
DefaultMQPushConsumerImpl#pullMessage; ref CO2).

One :class:`PullService` per client instance owns every queue's pull request. A pull request
(queue, ProcessQueue, next offset) is executed at once or later; each execution sends one
asynchronous PULL_MESSAGE (long polling: the broker holds it up to 15 s), and its result
schedules the next execution of the same request, so each queue has at most one pull in flight.

Many queues (``multi_queue_min`` or more assigned): a queue's pulls to a broker are made by
that broker's :class:`~tidemq.client.pull_driver.PullDriver` instead, one standing
PULL_MULTI_QUEUE for all of them, with no task per queue; the checks below and the handling of
each result (:meth:`PullService.multi_pull_of`, :meth:`PullService.on_result`) are the same.

Before a pull (flow control, logged every 1000th time):

- the ProcessQueue holds more than ``pull_threshold_for_queue`` (1000) messages, or more than
  ``pull_threshold_size_for_queue`` (100 MiB) of bodies;
- concurrent consumption only: the span between the smallest and the largest offset in flight
  exceeds ``consume_concurrently_max_span`` (2000) -- one stuck message must not let the queue
  run away from its committed offset;

  a queue held back by one of these is *parked*: it pulls again as soon as the consume service
  has consumed enough of it to be under every limit (:meth:`PullService.space_freed`, called
  after each commit), or after 50 ms at the latest, as RocketMQ retries. (RocketMQ only
  retries after 50 ms: a queue whose listener frees space in 1 ms then sits idle for 49. With
  ``pull_threshold_for_queue=100`` a 100,000-message backlog drained at 22 k msgs/s that way,
  and at 130-165 k msgs/s resumed by the consumption; at the default 1,000 a backlog drained
  by a no-op listener is not held back at all.)
- orderly consumption: the queue is not locked by this client on the broker (retry in 3 s);
- the consumer is paused (retry in 1 s, or at once when it is resumed).

Pull statuses (docs/protocol.md, "Pull"), as RocketMQ's push consumer handles them:

- FOUND: next offset = next_begin_offset; messages are filtered by tag string again (the broker
  filtered by tag hash), put in the ProcessQueue and handed to the consume service; the next
  pull goes out at once (after ``pull_interval`` when set). An empty list after filtering also
  pulls again at once.
- NO_NEW_MSG / NO_MATCHED_MSG: next offset = next_begin_offset; if nothing is in flight the
  offset store moves there too (``correctTagsOffset``); pull again at once.
- OFFSET_ILLEGAL: the ProcessQueue is dropped, and 10 s later the corrected offset is stored
  and persisted and the queue removed, to be re-added by the next rebalance.
- An error: retry in 3 s.

Messages of the retry topic ``%RETRY%<group>`` get their original topic back (property
``RETRY_TOPIC``) before the listener sees them.

Which broker of the queue's group (RocketMQ's pullFromWhichNodeTable): the broker id
the last pull response suggested (``suggest_which_broker_id``: a slave while this consumer is
far behind and the group reads from slaves, the master again once it caught up), else the
master, else a slave when the master is down. A pull to a slave carries no commit offset (a
slave keeps only explicitly committed offsets). A pull that cannot reach its broker marks the
address down for a few seconds, so the next one goes to another broker of the group.

Threads: the consumer's event loop only.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import TYPE_CHECKING, Any

from tidemq.client.codec import decode_pull_body
from tidemq.client.connection import raise_for_error
from tidemq.client.message import MessageExt, MessageQueue
from tidemq.client.process_queue import ProcessQueue
from tidemq.client.pull_driver import PullDriver
from tidemq.client.rebalance import RETRY_PREFIX
from tidemq.client.selection import Selection
from tidemq.protocol.codes import PullStatus, RequestCode, pull_status
from tidemq.protocol.corrupt import CorruptRecords
from tidemq.protocol.errors import BrokerError, TidemqError
from tidemq.protocol.headers import (
    MASTER_ID,
    MultiQueuePull,
    PullMessageRequestHeader,
    PullSysFlag,
)

if TYPE_CHECKING:
    from tidemq.client.push_consumer import PushConsumer

__all__ = ["PullService", "PullRequest", "restore_retry_topic"]

log = logging.getLogger(__name__)

FLOW_CONTROL_DELAY = 0.05
PAUSED_DELAY = 1.0
ERROR_DELAY = 3.0
OFFSET_ILLEGAL_DELAY = 10.0
#: A standing pull's permits cover at most this many pulls' worth of messages (keep_permits)
KEEP_PULLS = 4


class PullRequest:
    __slots__ = ("mq", "pq", "next_offset", "broker_id")

    def __init__(self, mq: MessageQueue, pq: ProcessQueue, next_offset: int) -> None:
        self.mq = mq
        self.pq = pq
        self.next_offset = next_offset
        self.broker_id = MASTER_ID  # which broker of the group to pull from (the suggestion)


def restore_retry_topic(msgs: list[MessageExt]) -> None:
    """Give messages pulled from a retry topic their original topic back (in place)."""
    for m in msgs:
        origin = m.properties.get("RETRY_TOPIC")
        if origin:
            m._b.topic = origin


def _skipped(corrupt: CorruptRecords, mq: MessageQueue, queue_offset: int, count: int,
             why: str) -> None:
    """A record of a pull that does not decode: counted and logged; the pull goes on past it
    (next_begin_offset), so the queue is never stalled on it (CO9, "tolerate on the way
    out")."""
    where = (f"offsets {queue_offset}..{queue_offset + count - 1}" if count > 0
             else f"offset {queue_offset} to the end of the pull")
    corrupt.skipped("consumer", f"topic {mq.topic} queue {mq.broker_name}:{mq.queue_id} {where}",
                    why, count)


class PullService:
    """Executes pull requests for every queue of one consumer (event loop only)."""

    #: a pull driver's answer of many queues is handled in slices of the loop (PullDriver)
    slice_answers = True

    def __init__(self, consumer: PushConsumer) -> None:
        self.c = consumer
        self.loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self.flow_controlled = 0
        self.pulls = 0
        #: body bytes of a message pulled, smoothed over the consumer's pulls (keep_permits
        #: sizes the permits of a queue that holds no message with it); 0: none pulled yet
        self.msg_bytes = 0.0
        #: Requests waiting out PAUSED_DELAY, with their timers: resume() runs them at once.
        self._paused: dict[PullRequest, asyncio.TimerHandle] = {}
        #: Requests held back by flow control, by ProcessQueue, with their fallback timers:
        #: space_freed() runs one as soon as its queue is under the limits again.
        self._parked: dict[ProcessQueue, tuple[PullRequest, asyncio.TimerHandle]] = {}
        #: Parked requests resumed by space_freed (before their fallback timer).
        self.unparked = 0
        #: pull drivers by broker address (many queues: client/pull_driver.py)
        self._drivers: dict[str, PullDriver] = {}
        self._deferred: list[PullRequest] | None = None

    def _driver(self, addr: str) -> PullDriver | None:
        """The pull driver of ``addr`` while this consumer holds ``multi_queue_min`` or more
        queues, None to pull queue by queue."""
        c = self.c
        if c.multi_queue_min <= 0 or len(c.rebalance.table) < c.multi_queue_min:
            return None
        d = self._drivers.get(addr)
        if d is None:
            d = self._drivers[addr] = PullDriver(self, addr)
        return None if d.unsupported else d

    @property
    def multi_requests(self) -> int:
        """PULL_MULTI_QUEUE requests sent so far."""
        return sum(d.requests for d in self._drivers.values())

    def start_queue(self, mq: MessageQueue, pq: ProcessQueue, offset: int) -> None:
        if self._deferred is not None:
            self._deferred.append(PullRequest(mq, pq, offset))
        else:
            self.execute_now(PullRequest(mq, pq, offset))

    def defer_starts(self) -> None:
        """A rebalance pass begins: the queues it adds start pulling when it ends, so the
        first pulls already know how many queues there are (many: one multi-queue request
        per broker, rather than single held pulls for the queues added first)."""
        if self._deferred is None:
            self._deferred = []

    def start_deferred(self) -> None:
        deferred, self._deferred = self._deferred or [], None
        for req in deferred:
            self.execute_now(req)

    def execute_now(self, req: PullRequest) -> None:
        if self._closed or req.pq.dropped:
            return
        if self.c.multi_queue_min > 0:
            got = self.c.routes.addr_for_read_now(req.mq, req.broker_id)
            d = None if got is None or got[1] else self._driver(got[0])
            if d is not None:
                d.add(req)  # with the broker's standing multi-queue pull, no task of its own
                return
        t = self.loop.create_task(self._pulls(req))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def execute_later(self, req: PullRequest, delay: float) -> None:
        if not self._closed:
            self.loop.call_later(delay, self.execute_now, req)

    def _pause(self, req: PullRequest) -> None:
        if not self._closed:
            self._paused[req] = self.loop.call_later(PAUSED_DELAY, self._unpause, req)

    def _unpause(self, req: PullRequest) -> None:
        self._paused.pop(req, None)
        self.execute_now(req)

    def _over_limits(self, pq: ProcessQueue) -> bool:
        c = self.c
        return (pq.msg_count > c.pull_threshold_for_queue
                or pq.msg_size > c.pull_threshold_size_for_queue
                or (not c.orderly and pq.max_span() > c.consume_concurrently_max_span))

    def _park(self, req: PullRequest) -> None:
        if self._closed:
            return
        old = self._parked.pop(req.pq, None)
        if old is not None:
            old[1].cancel()
        self._parked[req.pq] = (req, self.loop.call_later(FLOW_CONTROL_DELAY, self._unpark,
                                                           req.pq))

    def _unpark(self, pq: ProcessQueue) -> None:
        got = self._parked.pop(pq, None)
        if got is not None:
            self.execute_now(got[0])

    def space_freed(self, pq: ProcessQueue) -> None:
        """Messages of ``pq`` were consumed: a pull parked by flow control goes out now if the
        queue is under every limit again (event loop)."""
        got = self._parked.get(pq)
        if got is None or self._over_limits(pq):
            return
        del self._parked[pq]
        got[1].cancel()
        self.unparked += 1
        self.execute_now(got[0])

    def resume(self) -> None:
        """The consumer was resumed: pull the paused queues now rather than within 1 s."""
        paused, self._paused = self._paused, {}
        for req, timer in paused.items():
            timer.cancel()
            self.execute_now(req)

    async def close(self) -> None:
        self._closed = True
        for timer in self._paused.values():
            timer.cancel()
        self._paused.clear()
        for _req, timer in self._parked.values():
            timer.cancel()
        self._parked.clear()
        for d in self._drivers.values():
            d.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- one pull ----------------------------------------------------------------------------
    async def _pulls(self, req: PullRequest) -> None:
        """Pull ``req`` again and again while each pull says to go on at once (one task, not
        a task per pull: a consumer of 10,000 queues pulls about once per message)."""
        while await self._pull(req) and not self._closed and not req.pq.dropped:
            pass

    def _may_pull(self, req: PullRequest) -> bool:
        """Whether ``req`` pulls now; if not, it was parked, paused or rescheduled (or its
        queue is gone)."""
        c = self.c
        pq = req.pq
        if pq.dropped:
            return False
        pq.last_pull_ts = time.monotonic()
        if c.paused:
            self._pause(req)
            return False
        if self._over_limits(pq):
            self.flow_controlled += 1
            if self.flow_controlled % 1000 == 1:
                log.info("flow control of %s: %d messages, %d bytes, span %d in flight",
                         req.mq, pq.msg_count, pq.msg_size, pq.max_span())
            self._park(req)
            return False
        if c.orderly and not c.broadcasting and not pq.locked:
            self.execute_later(req, ERROR_DELAY)
            return False
        return True

    def _pulls_now(self, req: PullRequest) -> Selection | None:
        """The subscription ``req`` pulls for now; None when it does not pull now (see
        :meth:`_may_pull`) or its topic was unsubscribed meanwhile (the rebalance drops it)."""
        if not self._may_pull(req):
            return None
        return self.c.subscriptions.get(req.mq.topic)

    def _commit_flags(self, mq: MessageQueue, sub: Selection, slave: bool) -> tuple[int, int]:
        """(sys flags without SUSPEND, commit offset) of a pull of ``mq``."""
        c = self.c
        flags = PullSysFlag.SUBSCRIPTION if sub.filters else 0
        commit = 0
        if not c.broadcasting and not slave:
            off = c.offset_store.read(mq)
            if off > 0:
                flags |= PullSysFlag.COMMIT_OFFSET
                commit = off
        return flags, commit

    def multi_pull_of(self, req: PullRequest) -> MultiQueuePull | None:
        """The pull of ``req`` in a PULL_MULTI_QUEUE (client/pull_driver.py), or None if it
        does not pull now (see :meth:`_may_pull`)."""
        sub = self._pulls_now(req)
        if sub is None:
            return None
        c = self.c
        mq = req.mq
        flags, commit = self._commit_flags(mq, sub, False)
        self.pulls += 1
        return MultiQueuePull(mq.topic, mq.queue_id, req.next_offset, c.pull_batch_size, flags,
                              commit, sub.expression if sub.filters else None,
                              sub.expression_type)

    def keep_permits(self, req: PullRequest) -> int:
        """Permits of ``req``'s standing pull (PullDriver; docs/protocol.md 4.0, "kept
        standing"): how many messages the broker may deliver for the queue, answer after
        answer, before it is pulled -- and so checked against the flow-control limits --
        again. Within every limit of the queue (count, bytes at its average message size so
        far, else of the consumer's pulls; one pull's worth while no message was pulled) and
        at most ``KEEP_PULLS`` pulls' worth, so that a consumer paused meanwhile receives a bounded
        amount more (as Pulsar's granted permits). 0 with ``pull_interval`` or orderly
        consumption (each pull is its own decision there)."""
        c = self.c
        if c.pull_interval > 0 or c.orderly:
            return 0
        pq = req.pq
        room = min(c.pull_threshold_for_queue - pq.msg_count,
                   c.consume_concurrently_max_span - pq.max_span(),
                   KEEP_PULLS * c.pull_batch_size)
        per = pq.msg_size / pq.msg_count if pq.msg_count else self.msg_bytes
        if per > 0:
            room = min(room, int((c.pull_threshold_size_for_queue - pq.msg_size) / per))
        else:
            room = min(room, c.pull_batch_size)
        return max(0, room)

    def on_standing(self, req: PullRequest, r: Any) -> bool:
        """``req``'s queue found nothing and stands on the broker (PullDriver): keep it
        standing (the lite consumer's service also takes a resolved start here)."""
        return True

    def on_result(self, req: PullRequest, r: Any, body: Any, addr: str) -> bool:
        """One queue's result of a PULL_MULTI_QUEUE, handled as a PULL_MESSAGE's answer;
        True: pull again at once."""
        try:
            status = pull_status(r.code)
            if status is None:
                raise BrokerError(r.message or f"pull refused ({r.code})", response_code=r.code)
            return self._handle(req, status, r, body)
        except Exception as exc:  # noqa: BLE001 - the queue retries (failed logs it)
            self.failed(req, exc, addr)
            return False

    async def _pull(self, req: PullRequest) -> bool:
        """One pull of ``req``; True: pull again at once (else it was rescheduled, handed to
        a pull driver, or ends)."""
        sub = self._pulls_now(req)
        if sub is None:
            return False
        c = self.c
        mq = req.mq
        addr = ""
        try:
            addr, slave = await c.routes.addr_for_read(mq, req.broker_id)
            driver = None if slave else self._driver(addr)
            if driver is not None:
                # many queues: this queue is pulled with the broker's standing multi-queue
                # pull from now on (client/pull_driver.py), without this task
                driver.add(req)
                return False
            flags, commit = self._commit_flags(mq, sub, slave)
            conn = c.pool.get_nowait(addr) or await c.pool.get(addr)
            header = PullMessageRequestHeader(
                consumer_group=c.group, topic=mq.topic, queue_id=mq.queue_id,
                queue_offset=req.next_offset, max_msg_nums=c.pull_batch_size,
                sys_flag=flags | PullSysFlag.SUSPEND, commit_offset=commit,
                suspend_timeout_millis=c.suspend_ms,
                subscription=sub.expression if sub.filters else None,
                expression_type=sub.expression_type,
            )
            self.pulls += 1
            frame = await conn.request(RequestCode.PULL_MESSAGE, header,
                                       timeout=c.suspend_ms / 1000 + 10.0)
            status = pull_status(frame.code)
            if status is None:
                raise_for_error(frame)
            return self._handle(req, status, frame.header, frame.body)  # type: ignore[arg-type]
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the queue retries (failed logs it)
            self.failed(req, exc, addr)
        return False

    def failed(self, req: PullRequest, exc: Exception, addr: str, *, quiet: bool = False) -> None:
        """A pull of ``req`` failed: retry after the delay the error asks for (``quiet``: the
        caller logged it once for many queues)."""
        if not isinstance(exc, TidemqError):  # a bug must not silently stop a queue forever
            if not quiet:
                log.error("pull of %s failed unexpectedly; retrying in %g s", req.mq,
                          ERROR_DELAY, exc_info=exc)
            self.execute_later(req, ERROR_DELAY)
            return
        mq = req.mq
        c = self.c
        # SYSTEM_BUSY says when to come back (BrokerError.retry_after); else the default.
        delay = getattr(exc, "retry_after", 0.0) or ERROR_DELAY
        if addr and not isinstance(exc, BrokerError):
            # unreachable: the next pull tries another broker of the group at once
            c.routes.mark_down(addr, mq.topic)
            if c.routes.group_size(mq.broker_name) > 1:
                delay = FLOW_CONTROL_DELAY * 4
        if not self._closed and not quiet:
            log.warning("pull of %s from %s failed: %s; retrying in %g s", mq, addr or "?",
                        exc, delay)
        self.execute_later(req, delay)

    def _handle(self, req: PullRequest, status: PullStatus, h: Any, body: Any) -> bool:
        """The answer of one pull of ``req`` (a PULL_MESSAGE's header or a multi-queue
        result: the same fields); True: pull again at once."""
        c = self.c
        pq = req.pq
        mq = req.mq
        req.broker_id = h.suggest_which_broker_id
        if pq.dropped:
            return False
        sub = c.subscriptions.get(mq.topic)
        if sub is None:
            return False
        if status is PullStatus.FOUND:
            msgs, _end = decode_pull_body(
                body, from_offset=req.next_offset, broker_name=mq.broker_name,
                tags=sub.tags, check_crc=c.check_crc, topic=None,
                on_corrupt=functools.partial(_skipped, c.corrupt, mq),
                max_uncompressed=c.max_uncompressed_bytes,
            )
            if sub.sql is not None:
                msgs = sub.keep(msgs, body, h.members)
            if msgs:
                msgs = pq.assemble(msgs, c.chunk_expire)  # chunks -> whole messages (PR5)
            req.next_offset = h.next_begin_offset
            if msgs:
                per = len(body) / len(msgs)
                self.msg_bytes = per if not self.msg_bytes else (
                    self.msg_bytes + (per - self.msg_bytes) * 0.1)
                if mq.topic.startswith(RETRY_PREFIX):
                    restore_retry_topic(msgs)
                dispatch = pq.put_messages(msgs)
                c.consume_service.submit(msgs, pq, mq, dispatch)
            if c.pull_interval > 0:
                self.execute_later(req, c.pull_interval)
                return False
            return True
        if status is PullStatus.OFFSET_ILLEGAL:
            log.warning("pull offset %d of %s is illegal (queue holds [%d, %d]); "
                        "the queue restarts at %d", req.next_offset, mq, h.min_offset,
                        h.max_offset, h.next_begin_offset)
            req.next_offset = h.next_begin_offset
            pq.dropped = True
            self.loop.call_later(OFFSET_ILLEGAL_DELAY, self._fix_offset, req)
            return False
        # NO_NEW_MSG, NO_MATCHED_MSG
        req.next_offset = h.next_begin_offset
        if pq.msg_count == 0:
            c.offset_store.update(mq, pq.floor(req.next_offset), True)
        return True

    def _fix_offset(self, req: PullRequest) -> None:
        async def go() -> None:
            c = self.c
            c.offset_store.update(req.mq, req.next_offset, False)
            try:
                await c.offset_store.persist(req.mq)
            except TidemqError as exc:
                log.warning("persisting the corrected offset of %s failed: %s", req.mq, exc)
            c.rebalance.table.pop(req.mq, None)

        if not self._closed:
            t = self.loop.create_task(go())
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
