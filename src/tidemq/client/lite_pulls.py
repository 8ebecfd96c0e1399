"""The lite pull consumer's pulls of many queues, through per-broker pull drivers (issue 17).

A :class:`~tidemq.client.consumer.PullConsumer` with ``multi_queue_min`` (256) assigned queues
or more keeps no task, future or held request per queue: each broker's queues are pulled by
one :class:`~tidemq.client.pull_driver.PullDriver` (the push consumer's), one standing
PULL_MULTI_QUEUE per broker (docs/protocol.md 4.0). :class:`LitePulls` is what the driver calls
back, the lite consumer's side of it:

- ``multi_pull_of``: the queue's next pull (its offset; at the very first pull the broker
  resolves the start: the group's committed offset, else ``consume_from``), or None when the
  queue is held back -- paused, at ``pull_threshold_per_queue`` buffered messages, or the
  consumer at ``pull_threshold_for_all``. A held-back queue is *parked* and pulled again when
  ``poll`` frees room (``PullConsumer._wake``);
- ``on_result`` / ``on_standing``: one queue's answer, handled synchronously by the consumer's
  own result handling (``PullConsumer._handle``), the same as a PULL_MESSAGE's;
- ``execute_now``: pull a queue with its broker's driver, or queue by queue (its own task,
  ``PullConsumer._pull_loop``) when the pull goes to a slave, the route is not known yet, the
  broker has no PULL_MULTI_QUEUE or the consumer holds fewer than ``multi_queue_min`` queues;
- ``failed``: a pull error: the consumer's refusals that no retry fixes stop the queue, others
  retry after the error's delay (1 s; SYSTEM_BUSY's own).

A queue seeked or dropped is a new (or no) ``_Queue`` object: answers to the old one are void.

Threading: the consumer's event loop only.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from tidemq.client.pull_driver import PullDriver
from tidemq.client.selection import EVERYTHING
from tidemq.protocol.codes import ResponseCode, pull_status
from tidemq.protocol.errors import BrokerError, TidemqError
from tidemq.protocol.headers import MASTER_ID, MultiQueuePull, PullSysFlag

if TYPE_CHECKING:
    from tidemq.client.consumer import PullConsumer, _Queue

__all__ = ["LitePulls"]

log = logging.getLogger("tidemq.client.consumer")

# consume_from -> MultiQueuePull.resolve (the broker finds a new queue's start)
_RESOLVE = {"first": 1, "last": 2, "timestamp": 3}
# a multi pull that did not read the queue (answer full): resolve it at the next pull
_RETRY_RESOLVE = frozenset({int(ResponseCode.PULL_RETRY_IMMEDIATELY)})
ERROR_DELAY = 1.0


class LitePulls:
    """The pull drivers of one PullConsumer and the callbacks they make."""

    #: the drivers size their first requests by a probe (PullDriver): at 10,000 queues of a
    #: backlog the first requests otherwise over-ask, ~6,600 queues answered "not read"
    probe_first = True

    def __init__(self, consumer: PullConsumer) -> None:
        self.c = consumer
        self._drivers: dict[str, PullDriver] = {}
        self.pulls = 0

    @property
    def requests(self) -> int:
        """PULL_MULTI_QUEUE requests sent so far."""
        return sum(d.requests for d in self._drivers.values())

    def driver(self, addr: str) -> PullDriver | None:
        """The driver of broker ``addr``, None when that broker pulls queue by queue."""
        d = self._drivers.get(addr)
        if d is None:
            d = self._drivers[addr] = PullDriver(self, addr)  # type: ignore[arg-type]
        return None if d.unsupported else d

    def _current(self, q: _Queue) -> bool:
        """Whether ``q`` is still pulled. A queue unassigned or replaced (a seek) is retired
        first (``PullConsumer._retire`` sets ``dropped``), so a queue not dropped is the
        consumer's current one: no lookup of it by MessageQueue (hashed field by field, in a
        table of 100,000 queues) three times per answer."""
        return not q.dropped and q.failed is None and not self.c._closed

    def execute_now(self, q: _Queue) -> None:
        """Pull ``q`` now: with its broker's driver when it can, else with its own task."""
        c = self.c
        if not self._current(q):
            return
        if (q.broker_id == MASTER_ID and c._many()
                and (q.pull_offset is not None or not c._no_resolve)):
            got = c.routes.addr_for_read_now(q.mq, MASTER_ID)
            d = None if got is None or got[1] else self.driver(got[0])
            if d is not None:
                d.add(q)  # type: ignore[arg-type]
                return
        c._start_task(q)

    def multi_pull_of(self, q: _Queue) -> MultiQueuePull | None:
        """The pull of ``q`` in a PULL_MULTI_QUEUE, or None: it does not pull now (gone, or
        held back by flow control: parked until ``poll`` frees room)."""
        c = self.c
        if not self._current(q):
            return None
        if q.pull_offset is None and c._no_resolve:
            c._start_task(q)  # its start is looked up the usual way first
            return None
        if c._held_back(q):
            q.parked = True  # pulled again when poll frees room (PullConsumer._wake)
            return None
        mq = q.mq
        sel = c._subs.get(mq.topic, EVERYTHING)
        resolve = 0 if q.pull_offset is not None else _RESOLVE[c.consume_from.value]
        self.pulls += 1
        return MultiQueuePull(
            mq.topic, mq.queue_id, q.pull_offset or 0, c.pull_batch_size,
            PullSysFlag.SUBSCRIPTION if sel.filters else 0, 0,
            sel.expression if sel.filters else None, sel.expression_type, resolve,
            c.consume_timestamp)

    def keep_permits(self, q: _Queue) -> int:
        """Permits of ``q``'s standing pull (PullDriver; docs/protocol.md 4.0, "kept
        standing"): one pull's worth (``pull_batch_size``) when the queue and the consumer
        have room for that much more, else none. With permits left a queue answered with
        messages stands on at its next offset instead of being pulled again: draining a
        backlog of 10,000 queues then costs one pull per queue, not two (the second only to
        stand). It holds at most what a standing pull would deliver, checked against
        ``pull_threshold_per_queue`` and ``pull_threshold_for_all`` when granted (as a pull
        is checked when sent); a queue paused meanwhile receives at most that much more."""
        c = self.c
        n = c.pull_batch_size
        if q.paused or q.buffered + n > c.pull_threshold or c._buffered + n > c.pull_threshold_all:
            return 0
        return n

    def _started(self, q: _Queue, r: Any) -> bool:
        """Take a resolved start offset from ``r``; False if the queue has none (yet)."""
        if q.pull_offset is not None:
            return True
        if r.start_offset < 0:
            if r.code not in _RETRY_RESOLVE:
                self.c._no_resolve = True  # an older broker: look starts up queue by queue
            return False
        q.pull_offset = q.consume_offset = r.start_offset
        # a start chosen by consume_from is committed too (see PullConsumer._pull_loop)
        q.committed = r.start_offset if r.start_committed else None
        return True

    def on_standing(self, q: _Queue, r: Any) -> bool:
        """``q`` found nothing and stands on the broker: keep its resolved start. False: it
        does not stand here -- gone, or the broker resolved no start (a non-persistent
        topic, an older broker): its start is looked up and it is pulled again from there."""
        if not self._current(q):
            return False
        if self._started(q, r):
            return True
        self.c._start_task(q)
        return False

    def on_result(self, q: _Queue, r: Any, body: Any, addr: str) -> bool:
        """One queue's answer of a PULL_MULTI_QUEUE; True: pull it again at once."""
        c = self.c
        if not self._current(q):
            return False
        if not self._started(q, r):
            if r.code in _RETRY_RESOLVE:
                return True  # not read (the answer was full): resolve it with the next one
            c._start_task(q)
            return False
        try:
            status = pull_status(r.code)
            if status is None:
                raise BrokerError(r.message or f"pull refused ({r.code})", response_code=r.code)
            c._handle(q, q.pull_offset, status, r, body)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - the queue retries or stops (failed)
            self.failed(q, exc, addr)
            return False
        return True

    def failed(self, q: _Queue, exc: Exception, addr: str, *, quiet: bool = False) -> None:
        """A pull of ``q`` failed: stop it (a refusal no retry fixes) or retry after the delay
        the error asks for (``quiet``: the caller logged it once for many queues)."""
        c = self.c
        if not self._current(q):
            return
        if not isinstance(exc, TidemqError):  # a bug must not silently stop a queue forever
            if not quiet:
                log.error("pull of %s failed unexpectedly; retrying in %g s", q.mq,
                          ERROR_DELAY, exc_info=exc)
            delay: float | None = ERROR_DELAY
        else:
            delay = c._pull_failed(q, exc, addr, quiet=quiet)
        if delay is not None:  # None: the queue stopped
            asyncio.get_running_loop().call_later(delay, self.execute_now, q)

    def close(self) -> None:
        for d in self._drivers.values():
            d.close()
