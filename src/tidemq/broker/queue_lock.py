"""Queue locks for ordered consumption (RocketMQ's RebalanceLockManager; ref BR6).

An orderly consumer may consume a queue only while it holds the broker's lock on it, so that
during a rebalance the old owner and the new one never consume the same queue at once. A client
locks a batch of queues (LOCK_BATCH_MQ: the answer lists the queues it holds now, which may be
fewer than asked) and renews them every 20 s; a lock not renewed for ``queue_lock_max_live_ms``
(60 s) is free for another client. UNLOCK_BATCH_MQ releases (a dropped queue); a client that
leaves its group loses all its locks at once (``release_client``), which RocketMQ leaves to the
60 s expiry -- a killed orderly consumer's queues would otherwise stand still for a minute.

Locks live in memory only: after a broker restart every client locks again within 20 s.

Threads: the broker's event loop only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tidemq.broker.connection import decode_request
from tidemq.protocol.codes import RequestCode, ResponseCode
from tidemq.protocol.headers import (
    EmptyHeader,
    LockBatchRequestHeader,
    LockBatchResponseHeader,
    QueueRef,
)

if TYPE_CHECKING:
    from tidemq.broker.connection import BrokerConnection
    from tidemq.protocol.frame import Frame

__all__ = ["QueueLockManager"]

_Key = tuple[str, str, int]  # topic, broker name, queue id


class _Lock:
    __slots__ = ("client_id", "last_update")

    def __init__(self, client_id: str, now: float) -> None:
        self.client_id = client_id
        self.last_update = now


class QueueLockManager:
    """Per group: queue -> (holder, last renewal)."""

    def __init__(self, max_live_ms: int) -> None:
        self.max_live = max_live_ms / 1000
        self._groups: dict[str, dict[_Key, _Lock]] = {}

    def handlers(self) -> dict[int, Callable[..., None]]:
        return {
            RequestCode.LOCK_BATCH_MQ: self.lock_batch,
            RequestCode.UNLOCK_BATCH_MQ: self.unlock_batch,
        }

    def lock_batch(self, conn: BrokerConnection, frame: Frame) -> None:
        h: LockBatchRequestHeader = decode_request(frame, LockBatchRequestHeader)
        keys = [(q.topic, q.broker_name, q.queue_id) for q in h.queues]
        locked = self.try_lock(h.consumer_group, h.client_id, keys)
        conn.respond(
            frame.opaque, ResponseCode.SUCCESS,
            LockBatchResponseHeader([QueueRef(topic=t, broker_name=b, queue_id=i)
                                     for t, b, i in locked]),
        )

    def unlock_batch(self, conn: BrokerConnection, frame: Frame) -> None:
        h: LockBatchRequestHeader = decode_request(frame, LockBatchRequestHeader)
        self.unlock(h.consumer_group, h.client_id,
                    [(q.topic, q.broker_name, q.queue_id) for q in h.queues])
        if not frame.is_oneway:
            conn.respond(frame.opaque, ResponseCode.SUCCESS, EmptyHeader())

    # -- the table ---------------------------------------------------------------------------
    def try_lock(
        self, group: str, client_id: str, keys: list[_Key], now: float | None = None
    ) -> list[_Key]:
        """Lock or renew every free (or own, or expired) queue; the ones ``client_id`` holds."""
        now = time.monotonic() if now is None else now
        table = self._groups.setdefault(group, {})
        out = []
        for k in keys:
            lk = table.get(k)
            if lk is None or lk.client_id == client_id or now - lk.last_update > self.max_live:
                table[k] = _Lock(client_id, now)
                out.append(k)
        return out

    def unlock(self, group: str, client_id: str, keys: list[_Key]) -> None:
        table = self._groups.get(group)
        if not table:
            return
        for k in keys:
            lk = table.get(k)
            if lk is not None and lk.client_id == client_id:
                del table[k]

    def release_client(self, group: str, client_id: str) -> None:
        table = self._groups.get(group)
        if table:
            for k in [k for k, lk in table.items() if lk.client_id == client_id]:
                del table[k]

    def holder(self, group: str, key: _Key, now: float | None = None) -> str | None:
        now = time.monotonic() if now is None else now
        lk = self._groups.get(group, {}).get(key)
        if lk is None or now - lk.last_update > self.max_live:
            return None
        return lk.client_id
