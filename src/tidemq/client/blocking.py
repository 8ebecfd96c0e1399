"""The blocking facade: ``tidemq.Producer`` / ``PullConsumer`` / ``Admin`` for ordinary threads.

Each blocking object wraps its asyncio twin (``tidemq.aio``) and runs it on one background
event loop shared by the whole process (a daemon thread named ``tidemq-io``, started on first
use, uvloop when installed). A blocking call submits a coroutine to that loop and waits for it;
``send_async`` returns a ``concurrent.futures.Future`` at once.

Threading: any thread may call these objects, but calls into one object are serialised by the
loop, and they must not be made from the ``tidemq-io`` thread itself (a callback passed to
``send_async`` runs there: do not call blocking methods from it). After ``os.fork`` the child
starts its own loop thread.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import os
import threading
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any, TypeVar

from tidemq.client.admin import Admin as AioAdmin
from tidemq.client.admin import GroupInfo, GroupLag, QueueStatus
from tidemq.client.consumer import PullConsumer as AioPullConsumer
from tidemq.client.errors import RequestTimeoutError
from tidemq.client.message import Message, MessageExt, MessageQueue, SendResult
from tidemq.client.producer import Producer as AioProducer
from tidemq.client.producer import SendCallback
from tidemq.client.push_consumer import PushConsumer as AioPushConsumer
from tidemq.client.transaction_producer import TransactionProducer as AioTransactionProducer
from tidemq.client.transaction_producer import TransactionSendResult
from tidemq.protocol.headers import (
    ClusterInfo,
    SubscriptionGroupConfig,
    TopicConfig,
    TopicRouteData,
)

__all__ = ["Producer", "TransactionProducer", "PullConsumer", "PushConsumer", "Admin", "io_loop"]

T = TypeVar("T")


class _IoThread:
    """The process's shared event loop thread (created lazily, per process)."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None
    _pid = 0
    #: threading.get_ident() of the loop thread (a cheaper test than its name, per send)
    ident = -1

    @classmethod
    def loop(cls) -> asyncio.AbstractEventLoop:
        loop = cls._loop
        if loop is not None and cls._pid == os.getpid():
            return loop
        with cls._lock:
            if cls._loop is None or cls._pid != os.getpid():
                cls._loop = cls._start()
                cls._pid = os.getpid()
            return cls._loop

    @staticmethod
    def _start() -> asyncio.AbstractEventLoop:
        try:
            import uvloop

            loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
            loop = asyncio.new_event_loop()
        started = threading.Event()

        def run() -> None:
            _IoThread.ident = threading.get_ident()
            asyncio.set_event_loop(loop)
            loop.call_soon(started.set)
            loop.run_forever()

        threading.Thread(target=run, name="tidemq-io", daemon=True).start()
        started.wait()
        return loop


def io_loop() -> asyncio.AbstractEventLoop:
    """The shared background event loop the blocking facade runs on."""
    return _IoThread.loop()


def _submit(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    return asyncio.run_coroutine_threadsafe(coro, io_loop())


def _run(coro: Coroutine[Any, Any, T]) -> T:
    loop = io_loop()
    if threading.current_thread().name == "tidemq-io":
        coro.close()
        raise RuntimeError(
            "a blocking tidemq call was made on the tidemq-io thread (from a send_async "
            "callback?); use tidemq.aio there, or hand the work to another thread"
        )
    return asyncio.run_coroutine_threadsafe(coro, loop).result()


async def _make(factory: Callable[[], T]) -> T:
    return factory()  # built on the loop thread: asyncio objects bind to that loop


_open: set[Any] = set()


@atexit.register
def _close_all() -> None:
    """Close what the program left open (commits consumer offsets), bounded in time."""
    if not _open or _IoThread._loop is None or _IoThread._pid != os.getpid():
        return
    for obj in list(_open):
        try:
            _submit(obj._aio.close()).result(timeout=5)
        except Exception:  # exiting anyway
            pass


class _Facade:
    _aio: Any

    def __enter__(self: Any) -> Any:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self: Any) -> Any:
        _run(self._aio.start())
        _open.add(self)
        return self

    def close(self) -> None:
        _run(self._aio.close())
        _open.discard(self)


class _Waiter:
    """Where one blocking ``send`` waits: a lock taken at birth, released by the loop thread
    when the answer is in (one wake-up of one thread, no Condition, no Future)."""

    __slots__ = ("_lock", "_done", "result", "error")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._done = False
        self.result: SendResult | None = None
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self._done

    def set_result(self, result: SendResult) -> None:
        self.result = result
        self._done = True
        self._lock.release()

    def set_exception(self, exc: BaseException) -> None:
        self.error = exc
        self._done = True
        self._lock.release()

    def wait(self, timeout: float) -> SendResult:
        if not self._lock.acquire(timeout=timeout):
            raise RequestTimeoutError(f"no answer from the tidemq-io thread in {timeout:g} s")
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


class _Inbox:
    """Messages handed from callers' threads to the producer on the loop thread: one
    ``call_soon_threadsafe`` wake-up for all that arrive before the loop picks them up, which
    then go into the batch container together (deque appends and pops are thread-safe)."""

    def __init__(self, aio: AioProducer, loop: asyncio.AbstractEventLoop) -> None:
        self._aio = aio
        self._loop = loop
        self._items: collections.deque[tuple[Message, dict[str, Any], Any, bool]] = (
            collections.deque())
        self._armed = False

    def put(self, msg: Message, options: dict[str, Any], sink: Any, wait: bool) -> None:
        self._items.append((msg, options, sink, wait))
        if not self._armed:
            # Two threads may both arm it: one wake-up finds nothing, which is harmless.
            self._armed = True
            self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        # One loop callback from the hand-over to the write: the batches leave at the kick
        # (no call_soon per bucket) and their frames are written at once (not at the end of
        # the loop iteration), so a lone blocking send costs two loop iterations, not four.
        self._armed = False
        items = self._items
        aio = self._aio
        hand_over = aio._hand_over
        acc = aio.accumulator
        acc.handing_over()
        try:
            while items:
                msg, options, sink, wait = items.popleft()
                hand_over(msg, options, sink, wait)
        finally:
            acc.kick()
        aio.pool.flush_now()


# Bumped in a child after fork(): a facade built before it rebuilds its asyncio twin there
# (the parent's loop thread and connections do not exist in the child).
_fork_generation = 0


def _after_fork_in_child() -> None:
    global _fork_generation
    _fork_generation += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Producer(_Facade):
    """Blocking producer; options as ``tidemq.aio.Producer``. Any thread; safe across
    ``fork()``: in the child the producer builds a fresh asyncio producer (new connections on
    the child's own loop thread) on its next call.

    A blocking ``send`` hands the message to the loop thread through an inbox (one wake-up for
    everything that arrives before the loop picks it up) and waits on a lock the loop thread
    releases with the answer; concurrent senders' messages share frames (the batch container,
    docs/producer-path.md)."""

    def __init__(self, namesrv: str | Sequence[str], group: str | None = None,
                 **options: Any) -> None:
        self._args = (namesrv, group, options)
        self._build()

    def _build(self) -> None:
        namesrv, group, options = self._args
        self._gen = _fork_generation
        self._started = False
        self._aio: AioProducer = _run(_make(lambda: AioProducer(namesrv, group, **options)))
        self._inbox = _Inbox(self._aio, io_loop())
        self._wait_slack = self._aio.send_timeout + 30.0

    def _fresh(self) -> None:
        """In a child after fork(): a new asyncio producer, started if the parent's was."""
        started = self._started
        self._build()
        if started:
            self.start()

    def start(self) -> Producer:
        if self._gen != _fork_generation:
            self._fresh()
        _run(self._aio.start())
        self._started = True
        _open.add(self)
        return self

    def close(self) -> None:
        if self._gen != _fork_generation:
            return  # the parent's producer: nothing of it runs in this process
        _run(self._aio.close())
        _open.discard(self)

    @property
    def producer_id(self) -> int:
        return self._aio.producer_id

    def send(self, msg: Message, **options: Any) -> SendResult:
        """Send and wait (options: queue_id, selector, arg, hash_key, timeout)."""
        if self._gen != _fork_generation:
            self._fresh()
        if type(msg) is not Message or threading.get_ident() == _IoThread.ident:
            return _run(self._aio.send(msg, **options))
        w = _Waiter()
        self._inbox.put(msg, options, w, True)
        timeout = options.get("timeout")
        return w.wait(self._wait_slack if timeout is None else timeout + 30.0)

    def send_batch(self, msgs: Sequence[Message], **options: Any) -> SendResult:
        return _run(self._aio.send_batch(msgs, **options))

    def send_async(
        self,
        msg: Message | Sequence[Message],
        callback: SendCallback | None = None,
        **options: Any,
    ) -> concurrent.futures.Future[SendResult]:
        """Start a send; the future resolves to its SendResult. ``callback(result, error)``
        runs on the tidemq-io thread."""
        if self._gen != _fork_generation:
            self._fresh()
        if callback is None and type(msg) is Message:
            fut: concurrent.futures.Future[SendResult] = concurrent.futures.Future()
            self._inbox.put(msg, options, fut, False)
            return fut

        async def go() -> SendResult:
            return await self._aio.send_async(msg, callback, **options)

        return _submit(go())

    def send_oneway(self, msg: Message | Sequence[Message], **options: Any) -> None:
        _run(self._aio.send_oneway(msg, **options))

    def send_columns_async(self, cols: Any, **options: Any
                           ) -> concurrent.futures.Future[SendResult]:
        """Start ``Producer.send_columns`` (client/columns.py); the future resolves to its
        SendResult."""
        return _submit(self._aio.send_columns(cols, **options))

    def write_queues(self, topic: str) -> list[MessageQueue]:
        """The writable queues a send to ``topic`` chooses from (a new topic: those of the
        default route, as a send would use)."""
        return _run(self._aio.write_queues(topic))

    def cancel(self, result: SendResult, **options: Any) -> None:
        """Cancel a pending timed message by the SendResult of its send."""
        _run(self._aio.cancel(result, **options))


class TransactionProducer(Producer):
    """Blocking transactional producer; options as ``tidemq.aio.TransactionProducer``.

    ``execute(msg, arg)`` and ``checker(message_ext)`` are plain functions here and run in a
    worker thread (they may block on a database), never on the tidemq-io loop. Any thread."""

    def __init__(self, namesrv: str | Sequence[str], group: str, *,
                 checker: Callable[[MessageExt], Any], **options: Any) -> None:
        async def check(m: MessageExt) -> Any:
            return await asyncio.to_thread(checker, m)

        self._aio: AioTransactionProducer = _run(_make(
            lambda: AioTransactionProducer(namesrv, group, checker=check, **options)
        ))

    def send_in_transaction(
        self, msg: Message, execute: Callable[[Message, Any], Any], arg: Any = None,
        **options: Any,
    ) -> TransactionSendResult:
        async def run(m: Message, a: Any) -> Any:
            return await asyncio.to_thread(execute, m, a)

        return _run(self._aio.send_in_transaction(msg, run, arg, **options))


class PullConsumer(_Facade):
    """Blocking lite pull consumer; options as ``tidemq.aio.PullConsumer``. Any thread."""

    def __init__(self, namesrv: str | Sequence[str], group: str, **options: Any) -> None:
        self._aio: AioPullConsumer = _run(
            _make(lambda: AioPullConsumer(namesrv, group, **options))
        )

    @property
    def client_id(self) -> str:
        return self._aio.client_id

    def subscribe(self, topic: str, expression: str = "*", *, sql: str | None = None) -> None:
        async def go() -> None:
            self._aio.subscribe(topic, expression, sql=sql)

        _run(go())

    def unsubscribe(self, topic: str) -> None:
        async def go() -> None:
            self._aio.unsubscribe(topic)

        _run(go())

    def assign(self, queues: Iterable[MessageQueue]) -> None:
        qs = list(queues)

        async def go() -> None:
            self._aio.assign(qs)

        _run(go())

    def assignment(self) -> set[MessageQueue]:
        async def go() -> set[MessageQueue]:
            return self._aio.assignment()

        return _run(go())

    def fetch_queues(self, topic: str) -> list[MessageQueue]:
        return _run(self._aio.fetch_queues(topic))

    def stats(self) -> dict[str, int]:
        """Assigned queues, buffered messages and ``corrupt_skipped`` (records skipped because
        they do not decode)."""
        async def go() -> dict[str, int]:
            return self._aio.stats()

        return _run(go())

    def poll(self, timeout: float = 5.0) -> list[MessageExt]:
        _open.add(self)
        return _run(self._aio.poll(timeout))

    def seek(self, mq: MessageQueue, offset: int) -> None:
        _run(self._aio.seek(mq, offset))

    def seek_to_begin(self, mq: MessageQueue) -> None:
        _run(self._aio.seek_to_begin(mq))

    def seek_to_end(self, mq: MessageQueue) -> None:
        _run(self._aio.seek_to_end(mq))

    def seek_to_timestamp(self, mq: MessageQueue, timestamp_ms: int) -> None:
        _run(self._aio.seek_to_timestamp(mq, timestamp_ms))

    def position(self, mq: MessageQueue) -> int | None:
        async def go() -> int | None:
            return self._aio.position(mq)

        return _run(go())

    def committed(self, mq: MessageQueue) -> int | None:
        return _run(self._aio.committed(mq))

    def commit(self, offsets: dict[MessageQueue, int] | None = None) -> None:
        _run(self._aio.commit(offsets))

    def pause(self, queues: Iterable[MessageQueue]) -> None:
        qs = list(queues)

        async def go() -> None:
            self._aio.pause(qs)

        _run(go())

    def resume(self, queues: Iterable[MessageQueue]) -> None:
        qs = list(queues)

        async def go() -> None:
            self._aio.resume(qs)

        _run(go())


class PushConsumer(_Facade):
    """Blocking push consumer; options as ``tidemq.aio.PushConsumer``. Any thread.

    The listener runs on the consumer's thread pool (an ``async def`` listener on the shared
    ``tidemq-io`` loop, where it must not block)."""

    def __init__(self, namesrv: str | Sequence[str], group: str,
                 listener: Callable[..., Any], **options: Any) -> None:
        self._aio: AioPushConsumer = _run(
            _make(lambda: AioPushConsumer(namesrv, group, listener, **options))
        )

    @property
    def client_id(self) -> str:
        return self._aio.client_id

    def subscribe(self, topic: str, expression: str = "*", *, sql: str | None = None) -> None:
        async def go() -> None:
            self._aio.subscribe(topic, expression, sql=sql)

        _run(go())

    def unsubscribe(self, topic: str) -> None:
        async def go() -> None:
            self._aio.unsubscribe(topic)

        _run(go())

    def assignment(self) -> set[MessageQueue]:
        async def go() -> set[MessageQueue]:
            return self._aio.assignment()

        return _run(go())

    def stats(self) -> dict[str, Any]:
        async def go() -> dict[str, Any]:
            return self._aio.stats()

        return _run(go())

    def pause(self) -> None:
        self._aio.paused = True

    def resume(self) -> None:
        async def go() -> None:
            self._aio.resume()

        _run(go())


class Admin(_Facade):
    """Blocking admin client; methods as ``tidemq.aio.Admin``. Any thread."""

    def __init__(self, namesrv: str | Sequence[str], **options: Any) -> None:
        self._aio: AioAdmin = _run(_make(lambda: AioAdmin(namesrv, **options)))

    def cluster_info(self) -> ClusterInfo:
        return _run(self._aio.cluster_info())

    def brokers(self, cluster: str | None = None) -> dict[str, str]:
        return _run(self._aio.brokers(cluster))

    def runtime_info(self, addr: str) -> dict[str, Any]:
        return _run(self._aio.runtime_info(addr))

    def cluster_status(self) -> list[dict[str, Any]]:
        return _run(self._aio.cluster_status())

    def promote(self, addr: str, *, role: str = "", force: bool = False,
                timeout: float = 30.0) -> Any:
        return _run(self._aio.promote(addr, role=role, force=force, timeout=timeout))

    def create_topic(self, topic: str, queues: int = 8, **options: Any) -> list[str]:
        return _run(self._aio.create_topic(topic, queues, **options))

    def delete_topic(self, topic: str, *, broker: str | None = None) -> list[str]:
        return _run(self._aio.delete_topic(topic, broker=broker))

    def list_topics(self) -> list[str]:
        return _run(self._aio.list_topics())

    def topic_configs(self, broker: str) -> dict[str, TopicConfig]:
        return _run(self._aio.topic_configs(broker))

    def topic_route(self, topic: str) -> TopicRouteData:
        return _run(self._aio.topic_route(topic))

    def topic_queues(self, topic: str) -> list[MessageQueue]:
        return _run(self._aio.topic_queues(topic))

    def topic_status(self, topic: str) -> list[QueueStatus]:
        return _run(self._aio.topic_status(topic))

    def min_offset(self, mq: MessageQueue) -> int:
        return _run(self._aio.min_offset(mq))

    def max_offset(self, mq: MessageQueue) -> int:
        return _run(self._aio.max_offset(mq))

    def search_offset(self, mq: MessageQueue, timestamp_ms: int) -> int:
        return _run(self._aio.search_offset(mq, timestamp_ms))

    def consumer_offset(self, group: str, mq: MessageQueue) -> int | None:
        return _run(self._aio.consumer_offset(group, mq))

    def reset_consumer_offset(self, group: str, mq: MessageQueue, offset: int) -> None:
        _run(self._aio.reset_consumer_offset(group, mq, offset))

    def group_lag(self, group: str, topic: str | None = None) -> GroupLag:
        return _run(self._aio.group_lag(group, topic))

    def query_by_key(self, topic: str, key: str, max_num: int = 32) -> list[MessageExt]:
        return _run(self._aio.query_by_key(topic, key, max_num))

    def view_message(self, msg_id: str, topic: str | None = None) -> MessageExt | None:
        return _run(self._aio.view_message(msg_id, topic))

    def group_info(self, group: str) -> GroupInfo:
        return _run(self._aio.group_info(group))

    def update_group(self, group: str, **changes: Any) -> SubscriptionGroupConfig:
        return _run(self._aio.update_group(group, **changes))

    def reset_group_offsets(self, group: str, topic: str, *, offset: int | None = None,
                            timestamp_ms: int | None = None) -> dict[MessageQueue, int]:
        return _run(self._aio.reset_group_offsets(group, topic, offset=offset,
                                                  timestamp_ms=timestamp_ms))

    def dlq_messages(self, group: str, *, max_num: int = 100,
                     from_offset: int = 0) -> list[MessageExt]:
        return _run(self._aio.dlq_messages(group, max_num=max_num, from_offset=from_offset))

    def resend_dlq(self, group: str, msg_ids: Sequence[str] | None = None, *,
                   max_num: int = 1000) -> list[tuple[str, str, str]]:
        return _run(self._aio.resend_dlq(group, msg_ids, max_num=max_num))
