"""Consumer: a Pulsar-style consumer with a subscription type, over POP (docs/consumer-groups.md).

::

    async with aio.Consumer("127.0.0.1:9876", "orders", "billing",
                            subscription_type="Key_Shared") as c:
        while True:
            m = await c.receive()
            handle(m.body)
            await c.acknowledge(m)

The subscription is a consumer group; its type (``Exclusive``, ``Failover``, ``Shared``,
``Key_Shared``; Pulsar's default Exclusive) is enforced by the broker
(``broker/subscription_types.py``): a second exclusive consumer is refused with a
``BrokerError`` of code CONSUMER_BUSY naming the owner; of failover consumers the first by
name receives and the others stand by; shared consumers receive any message; key-shared ones
receive every message of a key (the sharding key, else the first key) in order. The consumer
is a member of the group through heartbeats (every ``heartbeat_interval``, and at ``start``,
which is where a refusal is raised); when it closes, or dies, the messages it held go at once
to the others.

**Receiver queue with flow permits** (Pulsar's ``receiverQueueSize``, 1000): a background task
pops for the consumer only as many messages as its queue has room for, and asks again once
half the queue was taken by :meth:`receive`; the messages in the queue are invisible to the
group while they wait there. :meth:`pause` stops the pops (what the queue holds can still be
received) until :meth:`resume`; ``start_paused=True`` joins the subscription without popping
(Pulsar's ``startPaused``): a set of consumers can all join first and then start together.

**Acks**: :meth:`acknowledge` (one message), :meth:`acknowledge_cumulative` (every message of
that queue received and not acked yet, up to and including it; Exclusive and Failover only),
:meth:`negative_acknowledge` (delivered again after
``negative_ack_redelivery_delay``, doubled per delivery attempt up to
``max_negative_ack_delay``). Acks are grouped: those of one turn of the event loop travel as
one ACK_MESSAGE frame per broker (``simple_consumer.py``). ``ack_timeout`` (seconds, None =
none) is the invisible time: a message not acked that long after it was popped is delivered
again. :meth:`seek` moves the subscription to an offset (a received message's) or a time.

Event loop only (``tidemq.Consumer`` is the blocking facade).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Sequence
from typing import Any

from tidemq.client.connection import DEFAULT_TIMEOUT, ConnectionPool, raise_for_error
from tidemq.client.errors import ClientClosedError, InvalidConfigurationError
from tidemq.client.membership import make_client_id
from tidemq.client.simple_consumer import ReceivedMessage, SimpleConsumer, StaleReceiptError
from tidemq.protocol.codes import RequestCode, ResponseCode
from tidemq.protocol.errors import BrokerError, TidemqError
from tidemq.protocol.pop import MAX_POP_MESSAGES, SeekRequestHeader

__all__ = ["Consumer", "SUBSCRIPTION_TYPES"]

log = logging.getLogger(__name__)

SUBSCRIPTION_TYPES = ("Exclusive", "Failover", "Shared", "Key_Shared")
_CUMULATIVE_TYPES = ("Exclusive", "Failover")  # Pulsar's rule for acknowledge_cumulative
_NO_ACK_TIMEOUT_S = 3600.0  # invisible time without an ack timeout (a leaving consumer's
#                             messages come back at once anyway)
#: refusals that no retry cures: raised from receive()
_FATAL = frozenset({ResponseCode.CONSUMER_BUSY, ResponseCode.CONSUME_MODE_CONFLICT,
                    ResponseCode.INVALID_ARGUMENT, ResponseCode.SUBSCRIPTION_PARSE_FAILED,
                    ResponseCode.NO_PERMISSION, ResponseCode.TOPIC_NOT_EXIST})

_QueueKey = tuple[str, str, int]  # (broker address, topic, queue id)


class Consumer:
    """A Pulsar-style consumer of ``topic`` in ``subscription`` (see the module doc).
    Event loop only."""

    def __init__(
        self,
        namesrv: str | Sequence[str],
        topic: str | Sequence[str],
        subscription: str,
        *,
        subscription_type: str = "Exclusive",
        consumer_name: str | None = None,
        receiver_queue_size: int = 1000,
        initial_position: str = "latest",
        ack_timeout: float | None = None,
        negative_ack_redelivery_delay: float = 60.0,
        max_negative_ack_delay: float = 600.0,
        expression: str = "*",
        sql: str | None = None,
        heartbeat_interval: float = 10.0,
        await_duration: float = 5.0,
        request_timeout: float = DEFAULT_TIMEOUT,
        pool: ConnectionPool | None = None,
        start_paused: bool = False,
    ) -> None:
        if subscription_type not in SUBSCRIPTION_TYPES:
            raise ValueError(f"subscription_type must be one of {', '.join(SUBSCRIPTION_TYPES)}")
        if receiver_queue_size < 1:
            raise ValueError("receiver_queue_size must be >= 1")
        if ack_timeout is not None and not 0.001 <= ack_timeout <= 12 * 3600:
            raise ValueError("ack_timeout must be between 0.001 s and 12 h (or None)")
        if negative_ack_redelivery_delay <= 0 or max_negative_ack_delay <= 0:
            raise ValueError("negative-ack delays must be > 0")
        self.topics = [topic] if isinstance(topic, str) else list(topic)
        if not self.topics:
            raise ValueError("name at least one topic")
        self.subscription = subscription
        self.subscription_type = subscription_type
        self.consumer_name = consumer_name or make_client_id()
        self.receiver_queue_size = receiver_queue_size
        self.invisible = ack_timeout if ack_timeout is not None else _NO_ACK_TIMEOUT_S
        self.nack_delay = negative_ack_redelivery_delay
        self.max_nack_delay = max_negative_ack_delay
        self.heartbeat_interval = heartbeat_interval
        # pops, acks, heartbeats (consume type POP, with the subscription type) and the
        # unregister at close are the SimpleConsumer's; this class adds the receiver queue
        # and the Pulsar vocabulary
        self._sc = SimpleConsumer(
            namesrv, subscription, await_duration=await_duration, init_mode=initial_position,
            request_timeout=request_timeout, heartbeat_interval=heartbeat_interval, pool=pool,
            consumer_name=self.consumer_name, subscription_type=subscription_type)
        for t in self.topics:
            self._sc.subscribe(t, expression, sql=sql)
        self._queue: collections.deque[ReceivedMessage] = collections.deque()
        self._arrived = asyncio.Event()  # the queue got messages (or an error)
        self._room = asyncio.Event()  # receive() made room: the fetcher may ask for more
        self._resumed = asyncio.Event()  # clear while paused: the fetcher pops no more
        if not start_paused:
            self._resumed.set()
        self._unacked: dict[_QueueKey, dict[int, ReceivedMessage]] = {}
        self._generation = 0  # moved by seek: a pop answered across it is dropped
        self._error: BaseException | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._nacks: set[asyncio.Task[None]] = set()
        self._started = False
        self._closed = False
        self.negative_acked = 0
        self.negative_ack_frames = 0  # CHANGE_INVISIBLE_TIME frames the negative acks took
        self._nack_buf: list[tuple[ReceivedMessage, float]] = []
        self.stale_acks = 0

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> Consumer:
        """Join the subscription (heartbeat to every broker of the topics): a refusal --
        CONSUMER_BUSY for a second exclusive consumer, CONSUME_MODE_CONFLICT for another type
        -- is raised here as a BrokerError."""
        if self._closed:
            raise ClientClosedError("this Consumer was closed; create a new one")
        if self._started:
            return self
        await self._sc.start()
        await self._sc._heartbeat()  # a refusal raises here
        self._started = True
        self._tasks = [asyncio.get_running_loop().create_task(self._fetch(),
                                                              name="consumer-fetch")]
        return self

    async def close(self) -> None:
        """Send pending acks, leave the subscription (the messages this consumer held go to
        the others at once), close."""
        if self._closed:
            return
        self._closed = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._flush_nacks()  # queued in this loop turn
        if self._nacks:
            await asyncio.gather(*self._nacks, return_exceptions=True)
        await self._sc.close()  # pending acks first, then it leaves the subscription

    async def __aenter__(self) -> Consumer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def pause(self) -> None:
        """Stop popping (a pop already sent is still answered and queued); the receiver
        queue's messages can still be received. Until :meth:`resume`."""
        self._resumed.clear()

    def resume(self) -> None:
        """Pop again after :meth:`pause` (or ``start_paused``)."""
        self._resumed.set()

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    # -- background: the receiver queue -----------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._arrived.set()

    async def _fetch(self) -> None:
        """Pop while the receiver queue has permits: at most its free room, asking again once
        half of it is free (Pulsar's flow permits)."""
        size = self.receiver_queue_size
        refill = max(1, size // 2)
        while True:
            if not self._resumed.is_set():
                await self._resumed.wait()
                continue
            free = size - len(self._queue)
            if free < refill and self._queue:
                self._room.clear()
                await self._room.wait()
                continue
            gen = self._generation
            try:
                got = await self._sc.receive(min(free, MAX_POP_MESSAGES), self.invisible)
            except BrokerError as exc:
                if exc.response_code == ResponseCode.CONSUMER_NOT_ONLINE:
                    if not await self._rejoin():
                        return  # refused (another exclusive consumer took over): receive raises
                elif exc.response_code in _FATAL:
                    self._fail(exc)
                    return
                else:
                    log.warning("consumer %s: pop failed: %s", self.consumer_name, exc)
                    await asyncio.sleep(0.2)
                continue
            except TidemqError as exc:  # a broker down, a connection lost: try again
                log.warning("consumer %s: pop failed: %s", self.consumer_name, exc)
                await asyncio.sleep(0.2)
                continue
            except Exception as exc:  # a bug: receive() raises it rather than wait forever
                self._fail(exc)
                raise
            if got and gen == self._generation:
                self._queue.extend(got)
                self._arrived.set()
            elif got:  # popped across a seek: give them back at once (stale ones are moot)
                for m in got:
                    self._release(m, 0.001)

    async def _rejoin(self) -> bool:
        """Heartbeat again (the broker dropped this member); False when refused."""
        try:
            await self._sc._heartbeat()
        except BrokerError as exc:
            self._fail(exc)
            return False
        except TidemqError as exc:
            log.warning("heartbeat of consumer %s failed: %s", self.consumer_name, exc)
            await asyncio.sleep(0.2)
        return True

    # -- receive -----------------------------------------------------------------------------------
    def _take(self, n: int) -> list[ReceivedMessage]:
        q = self._queue
        out = [q.popleft() for _ in range(min(n, len(q)))]
        for m in out:
            key = (m.broker_addr, m.message.topic, m.message.queue_id)
            u = self._unacked.get(key)
            if u is None:
                u = self._unacked[key] = {}
            u[m.message.queue_offset] = m
        if len(q) <= self.receiver_queue_size // 2:
            self._room.set()
        return out

    async def _wait(self, timeout: float | None) -> bool:
        if not self._started:
            await self.start()
        while not self._queue:
            if self._error is not None:
                raise self._error
            if self._closed:
                raise ClientClosedError("this Consumer was closed")
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout)
            except TimeoutError:
                return False
        return True

    async def receive(self, timeout: float | None = None) -> ReceivedMessage | None:
        """The next message; None when none came within ``timeout`` seconds (None: wait)."""
        if not await self._wait(timeout):
            return None
        return self._take(1)[0]

    async def batch_receive(self, max_messages: int = 100, timeout: float | None = None
                            ) -> list[ReceivedMessage]:
        """What the receiver queue holds, up to ``max_messages`` (waits for at least one, up
        to ``timeout``; [] then)."""
        if not await self._wait(timeout):
            return []
        return self._take(max_messages)

    # -- acks ------------------------------------------------------------------------------------
    def _forget(self, m: ReceivedMessage) -> None:
        u = self._unacked.get((m.broker_addr, m.message.topic, m.message.queue_id))
        if u is not None:
            u.pop(m.message.queue_offset, None)

    def acknowledge_nowait(self, msg: ReceivedMessage) -> asyncio.Future[None]:
        """Queue the ack of ``msg``; its future resolves when the broker answered
        (StaleReceiptError: it was delivered again since -- the ack timeout passed)."""
        self._forget(msg)
        return self._sc.ack_nowait(msg)

    async def acknowledge(self, msg: ReceivedMessage) -> None:
        """Ack ``msg`` (grouped with concurrent acks into one frame per broker)."""
        await self.acknowledge_nowait(msg)

    async def acknowledge_cumulative(self, msg: ReceivedMessage) -> int:
        """Ack every message received from ``msg``'s queue and not acked yet, up to and
        including ``msg`` (one frame); how many were acked. A stale one (delivered again
        since) is counted in ``stats()['stale_acks']``, not raised. Exclusive and Failover
        subscriptions only, as in Pulsar (InvalidConfigurationError on Shared/Key_Shared:
        there a queue's earlier messages are other consumers', and acking them would lose
        what they have not processed)."""
        if self.subscription_type not in _CUMULATIVE_TYPES:
            raise InvalidConfigurationError(
                f"acknowledge_cumulative is not allowed on a {self.subscription_type} "
                f"subscription ({self.subscription!r}): only Exclusive and Failover ones have "
                "one consumer per queue; acknowledge each message instead")
        key = (msg.broker_addr, msg.message.topic, msg.message.queue_id)
        u = self._unacked.get(key, {})
        upto = msg.message.queue_offset
        todo = [m for off, m in u.items() if off <= upto]
        for m in todo:
            del u[m.message.queue_offset]
        if msg not in todo:
            todo.append(msg)
        results = await self._sc.ack_all(todo)
        stale = sum(1 for r in results if isinstance(r, StaleReceiptError))
        self.stale_acks += stale
        for r in results:
            if r is not None and not isinstance(r, StaleReceiptError):
                raise r
        return len(todo) - stale

    def negative_acknowledge(self, msg: ReceivedMessage) -> None:
        """Deliver ``msg`` again (to this or another consumer) after the negative-ack delay,
        doubled per delivery attempt up to ``max_negative_ack_delay``."""
        self._forget(msg)
        delay = min(self.nack_delay * 2 ** max(0, msg.delivery_attempt - 1), self.max_nack_delay)
        self.negative_acked += 1
        self._release(msg, delay)

    def _release(self, msg: ReceivedMessage, delay: float) -> None:
        """Queue the invisible-time change; those of one loop turn travel as one frame per
        broker (as acks do)."""
        self._nack_buf.append((msg, delay))
        if len(self._nack_buf) == 1:
            loop = asyncio.get_running_loop()
            loop.call_soon(self._flush_nacks)

    def _flush_nacks(self) -> None:
        buf, self._nack_buf = self._nack_buf, []
        if not buf:
            return
        task = asyncio.get_running_loop().create_task(self._nack(buf))
        self._nacks.add(task)
        task.add_done_callback(self._nacks.discard)

    async def _nack(self, buf: list[tuple[ReceivedMessage, float]]) -> None:
        self.negative_ack_frames += len({m.broker_addr for m, _d in buf})
        try:
            results = await self._sc.change_invisible_all([m for m, _d in buf],
                                                          [d for _m, d in buf])
        except TidemqError as exc:
            results = [exc] * len(buf)
        for (msg, _d), r in zip(buf, results, strict=True):
            if isinstance(r, StaleReceiptError):
                self.stale_acks += 1
            elif r is not None:  # it comes back at its ack timeout instead
                log.warning("negative ack of %r failed: %s", msg, r)

    # -- seek ------------------------------------------------------------------------------------
    async def seek(self, message: ReceivedMessage | None = None, *,
                   timestamp: float | None = None) -> dict[str, dict[int, int]]:
        """Move the subscription: to ``message`` (its queue starts again at it) or, with
        ``timestamp`` (seconds since the epoch), every queue of every topic to the first
        message stored at or after it. Messages in the receiver queue and unacked ones are
        dropped (they come again if the seek goes back over them). Returns, per broker
        address, the queues moved and their new offsets."""
        if (message is None) == (timestamp is None):
            raise ValueError("seek to a message or to a timestamp (exactly one)")
        if not self._started:
            await self.start()
        self._generation += 1
        self._queue.clear()
        self._unacked.clear()
        self._room.set()
        targets: list[tuple[str, SeekRequestHeader]] = []
        if message is not None:
            m = message.message
            targets.append((message.broker_addr, SeekRequestHeader(
                consumer_group=self.subscription, topic=m.topic, queue_id=m.queue_id,
                offset=m.queue_offset)))
        else:
            assert timestamp is not None
            for t in self.topics:
                route = await self._sc.routes.get(t)
                for addr in sorted(set(route.read_addrs.values())):
                    targets.append((addr, SeekRequestHeader(
                        consumer_group=self.subscription, topic=t,
                        timestamp=int(timestamp * 1000))))
        moved: dict[str, dict[int, int]] = {}
        for addr, h in targets:
            f = await self._sc.pool.request(addr, RequestCode.SEEK_SUBSCRIPTION, h,
                                            timeout=self._sc.request_timeout)
            if f.code != ResponseCode.SUCCESS:
                raise_for_error(f)
            moved.setdefault(addr, {}).update(f.header.offsets)
        self._generation += 1  # a pop answered while the seek ran is dropped too
        self._queue.clear()
        return moved

    # -- introspection -----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        s = dict(self._sc.stats())
        s.update(queued=len(self._queue), negative_acked=self.negative_acked,
                 negative_ack_frames=self.negative_ack_frames,
                 stale_acks=self.stale_acks + self._sc.stale,
                 unacked=sum(len(u) for u in self._unacked.values()))
        return s
