"""Flushing the CommitLog to disk (SPEC ST5): group commit for SYNC_FLUSH, an interval for ASYNC.

SYNC_FLUSH (RocketMQ's GroupCommitService): a put registers "tell me when offset X is durable";
the flush thread takes every request waiting, runs one fdatasync for all of them (it covers every
byte written before it started), then completes them. Many concurrent puts share one fsync, so the
rate is bounded by puts-per-fsync-interval rather than fsyncs per second.

ASYNC_FLUSH (FlushRealTimeService): fdatasync every ``interval_ms`` (500 ms) if anything is new.

Thread contract: ``request`` may be called from any thread (the store calls it under its put
lock); callbacks run on the flush thread and must be quick and never block (the broker hands them
to its event loop with call_soon_threadsafe).
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


class FlushService:
    def __init__(self, commitlog: CommitLog, mode: FlushMode, interval_ms: int = 500) -> None:
        self.commitlog = commitlog
        self.mode = FlushMode(mode)
        self.interval = interval_ms / 1000
        self._cond = threading.Condition()
        self._requests: list[tuple[int, FlushCallback]] = []
        self._running = True
        self.flush_count = 0
        self.last_error: StoreError | None = None
        self._thread = threading.Thread(target=self._run, name="commitlog-flush", daemon=True)
        self._thread.start()

    def request(self, offset: int, callback: FlushCallback) -> None:
        """Call ``callback(None)`` once everything below ``offset`` is durable (or the error)."""
        if offset <= self.commitlog.flushed_pos:
            callback(None)
            return
        with self._cond:
            if not self._running:
                callback(StoreError("store is closing; the put's durability is unknown"))
                return
            self._requests.append((offset, callback))
            self._cond.notify()

    def wait(self, offset: int, timeout: float | None = None) -> None:
        """Blocking form of :meth:`request`; raises the flush error or TimeoutError."""
        done = threading.Event()
        box: list[StoreError | None] = []

        def cb(err: StoreError | None) -> None:
            box.append(err)
            done.set()

        self.request(offset, cb)
        if not done.wait(timeout):
            raise TimeoutError(f"flush to offset {offset} did not complete in {timeout} s")
        if box[0] is not None:
            raise box[0]

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._running and not self._requests:
                    self._cond.wait(self.interval)
                batch, self._requests = self._requests, []
                running = self._running
            err: StoreError | None = None
            if batch or self.mode is FlushMode.ASYNC or not running:
                try:
                    self.commitlog.flush()
                    self.flush_count += 1
                except StoreWriteError as exc:
                    err = self.last_error = exc
                    log.error("%s", exc)
            flushed = self.commitlog.flushed_pos
            late = []
            for off, cb in batch:
                if err is not None:
                    cb(err)
                elif off <= flushed:
                    cb(None)
                else:  # written after this flush began: next round
                    late.append((off, cb))
            if late:
                with self._cond:
                    self._requests[:0] = late
            if not running:
                return

    def close(self) -> None:
        """Flush what is pending, complete every waiter, stop the thread."""
        with self._cond:
            self._running = False
            self._cond.notify()
        self._thread.join()
        with self._cond:
            rest, self._requests = self._requests, []
        for _off, cb in rest:
            cb(StoreError("store closed before the put was flushed"))


class CallbackBatcher:
    """Hands durability callbacks from the flush thread to an event loop, one wake per round.

    ``call_soon_threadsafe`` costs a self-pipe write and a loop wake-up; a group commit that
    completes 64 puts would pay that 64 times. ``wrap(fn)`` returns a FlushCallback that queues
    ``fn(err)`` and wakes the loop only when the queue was empty, so the loop runs every callback
    of a flush round in one go. ``schedule`` is e.g. ``loop.call_soon_threadsafe`` (this module
    stays free of asyncio). ``wrap`` may be called from any thread; ``fn`` runs on the loop.
    """

    def __init__(self, schedule: Callable[[Callable[[], None]], object]) -> None:
        self._schedule = schedule
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable[[StoreError | None], None], StoreError | None]] = []

    def wrap(self, fn: Callable[[StoreError | None], None]) -> FlushCallback:
        def callback(err: StoreError | None) -> None:
            with self._lock:
                first = not self._pending
                self._pending.append((fn, err))
            if first:
                self._schedule(self._drain)

        return callback

    def _drain(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        for fn, err in batch:
            try:
                fn(err)
            except Exception:  # one failing callback must not starve the others
                log.exception("durability callback failed")

