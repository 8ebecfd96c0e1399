"""Concurrent consumption (RocketMQ's ConsumeMessageConcurrentlyService; ref CO5).

Every pull result is cut into pages of ``consume_message_batch_max_size`` messages (1 by
default: one message per listener call) and the pages run on the consumer's thread pool
(``consume_thread_max``, 20 threads) -- or, for an ``async def`` listener, as tasks on the
consumer's event loop. Pages of one pull are spread over at most :data:`JOBS_PER_PULL` pool
jobs: handing every single page to the pool costs more than a no-op listener itself
(~10-30 µs per hop: a Future, a thread wake-up, GIL hand-overs), while a few jobs per pull
keep a slow listener parallel across the pool. How many jobs is sized by the listener's
measured time per page (:data:`JOB_TARGET` of listener time per job, at least): a fast listener
gets the whole pull in one job -- what makes a backlog of single-message batches, 32 messages
per pull, affordable -- a slow one (or one not measured yet) up to JOBS_PER_PULL. Parallelism
across jobs of *several* pulls is unchanged: the next pull goes out as soon as this one is
handed over. For a fast listener the pulls handed over in one event-loop iteration also
share jobs, up to JOB_TARGET of listener time each: a pull driver's answer carries the pulls of
up to 1,000 queues, at 10,000 queues mostly one message each, and a job (or, for an
``async def`` listener, a task) per pull cost more than the listener (issue 17).

Finished jobs post their results to a queue that the event loop drains; one loop wake-up
(``call_soon_threadsafe``) serves every job that finished before the loop got to it.

After a listener call, on the event loop:

- SUCCESS: the page is consumed (``ctx.ack_index`` may say only the first k+1 were);
- RECONSUME_LATER, an exception or None: the page failed. Clustering: each failed message is
  sent back to the broker (CONSUMER_SEND_MSG_BACK -> ``%RETRY%<group>`` with the next delay
  level, or the DLQ after ``max_reconsume_times``); a message whose send-back fails stays in
  the ProcessQueue and is consumed again locally after 5 s. Broadcasting: only logged, as in
  RocketMQ.

Then the page leaves the ProcessQueue and the queue's offset moves to the smallest offset still
in flight. Results of a dropped queue (rebalanced away meanwhile) are discarded without a
commit: the new owner consumes from the committed offset (at-least-once).

Messages held longer than ``consume_timeout`` (15 min) are sent back and removed
(:meth:`clean_expired`), so one hung listener cannot pin the committed offset forever.

Threads: :meth:`submit` and result handling on the consumer's event loop; listener calls and
hooks on the pool (sync listeners) or the loop (async listeners).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import inspect
import logging
import math
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from tidemq.client.listener import ConsumeContext, ConsumeStatus
from tidemq.client.message import MessageExt, MessageQueue
from tidemq.client.process_queue import ProcessQueue
from tidemq.protocol.codes import RequestCode
from tidemq.protocol.errors import TidemqError
from tidemq.protocol.headers import ConsumerSendMsgBackRequestHeader

if TYPE_CHECKING:
    from tidemq.client.push_consumer import PushConsumer

__all__ = ["ConsumeConcurrentlyService", "JOBS_PER_PULL", "JOB_TARGET", "LOCAL_RETRY_DELAY",
           "send_back"]

log = logging.getLogger(__name__)

JOBS_PER_PULL = 4
#: Seconds of listener time a pool job should carry before a pull's pages are split further.
JOB_TARGET = 0.0002
#: Weight of one job's measurement in the running time-per-page estimate.
_EWMA = 1 / 16
LOCAL_RETRY_DELAY = 5.0

_Result = tuple[list[MessageExt], bool, int]  # page, success, ack index
_Segment = tuple[list[list[MessageExt]], ProcessQueue, MessageQueue]  # a pull's pages
_SUCCESS = ConsumeStatus.SUCCESS
_RECONSUME_LATER = ConsumeStatus.RECONSUME_LATER


async def send_back(c: PushConsumer, msg: MessageExt, delay_level: int = 0) -> None:
    """CONSUMER_SEND_MSG_BACK for ``msg`` (delay level 0: the broker's 3 + reconsume times;
    -1: straight to the dead-letter queue). Raises TidemqError when it fails."""
    addr = c.routes.broker_addr(msg.broker_name)
    header = ConsumerSendMsgBackRequestHeader(
        consumer_group=c.group, commit_log_offset=msg.commit_log_offset, index=msg._i,
        delay_level=delay_level, origin_msg_id=msg.msg_id, origin_topic=msg.topic,
        max_reconsume_times=-1 if c.max_reconsume_times is None else c.max_reconsume_times,
    )
    await c.pool.request(addr, RequestCode.CONSUMER_SEND_MSG_BACK, header,
                         timeout=c.request_timeout)


class ConsumeConcurrentlyService:
    """Runs the listener over pulled pages and commits the results (see the module doc)."""

    def __init__(self, consumer: PushConsumer) -> None:
        self.c = consumer
        self.loop = asyncio.get_running_loop()
        self.is_async = inspect.iscoroutinefunction(consumer.listener)
        self.pool = concurrent.futures.ThreadPoolExecutor(
            consumer.consume_thread_max, thread_name_prefix=f"tidemq-consume-{consumer.group}"
        )
        self._sem = asyncio.Semaphore(consumer.consume_thread_max)
        self._tasks: set[asyncio.Task[None]] = set()
        self.consumed = 0
        self.failed = 0
        self.jobs = 0  # pool jobs or tasks started
        #: Listener wall time per page, a running estimate written by the pool threads (a lost
        #: update between two of them only delays the estimate); starts "slow": pages are
        #: spread until the listener is measured fast.
        self.page_seconds = JOB_TARGET
        #: Results of finished jobs (appended by pool threads, drained on the loop) and whether
        #: a drain is scheduled.
        self._done: collections.deque[tuple[list[_Result], ProcessQueue, MessageQueue]] = (
            collections.deque())
        self._drain_scheduled = False
        #: one-job pulls of this loop iteration, to share a job (a fast listener's), their
        #: pages, and whether they are handed over at the end of the iteration
        self._gather: list[_Segment] = []
        self._gather_pages = 0
        self._gather_scheduled = False

    def submit(self, msgs: list[MessageExt], pq: ProcessQueue, mq: MessageQueue,
               dispatch: bool) -> None:
        bs = self.c.consume_message_batch_max_size
        if len(msgs) <= bs:
            pages = [msgs]
        elif bs == 1:  # RocketMQ's default: one message per call
            pages = [[m] for m in msgs]
        else:
            pages = [msgs[i : i + bs] for i in range(0, len(msgs), bs)]
        n = len(pages)
        # an async listener runs the pages of a pull in order in one task
        jobs = 1 if self.is_async else min(
            n, JOBS_PER_PULL, max(1, math.ceil(n * self.page_seconds / JOB_TARGET)))
        if jobs > 1:
            step = -(-n // jobs)
            for j in range(0, n, step):
                self._start([(pages[j : j + step], pq, mq)])
            return
        # one job's worth: it may share its job with the other pulls of this iteration
        self._gather.append((pages, pq, mq))
        self._gather_pages += n
        if self._gather_pages * self.page_seconds >= JOB_TARGET:
            self._hand_over()
        elif not self._gather_scheduled:
            self._gather_scheduled = True
            self.loop.call_soon(self._hand_over_soon)

    def _hand_over_soon(self) -> None:
        self._gather_scheduled = False
        self._hand_over()

    def _hand_over(self) -> None:
        """The gathered pulls go as one job (or task)."""
        segments, self._gather = self._gather, []
        self._gather_pages = 0
        if segments:
            self._start(segments)

    def _start(self, segments: list[_Segment]) -> None:
        self.jobs += 1
        if self.is_async:
            self._spawn(self._run_async(segments))
        else:
            self.pool.submit(self._run_job, segments)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        t = self.loop.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _measured(self, t0: float, pages: int) -> None:
        """A job ran ``pages`` pages since ``t0``: update the time-per-page estimate."""
        if pages:
            # Clipped at JOB_TARGET: one job held up (say, waiting for the GIL) must not make
            # a fast listener look slow for long; anything that slow is spread anyway.
            per_page = min((time.perf_counter() - t0) / pages, JOB_TARGET)
            self.page_seconds += (per_page - self.page_seconds) * _EWMA

    def _run_job(self, segments: list[_Segment]) -> None:
        """One pool job: the listener over the pages of ``segments`` (one or more pulls),
        results posted to the loop (pool thread)."""
        t0 = time.perf_counter()
        ran = 0
        for pages, pq, mq in segments:
            results: list[_Result] = []
            try:
                self._run_pages(pages, pq, mq, results)
            except Exception:  # a hook failed: what did not complete is retried, not stranded
                log.exception("consume job of group %s on %s failed", self.c.group, mq)
                if not pq.dropped:
                    results += [(page, False, -1) for page in pages[len(results):]]
            ran += len(results)
            self._done.append((results, pq, mq))
        self._measured(t0, ran)
        if not self._drain_scheduled:
            self._drain_scheduled = True
            try:
                self.loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is closed: the consumer is gone
                pass

    def _drain(self) -> None:
        """Process every posted job result (event loop)."""
        # Cleared before draining: a job posting after this either is drained below or
        # schedules the next drain itself.
        self._drain_scheduled = False
        done = self._done
        while done:
            results, pq, mq = done.popleft()
            try:
                self.process_results(results, pq, mq)
            except Exception:  # a bug must not strand the results queued behind it
                log.exception("processing consume results of %s failed", mq)

    # -- listener calls --------------------------------------------------------------------------
    def _context(self, page: list[MessageExt], mq: MessageQueue) -> ConsumeContext:
        return ConsumeContext(group=self.c.group, message_queue=mq, msgs=page)

    def _run_pages(self, pages: list[list[MessageExt]], pq: ProcessQueue, mq: MessageQueue,
                   out: list[_Result]) -> None:
        """The listener over ``pages``, one result appended to ``out`` per page called."""
        c = self.c
        listener = c.listener
        hooks = c.hooks
        group = c.group
        append = out.append
        for page in pages:
            if pq.dropped:
                break
            ctx = ConsumeContext(group, mq, page)
            if hooks:
                for h in hooks:
                    h.before(ctx)
            try:
                status = listener(page, ctx)
            except Exception:
                log.exception("listener of group %s failed on %d messages of %s; they will "
                              "be retried", group, len(page), mq)
                status = _RECONSUME_LATER
            ctx.status = status  # type: ignore[assignment]  # a sync listener answers a status
            if hooks:
                for h in hooks:
                    h.after(ctx)
            append((page, status is _SUCCESS or status == _SUCCESS, ctx.ack_index))

    async def _run_async(self, segments: list[_Segment]) -> None:
        """The ``async def`` listener over the pages of ``segments``, one after the other
        (the pulls of a fast listener share a task; see :meth:`submit`)."""
        c = self.c
        # the consumer's fields read once per job, not per page (at 10,000 queues a job is
        # mostly one-message pages of many queues, issue 17), as _run_pages does
        listener = c.listener
        hooks = c.hooks
        group = c.group
        process_results = self.process_results
        async with self._sem:
            t0 = time.perf_counter()
            ran = 0
            for pages, pq, mq in segments:
                out: list[_Result] = []
                for page in pages:
                    if pq.dropped:
                        break
                    ctx = ConsumeContext(group, mq, page)
                    if hooks:
                        for h in hooks:
                            h.before(ctx)
                    try:
                        status = await listener(page, ctx)
                    except asyncio.CancelledError:
                        raise
                    except Exception:
                        log.exception("listener of group %s failed on %d messages of %s; "
                                      "they will be retried", group, len(page), mq)
                        status = _RECONSUME_LATER
                    ctx.status = status
                    if hooks:
                        for h in hooks:
                            h.after(ctx)
                    out.append((page, status is _SUCCESS or status == _SUCCESS, ctx.ack_index))
                ran += len(out)
                process_results(out, pq, mq)
            self._measured(t0, ran)

    # -- results ---------------------------------------------------------------------------------
    def process_results(self, results: list[_Result], pq: ProcessQueue,
                        mq: MessageQueue) -> None:
        if pq.dropped:
            return  # the queue moved to another member; it consumes from the committed offset
        c = self.c
        done: list[MessageExt] = []
        failed: list[MessageExt] = []
        if len(results) == 1 and results[0][1] and (
                results[0][2] < 0 or results[0][2] >= len(results[0][0]) - 1):
            done = results[0][0]  # one page, all consumed (a queue's pull at 10,000 queues)
        elif all([ok and ack < 0 and len(page) == 1 for page, ok, ack in results]):
            # The common case (one message per call, all consumed): one pass, no per-page call.
            done = [page[0] for page, _ok, _ack in results]
        else:
            extend = done.extend
            for page, ok, ack in results:
                if ok and (ack < 0 or ack >= len(page) - 1):
                    extend(page)
                elif ok:
                    done += page[: ack + 1]
                    failed += page[ack + 1 :]
                else:
                    failed += page
        self.consumed += len(done)
        if failed:
            self.failed += len(failed)
            if c.broadcasting:
                for m in failed:
                    log.warning("broadcasting: message %s of %s failed and is not retried "
                                "(RECONSUME_LATER is only logged in broadcasting)",
                                m.msg_id, mq)
                done += failed
            else:
                self._spawn(self._send_back_failed(failed, pq, mq))
        if done:
            self._commit(done, pq, mq)

    def _commit(self, msgs: list[MessageExt], pq: ProcessQueue, mq: MessageQueue) -> None:
        offset = pq.remove_messages(msgs)
        if offset >= 0 and not pq.dropped:
            self.c.offset_store.update(mq, offset, True)
            self.c.pull_service.space_freed(pq)

    async def _send_back_failed(self, failed: list[MessageExt], pq: ProcessQueue,
                                mq: MessageQueue) -> None:
        c = self.c
        results = await asyncio.gather(*(send_back(c, m) for m in failed),
                                       return_exceptions=True)
        sent, kept = [], []
        for m, r in zip(failed, results, strict=True):
            if isinstance(r, BaseException):
                if not isinstance(r, TidemqError):
                    log.error("send-back of %s failed unexpectedly: %r", m.msg_id, r)
                kept.append(m)
            else:
                sent.append(m)
        if kept:
            log.warning("send-back of %d messages of %s failed; consuming them again locally "
                        "in %g s", len(kept), mq, LOCAL_RETRY_DELAY)
            self.loop.call_later(LOCAL_RETRY_DELAY, self._resubmit, kept, pq, mq)
        if sent and not pq.dropped:
            self._commit(sent, pq, mq)

    def _resubmit(self, msgs: list[MessageExt], pq: ProcessQueue, mq: MessageQueue) -> None:
        if not pq.dropped:
            self.submit(msgs, pq, mq, True)

    async def clean_expired(self, pq: ProcessQueue, mq: MessageQueue) -> None:
        """Send back and remove messages held longer than ``consume_timeout``."""
        c = self.c
        for _ in range(16):  # at most 16 per round, as RocketMQ
            if pq.dropped or pq.oldest_age() < c.consume_timeout:
                return
            m = pq.first_message()
            if m is None:
                return
            try:
                await send_back(c, m, 3)
            except TidemqError as exc:
                log.warning("send-back of expired message %s failed: %s", m.msg_id, exc)
                return
            log.warning("message %s of %s was held over %g s; sent back", m.msg_id, mq,
                        c.consume_timeout)
            self._commit([m], pq, mq)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.pool.shutdown(wait=False, cancel_futures=True)
