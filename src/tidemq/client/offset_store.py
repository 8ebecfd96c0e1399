"""Where a push consumer keeps its consume offsets (RocketMQ's OffsetStore; ref CO7).

- :class:`RemoteOffsetStore` (CLUSTERING): offsets are the group's, on the broker of each
  queue. Updates stay in memory and are sent every 5 s (``persist_all``), when a queue is
  dropped by a rebalance, and at shutdown; pulls also piggy-back the current offset.
  ``persist_all`` sends only the offsets that moved since they were last sent, those of one
  broker together in UPDATE_CONSUMER_OFFSETS requests of at most ``BATCH`` (4,096) queues
  (a consumer of 10,000 queues sent 10,000 requests at once every 5 s, which held the broker
  up for seconds); a broker that does not serve it gets one request per queue, 64 at a time.
- :class:`LocalFileOffsetStore` (BROADCASTING): every member consumes everything, so offsets
  are the member's own, in ``<offset_dir>/<client name>/<group>/offsets.json`` (written tmp ->
  fsync -> rename -> fsync dir). A restarted member with the same ``instance_name`` continues
  where it left off.

An offset is the next queue offset to consume. ``update(..., increase_only=True)`` never moves
an offset backwards (a late result of an older consume must not undo a newer one).

Threads: the consumer's event loop only (file writes go to a worker thread).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Protocol

from tidemq.base.atomic_file import write_atomic
from tidemq.client import offsets
from tidemq.client.connection import ConnectionPool
from tidemq.client.loop_share import Slicer
from tidemq.client.message import MessageQueue
from tidemq.client.route import RouteCache
from tidemq.protocol.errors import TidemqError

__all__ = ["OffsetStore", "RemoteOffsetStore", "LocalFileOffsetStore", "default_offset_dir"]

log = logging.getLogger(__name__)

#: Most queues of one UPDATE_CONSUMER_OFFSETS request.
BATCH = 4096


def default_offset_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".tidemq_offsets")


class OffsetStore(Protocol):
    async def load(self) -> None: ...
    def update(self, mq: MessageQueue, offset: int, increase_only: bool) -> None: ...
    def read(self, mq: MessageQueue) -> int: ...
    async def read_from_store(self, mq: MessageQueue) -> int: ...
    async def persist(self, mq: MessageQueue) -> None: ...
    async def persist_all(self, mqs: set[MessageQueue]) -> None: ...
    def remove(self, mq: MessageQueue) -> None: ...


class _MemoryTable:
    def __init__(self) -> None:
        self.table: dict[MessageQueue, int] = {}

    def update(self, mq: MessageQueue, offset: int, increase_only: bool) -> None:
        if offset < 0:
            return
        old = self.table.get(mq)
        if old is None or not increase_only or offset > old:
            self.table[mq] = offset

    def read(self, mq: MessageQueue) -> int:
        """The offset in memory, -1 if none."""
        return self.table.get(mq, -1)

    def remove(self, mq: MessageQueue) -> None:
        self.table.pop(mq, None)


class RemoteOffsetStore(_MemoryTable):
    """The group's offsets on the brokers (clustering)."""

    def __init__(self, pool: ConnectionPool, routes: RouteCache, group: str,
                 timeout: float) -> None:
        super().__init__()
        self.pool = pool
        self.routes = routes
        self.group = group
        self.timeout = timeout
        self._sent: dict[MessageQueue, int] = {}
        #: brokers that answered UPDATE_CONSUMER_OFFSETS with REQUEST_CODE_NOT_SUPPORTED
        self._one_by_one: dict[str, bool] = {}

    async def load(self) -> None:
        return None

    async def read_from_store(self, mq: MessageQueue) -> int:
        """The broker's offset (also kept in memory); -1 when the group has none."""
        addr = await self.routes.addr_for_admin(mq)
        off = await offsets.query_consumer_offset(self.pool, addr, self.group, mq,
                                                  timeout=self.timeout)
        if off is None:
            return -1
        self.update(mq, off, False)
        return off

    async def persist(self, mq: MessageQueue) -> None:
        off = self.table.get(mq)
        if off is None:
            return
        addr = await self.routes.addr_for_admin(mq)
        await offsets.update_consumer_offset(self.pool, addr, self.group, mq, off,
                                             timeout=self.timeout)
        self._sent[mq] = off

    async def persist_all(self, mqs: set[MessageQueue]) -> None:
        table, sent = self.table, self._sent
        by_addr: dict[str, dict[MessageQueue, int]] = {}
        sl = Slicer()
        for mq in mqs:
            if sl.due():  # 10,000 queues are not one stretch of the loop (loop_share)
                await asyncio.sleep(0)
            off = table.get(mq)
            if off is None or sent.get(mq) == off:
                continue
            known = self.routes.addr_for_read_now(mq)
            try:
                addr = known[0] if known is not None else await self.routes.addr_for_admin(mq)
            except TidemqError as exc:
                log.warning("persisting the offset of %s for group %s failed: %s",
                            mq, self.group, exc)
                continue
            by_addr.setdefault(addr, {})[mq] = off
        chunks = []
        for addr, offs in by_addr.items():
            items = list(offs.items())
            chunks += [(addr, dict(items[i : i + BATCH])) for i in range(0, len(items), BATCH)]
        results = await asyncio.gather(*(self._persist_chunk(a, c) for a, c in chunks),
                                       return_exceptions=True)
        for (addr, chunk), r in zip(chunks, results, strict=True):
            if isinstance(r, TidemqError):
                log.warning("persisting the offsets of %d queues (%s, ...) for group %s to %s "
                            "failed: %s", len(chunk), next(iter(chunk)), self.group, addr, r)
            elif isinstance(r, BaseException):
                raise r

    async def _persist_chunk(self, addr: str, chunk: dict[MessageQueue, int]) -> None:
        if not self._one_by_one.get(addr) and await offsets.update_consumer_offsets(
                self.pool, addr, self.group, chunk, timeout=self.timeout):
            self._sent.update(chunk)
            return
        self._one_by_one[addr] = True  # an older broker: one request per queue
        sem = asyncio.Semaphore(64)

        async def one(mq: MessageQueue) -> None:
            async with sem:
                await self.persist(mq)

        results = await asyncio.gather(*(one(mq) for mq in chunk), return_exceptions=True)
        for mq, r in zip(chunk, results, strict=True):
            if isinstance(r, TidemqError):
                log.warning("persisting the offset of %s for group %s failed: %s",
                            mq, self.group, r)
            elif isinstance(r, BaseException):
                raise r

    def remove(self, mq: MessageQueue) -> None:
        super().remove(mq)
        self._sent.pop(mq, None)


class LocalFileOffsetStore(_MemoryTable):
    """This member's own offsets in a local file (broadcasting)."""

    def __init__(self, directory: str, client_name: str, group: str) -> None:
        super().__init__()
        self.path = os.path.join(directory, client_name, group, "offsets.json")

    async def load(self) -> None:
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            log.warning("offset file %s is unreadable (%s); starting from consume_from",
                        self.path, exc)
            return
        for key, off in data.get("offsets", {}).items():
            topic, broker, qid = key.rsplit("|", 2)
            self.table[MessageQueue(topic, broker, int(qid))] = int(off)

    async def read_from_store(self, mq: MessageQueue) -> int:
        return self.table.get(mq, -1)

    async def persist(self, mq: MessageQueue) -> None:
        await self.persist_all({mq})

    async def persist_all(self, mqs: set[MessageQueue]) -> None:
        data = {"offsets": {f"{mq.topic}|{mq.broker_name}|{mq.queue_id}": off
                            for mq, off in self.table.items()}}
        await asyncio.to_thread(
            write_atomic, self.path, json.dumps(data).encode(), unique_tmp=True
        )



