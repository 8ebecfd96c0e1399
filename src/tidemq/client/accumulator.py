"""The producer's batch accumulator (ref PR3; Pulsar's batch container, Kafka's
RecordAccumulator): every send path batches.

Messages are gathered in *buckets*, one per key: ``topic`` for sends the router may place on any
queue (each batch then goes to the next queue), ``(topic, MessageQueue)`` for ordered sends
pinned to a queue (``queue_id=``, ``selector=``, ``hash_key=``). A bucket leaves as one batch
(one frame, one round trip) when:

- it holds ``batch_max_messages`` (1000) or ``batch_max_bytes`` (512 KiB): at once;
- it holds a waiting caller (``await send()``, blocking ``send()``) and no batch of the bucket is
  in flight: at the end of the current event-loop iteration (no added latency when idle; every
  send of the same iteration joins it); while one is in flight, arriving sends gather and leave
  together when it is answered;
- it holds only ``send_async`` messages: ``batch_max_delay`` (1 ms) after the first.

A pinned bucket has at most one batch in flight, so a retry cannot overtake a later batch of the
same queue: ordered sends keep their order. Each message keeps its own future and SendResult,
and its own error: a message that cannot be encoded (or that the broker refuses for its content:
MESSAGE_ILLEGAL, MESSAGE_TOO_LARGE, INVALID_ARGUMENT) fails only its own caller, the others of
the batch are sent again without it. A waiting caller's timeout covers its time in the bucket:
the batch is sent with the earliest deadline of its messages, a message whose deadline passed
before its batch left fails with RequestTimeoutError.

At most ``max_pending_messages`` messages may be unanswered (in a bucket or in flight): a send
that finds no room waits for it (``await room()``) or raises ProducerQueueFullError (Pulsar's
maxPendingMessages and blockIfQueueFull).

For [scale]'s multi-queue frames: the key is the only thing that decides what travels
together, and ``BatchSend`` receives the bucket's key with its messages; a key per broker and a
send that builds one frame of several queues' batches plug in here.

Threading: one event loop (the producer's).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

from tidemq.client.errors import MessageRejectedError, ProducerQueueFullError, RequestTimeoutError
from tidemq.client.message import Message, MessageQueue, SendResult
from tidemq.client.retry_policy import CONTENT_CODES
from tidemq.client.send_future import BatchCell, SendFuture
from tidemq.protocol.errors import BrokerError

__all__ = ["Accumulator", "BatchSend", "split_result"]

_Future = asyncio.Future

# Sends one bucket's batch: (topic, pinned queue or None, messages, timeout or None).
BatchSend = Callable[[str, MessageQueue | None, list[Message], float | None],
                     Awaitable[SendResult]]
# The reason one message of a batch cannot be sent (None: it can), found without sending.
Check = Callable[[Message], Exception | None]

_InvalidState = (asyncio.InvalidStateError, concurrent.futures.InvalidStateError)

#: Awaiting coroutines of one bucket travel as two alternating groups (two batches, one in
#: flight while the other gathers) when there are at least twice this many of them. High:
#: each request costs ~110 us of broker and ~80 us of client CPU on top of its messages, so
#: with 64 coroutines the lock-step of one batch of 64 beat two groups of 32 in 6 of 6
#: alternated runs here (42-72 k against 19-40 k msgs/s, a loaded 2-core machine).
PIPELINE_MIN = 256


class _Bucket:
    __slots__ = ("key", "topic", "mq", "msgs", "futs", "deadlines", "size", "waiting",
                 "inflight", "loop", "scheduled", "timer", "cool", "listed", "cell")

    def __init__(self, key: Hashable, topic: str, mq: MessageQueue | None,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.key = key
        self.topic = topic
        self.mq = mq
        self.msgs: list[Message] = []
        self.futs: list[asyncio.Future[SendResult]] = []
        self.deadlines: list[float] = []  # of waiting callers only (0: none)
        self.size = 0
        self.waiting = False  # a caller waits on a message of the bucket
        self.inflight = 0
        self.loop = loop
        self.scheduled = False  # a dispatch at the end of this loop iteration is queued
        self.timer: asyncio.TimerHandle | None = None  # the earliest waiting deadline
        # A batch was answered in this loop iteration: the senders it wakes are about to send
        # again, so a send finding the bucket empty joins them instead of leaving alone.
        self.cool = False
        self.listed = False  # in the accumulator's list of lingering buckets
        #: the BatchCell of the send_async futures added to ``futs`` (None: none yet); a
        #: new one whenever ``futs`` is replaced (a cell's futures are exactly its list's
        #: while ``cell.count == len(futs)``)
        self.cell: BatchCell | None = None


class _Lone:
    """Where the connection puts the answer of a batch's request written without a task (a
    lone message, or a batch of waiting callers: what ``Connection.start_request`` calls with
    a ``sink``): handed straight to the accumulator. Awaitable (until answered), so
    ``close()`` and ``flush()`` wait for it as for a task."""

    __slots__ = ("acc", "b", "msgs", "futs", "deadlines", "st", "_done", "_waiter")

    def __init__(self, acc: Accumulator, b: _Bucket, msgs: list[Message],
                 futs: list[Any], deadlines: list[float]) -> None:
        self.acc = acc
        self.b = b
        self.msgs = msgs
        self.futs = futs
        self.deadlines = deadlines
        self.st: Any = None
        self._done = False
        self._waiter: asyncio.Future[None] | None = None

    def done(self) -> bool:
        return self._done

    def set_result(self, frame: Any) -> None:
        self._finish(frame, None)

    def set_exception(self, exc: BaseException) -> None:
        self._finish(None, exc)

    def _finish(self, frame: Any, exc: BaseException | None) -> None:
        if self._done:
            return
        self._done = True
        self.acc.tasks.discard(self)
        try:
            self.acc._one_done(self, frame, exc)
        finally:
            w = self._waiter
            if w is not None and not w.done():
                w.set_result(None)

    def __await__(self) -> Any:
        if self._done:
            return
        if self._waiter is None:
            self._waiter = self.b.loop.create_future()
        yield from self._waiter.__await__()


class Accumulator:
    def __init__(self, send: BatchSend, *, batch_max_messages: int, batch_max_bytes: int,
                 batch_max_delay: float, max_pending_messages: int,
                 check: Check | None = None) -> None:
        if max_pending_messages < 1:
            raise ValueError("max_pending_messages must be >= 1")
        self._send = send
        self._check = check
        self.batch_max_messages = batch_max_messages
        self.batch_max_bytes = batch_max_bytes
        self.batch_max_delay = batch_max_delay
        self.max_pending_messages = max_pending_messages
        self._buckets: dict[Hashable, _Bucket] = {}
        self._flush_scheduled = False
        #: the buckets that got a lingering message since the last flush: the flush looks at
        #: these, not at every bucket (a producer spread over 100,000 queues has 12,500)
        self._lingering: list[_Bucket] = []
        #: messages handed over and not answered yet (in a bucket or in flight)
        self.npending = 0
        self._room: asyncio.Event | None = None  # set when npending drops below the bound
        #: the tasks of batches in flight (and other tracked sends)
        self.tasks: set[Any] = set()
        #: when several topics' batches flush together: takes those it sends in frames of many
        #: batches per broker (SEND_MULTI_QUEUE, client/multi_sender.py), returns the rest
        self.send_many: Callable[[list[Any]], list[Any]] | None = None
        #: a lone message's (or a batch of waiting callers') send without a task
        #: (BatchSender.start / finish / send with ``started``, wired by the producer); None:
        #: every batch is a task
        #: (``now``, the last argument: the frame is written at once, not at the end of the
        #: loop iteration)
        self.start_one: Callable[[str, MessageQueue | None, list[Message], float | None,
                                  Any, bool], Any] | None = None
        self.finish_one: Callable[[Any, str, Any], SendResult | None] | None = None
        self.resume_one: Callable[[str, MessageQueue | None, list[Message], Any],
                                  Awaitable[SendResult]] | None = None
        #: while a caller hands over several messages and then calls :meth:`kick` (the
        #: blocking facade's inbox, :meth:`handing_over`): the buckets to send at the kick,
        #: instead of a ``call_soon`` each
        self._kicking: list[_Bucket] | None = None
        #: called (on the loop) after each batch's answer is handled: the blocking facade's
        #: inbox drains there (client/blocking.py)
        self.on_answered: Callable[[], None] | None = None
        #: wake the blocking facade's callers of an answered batch before on_answered sends
        #: what gathered (set by the facade when its wake-up hands over the GIL; _one_done)
        self.wake_first = False
        #: how many callers the last batch answered with ``wake_first`` woke (the blocking
        #: facade's inbox waits briefly for their next messages before it drains)
        self.woken = 0
        #: how the blocking facade's callers of an answered batch are woken with
        #: ``wake_first`` (None: each by its own ``set_result``)
        self.wake_many: Callable[[SendResult, list[Any]], None] | None = None
        #: writes the frames queued so far now (the connection pool's flush_now, wired by the
        #: producer): a batch that leaves at the end of a loop iteration is written in it
        self.flush_now: Callable[[], None] | None = None
        #: batches sent from buckets so far, and the messages in them
        self.batches = 0
        self.batched_messages = 0

    # -- the pending bound -------------------------------------------------------------------
    def may_join(self, msg: Any) -> bool:
        """Whether ``msg`` may share a batch with others: under ``batch_max_bytes``, without a
        delay level or a delivery time (both are per batch: such a message travels alone).
        The one owner of the rule; ``Producer.send_async`` and :meth:`add_async` inline it
        (the hot path of every ``send_async``)."""
        return len(msg.body) < self.batch_max_bytes and not msg.delay_level and not msg.deliver_at

    def check_room(self, n: int = 1) -> None:
        if self.npending + n > self.max_pending_messages:
            raise ProducerQueueFullError(
                f"{self.npending} messages sent are not answered yet "
                f"(max_pending_messages={self.max_pending_messages}); await some of their "
                "futures or `await producer.flush()` before sending more"
            )

    async def room(self, deadline: float | None = None) -> None:
        """Wait until one more message fits under the bound (RequestTimeoutError at
        ``deadline``, a loop time)."""
        while self.npending >= self.max_pending_messages:
            if self._room is None:
                self._room = asyncio.Event()
            self._room.clear()
            if deadline is None:
                await self._room.wait()
                continue
            left = deadline - asyncio.get_running_loop().time()
            try:
                await asyncio.wait_for(self._room.wait(), max(left, 0.0))
            except TimeoutError:
                raise RequestTimeoutError(
                    f"no room for the message before its send timeout: {self.npending} "
                    f"messages are unanswered (max_pending_messages="
                    f"{self.max_pending_messages})") from None

    def _answered(self, n: int) -> None:
        self.npending -= n
        if self._room is not None and self.npending < self.max_pending_messages:
            self._room.set()

    # -- adding ------------------------------------------------------------------------------
    def send(self, msg: Message, key: Hashable | None, mq: MessageQueue | None,
             deadline: float) -> Awaitable[SendResult]:
        """A waiting sender's message (counted in ``npending`` by the caller); await what it
        returns. When its bucket is idle (nothing gathered, nothing in flight) it leaves at
        once, sent by the caller's coroutine (no task, no hop: an idle producer costs what a
        direct send costs), and the sends arriving meanwhile gather behind it; else it joins
        the bucket (its future: no coroutine of its own)."""
        b = self._buckets.get(msg.topic if key is None else key)
        if b is None or not (b.msgs or b.inflight or b.cool):
            return self._send_alone(b, msg, key, mq, deadline)
        if b.scheduled and b.waiting and not b.inflight:
            # It joins a batch of waiting callers that leaves at the end of this loop
            # iteration (64 coroutines woken by an answer: all but the first come here): what
            # :meth:`add` does then, without its second lookup and checks.
            fut = b.loop.create_future()
            msgs = b.msgs
            msgs.append(msg)
            b.futs.append(fut)
            b.deadlines.append(deadline)
            size = b.size = b.size + len(msg.body)
            if len(msgs) >= self.batch_max_messages or size >= self.batch_max_bytes:
                self._dispatch(b)
            return fut
        return self.add(msg, key, mq, deadline)

    async def _send_alone(self, b: _Bucket | None, msg: Message, key: Hashable | None,
                          mq: MessageQueue | None, deadline: float) -> SendResult:
        if b is None:
            k = msg.topic if key is None else key
            b = self._buckets[k] = _Bucket(k, msg.topic, mq, asyncio.get_running_loop())
        b.inflight += 1
        self.batches += 1
        self.batched_messages += 1
        try:
            return await self._send(b.topic, mq, [msg], max(deadline - b.loop.time(), 0.0))
        finally:
            self._answered(1)
            self._after(b, answered=1)

    def start_lone(self, msg: Message, deadline: float, timeout: float, sink: Any) -> bool:
        """A waiting caller's message (not counted in ``npending`` yet) written now as a batch
        of its own when its topic's bucket is idle (nothing gathered, in flight, cooling or
        leaving) and there is room: what :meth:`add` then the end-of-iteration
        :meth:`_dispatch` would do for it, without the bucket's lists and the hand-over in
        between. The blocking facade's borrower (client/blocking.py): one thread sending alone,
        whose every send finds its bucket idle. ``deadline`` (loop time) is ``timeout`` from
        now (the caller read the clock). ``sink`` gets the answer as a lone batch's
        callers do (:class:`_Lone`, :meth:`_one_done`), or, when it cannot be written so, by
        a task, as :meth:`_dispatch` would. False (nothing done, nothing counted): take the
        ordinary path (:meth:`add`)."""
        b = self._buckets.get(msg.topic)
        if (b is None or b.msgs or b.inflight or b.cool or b.scheduled
                or self.npending >= self.max_pending_messages or self.start_one is None):
            return False
        if timeout <= 0:
            return False
        b.inflight += 1  # before the write: a send of another thread now gathers behind it
        self.npending += 1
        self.batches += 1
        self.batched_messages += 1
        self._start(b, [msg], [sink], [deadline], timeout, True)
        return True

    def add(self, msg: Message, key: Hashable | None = None, mq: MessageQueue | None = None,
            deadline: float = 0.0, fut: Any = None) -> asyncio.Future[SendResult]:
        """Queue ``msg`` (the caller checked room and counted it in ``npending``); its future.
        ``key``: the bucket (default: the topic); ``mq``: the queue a pinned bucket goes to;
        ``deadline`` (loop time): a caller waits for this message until then (0: a
        ``send_async`` message, which may linger ``batch_max_delay``); ``fut``: where the
        result goes instead of a new future (anything with ``done()``, ``set_result()``,
        ``set_exception()``, completed on the loop: the blocking facade's waiters)."""
        b = self._buckets.get(msg.topic if key is None else key)
        if b is None:
            loop = asyncio.get_running_loop()
            k = msg.topic if key is None else key
            b = self._buckets[k] = _Bucket(k, msg.topic, mq, loop)
        if fut is None:
            # (create_future: ~0.2 us less than ``Future(loop=...)``, whose keyword the C
            # constructor parses on every call)
            fut = b.loop.create_future()
        result: asyncio.Future[SendResult] = fut
        msgs = b.msgs
        msgs.append(msg)
        b.futs.append(fut)
        b.deadlines.append(deadline)
        size = b.size + len(msg.body)
        b.size = size
        if len(msgs) >= self.batch_max_messages or size >= self.batch_max_bytes:
            if not (b.mq is not None and b.inflight):
                self._dispatch(b)
            return result
        if deadline:
            b.waiting = True
            if not b.inflight:
                if not b.scheduled:
                    b.scheduled = True
                    if self._kicking is not None:
                        self._kicking.append(b)
                    else:
                        b.loop.call_soon(self._leave, b)
            elif b.timer is None:  # it waits for the batch in flight: not past its deadline
                b.timer = b.loop.call_at(deadline, self._expire, b)
        elif not (b.listed and self._flush_scheduled):
            self._linger(b)
        return result

    def add_async(self, msg: Message) -> SendFuture | None:
        """A ``send_async`` message (no routing options) into its topic's bucket, counted in
        ``npending``, answered through a :class:`SendFuture` (resolved per batch, no asyncio
        future nor SendResult per message unless asked for) -- or None when it travels alone
        (a delay, a delivery time, a body of ``batch_max_bytes`` or more). Raises
        ProducerQueueFullError when ``max_pending_messages`` are unanswered. The hot path of
        ``send_async``: every check and count of it in one call."""
        n = len(msg.body)
        if n >= self.batch_max_bytes or msg.delay_level or msg.deliver_at:  # not may_join
            return None
        if self.npending >= self.max_pending_messages:
            self.check_room()  # raises
        b = self._buckets.get(msg.topic)
        if b is None:
            k = msg.topic
            b = self._buckets[k] = _Bucket(k, k, None, asyncio.get_running_loop())
        elif b.size + n > self.batch_max_bytes and b.msgs:
            # What the bucket holds leaves now and this message starts the next batch: the
            # batch _dispatch would cut at the limit, without its walk over the messages,
            # and whole (its futures resolved through their cell).
            self._dispatch(b)
        self.npending += 1  # given back per batch
        c = b.cell
        if c is None:
            c = b.cell = BatchCell()
        i = c.count
        c.count = i + 1
        fut = SendFuture(b.loop, c, i)
        msgs = b.msgs
        msgs.append(msg)
        b.futs.append(fut)  # type: ignore[arg-type]
        b.deadlines.append(0.0)
        size = b.size = b.size + n
        if len(msgs) >= self.batch_max_messages or size >= self.batch_max_bytes:
            self._dispatch(b)  # an unpinned bucket: never held back by a batch in flight
        elif not (b.listed and self._flush_scheduled):
            self._linger(b)
        return fut

    def _linger(self, b: _Bucket) -> None:
        """``b`` holds a message that waits for the timed flush: list it for that flush, and
        schedule the flush -- ``batch_max_delay`` from now (at the end of this loop iteration
        when it is 0), one timer for all lingering buckets."""
        if not b.listed:
            b.listed = True
            self._lingering.append(b)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            if self.batch_max_delay > 0:
                b.loop.call_later(self.batch_max_delay, self._flush_lingering)
            else:
                b.loop.call_soon(self._flush_lingering)

    def _expire(self, b: _Bucket) -> None:
        """Fail the messages of ``b`` whose callers' deadlines passed while they waited."""
        b.timer = None
        now = b.loop.time()
        keep = [i for i, d in enumerate(b.deadlines) if not d or d > now]
        if len(keep) < len(b.msgs):
            for f, d in zip(b.futs, b.deadlines, strict=True):
                if d and d <= now and not f.done():
                    f.set_exception(_waited_too_long(b.topic))
            self._answered(len(b.msgs) - len(keep))
            b.msgs = [b.msgs[i] for i in keep]
            b.futs = [b.futs[i] for i in keep]
            b.cell = None
            b.deadlines = [b.deadlines[i] for i in keep]
            b.size = sum(len(m.body) for m in b.msgs)
        waiting = [d for d in b.deadlines if d]
        b.waiting = bool(waiting)
        if waiting:
            b.timer = b.loop.call_at(min(waiting), self._expire, b)

    def _leave(self, b: _Bucket, flush: bool = True) -> None:
        """(At the end of a loop iteration, or at a kick: ``flush`` False, the caller writes
        the frames.) Send what ``b`` gathered, unless it left already."""
        if not b.scheduled:  # left already (kick)
            return
        b.scheduled = False
        msgs = b.msgs
        if msgs and not b.inflight:
            n = len(msgs)
            if (n >= 2 * PIPELINE_MIN and b.mq is None and b.waiting
                    and isinstance(b.futs[0], _Future)):
                # Awaiting coroutines, nothing in flight: two frames, so that the broker
                # stores the second while this thread wakes the first's senders, and from
                # then on one group's batch is in flight while the other's gathers (_after).
                self._dispatch(b, (n + 1) // 2)
            self._dispatch(b)
            if flush and self.flush_now is not None:
                self.flush_now()

    @staticmethod
    def _uncool(b: _Bucket) -> None:
        b.cool = False

    def handing_over(self) -> None:
        """The caller adds several messages now and then calls :meth:`kick` (on the loop, in
        the same callback): the buckets they open leave at the kick, with no ``call_soon``
        each."""
        self._kicking = []

    def kick(self) -> None:
        """Send now the buckets that would leave at the end of this loop iteration (a caller
        that added everything it had, the blocking facade's inbox: no further wait)."""
        kicking, self._kicking = self._kicking, None
        for b in self._buckets.values() if kicking is None else kicking:
            if b.scheduled:
                self._leave(b, False)

    def answer_pending(self, topic: str) -> bool:
        """A batch of ``topic``'s (unpinned) bucket is in flight: ``on_answered`` will be
        called when it is answered. Read from other threads (one dict lookup and one int: a
        consistent answer under the GIL)."""
        b = self._buckets.get(topic)
        return b is not None and b.inflight > 0

    @property
    def has_open(self) -> bool:
        return any(b.msgs for b in self._buckets.values())

    def flush_open(self) -> None:
        """Send every bucket now (a pinned one whose batch is in flight: when it is answered).
        With ``send_many`` set, the lingering ``send_async`` batches of several topics go to
        it together (frames of many batches per broker); what it hands back goes alone."""
        self._flush_scheduled = False
        for b in self._lingering:
            b.listed = False
        self._lingering = []
        self._flush_ready([b for b in self._buckets.values()
                           if b.msgs and not (b.mq is not None and b.inflight)])

    def _flush_lingering(self) -> None:
        """The flush ``batch_max_delay`` after a lingering message: :meth:`flush_open` of the
        buckets that got one since the last flush (the others have nothing to send, or send
        it themselves: a waiting caller's bucket leaves on its own)."""
        self._flush_scheduled = False
        lingering, self._lingering = self._lingering, []
        for b in lingering:
            b.listed = False
        self._flush_ready([b for b in lingering
                           if b.msgs and not (b.mq is not None and b.inflight)])

    def _flush_ready(self, ready: list[_Bucket]) -> None:
        if self.send_many is not None:
            many = [b for b in ready if b.mq is None and not b.waiting]
            if len(many) > 1:
                batches = []
                for b in many:
                    batches.append((b.topic, b.msgs, b.futs))
                    # new lists for what the batch took; the deadlines (all 0: send_async)
                    # are cleared in place: one list fewer per bucket and flush for the
                    # collector to track (at 100,000 queues, per message)
                    b.msgs, b.futs, b.size, b.cell = [], [], 0, None
                    b.deadlines.clear()
                for batch in self.send_many(batches):
                    self.send_single(batch)
                ready = [b for b in ready if b.mq is not None or b.waiting]
        for b in ready:
            self._dispatch(b)

    def send_single(self, batch: tuple[str, list[Message], list[Any]]) -> None:
        """Send one open batch (topic, messages, futures) of an unpinned bucket alone."""
        topic, msgs, futs = batch
        b = self._buckets[topic]
        b.inflight += 1
        self.batches += 1
        self.batched_messages += len(msgs)
        self.track(b.loop.create_task(self._send_batch(b, msgs, futs, [0.0] * len(msgs))))

    def answered(self, n: int) -> None:
        """``n`` messages sent by ``send_many`` were answered."""
        self._answered(n)

    def _dispatch(self, b: _Bucket, limit: int = 0) -> None:
        """Send what ``b`` gathered as one batch (``limit``: at most that many messages; the
        rest stays for the next)."""
        if b.timer is not None:
            b.timer.cancel()
            b.timer = None
        msgs, futs, deadlines = b.msgs, b.futs, b.deadlines
        cell = b.cell
        b.cell = None
        if cell is not None and cell.count != len(futs):
            cell = None  # not only send_async futures: each is resolved on its own
        most = min(limit, self.batch_max_messages) if limit else self.batch_max_messages
        if len(msgs) > most or b.size > self.batch_max_bytes:
            # A pinned bucket gathered past the limits while its batch was in flight: send
            # the first batch's worth; the rest leaves when that is answered.
            k, size = 0, 0
            while k < len(msgs) and k < most and (
                    k == 0 or size + len(msgs[k].body) <= self.batch_max_bytes):
                size += len(msgs[k].body)
                k += 1
            b.msgs, b.futs, b.deadlines = msgs[k:], futs[k:], deadlines[k:]
            b.size -= size
            waiting = [d for d in b.deadlines if d]
            b.waiting = bool(waiting)
            if waiting:  # the rest's callers: not past their deadlines while they wait
                b.timer = b.loop.call_at(min(waiting), self._expire, b)
            msgs, futs, deadlines = msgs[:k], futs[:k], deadlines[:k]
            cell = None
        else:
            b.msgs, b.futs, b.deadlines, b.size, b.waiting = [], [], [], 0, False
        b.inflight += 1
        self.batches += 1
        self.batched_messages += len(msgs)
        if self.start_one is not None and (len(msgs) == 1 or all(deadlines)):
            # A lone message (the blocking facade's send when nothing else is in flight), or a
            # batch of waiting callers only (blocking sends of many threads, many coroutines'
            # ``await send()``): written now, answered from the connection's data_received
            # through a _Lone (no task, no future, no loop iteration between the answer and
            # the callers' wake-up); a task only when the answer is not a plain success
            # (errors, retries) or a message waited past its deadline in the bucket.
            d = min(deadlines) if len(deadlines) > 1 else deadlines[0]
            timeout = None
            if d:
                timeout = d - b.loop.time()
            if timeout is None or timeout > 0:
                self._start(b, msgs, futs, deadlines, timeout, False, cell)
                return
        self.track(b.loop.create_task(self._send_batch(b, msgs, futs, deadlines, cell)))

    def _start(self, b: _Bucket, msgs: list[Message], futs: list[Any], deadlines: list[float],
               timeout: float | None, now: bool, cell: Any = None) -> None:
        """Write a batch without a task (``start_one``; ``now``: its frame at once, not at the
        end of the loop iteration), answered through a :class:`_Lone`; a task (one attempt
        to start it, one queue chosen, not two) when it cannot be written so."""
        assert self.start_one is not None
        lone = _Lone(self, b, msgs, futs, deadlines)
        st = self.start_one(b.topic, b.mq, msgs, timeout, lone, now)
        if st is not None:
            lone.st = st
            self.tasks.add(lone)
        else:
            self.track(b.loop.create_task(self._send_batch(b, msgs, futs, deadlines, cell)))

    def _one_done(self, lone: _Lone, frame: Any, exc: BaseException | None) -> None:
        """The outcome of a started batch's request (on the loop, from the connection)."""
        assert self.finish_one is not None
        b, st, futs = lone.b, lone.st, lone.futs
        r = None
        if exc is None:
            try:
                r = self.finish_one(st, b.topic, frame)
            except Exception:  # noqa: BLE001 - the coroutine path reports it
                r = None
        if r is None:
            f = b.loop.create_future()
            if exc is None:
                f.set_result(frame)
            else:
                f.set_exception(exc)
            self.track(b.loop.create_task(self._resume(b, st._replace(fut=f), lone.msgs,
                                                       futs, lone.deadlines)))
            return
        self._answered(len(futs))
        if isinstance(futs[0], _Future):
            # Coroutines: woken first (they run in the next loop iteration). What gathered
            # behind this batch leaves now when it is a group of its own (_after: two
            # alternating groups), else at the end of that iteration, with them.
            split_result(r, futs)
            self._after(b, answered=len(futs))
            return
        # Senders on other threads (the blocking facade). With ``wake_first`` (callers woken by
        # a write that hands them the GIL: blocking._Bell) they are woken first, one by one,
        # and each puts its next message into the inbox before it sleeps again; the drain
        # (on_answered, in _after) then sends all of them as one batch: the threads travel
        # in lock-step as one batch, as 64 coroutines do, instead of two alternating groups
        # of half the size (each request costs ~110 us of broker and ~100 us of client CPU
        # on top of its messages). Without it (a lock released with the GIL held) what
        # gathered is written first and only then are they woken: woken earlier, they would
        # fight this thread for the GIL while it encodes and writes. They send their next
        # messages through the inbox, never in this loop iteration: no cool-down.
        if self.wake_first:
            self.woken = len(futs)
            try:
                # (a lone caller, a thread sending alone: woken without wake_many's layers)
                (_wake if len(futs) == 1 else self.wake_many or _wake)(r, futs)
            finally:
                self._after(b, cool=False)
            return
        try:
            self._after(b, cool=False)
        finally:
            _wake(r, futs)

    async def _resume(self, b: _Bucket, st: Any, msgs: list[Message], futs: list[Any],
                      deadlines: list[float]) -> None:
        """A started batch whose answer was not a plain success: the send's coroutine from its
        first answer on (retries, errors), then as any batch."""
        assert self.resume_one is not None
        try:
            try:
                r = await self.resume_one(b.topic, b.mq, msgs, st)
            except BaseException as exc:
                await self._failed(b, msgs, futs, deadlines, exc, may_isolate=True)
                return
            self._answered(len(msgs))
            split_result(r, futs)
        finally:
            self._after(b)

    def track(self, task: asyncio.Future[Any]) -> None:
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def wait_all(self) -> None:
        """Until every tracked send is answered (failures stay in their futures)."""
        while self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)

    # -- sending -----------------------------------------------------------------------------
    async def _send_batch(self, b: _Bucket, msgs: list[Message],
                          futs: list[asyncio.Future[SendResult]], deadlines: list[float],
                          cell: BatchCell | None = None) -> None:
        try:
            await self._send_some(b, msgs, futs, deadlines, cell=cell)
        finally:
            self._after(b)

    def _after(self, b: _Bucket, cool: bool = True, answered: int = 0) -> None:
        """A batch of ``b`` was answered: send what gathered meanwhile. ``cool``: its senders
        may send again in this loop iteration (coroutines woken by the answer);
        ``answered``: how many of them (0: do not pipeline)."""
        b.inflight -= 1
        if not cool and self.on_answered is not None:
            # The blocking facade's callers (woken after this): what its inbox holds joins the
            # bucket now and leaves at once with what gathered in it (the drain kicks and
            # writes it), or what gathered leaves alone -- nobody else sends in this loop
            # iteration, so waiting for its end would only add an iteration and a write.
            self.on_answered()
            if b.msgs and (b.waiting or b.mq is not None) and not b.inflight and not b.scheduled:
                self._dispatch(b)
                if self.flush_now is not None:
                    self.flush_now()
            return
        if (answered and b.mq is None and b.waiting and not b.inflight and not b.scheduled
                and len(b.msgs) >= PIPELINE_MIN):
            # Coroutines gathered behind the answered batch: they leave now, and the
            # ``answered`` senders this answer wakes gather behind them -- two groups, one
            # batch in flight while the other gathers (the broker stores one while this
            # thread runs the other's senders). The larger group gives some to the other.
            g = len(b.msgs)
            self._dispatch(b, max((g + answered + 1) // 2, PIPELINE_MIN))
            if self.flush_now is not None:
                self.flush_now()
        elif b.msgs and (b.waiting or b.mq is not None) and not b.inflight and not b.scheduled:
            # At the end of this loop iteration: the senders this answer wakes send their
            # next messages first, and they all leave together.
            b.scheduled = True
            b.loop.call_soon(self._leave, b)
        elif cool and not b.msgs and not b.inflight and not b.cool:
            b.cool = True
            b.loop.call_soon(self._uncool, b)
        if self.on_answered is not None:
            self.on_answered()
        # An idle bucket stays (one per topic, and per queue of ordered sends): the next send
        # finds it ready.

    async def _send_some(self, b: _Bucket, msgs: list[Message],
                         futs: list[asyncio.Future[SendResult]], deadlines: list[float],
                         alone: bool = False, cell: BatchCell | None = None) -> None:
        """Send one batch; on success each message gets its result (through ``cell``, when
        the batch is exactly that cell's futures: one store for all of them)."""
        timeout: float | None = None
        # (any() first: a send_async batch has no deadlines, and any() walks them in C)
        waited = [d for d in deadlines if d] if any(deadlines) else None
        if waited:
            now = b.loop.time()
            first = min(waited)
            if first <= now:  # some waited past their deadline in the bucket: fail just those
                keep = [i for i, d in enumerate(deadlines) if not d or d > now]
                for i, f in enumerate(futs):
                    if (deadlines[i] and deadlines[i] <= now) and not f.done():
                        f.set_exception(_waited_too_long(b.topic))
                self._answered(len(msgs) - len(keep))
                msgs = [msgs[i] for i in keep]
                futs = [futs[i] for i in keep]
                cell = None
                deadlines = [deadlines[i] for i in keep]
                if not msgs:
                    return
                waited = [d for d in deadlines if d]
            if waited:
                timeout = min(waited) - now
        try:
            r = await self._send(b.topic, b.mq, msgs, timeout)
        except BaseException as exc:
            await self._failed(b, msgs, futs, deadlines, exc, may_isolate=not alone)
            return
        self._answered(len(msgs))
        if cell is not None and len(futs) > 1:
            cell.resolve(r, futs)  # type: ignore[arg-type]
        else:
            split_result(r, futs)

    async def _failed(self, b: _Bucket, msgs: list[Message], futs: list[Any],
                      deadlines: list[float], exc: BaseException, *, may_isolate: bool) -> None:
        """A batch's send raised: a shared batch refused for its content is isolated (only the
        messages that cannot be sent fail); otherwise every caller gets the error, and what is
        not an Exception (cancellation) is raised on."""
        if (may_isolate and len(msgs) > 1 and isinstance(exc, MessageRejectedError | BrokerError)
                and (isinstance(exc, MessageRejectedError) or exc.response_code in CONTENT_CODES)):
            await self._isolate(b, msgs, futs, deadlines)
            return
        self._answered(len(msgs))
        for f in futs:
            if not f.done():
                f.set_exception(exc)
        if not isinstance(exc, Exception):
            raise exc

    async def _isolate(self, b: _Bucket, msgs: list[Message],
                       futs: list[asyncio.Future[SendResult]], deadlines: list[float]) -> None:
        """A shared batch was refused for its content: fail the messages that cannot be sent,
        send the others again without them (or, when no check finds the culprit, each alone)."""
        bad: list[int] = []
        if self._check is not None:
            for i, m in enumerate(msgs):
                err = self._check(m)
                if err is not None:
                    bad.append(i)
                    if not futs[i].done():
                        futs[i].set_exception(err)
        if bad:
            self._answered(len(bad))
            bad_set = set(bad)
            keep = [i for i in range(len(msgs)) if i not in bad_set]
            if keep:
                await self._send_some(b, [msgs[i] for i in keep], [futs[i] for i in keep],
                                      [deadlines[i] for i in keep], alone=True)
            return
        for i in range(len(msgs)):  # in order: a pinned bucket keeps its order
            await self._send_some(b, [msgs[i]], [futs[i]], [deadlines[i]], alone=True)


def _finish_after_race(r: SendResult, futs: list[Any]) -> None:
    """split_result, one future at a time (some were cancelled meanwhile)."""
    pid = r.producer_id
    step = 1 if r.queue_offset >= 0 else 0
    for i, f in enumerate(futs):
        seq = r.base_seq + i
        with contextlib.suppress(*_InvalidState):
            if not f.done():
                f.set_result(SendResult(r.status, f"{pid:016X}{seq:016X}", r.topic, r.queue_id,
                                        r.queue_offset + i * step, 1, r.broker_name, pid, seq))


def _wake(r: SendResult, futs: list[Any]) -> None:
    """split_result for the blocking facade's callers (a lone one without the loop)."""
    if len(futs) > 1:
        split_result(r, futs)
    elif not (f0 := futs[0]).done():
        try:  # (not contextlib.suppress: three calls more, on every lone send)
            f0.set_result(r)
        except _InvalidState:  # cancelled by another thread
            pass


def _waited_too_long(topic: str) -> RequestTimeoutError:
    return RequestTimeoutError(
        f"send to topic {topic!r} timed out before its batch left (the send timeout covers "
        "the wait in the batch container behind the batch in flight)")


def results_of(r: SendResult, n: int) -> list[SendResult]:
    """The SendResult of each of the ``n`` messages of a batch answered ``r`` (message i:
    offset and sequence + i), as :func:`split_result` gives them."""
    pid = r.producer_id
    prefix = f"{pid:016X}"
    status, topic, qid, qoff, bname, base = (r.status, r.topic, r.queue_id, r.queue_offset,
                                             r.broker_name, r.base_seq)
    step = 1 if qoff >= 0 else 0
    return [SendResult(status, f"{prefix}{base + i:016X}", topic, qid, qoff + i * step, 1,
                       bname, pid, base + i) for i in range(n)]


def split_result(r: SendResult, futs: list[Any]) -> None:
    """Give each message of a batch its own SendResult (message i: offset and sequence + i);
    a ``send_async`` SendFuture gets the batch's result and its index, and builds its
    SendResult when read."""
    if len(futs) == 1:
        f = futs[0]
        if not f.done():
            f.set_result(r)
        return
    pid = r.producer_id
    prefix = f"{pid:016X}"  # unique_id(pid, seq), formatted once per batch
    status, topic, qid, qoff, bname, base = (r.status, r.topic, r.queue_id, r.queue_offset,
                                             r.broker_name, r.base_seq)
    step = 1 if qoff >= 0 else 0  # a DUPLICATE batch has no offsets: -1 for each
    try:
        for i, f in enumerate(futs):
            if type(f) is SendFuture:  # send_async's: its SendResult is built when read
                f.in_batch(r, i)
            elif not f.done():
                seq = base + i
                f.set_result(SendResult(status, f"{prefix}{seq:016X}", topic, qid,
                                        qoff + i * step, 1, bname, pid, seq))
    except _InvalidState:  # a concurrent.futures.Future cancelled by another thread
        _finish_after_race(r, futs)
