"""Ordered consumption (RocketMQ's ConsumeMessageOrderlyService; ref CO6).

Messages of one queue are consumed strictly in queue order, by one listener call at a time:

- in clustering, only while this client holds the broker's lock on the queue (LOCK_BATCH_MQ at
  add time, renewed every 20 s by :meth:`Rebalance.lock_all`; a lock older than 30 s on the
  client side is not trusted). Without the lock the consume request waits and retries, so two
  members never consume one queue at once during a rebalance;
- one consume request per queue (``ProcessQueue.orderly_running``) and one listener call in
  flight (``ProcessQueue.consume_lock``, which a dropped queue waits for before unlocking);
- a request runs for at most 60 s (``MAX_TIME_CONSUME_CONTINUOUSLY``) and then yields.

Results: SUCCESS commits the taken messages (the queue offset moves past them);
SUSPEND_CURRENT_QUEUE_A_MOMENT (or an exception) puts them back in front and consumes them
again after ``ctx.suspend_seconds`` (1 s) -- a local retry, the queue does not move. When a
message has been retried ``max_reconsume_times`` (16) times it is sent to the dead-letter queue
(clustering; CONSUMER_SEND_MSG_BACK with delay level -1) and the queue moves on; if that fails
the queue keeps suspending. Broadcasting has no locks and never gives up.

Threads: scheduling and results on the consumer's event loop; sync listeners on the pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import time
from typing import TYPE_CHECKING, cast

from tidemq.client.consume_concurrently import send_back
from tidemq.client.listener import ConsumeContext, ConsumeOrderlyStatus
from tidemq.client.message import MessageExt, MessageQueue
from tidemq.client.process_queue import ProcessQueue
from tidemq.protocol.errors import TidemqError

if TYPE_CHECKING:
    from tidemq.client.push_consumer import PushConsumer

__all__ = ["ConsumeOrderlyService", "MAX_TIME_CONSUME_CONTINUOUSLY"]

log = logging.getLogger(__name__)

MAX_TIME_CONSUME_CONTINUOUSLY = 60.0
DEFAULT_MAX_RECONSUME_TIMES = 16
LOCK_RETRY_DELAY = 0.1


class ConsumeOrderlyService:
    def __init__(self, consumer: PushConsumer) -> None:
        self.c = consumer
        self.loop = asyncio.get_running_loop()
        self.is_async = inspect.iscoroutinefunction(consumer.listener)
        self.pool = concurrent.futures.ThreadPoolExecutor(
            consumer.consume_thread_max, thread_name_prefix=f"tidemq-orderly-{consumer.group}"
        )
        self._tasks: set[asyncio.Task[None]] = set()
        self.consumed = 0
        self.suspended = 0
        self.dead_lettered = 0
        #: Local retries before the DLQ (the client decides for orderly queues).
        self.max_times = (DEFAULT_MAX_RECONSUME_TIMES if consumer.max_reconsume_times is None
                          else consumer.max_reconsume_times)

    def submit(self, msgs: list[MessageExt], pq: ProcessQueue, mq: MessageQueue,
               dispatch: bool) -> None:
        if dispatch:
            self._schedule(pq, mq, 0.0)

    def _schedule(self, pq: ProcessQueue, mq: MessageQueue, delay: float) -> None:
        def go() -> None:
            t = self.loop.create_task(self._consume(pq, mq))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

        if delay > 0:
            self.loop.call_later(delay, go)
        else:
            go()

    async def _consume(self, pq: ProcessQueue, mq: MessageQueue) -> None:
        c = self.c
        if pq.dropped:
            pq.orderly_running = False
            return
        clustering = not c.broadcasting
        if clustering and (not pq.locked or pq.lock_expired()):
            # Not ours (yet): renew/obtain the lock and try again shortly.
            got = await c.rebalance.lock([mq])
            if mq in got and not pq.dropped:
                pq.locked = True
                pq.last_lock_ts = time.monotonic()
            else:
                self._schedule(pq, mq, 0.5)
                return
        start = time.monotonic()
        bs = c.consume_message_batch_max_size
        while True:
            if pq.dropped:
                pq.orderly_running = False
                return
            if clustering and (not pq.locked or pq.lock_expired()):
                self._schedule(pq, mq, LOCK_RETRY_DELAY)
                return
            if time.monotonic() - start > MAX_TIME_CONSUME_CONTINUOUSLY:
                self._schedule(pq, mq, 0.01)
                return
            msgs = pq.take_messages(bs)
            if not msgs:
                return  # take_messages cleared orderly_running
            ctx = ConsumeContext(group=c.group, message_queue=mq, msgs=msgs, orderly=True,
                                 suspend_seconds=c.suspend_current_queue_time)
            async with pq.consume_lock:
                if pq.dropped:
                    pq.orderly_running = False
                    return
                status = await self._call(msgs, ctx)
            if pq.dropped:
                # Rebalanced away during the call: no commit, the new owner consumes from the
                # committed offset (in order, possibly again).
                pq.orderly_running = False
                return
            if status == ConsumeOrderlyStatus.SUCCESS:
                self._commit(pq, mq, len(msgs))
                continue
            # Suspend: local retry, unless a message is out of retries.
            out_of_retries = clustering and any(
                self._times(pq, m) >= self.max_times for m in msgs)
            if out_of_retries and await self._to_dlq(msgs):
                self._commit(pq, mq, 0)
                self.dead_lettered += len(msgs)
                continue
            self.suspended += 1
            pq.make_messages_to_consume_again(msgs)
            self._schedule(pq, mq, ctx.suspend_seconds)
            return

    @staticmethod
    def _times(pq: ProcessQueue, m: MessageExt) -> int:
        return m.reconsume_times + pq.local_retries.get(m.queue_offset, 0)

    def _commit(self, pq: ProcessQueue, mq: MessageQueue, n: int) -> None:
        offset = pq.commit()
        self.consumed += n
        if offset >= 0 and not pq.dropped:
            self.c.offset_store.update(mq, offset, False)
            self.c.pull_service.space_freed(pq)

    async def _to_dlq(self, msgs: list[MessageExt]) -> bool:
        try:
            for m in msgs:
                await send_back(self.c, m, -1)
            return True
        except TidemqError as exc:
            log.warning("moving messages to the dead-letter queue failed: %s; suspending", exc)
            return False

    async def _call(self, msgs: list[MessageExt], ctx: ConsumeContext) -> str:
        c = self.c
        for h in c.hooks:
            h.before(ctx)
        try:
            if self.is_async:
                status = await c.listener(msgs, ctx)
            else:
                status = await self.loop.run_in_executor(self.pool, c.listener, msgs, ctx)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("orderly listener of group %s failed on %s; suspending the queue",
                          c.group, ctx.message_queue)
            status = ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT
        if status is None:
            status = ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT
        ctx.status = status
        for h in c.hooks:
            h.after(ctx)
        return cast(str, status)

    async def clean_expired(self, pq: ProcessQueue, mq: MessageQueue) -> None:
        return None  # orderly queues never skip a message (RocketMQ does the same)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.pool.shutdown(wait=False, cancel_futures=True)
