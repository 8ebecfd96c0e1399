"""The blocking facade: ``tidemq.Producer`` / ``PullConsumer`` / ``Admin`` for ordinary threads.

Each blocking object wraps its asyncio twin (``tidemq.aio``) and runs it on a background event
loop of the process, started on first use: consumers and admin on the one a daemon thread
named ``tidemq-io`` runs (uvloop when installed), producers on their own (``tidemq-io-send``,
the stock asyncio loop), which a thread that sends alone runs itself inside its ``send``
(:class:`_LoopHost`; docs/producer-path.md, "The blocking facade"). A blocking call submits a
coroutine to its loop and waits for it; ``send_async`` returns a
``concurrent.futures.Future`` at once.

Threading: any thread may call these objects, but calls into one object are serialised by the
loop, and they must not be made from a thread while it runs the loop (a callback passed to
``send_async`` runs there: do not call blocking methods from it). After ``os.fork`` the child
starts its own loops.
"""

from __future__ import annotations

import asyncio
import asyncio.events as asyncio_events
import atexit
import collections
import concurrent.futures
import os
import socket
import struct
import sys
import threading
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any, TypeVar

from tidemq.client.accumulator import results_of, split_result
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


#: A borrowed loop (see _LoopHost) goes back to its thread after the borrower has not sent
#: for this long: what a caller of the facade elsewhere may wait, at most, for the loop.
RECLAIM_AFTER = 0.01
#: A thread borrows the producers' loop after this many consecutive sends of its own with no
#: other thread waiting on the loop (one thread sending in a loop; never 16 threads taking turns).
BORROW_AFTER = 2


_ON_LOOP = ("a blocking tidemq call was made on a thread while it runs a tidemq-io loop (from a "
            "send_async callback?); use tidemq.aio there, or hand the work to another thread")


class _LoopHost:
    """One event loop of the facade and the thread that runs it whenever nobody else does.

    The thread (``name``) runs the loop; a thread that sends alone may *borrow* it (only a
    ``lendable`` host lends): the loop stops on its thread and the borrower runs it itself,
    inside each ``send``, until its answer is in -- the round trip on the calling thread, with
    the same connections, no hop to another thread and no wake-up of one. Between its sends
    the borrower keeps the loop (the next send starts at once) until someone else needs it:

    - another thread sends or calls the facade: the loop goes back to the host thread at once
      (or, while the borrower is inside a send, when that send ends);
    - the borrower has not sent for RECLAIM_AFTER: the host thread takes it back (its
      periodic work -- route refreshes, timers -- runs late by at most that).

    ``_mu`` guards the role; only ``_owner``'s thread runs the loop. docs/producer-path.md,
    "The blocking facade", has the measurements behind this design."""

    def __init__(self, name: str, uv: bool, lendable: bool) -> None:
        self.name = name
        self.lendable = lendable
        loop: asyncio.AbstractEventLoop
        if uv:
            try:
                import uvloop

                loop = uvloop.new_event_loop()
            except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
                loop = asyncio.new_event_loop()
        else:
            loop = asyncio.new_event_loop()
        self.loop = loop
        self.ident = -1
        self._mu = threading.Lock()
        self._owner = 0  # 0: the host thread runs the loop; else the borrower's thread ident
        self._driving = False  # the borrower is inside a send, running the loop
        self._want_back = False  # someone needs the loop: give it back when the send ends
        self._users = 0  # threads waiting for work on the loop (calls, handed-over sends)
        self._sends = 0  # sends of the borrower (the host thread's reclaim check)
        self._last = 0  # the thread of the last send, and its consecutive sends
        self._streak = 0
        self._wake = threading.Lock()  # released to wake the host thread while lent
        self._wake.acquire()
        self._wake_pending = False  # _wake is released and not yet taken
        self._returned = False  # handed back, and the parked host thread has not seen it yet
        self._lent = threading.Lock()  # released when the host thread stopped for a borrower
        self._lent.acquire()
        started = threading.Event()
        threading.Thread(target=self._main, args=(started,), name=name, daemon=True).start()
        started.wait()

    def _main(self, started: threading.Event) -> None:
        self.ident = threading.get_ident()
        loop = self.loop
        asyncio.set_event_loop(loop)
        loop.call_soon(started.set)
        while True:
            loop.run_forever()  # until a borrower stops it (borrow)
            self._lent.release()
            self._parked()

    def _parked(self) -> None:
        """While the loop is lent: wait until it is handed back, or take it back when the
        borrower has not sent for RECLAIM_AFTER. Decided on the state under ``_mu`` (the
        wake-up lock is only a hint)."""
        seen = -1
        while True:
            got = self._wake.acquire(timeout=RECLAIM_AFTER)
            with self._mu:
                if got:
                    self._wake_pending = False
                if self._returned:
                    # Handed back: run it (even if another thread borrowed it again since: its
                    # stop is queued, and it waits for this thread's run_forever to return).
                    self._returned = False
                    return
                if not self._driving and self._sends == seen:
                    self._owner = 0
                    return
                seen = self._sends

    def _hand_back(self) -> None:
        """(Under ``_mu``.) The host thread runs the loop again from now on."""
        self._owner = 0
        self._want_back = False
        self._returned = True
        if not self._wake_pending:
            self._wake_pending = True
            self._wake.release()

    def _need_loop(self) -> None:
        """(Under ``_mu``.) Someone needs work done on the loop: if it is lent, have it back
        (now, or when the borrower's send ends)."""
        if self._owner:
            if self._driving:
                self._want_back = True
            else:
                self._hand_back()

    def check_thread(self) -> None:
        if asyncio._get_running_loop() is self.loop:
            raise RuntimeError(_ON_LOOP)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for it (any thread but the loop's)."""
        if asyncio._get_running_loop() is self.loop:
            coro.close()
            self.check_thread()
        with self._mu:
            self._users += 1
            self._need_loop()
        try:
            return asyncio.run_coroutine_threadsafe(coro, self.loop).result()
        finally:
            with self._mu:
                self._users -= 1

    def need_loop(self) -> None:
        with self._mu:
            self._need_loop()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        self.need_loop()
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    # -- the send role -----------------------------------------------------------------------
    def enter_send(self) -> bool:
        """A blocking send begins on this thread: True when it runs the loop itself (it holds
        the loop, or borrows it now), False when it hands the message over and waits (then
        :meth:`leave_handed` after the answer)."""
        me = threading.get_ident()
        if me == self.ident:
            self.check_thread()  # a callback on the loop's own thread: raises
        with self._mu:
            if self._owner == me:
                if self._driving:  # a callback of the loop this very send runs
                    raise RuntimeError(_ON_LOOP)
                self._driving = True
                return True
            if self._last == me:
                self._streak += 1
            else:
                self._last = me
                self._streak = 0
            if not (self._owner == 0 and not self._users and self.lendable
                    and self._streak >= BORROW_AFTER
                    and asyncio._get_running_loop() is None):
                self._users += 1
                self._need_loop()
                return False
            self._owner = me
            self._driving = True
        # Borrow: stop the loop on the host thread and wait until it has stopped (one
        # wake-up each way, once for a whole run of sends).
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._lent.acquire()
        return True

    def drive(self, put: Callable[[Message, dict[str, Any], Any], None], msg: Message,
              options: dict[str, Any], d: _Driven) -> None:
        """(The borrower, between enter_send and leave_driven.) ``put`` the message, then run
        the loop on this thread until ``d`` has its answer.

        The loop's iterations (``_run_once``) are run here under one running-loop mark, not
        through ``run_forever`` and a ``put`` marked running apart: ``run_forever``'s set-up
        and tear-down (asyncgen hooks, coroutine origin tracking, the running-loop mark, each
        ``_set_running_loop`` a ``getpid`` system call on Python 3.11) cost more than the
        iteration that waits for the answer. Async generators first iterated here are not
        registered with the loop for ``shutdown_asyncgens`` (the facade's loops are never
        shut down: daemon threads). Where the loop has no ``_run_once`` (not the stock
        asyncio loop), ``run_forever`` until ``d`` stops it."""
        loop = self.loop
        run_once = getattr(loop, "_run_once", None)
        if run_once is None:  # pragma: no cover - the producers' loop is the stock one
            d._loop = loop  # its answer stops run_forever
            asyncio_events._set_running_loop(loop)
            try:
                put(msg, options, d)
            finally:
                asyncio_events._set_running_loop(None)
            while not d._done:
                loop.run_forever()
            return
        loop._thread_id = threading.get_ident()  # type: ignore[attr-defined]  # is_running()
        asyncio_events._set_running_loop(loop)
        try:
            put(msg, options, d)
            while not d._done:
                run_once()
        finally:
            loop._stopping = False  # type: ignore[attr-defined]  # d's loop.stop()
            loop._thread_id = None  # type: ignore[attr-defined]
            asyncio_events._set_running_loop(None)

    def leave_handed(self) -> None:
        with self._mu:
            self._users -= 1

    def leave_driven(self, clean: bool) -> None:
        """The driving send ended; ``clean``: the loop stopped normally (else it is handed
        back to the host thread, which finishes whatever is in flight)."""
        with self._mu:
            self._driving = False
            self._sends += 1
            if self._want_back or not clean:
                self._hand_back()


_hosts: dict[str, _LoopHost] = {}
_hosts_pid = 0
_hosts_lock = threading.Lock()
#: The consumers', admin's and anything else's loop (uvloop), never lent.
SHARED = "tidemq-io"
#: The blocking producers' loop: lent to a thread that sends alone. The stock asyncio loop:
#: uvloop, run from the main thread, sets up its signal wake-up socket pair on every
#: run_forever (~50 us per send here), which a borrowed loop does per send.
PRODUCERS = "tidemq-io-send"


def _host(name: str = SHARED) -> _LoopHost:
    global _hosts_pid
    if _hosts_pid == os.getpid():
        h = _hosts.get(name)
        if h is not None:
            return h
    with _hosts_lock:
        if _hosts_pid != os.getpid():  # first use, or a child after fork(): fresh loops
            _hosts.clear()
            _hosts_pid = os.getpid()
        h = _hosts.get(name)
        if h is None:
            h = _hosts[name] = _LoopHost(name, uv=name == SHARED, lendable=name == PRODUCERS)
        return h


def io_loop() -> asyncio.AbstractEventLoop:
    """The shared background event loop the blocking facade's consumers and admin run on."""
    return _host().loop


def _submit(coro: Coroutine[Any, Any, T], host: str = SHARED) -> concurrent.futures.Future[T]:
    return _host(host).submit(coro)


def _run(coro: Coroutine[Any, Any, T], host: str = SHARED) -> T:
    return _host(host).run(coro)


async def _make(factory: Callable[[], T]) -> T:
    return factory()  # built on the loop thread: asyncio objects bind to that loop


_open: set[Any] = set()


@atexit.register
def _close_all() -> None:
    """Close what the program left open (commits consumer offsets), bounded in time."""
    if not _open or _hosts_pid != os.getpid():
        return
    for obj in list(_open):
        try:
            _submit(obj._aio.close(), obj._host_name).result(timeout=5)
        except Exception:  # exiting anyway
            pass


class _Facade:
    _aio: Any
    #: the loop (``_LoopHost``) this object's asyncio twin lives on
    _host_name = SHARED

    def __enter__(self: Any) -> Any:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self: Any) -> Any:
        _run(self._aio.start(), self._host_name)
        _open.add(self)
        return self

    def close(self) -> None:
        _run(self._aio.close(), self._host_name)
        _open.discard(self)


class _Bell:
    """A thread's doorbell: where its blocking ``send`` sleeps until the loop has the answer.

    A socket pair per thread (made on first use, again in a child after ``fork()``): the
    caller sleeps in one ``recv`` (bounded by ``SO_RCVTIMEO``, so the safety timeout costs no
    ``poll`` call), the loop rings it with one non-blocking ``write``. Both calls release the
    GIL, and that is the point: a ``threading.Lock`` is released with the GIL held, so the
    caller it wakes (on the other CPU) finds the GIL taken by the loop thread and sleeps a
    second time on it -- two sleeps and two wake-ups per message. Rung by a ``write`` that
    drops the GIL, the caller takes it at once and runs until it sends again: one sleep per
    message. Measured (a hand-over without any network, 16 threads and a loop thread, 2-core
    machine): 12-15 -> 6-8 us of CPU per message, 2.3 -> 1.1 voluntary context switches per
    message (docs/benchmarks.md, "Many blocking senders"). Linux only (the ``timeval`` of
    ``SO_RCVTIMEO``); elsewhere a lock (:class:`_LockWaiter`)."""

    __slots__ = ("_r", "_w", "_wfd", "_timeout", "pid")

    def __init__(self) -> None:
        r, w = socket.socketpair()
        w.setblocking(False)  # a full buffer (stale rings) must never block the loop
        self._r, self._w = r, w
        self._wfd = w.fileno()
        self._timeout = -1.0
        self.pid = os.getpid()

    def ring(self) -> None:
        try:
            os.write(self._wfd, b"\0")
        except OSError:  # full: the sleeper has bytes to wake on already (or it is gone)
            pass

    def sleep(self, timeout: float) -> bool:
        """Until rung (True; possibly by a stale ring: check the waiter) or ``timeout``."""
        if timeout != self._timeout:
            t = max(timeout, 1e-6)  # a zero SO_RCVTIMEO would mean: no timeout at all
            sec = int(t)
            self._r.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                               _TIMEVAL.pack(sec, int((t - sec) * 1e6)))
            self._timeout = timeout
        try:
            self._r.recv(64)  # every pending ring at once
        except BlockingIOError:  # SO_RCVTIMEO ran out
            return False
        return True


_TIMEVAL = struct.Struct("@ll")
_bells = threading.local()


def _bell() -> _Bell:
    b: _Bell | None = getattr(_bells, "bell", None)
    if b is None or b.pid != _pid:
        b = _bells.bell = _Bell()
    return b


class _Answer:
    """What one blocking ``send`` gets back, set by the loop thread, which then wakes the
    caller (``_wake``: a :class:`_Bell` or a lock, below)."""

    __slots__ = ("_done", "result", "error")

    def __init__(self) -> None:
        self._done = False
        self.result: SendResult | None = None
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self._done

    def set_result(self, result: SendResult) -> None:
        self.result = result
        self._done = True
        self._wake()

    def set_exception(self, exc: BaseException) -> None:
        self.error = exc
        self._done = True
        self._wake()

    def _wake(self) -> None:
        raise NotImplementedError

    def _outcome(self) -> SendResult:
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


class _Waiter(_Answer):
    """Where one blocking ``send`` waits: the calling thread's :class:`_Bell`, rung by the
    loop thread when the answer is in (one wake-up of one thread, no Condition, no Future).
    The callers of one answered batch are woken in turn (:func:`_wake_in_turn`): the loop
    rings the first, each woken caller rings the next (``_next``) before it returns. (Tried
    before the loop waited for their next messages, _Inbox._gather, it lost: the callers came
    back spread out and the batches shrank; with the wait the batch stays whole.)"""

    __slots__ = ("_bell", "_next", "_gone")

    def __init__(self) -> None:
        super().__init__()
        self._bell = _bell()
        #: the caller this one wakes when it wakes (_wake_in_turn), set before ``_done``
        self._next: _Waiter | None = None
        self._gone = False  # gave up waiting: it will wake nobody

    def _wake(self) -> None:
        self._bell.ring()

    def wait(self, timeout: float) -> SendResult:
        bell = self._bell
        try:
            while not self._done:
                if not bell.sleep(timeout) and not self._done:
                    self._gone = True
                    if not self._done:  # (else answered meanwhile: it wakes the next)
                        raise RequestTimeoutError(
                            f"no answer from the tidemq-io thread in {timeout:g} s")
        except BaseException:  # a timeout, or KeyboardInterrupt in the sleep
            # Gone: the loop wakes the caller after this one if it resolves this one later;
            # if it did already, this one wakes it now (either way, never nobody).
            self._gone = True
            if self._done and self._next is not None:
                self._next._bell.ring()
            raise
        nxt = self._next
        if nxt is not None:
            nxt._bell.ring()
        return self._outcome()


def _wake_in_turn(r: SendResult, futs: list[Any]) -> None:
    """(On the loop.) The callers of a batch answered ``r``: all resolved, the first woken;
    each woken caller wakes the next (its write hands it the GIL), and the loop thread, which
    then waits for their next messages (_Inbox._gather), does not take the GIL back after
    each ring. Anything but plain waiters: each woken by its own ``set_result``."""
    if len(futs) < 2 or any(type(f) is not _Waiter or f._done for f in futs):
        split_result(r, futs)
        return
    for a, b in zip(futs, futs[1:], strict=False):
        a._next = b  # before any of them is done: a waiter that wakes early passes it on
    for f, res in zip(futs, results_of(r, len(futs)), strict=True):
        f.result = res
        f._done = True
    futs[0]._bell.ring()
    for f in futs:
        if f._gone and f._next is not None:  # it gave up before it was answered
            f._next._bell.ring()


class _LockWaiter(_Answer):
    """:class:`_Waiter` where there is no :class:`_Bell` (not Linux): a lock taken at birth,
    released by the loop thread when the answer is in."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._lock.acquire()

    def _wake(self) -> None:
        self._lock.release()

    def wait(self, timeout: float) -> SendResult:
        if not self._lock.acquire(timeout=timeout):
            raise RequestTimeoutError(f"no answer from the tidemq-io thread in {timeout:g} s")
        return self._outcome()


#: callers sleep on a _Bell (Linux); else on a lock (_LockWaiter), and the answered callers
#: are then woken after the next batch is written (accumulator ``wake_first``)
_BELLS = sys.platform.startswith("linux")
if not _BELLS:  # pragma: no cover - CI runs on Linux
    _Waiter = _LockWaiter  # type: ignore[misc,assignment]


class _Driven:
    """Where a send that runs the loop itself (a borrower's, see _LoopHost) gets its answer,
    and the send returns. The borrower runs the loop's iterations itself and checks
    ``_done`` after each (``_LoopHost.drive``): nothing to stop. Only where it runs the loop
    through ``run_forever`` (a loop without ``_run_once``) does ``drive`` set ``_loop``: the
    answer then stops it. A send left by an exception (KeyboardInterrupt) is abandoned: its
    late answer must not stop the loop on whichever thread runs it then."""

    __slots__ = ("_loop", "_done", "result", "error")

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done = False
        self.result: SendResult | None = None
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self._done

    def abandon(self) -> None:
        self._loop = None

    def set_result(self, result: SendResult) -> None:
        self.result = result
        self._done = True
        if self._loop is not None and self._loop.is_running():
            self._loop.stop()  # not when answered before the loop runs (a refusal)

    def set_exception(self, exc: BaseException) -> None:
        self.error = exc
        self._done = True
        if self._loop is not None and self._loop.is_running():
            self._loop.stop()


#: How long the loop waits, after waking the callers of an answered batch, for their next
#: messages before it sends what gathered (_Inbox._gather), and how many answered batches
#: then leave without waiting when they did not all come back in time.
GATHER_WAIT = 0.0002
GATHER_PAUSE = 16


class _Inbox:
    """Messages handed from callers' threads to the producer on the loop: one wake-up of the
    loop per batch, not per message (deque appends and pops are thread-safe).

    - The message's topic has nothing in flight: the message wakes the loop
      (``call_soon_threadsafe``) unless a wake-up is pending already; all that arrive before
      the loop picks them up go into the batch container together.
    - A batch of its topic is in flight: the message wakes nobody. The loop drains the inbox
      when a batch is answered (the accumulator's ``on_answered``, called after the answer's
      bookkeeping), and what it finds leaves as the next batch at once. The senders an answer
      wakes come back one by one (the GIL lets one run at a time), and each used to wake the
      loop: a context switch of the loop thread per message, for a message that could not
      leave before that answer anyway.
    The in-flight check reads the topic's bucket after the message is in the inbox: if it
    sees the batch in flight, that batch's answer has not been handled yet, and its drain will
    find the message. (A message waiting in the inbox waits for that answer, or its request's
    timeout; its own send timeout starts when it is drained.)"""

    def __init__(self, aio: AioProducer, loop: asyncio.AbstractEventLoop) -> None:
        self._aio = aio
        self._loop = loop
        self._items: collections.deque[tuple[Message, dict[str, Any], Any, bool]] = (
            collections.deque())
        self._armed = False
        self._draining = False
        acc = aio.accumulator
        acc.on_answered = self._answered
        acc.wake_first = _BELLS
        if _BELLS:
            acc.wake_many = _wake_in_turn
        self._acc = acc
        self._answer_pending = acc.answer_pending
        #: while the loop waits for the callers an answer woke (:meth:`_gather`): how many
        #: messages the inbox must hold to ring ``_gate``, the loop's doorbell (0: nobody waits)
        self._want = 0
        self._gate: _Bell | None = None
        #: answered batches left to drain without waiting (after a wait that ran out)
        self._impatient = 0

    def put(self, msg: Message, options: dict[str, Any], sink: Any, wait: bool) -> None:
        items = self._items
        items.append((msg, options, sink, wait))
        if self._want and len(items) >= self._want:
            self._want = 0
            self._gate.ring()  # type: ignore[union-attr]
        if not self._armed and (options or not self._answer_pending(msg.topic)):
            # Two threads may both arm it: one wake-up finds nothing, which is harmless.
            self._armed = True
            self._loop.call_soon_threadsafe(self._drain)

    def put_driven(self, msg: Message, options: dict[str, Any], sink: Any) -> None:
        """:meth:`put` by the thread that holds the loop and runs it (see _LoopHost.drive):
        the hand-over and the write happen here and now, on this thread, as the loop would
        run them, which saves the loop the iteration (and the ``epoll`` call) that would
        run the drain. A message without routing options whose topic's bucket is idle (every
        send of a thread sending alone) is not handed over at all: it is written at once as
        a batch of its own (``Producer._lone_driven``), answered as the drain's would be."""
        if not self._armed and not self._items and (
            not options or (len(options) == 1 and "timeout" in options)
        ) and self._aio._lone_driven(msg, options.get("timeout") if options else None, sink):
            return
        self._items.append((msg, options, sink, True))
        if self._armed:
            return  # a drain is queued (another thread's put): it takes this one too
        self._armed = True
        self._drain()

    def _answered(self) -> None:
        """(On the loop.) A batch of the producer was answered: take what gathered -- once
        the callers it woke have put their next messages (:meth:`_gather`)."""
        woken, self._acc.woken = self._acc.woken, 0
        if woken > 1 and len(self._items) < woken and not self._draining:
            self._gather(woken)
        if self._items and not self._draining:
            self._drain()

    def _gather(self, woken: int) -> None:
        """Wait (at most ``GATHER_WAIT``) until the inbox holds ``woken`` messages: the
        callers the answer woke come back one at a time (the GIL), and some are still on
        their way when the loop gets here; drained now, their messages would leave as a
        second, smaller batch (or wait for the next answer), and each request costs ~120 us
        of broker and ~100 us of client CPU on top of its messages. The last of them rings
        the loop's own doorbell (one sleep and one wake-up of the loop thread per batch).
        When callers do not come back in time (they do other work between sends), the next
        ``GATHER_PAUSE`` answered batches leave at once."""
        if self._impatient:
            self._impatient -= 1
            return
        gate = self._gate
        if gate is None or gate.pid != _pid:
            gate = self._gate = _Bell()
        items = self._items
        self._want = woken
        try:
            for _ in range(2):  # a second time only after a stale ring (a late straggler)
                if len(items) >= woken:
                    return
                if not gate.sleep(GATHER_WAIT):
                    break
            if len(items) < woken:
                self._impatient = GATHER_PAUSE
        finally:
            self._want = 0

    def _drain(self) -> None:
        # One loop callback from the hand-over to the write: the batches leave at the kick
        # (no call_soon per bucket) and their frames are written at once (not at the end of
        # the loop iteration), so a lone blocking send costs two loop iterations, not four.
        self._armed = False
        self._draining = True
        items = self._items
        aio = self._aio
        hand_over = aio._hand_over
        acc = aio.accumulator
        pool = aio.pool
        pool.cork()  # the frames are written below, not by a call_soon each
        acc.handing_over()
        try:
            while items:
                msg, options, sink, wait = items.popleft()
                hand_over(msg, options, sink, wait)
        finally:
            self._draining = False
            try:
                acc.kick()
            finally:
                pool.flush_now()


# Bumped in a child after fork(): a facade built before it rebuilds its asyncio twin there
# (the parent's loop thread and connections do not exist in the child).
_fork_generation = 0


#: this process's id (a thread's _Bell made before a fork() is the parent's: made anew)
_pid = os.getpid()


def _after_fork_in_child() -> None:
    global _fork_generation, _hosts_lock, _pid
    _fork_generation += 1
    _pid = os.getpid()
    _hosts_lock = threading.Lock()  # another thread may have held it at the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Producer(_Facade):
    """Blocking producer; options as ``tidemq.aio.Producer``. Any thread; safe across
    ``fork()``: in the child the producer builds a fresh asyncio producer (new connections on
    the child's own loop thread) on its next call.

    Blocking producers live on their own loop (the ``tidemq-io-send`` thread's). A thread
    that sends alone runs that loop itself inside ``send`` (it borrows it: the round trip on
    the calling thread, over the same connections); sends of several threads are handed to
    the loop through an inbox (one wake-up for everything that arrives before the loop picks
    it up) and sleep on their thread's doorbell (_Bell), which the loop rings with the
    answer; concurrent senders' messages share frames (the batch container), and 16 threads
    sending in a loop travel as one batch. docs/producer-path.md, "The blocking facade"."""

    _host_name = PRODUCERS

    def __init__(self, namesrv: str | Sequence[str], group: str | None = None,
                 **options: Any) -> None:
        self._args = (namesrv, group, options)
        self._build()

    def _factory(self) -> AioProducer:
        namesrv, group, options = self._args
        return AioProducer(namesrv, group, **options)

    def _build(self) -> None:
        self._gen = _fork_generation
        self._started = False
        self._host = _host(PRODUCERS)
        self._aio: AioProducer = self._host.run(_make(self._factory))
        self._inbox = _Inbox(self._aio, self._host.loop)
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
        self._host.run(self._aio.start())
        self._started = True
        _open.add(self)
        return self

    def close(self) -> None:
        if self._gen != _fork_generation:
            return  # the parent's producer: nothing of it runs in this process
        self._host.run(self._aio.close())
        _open.discard(self)

    @property
    def producer_id(self) -> int:
        return self._aio.producer_id

    def send(self, msg: Message, **options: Any) -> SendResult:
        """Send and wait (options: queue_id, selector, arg, hash_key, timeout)."""
        if self._gen != _fork_generation:
            self._fresh()
        host = self._host
        if type(msg) is not Message:
            return host.run(self._aio.send(msg, **options))
        if host.enter_send():  # (raises on a thread while it runs the loop: a callback)
            # This thread runs the loop (see _LoopHost): the hand-over, the write, the answer
            # and the wake-up are calls on this thread's stack.
            d = _Driven()
            clean = False
            try:
                host.drive(self._inbox.put_driven, msg, options, d)
                clean = True
            finally:
                if not clean:
                    d.abandon()
                host.leave_driven(clean)
            if d.error is not None:
                raise d.error
            assert d.result is not None
            return d.result
        try:
            w = _Waiter()
            self._inbox.put(msg, options, w, True)
            timeout = options.get("timeout")
            return w.wait(self._wait_slack if timeout is None else timeout + 30.0)
        finally:
            host.leave_handed()

    def send_batch(self, msgs: Sequence[Message], **options: Any) -> SendResult:
        return self._host.run(self._aio.send_batch(msgs, **options))

    def send_async(
        self,
        msg: Message | Sequence[Message],
        callback: SendCallback | None = None,
        **options: Any,
    ) -> concurrent.futures.Future[SendResult]:
        """Start a send; the future resolves to its SendResult. ``callback(result, error)``
        runs on the thread running the producers' loop (``tidemq-io-send``, or a thread
        inside a ``send`` of its own, see the class): it must not block."""
        if self._gen != _fork_generation:
            self._fresh()
        if callback is None and type(msg) is Message:
            fut: concurrent.futures.Future[SendResult] = concurrent.futures.Future()
            self._host.need_loop()
            self._inbox.put(msg, options, fut, False)
            return fut

        async def go() -> SendResult:
            return await self._aio.send_async(msg, callback, **options)

        return self._host.submit(go())

    def send_oneway(self, msg: Message | Sequence[Message], **options: Any) -> None:
        self._host.run(self._aio.send_oneway(msg, **options))

    def send_columns_async(self, cols: Any, **options: Any
                           ) -> concurrent.futures.Future[SendResult]:
        """Start ``Producer.send_columns`` (client/columns.py); the future resolves to its
        SendResult."""
        return self._host.submit(self._aio.send_columns(cols, **options))

    def write_queues(self, topic: str) -> list[MessageQueue]:
        """The writable queues a send to ``topic`` chooses from (a new topic: those of the
        default route, as a send would use)."""
        return self._host.run(self._aio.write_queues(topic))

    def cancel(self, result: SendResult, **options: Any) -> None:
        """Cancel a pending timed message by the SendResult of its send."""
        self._host.run(self._aio.cancel(result, **options))


class TransactionProducer(Producer):
    """Blocking transactional producer; options as ``tidemq.aio.TransactionProducer``.

    ``execute(msg, arg)`` and ``checker(message_ext)`` are plain functions here and run in a
    worker thread (they may block on a database), never on the producers' loop. Any thread."""

    def __init__(self, namesrv: str | Sequence[str], group: str, *,
                 checker: Callable[[MessageExt], Any], **options: Any) -> None:
        async def check(m: MessageExt) -> Any:
            return await asyncio.to_thread(checker, m)

        self._checker = check
        self._args = (namesrv, group, options)
        self._build()

    def _factory(self) -> AioTransactionProducer:
        namesrv, group, options = self._args
        assert group is not None
        return AioTransactionProducer(namesrv, group, checker=self._checker, **options)

    def send_in_transaction(
        self, msg: Message, execute: Callable[[Message, Any], Any], arg: Any = None,
        **options: Any,
    ) -> TransactionSendResult:
        async def run(m: Message, a: Any) -> Any:
            return await asyncio.to_thread(execute, m, a)

        aio = self._aio
        assert isinstance(aio, AioTransactionProducer)
        return self._host.run(aio.send_in_transaction(msg, run, arg, **options))


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
