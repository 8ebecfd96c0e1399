"""SYNC_MASTER sends waiting for their slaves (the group-commit idea again; docs/cluster.md).

A SYNC_MASTER send is stored, then waits until ``min_in_sync_replicas`` in-sync slaves have
acknowledged a CommitLog offset at or past its end. Sends wait in one queue in CommitLog order;
each acknowledgement round (one ACK frame of one slave, covering every byte it stored since its
last) moves the replicated offset once, and one loop wake-up then answers every send it covers
-- never one round trip per send. The timeout (``store.sync_flush_timeout_ms``, FLUSH_SLAVE_TIMEOUT)
is the send processor's sweep, shared with SYNC_FLUSH.

Broker-made writes (delay and timer deliveries, transaction ends, send-backs) wait here too,
as callbacks (:meth:`ReplicaWaiters.after`): RocketMQ's puts all wait for the slaves under
SYNC_MASTER. They are called with None once replicated, or once ``timeout_s`` passed or no
slave is in sync (the write is stored here; nothing better will come).

Fencing (election on, docs/cluster.md): ``may_ack`` says whether this master may still
acknowledge (its etcd lease holds); when it may not, waiting sends are answered
SERVICE_NOT_AVAILABLE, never SEND_OK.

Threads: the broker's event loop only (the master's replication links run on it too, so an
acknowledgement answers the sends it covers without a thread hand-off).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from tidemq.protocol.codes import ResponseCode

__all__ = ["ReplicaWaiters"]

log = logging.getLogger(__name__)


class _Waiting(Protocol):
    answered: bool

    def replicated(self, code: int | None) -> None: ...


class _AfterReplication:
    """A broker-made write's callback waiting for the slaves."""

    __slots__ = ("answered", "callback", "deadline")

    def __init__(self, callback: Callable[[object], None], deadline: float) -> None:
        self.answered = False
        self.callback = callback
        self.deadline = deadline

    def replicated(self, code: int | None) -> None:
        if not self.answered:
            self.answered = True
            self.callback(None)  # stored here in any case; the caller's progress goes on


class ReplicaWaiters:
    def __init__(
        self,
        replicated_offset: Callable[[], int],
        in_sync: Callable[[], int],
        min_replicas: int,
        *,
        may_ack: Callable[[], bool] | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        self._replicated_offset = replicated_offset
        self._in_sync = in_sync
        self.min_replicas = min_replicas
        self.may_ack = may_ack
        self.timeout_s = timeout_s
        #: the end of the last send answered as replicated (Kafka's high watermark): a slave
        #: joins the in-sync set in etcd only once it holds this
        self.high_watermark = 0
        self.fenced_answers = 0
        #: the replicated offset as last computed (by an acknowledgement or the drain)
        self.replicated = -1
        self.in_sync_count = 0
        self._q: collections.deque[tuple[int, _Waiting]] = collections.deque()
        self.not_available = 0
        self.rounds = 0  # loop wake-ups that answered waiting sends
        self.waited = 0  # sends that had to wait for an acknowledgement

    def refresh(self) -> None:
        """Recompute the in-sync set and the replicated offset."""
        self.in_sync_count = self._in_sync()
        self.replicated = self._replicated_offset()

    def _fenced(self, pending: _Waiting) -> bool:
        if self.may_ack is not None and not self.may_ack():
            self.fenced_answers += 1
            pending.replicated(ResponseCode.SERVICE_NOT_AVAILABLE)
            return True
        return False

    def after(self, callback: Callable[[Any], None], end: int) -> None:
        """Call ``callback(None)`` once the slaves hold ``end`` (or it timed out, or no slave
        is in sync): a broker-made write (loop)."""
        self.expect(_AfterReplication(callback, time.monotonic() + self.timeout_s), end)

    def expect(self, pending: _Waiting, end: int) -> None:
        """``pending`` is answered once the slaves hold CommitLog offset ``end`` (loop)."""
        if self.in_sync_count < self.min_replicas:
            self.refresh()
            if self.in_sync_count < self.min_replicas:
                self.not_available += 1
                pending.replicated(ResponseCode.SLAVE_NOT_AVAILABLE)
                return
        if self.replicated >= end and not self._q:
            if not self._fenced(pending):
                self.high_watermark = max(self.high_watermark, end)
                pending.replicated(None)
            return
        self._q.append((end, pending))
        self.waited += 1

    def acked(self) -> None:
        """An acknowledgement arrived: answer the sends it covers."""
        self.refresh()
        q = self._q
        if q and self.replicated >= q[0][0]:
            self._drain()

    def _drain(self) -> None:
        rep = self.replicated
        q = self._q
        n = 0
        if self.may_ack is not None and not self.may_ack():
            while q and (q[0][0] <= rep or q[0][1].answered):
                pending = q.popleft()[1]
                if not pending.answered:
                    self._fenced(pending)
            return
        while q:
            end, pending = q[0]
            if end > rep and not pending.answered:
                break
            q.popleft()
            if not pending.answered:
                if end > self.high_watermark:
                    self.high_watermark = end
                pending.replicated(None)
                n += 1
        if n:
            self.rounds += 1

    def sweep(self) -> None:
        """Drop answered (timed-out) waiters from the head; recompute the in-sync set (loop,
        every second)."""
        self.refresh()
        q = self._q
        now = time.monotonic()
        for _end, pending in q:
            if isinstance(pending, _AfterReplication) and now > pending.deadline:
                pending.replicated(None)
        while q and q[0][1].answered:
            q.popleft()
        if q and self.replicated >= q[0][0]:
            self._drain()

    def fail_all(self, code: int) -> None:
        """The broker stops being a master: nobody will replicate what waits (loop)."""
        q, self._q = self._q, collections.deque()
        for _end, pending in q:
            if not pending.answered:
                pending.replicated(code)

    def __len__(self) -> int:
        return len(self._q)
