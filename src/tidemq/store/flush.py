"""Flushing the CommitLog to disk (ref ST5): group commit for SYNC_FLUSH, an interval for ASYNC.

SYNC_FLUSH (RocketMQ's GroupCommitService): a put registers "tell me when offset X is durable";
the flush thread takes every request waiting, runs one fdatasync for all of them (it covers every
byte written before it started), then completes them. Many concurrent puts share one fsync, so the
rate is bounded by puts-per-fsync-interval rather than fsyncs per second.

ASYNC_FLUSH (FlushRealTimeService): fdatasync every ``interval_ms`` (500 ms) if anything is new,
and also as soon as ``dirty_bytes`` (64 MiB) are unflushed: that bounds what a power loss can
take under a fast writer, and spreads the writeback over the writes instead of leaving a burst
of a gigabyte to the next tick (1 GiB of 104 KB writes then one fdatasync: 2.1 GB/s; the same
with an fdatasync every 64 MiB on the side: 2.9 GB/s, on this machine).

Completing a round is per-round work, not per-put work: the flush thread hands the whole list
of completed requests to one executor call. By default that calls each callback on the flush
thread; the broker installs :func:`handoff_to` its event loop, so a round of 64 puts costs one
``call_soon_threadsafe`` and its callbacks run on the loop, where they resolve sends.

Thread contract: ``request`` and ``wait`` may be called from any thread (the store calls
``request`` right after its put); callbacks run where the executor runs them (by default the
flush thread) and must be quick and never block. ``wait``'s own callback always runs on the
flush thread, so a thread blocked in ``wait`` never depends on the executor.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable

from tidemq.protocol.errors import StoreError, StoreWriteError
from tidemq.store.commit_log import CommitLog

log = logging.getLogger(__name__)

FlushCallback = Callable[[StoreError | None], None]


class FlushMode(enum.StrEnum):
    SYNC = "sync"
    ASYNC = "async"


#: Runs the callbacks of one group commit: ``executor(requests, err)`` with the (offset,
#: callback) requests the round completed; see FlushService.complete_on.
RoundExecutor = Callable[[list[tuple[int, FlushCallback]], StoreError | None], None]


def run_callbacks(requests: list[tuple[int, FlushCallback]], err: StoreError | None) -> None:
    """Call every callback of a completed round with ``err`` (None: durable)."""
    for _off, cb in requests:
        try:
            cb(err)
        except Exception:  # one failing callback must not starve the others
            log.exception("durability callback failed")


def handoff_to(schedule: Callable[..., object]) -> RoundExecutor:
    """A RoundExecutor that runs each round's callbacks where ``schedule`` runs things, e.g.
    ``loop.call_soon_threadsafe``: one self-pipe write and one loop wake-up per group commit,
    not one per put (this module stays free of asyncio). A closed loop means nobody is left
    to tell: the round is dropped, quietly."""

    def executor(requests: list[tuple[int, FlushCallback]], err: StoreError | None) -> None:
        try:
            schedule(run_callbacks, requests, err)
        except RuntimeError:  # the loop is closed
            log.debug("durability callbacks of %d puts dropped: loop closed", len(requests))

    return executor


class FlushService:
    def __init__(
        self, commitlog: CommitLog, mode: FlushMode, interval_ms: int = 500,
        dirty_bytes: int = 64 << 20,
    ) -> None:
        self.commitlog = commitlog
        self.mode = FlushMode(mode)
        self.interval = interval_ms / 1000
        self.dirty_bytes = dirty_bytes
        self._cond = threading.Condition()
        self._requests: list[tuple[int, FlushCallback]] = []  # completed by the executor
        self._direct: list[tuple[int, FlushCallback]] = []  # completed on the flush thread
        self._executor: RoundExecutor = run_callbacks
        self._idle = False  # the flush thread is waiting for work (only then is notify needed)
        self._wake_requested = False  # ASYNC: dirty_bytes were written since the last flush
        self._running = True
        self.flush_count = 0
        self.last_error: StoreError | None = None
        if self.mode is FlushMode.ASYNC and dirty_bytes > 0:
            commitlog.on_flush_wake = self._wake
            self._arm()
        self._thread = threading.Thread(target=self._run, name="commitlog-flush", daemon=True)
        self._thread.start()

    def _arm(self) -> None:
        """ASYNC: be woken when dirty_bytes more than what is flushed have been written."""
        self.commitlog.flush_wake_at = self.commitlog.flushed_pos + self.dirty_bytes

    def _wake(self) -> None:  # the writer's thread, from CommitLog.advance
        with self._cond:
            self._wake_requested = True
            if self._idle:
                self._idle = False
                self._cond.notify()

    def complete_on(self, executor: RoundExecutor) -> None:
        """Hand every group commit's completed :meth:`request` callbacks to ``executor`` in
        one call (e.g. :func:`handoff_to` an event loop) instead of calling them one by one on
        the flush thread. :meth:`wait` is unaffected: it never depends on the executor."""
        self._executor = executor

    def request(self, offset: int, callback: FlushCallback) -> None:
        """Call ``callback(None)`` once everything below ``offset`` is durable (or the error):
        at once on this thread if it already is, else through the round executor."""
        self._enqueue(offset, callback, self._requests)

    def _enqueue(
        self, offset: int, callback: FlushCallback, queue: list[tuple[int, FlushCallback]]
    ) -> None:
        if offset <= self.commitlog.flushed_pos:
            callback(None)
            return
        with self._cond:
            if not self._running:
                callback(StoreError("store is closing; the put's durability is unknown"))
                return
            queue.append((offset, callback))
            if self._idle:  # a busy flush thread looks at the queues again before it waits
                self._idle = False  # one wake-up is enough: the thread takes every request
                self._cond.notify()

    def wait(self, offset: int, timeout: float | None = None) -> None:
        """Blocking form of :meth:`request`; raises the flush error or TimeoutError."""
        done = threading.Event()
        box: list[StoreError | None] = []

        def cb(err: StoreError | None) -> None:
            box.append(err)
            done.set()

        self._enqueue(offset, cb, self._direct)
        if not done.wait(timeout):
            raise TimeoutError(f"flush to offset {offset} did not complete in {timeout} s")
        if box[0] is not None:
            raise box[0]

    def _run(self) -> None:
        while True:
            with self._cond:
                if (
                    self._running and not self._requests and not self._direct
                    and not self._wake_requested
                ):
                    self._idle = True
                    self._cond.wait(self.interval)
                    self._idle = False
                self._wake_requested = False
                batch, self._requests = self._requests, []
                direct, self._direct = self._direct, []
                running = self._running
            err: StoreError | None = None
            if batch or direct or self.mode is FlushMode.ASYNC or not running:
                try:
                    self.commitlog.flush()
                    self.flush_count += 1
                except StoreWriteError as exc:
                    err = self.last_error = exc
                    log.error("%s", exc)
                if self.mode is FlushMode.ASYNC and self.dirty_bytes > 0:
                    self._arm()
            if batch:
                self._complete(batch, err, self._executor, self._requests)
            if direct:
                self._complete(direct, err, run_callbacks, self._direct)
            if not running:
                return

    def _complete(
        self,
        batch: list[tuple[int, FlushCallback]],
        err: StoreError | None,
        executor: RoundExecutor,
        queue: list[tuple[int, FlushCallback]],
    ) -> None:
        """Complete the requests the round covered; requeue any written after it began (a
        request is made after its put advanced the write position, and a flush covers the
        write position it reads after taking the queue, so normally there are none)."""
        if err is None:
            flushed = self.commitlog.flushed_pos
            late = [r for r in batch if r[0] > flushed]
            if late:
                batch = [r for r in batch if r[0] <= flushed]
                with self._cond:
                    queue[:0] = late
            if not batch:
                return
        try:
            executor(batch, err)
        except Exception:  # the flush thread must survive a broken executor
            log.exception("durability executor failed")

    def close(self) -> None:
        """Flush what is pending, complete every waiter, stop the thread."""
        with self._cond:
            self._running = False
            self._cond.notify()
        self._thread.join()
        with self._cond:
            rest = self._requests + self._direct
            self._requests, self._direct = [], []
        run_callbacks(rest, StoreError("store closed before the put was flushed"))
