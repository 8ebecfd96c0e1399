"""The producer's ids and sequences (ref PR6, PR9, BR12 deduplication).

Each producer has a random 63-bit ``producer_id``; every batch gets the next ``base_seq``
(message i: ``base_seq + i``); the unique message id is ``record.unique_id(producer_id, seq)``.
A producer with a ``producer_name`` is deduplicated by the brokers: its id is
``dedup_producer_id(name)`` (bit 63 set) and its sequence continues after the highest one the
brokers persisted for that name (Pulsar's getLastSequenceId, asked at start). An explicit
``sequence_id`` moves the counter past it.

Threading: one event loop (the producer's).
"""

from __future__ import annotations

import secrets

from tidemq.client.connection import ConnectionPool, raise_for_error
from tidemq.client.errors import MessageRejectedError
from tidemq.client.route import RouteCache
from tidemq.protocol.codes import RequestCode
from tidemq.protocol.headers import (
    ClusterInfo,
    LastSequenceRequestHeader,
    LastSequenceResponseHeader,
    dedup_producer_id,
)

__all__ = ["Sequencer"]


class Sequencer:
    def __init__(self, producer_name: str | None) -> None:
        self.producer_name = producer_name
        # Named producers are deduplicated by the broker (bit 63 set); random ids keep it clear.
        self.producer_id = (
            dedup_producer_id(producer_name) if producer_name else secrets.randbits(63)
        )
        self.last_sequence_id = -1  # named producers: the brokers' highest persisted, at start
        self.next_seq = 0

    @property
    def dedup(self) -> bool:
        """Whether the brokers deduplicate this producer's batches."""
        return self.producer_name is not None

    def take(self, n: int, explicit: int | None = None) -> int:
        """The base sequence of a batch of ``n`` messages: the next ones, or ``explicit``."""
        if explicit is None:
            seq = self.next_seq
            self.next_seq = seq + n
            return seq
        if explicit < 0:
            raise MessageRejectedError(f"sequence_id must be >= 0, got {explicit}")
        self.next_seq = max(self.next_seq, explicit + n)
        return explicit

    async def fetch_last(self, routes: RouteCache, pool: ConnectionPool, timeout: float
                         ) -> None:
        """Continue after the highest sequence any broker of the cluster persisted for this
        producer's name."""
        frame = await routes.namesrv_request(RequestCode.GET_BROKER_CLUSTER_INFO)
        info = frame.header
        addrs: list[str] = []
        if isinstance(info, ClusterInfo):
            for bd in info.broker_addr_table.values():
                addrs.extend(bd.broker_addrs.values())
        last = -1
        for addr in addrs:
            conn = await pool.get(addr)
            resp = await conn.request(
                RequestCode.GET_LAST_SEQUENCE,
                LastSequenceRequestHeader(producer_name=self.producer_name or ""),
                timeout=timeout,
            )
            raise_for_error(resp)
            h = resp.header
            assert isinstance(h, LastSequenceResponseHeader)
            last = max(last, h.last_sequence_id)
        self.last_sequence_id = last
        self.next_seq = max(self.next_seq, last + 1)
