"""The future ``Producer.send_async`` returns for one message: asyncio-compatible, resolved per
batch, its SendResult built only when someone reads it.

Why not an ``asyncio.Future`` per message (measured, docs/producer-path.md): a future, its
``set_result`` and the message's own SendResult cost ~1 µs per message, and each future is an
object the garbage collector tracks, so 200 k messages handed over before a ``flush()`` make
every full collection walk 200 k futures. A :class:`SendFuture` is a ``msgspec.Struct`` the
collector does not track (``gc=False``; it drops its callbacks and waiter once resolved, so it
holds no cycle after that). The futures of one bucket's batch share a :class:`BatchCell`: a
batch answered as a whole resolves all of its messages with one store in the cell (no work per
message; before, two stores and a call each, ~0.1-0.2 µs per message), and a message resolved
on its own (its batch split, retried without others, refused alone) gets two stores
(``in_batch``: the batch's result and its index). Message ``i``'s SendResult (offset and
sequence + ``i``) is built on the first ``result()``. An
``asyncio.Future`` is made only for a coroutine that awaits the message before its answer.

It behaves as an ``asyncio.Future`` for what applications do with one: ``await``,
``result()``, ``exception()``, ``done()``, ``cancelled()``, ``cancel()`` (the message is still
sent: it is in a batch already), ``add_done_callback`` / ``remove_done_callback`` (callbacks
run on the loop with ``call_soon``, as asyncio's), ``get_loop()``, and ``asyncio.isfuture`` is
true, so ``asyncio.gather``, ``asyncio.wait`` and ``asyncio.wait_for`` take it as it is.

Threading: the producer's event loop only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from typing import Any

import msgspec

from tidemq.client.message import SendResult

__all__ = ["BatchCell", "SendFuture"]

_PENDING, _DONE, _CANCELLED = 0, 1, 2


class BatchCell:
    """The outcome the SendFutures of one bucket's batch share: the batch answered as a whole
    (the common case) resolves all of them with one store -- no work per message; each reads
    its own SendResult from it when asked. Message ``i`` of the cell holds ``index == i``;
    only a list of exactly the cell's futures, in that order, may be resolved through it
    (the accumulator checks: ``count == len(futs)``, and a bucket takes a new cell whenever
    its list of futures is replaced). Futures resolved one at a time (a batch split, a
    message failed alone) keep their own outcome and never look at the cell.

    It holds no future (a future holds it): nothing for the collector to walk, no cycle."""

    __slots__ = ("result", "count", "watched")

    def __init__(self) -> None:
        self.result: SendResult | None = None
        self.count = 0  # futures made in this cell (their indexes: 0 .. count - 1)
        self.watched = 0  # of them, how many got a callback or an awaiting coroutine

    def resolve(self, r: SendResult, futs: list[SendFuture]) -> None:
        """The batch of exactly this cell's futures (``futs``, in index order) answered
        ``r``: all of them resolved now; those with callbacks or waiters woken."""
        self.result = r
        if self.watched:
            for f in futs:
                if f.state == _PENDING and (f.callbacks is not None or f.waiter is not None):
                    f.batch = r
                    f.state = _DONE
                    f._wake()


class SendFuture(msgspec.Struct, gc=False, eq=False):
    """The outcome of one ``send_async`` message (see the module docstring). Event loop only."""

    loop: asyncio.AbstractEventLoop
    #: the outcome shared with the other messages of its batch (None: only its own)
    cell: BatchCell | None = None
    #: the message's index in its batch (in its cell until resolved on its own)
    index: int = 0
    #: resolved on its own (``in_batch``): its batch's SendResult
    batch: SendResult | None = None
    value: SendResult | None = None
    error: BaseException | None = None
    state: int = _PENDING
    callbacks: list[Callable[[Any], object]] | None = None
    waiter: asyncio.Future[None] | None = None
    # asyncio.isfuture() looks for this attribute (not None) on the class and the object.
    _asyncio_future_blocking: bool = False

    # -- resolution (the accumulator; anything with done/set_result/set_exception) ---------
    def done(self) -> bool:
        if self.state != _PENDING:
            return True
        c = self.cell
        return c is not None and c.result is not None

    def cancelled(self) -> bool:
        return self.state == _CANCELLED

    def _sync(self) -> int:
        """The state, taking the cell's outcome first when the cell was resolved."""
        s = self.state
        if s == _PENDING:
            c = self.cell
            if c is not None and c.result is not None:
                self.batch = c.result
                self.state = s = _DONE
        return s

    def _watch(self) -> None:
        """A callback or waiter is added while pending: the cell must wake this one."""
        if self.callbacks is None and self.waiter is None and self.cell is not None:
            self.cell.watched += 1

    def in_batch(self, batch: SendResult, index: int) -> None:
        """Message ``index`` of the answered ``batch`` (its SendResult is built when read)."""
        if self._sync() == _PENDING:
            self.batch = batch
            self.index = index
            self.state = _DONE
            if self.callbacks is not None or self.waiter is not None:
                self._wake()

    def set_result(self, result: SendResult) -> None:
        if self._sync() != _PENDING:
            raise asyncio.InvalidStateError("the send's outcome is already set")
        self.value = result
        self.state = _DONE
        if self.callbacks is not None or self.waiter is not None:
            self._wake()

    def set_exception(self, exc: BaseException) -> None:
        if self._sync() != _PENDING:
            raise asyncio.InvalidStateError("the send's outcome is already set")
        self.error = exc
        self.state = _DONE
        if self.callbacks is not None or self.waiter is not None:
            self._wake()

    def _wake(self) -> None:
        w, self.waiter = self.waiter, None
        if w is not None and not w.done():
            if self.state == _CANCELLED:
                w.cancel()
            else:
                w.set_result(None)
        cbs, self.callbacks = self.callbacks, None
        if cbs:
            for cb in cbs:
                self.loop.call_soon(cb, self)

    # -- asyncio.Future's reading side -----------------------------------------------------
    def result(self) -> SendResult:
        s = self._sync()
        if s == _PENDING:
            raise asyncio.InvalidStateError("the send is not answered yet")
        if s == _CANCELLED:
            raise asyncio.CancelledError()
        if self.error is not None:
            raise self.error
        v = self.value
        if v is None:
            v = self.value = _nth(self.batch, self.index)  # type: ignore[arg-type]
        return v

    def exception(self) -> BaseException | None:
        s = self._sync()
        if s == _PENDING:
            raise asyncio.InvalidStateError("the send is not answered yet")
        if s == _CANCELLED:
            raise asyncio.CancelledError()
        return self.error

    def cancel(self, msg: Any = None) -> bool:
        """Stop waiting for the outcome (the message is still sent: it may be in a frame
        already). True unless it was answered."""
        if self._sync() != _PENDING:
            return False
        self.state = _CANCELLED
        self._wake()
        return True

    def add_done_callback(self, fn: Callable[[Any], object], *, context: Any = None) -> None:
        if self._sync() != _PENDING:
            self.loop.call_soon(fn, self, context=context)
            return
        self._watch()
        if context is not None:
            cbs = self.callbacks if self.callbacks is not None else []
            cbs.append(lambda f: context.run(fn, f))
            self.callbacks = cbs
        elif self.callbacks is None:
            self.callbacks = [fn]
        else:
            self.callbacks.append(fn)

    def remove_done_callback(self, fn: Callable[[Any], object]) -> int:
        cbs = self.callbacks
        if not cbs:
            return 0
        kept = [cb for cb in cbs if cb != fn]
        self.callbacks = kept or None
        return len(cbs) - len(kept)

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self.loop

    def __await__(self) -> Generator[Any, None, SendResult]:
        if self._sync() == _PENDING:
            w = self.waiter
            if w is None:
                self._watch()
                w = self.waiter = self.loop.create_future()
            try:
                yield from w.__await__()
            except asyncio.CancelledError:
                # The awaiting task was cancelled: as with an asyncio.Future, so is this one.
                self.cancel()
                raise
        return self.result()

    __iter__ = __await__


def _nth(r: SendResult, i: int) -> SendResult:
    """Message ``i``'s SendResult of the batch answered ``r`` (what ``split_result`` gives)."""
    if i == 0 and r.count == 1:
        return r
    pid = r.producer_id
    seq = r.base_seq + i
    step = 1 if r.queue_offset >= 0 else 0  # a DUPLICATE batch has no offsets: -1 for each
    return SendResult(r.status, f"{pid:016X}{seq:016X}", r.topic, r.queue_id,
                      r.queue_offset + i * step, 1, r.broker_name, pid, seq)
