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
handed over.

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
        #: Listener wall time per page, a running estimate written by the pool threads (a lost
        #: update between two of them only delays the estimate); starts "slow": pages are
        #: spread until the listener is measured fast.
        self.page_seconds = JOB_TARGET
        #: Results of finished jobs (appended by pool threads, drained on the loop) and whether
        #: a drain is scheduled.
        self._done: collections.deque[tuple[list[_Result], ProcessQueue, MessageQueue]] = (
            collections.deque())
        self._drain_scheduled = False

    def submit(self, msgs: list[MessageExt], pq: ProcessQueue, mq: MessageQueue,
               dispatch: bool) -> None:
        bs = self.c.consume_message_batch_max_size
        if len(msgs) <= bs:
            pages = [msgs]
        elif bs == 1:  # RocketMQ's default: one message per call
            pages = [[m] for m in msgs]
        else:
            pages = [msgs[i : i + bs] for i in range(0, len(msgs), bs)]
        if self.is_async:
            self._spawn(self._run_async(pages, pq, mq))
            return
        n = len(pages)
        jobs = min(n, JOBS_PER_PULL, max(1, math.ceil(n * self.page_seconds / JOB_TARGET)))
        if jobs == 1:
            self.pool.submit(self._run_job, pages, pq, mq)
            return
        step = -(-n // jobs)
        for j in range(0, n, step):
            self.pool.submit(self._run_job, pages[j : j + step], pq, mq)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        t = self.loop.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _run_job(self, pages: list[list[MessageExt]], pq: ProcessQueue,
                 mq: MessageQueue) -> None:
        """One pool job: the listener over ``pages``, results posted to the loop (pool thread)."""
        t0 = time.perf_counter()
        results: list[_Result] = []
        try:
            self._run_pages(pages, pq, mq, results)
        except Exception:  # a hook failed: what did not complete is retried, not stranded
            log.exception("consume job of group %s on %s failed", self.c.group, mq)
            if not pq.dropped:
                results += [(page, False, -1) for page in pages[len(results):]]
        if results:
            # Clipped at JOB_TARGET: one job held up (say, waiting for the GIL) must not make
            # a fast listener look slow for long; anything that slow is spread anyway.
            per_page = min((time.perf_counter() - t0) / len(results), JOB_TARGET)
            self.page_seconds += (per_page - self.page_seconds) * _EWMA
        self._done.append((results, pq, mq))
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

    async def _run_async(self, pages: list[list[MessageExt]], pq: ProcessQueue,
                         mq: MessageQueue) -> None:
        c = self.c
        out: list[_Result] = []
        async with self._sem:
            for page in pages:
                if pq.dropped:
                    break
                ctx = self._context(page, mq)
                for h in c.hooks:
                    h.before(ctx)
                try:
                    status = await c.listener(page, ctx)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("listener of group %s failed on %d messages of %s; they "
                                  "will be retried", c.group, len(page), mq)
                    status = ConsumeStatus.RECONSUME_LATER
                ctx.status = status
                for h in c.hooks:
                    h.after(ctx)
                out.append((page, status == ConsumeStatus.SUCCESS, ctx.ack_index))
        self.process_results(out, pq, mq)

    # -- results ---------------------------------------------------------------------------------
    def process_results(self, results: list[_Result], pq: ProcessQueue,
                        mq: MessageQueue) -> None:
        if pq.dropped:
            return  # the queue moved to another member; it consumes from the committed offset
        c = self.c
        done: list[MessageExt] = []
        failed: list[MessageExt] = []
        if all([ok and ack < 0 and len(page) == 1 for page, ok, ack in results]):
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
