"""The transactional producer (ref PR7; RocketMQ's TransactionMQProducer).

``send_in_transaction(msg, execute)``:

1. sends ``msg`` as a *half* message (batch attribute txn = PREPARED): the broker stores it on
   its hidden half topic, so no consumer sees it;
2. runs ``execute(msg, arg)`` -- the local transaction -- which returns a
   :class:`LocalTransactionState` (an exception counts as UNKNOW);
3. tells the broker the outcome with a one-way END_TRANSACTION: COMMIT_MESSAGE makes the message
   visible in its topic, ROLLBACK_MESSAGE drops it, UNKNOW leaves it to the broker's check.

The check: for a half message still unresolved after the broker's transaction timeout (6 s by
default), the broker sends CHECK_TRANSACTION_STATE over the connection of a live producer of the
same group -- this one, or one started later with the same group after this one died. The
producer answers with ``checker(message_ext)`` (another LocalTransactionState) in an
END_TRANSACTION. A producer makes itself known to every broker of the cluster at start and
every ``heartbeat_interval`` seconds (HEART_BEAT listing its group), so a restarted producer is
asked even before it sends anything.

``execute`` and ``checker`` may be plain functions or coroutine functions; plain ones run on the
event loop (keep them short, or make them async).

Threading: one event loop, like :class:`Producer`. ``tidemq.TransactionProducer`` is the
blocking twin.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import inspect
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from tidemq.client.codec import decode_batches
from tidemq.client.connection import Connection
from tidemq.client.errors import ClientError
from tidemq.client.message import Message, MessageExt, SendResult
from tidemq.client.producer import Producer
from tidemq.protocol.batch.fields import mark_prepared
from tidemq.protocol.codes import RequestCode
from tidemq.protocol.errors import BrokerError, CorruptBatchError
from tidemq.protocol.frame import Frame
from tidemq.protocol.headers import (
    CheckTransactionStateRequestHeader,
    ClusterInfo,
    EndTransactionRequestHeader,
    HeartbeatRequestHeader,
)
from tidemq.protocol.record import (
    TxnType,
)

__all__ = [
    "LocalTransactionState",
    "TransactionProducer",
    "TransactionSendResult",
    "TransactionChecker",
    "LocalTransaction",
]

log = logging.getLogger(__name__)


class LocalTransactionState(enum.StrEnum):
    """RocketMQ's LocalTransactionState (UNKNOW is RocketMQ's spelling)."""

    COMMIT_MESSAGE = "COMMIT_MESSAGE"
    ROLLBACK_MESSAGE = "ROLLBACK_MESSAGE"
    UNKNOW = "UNKNOW"


_TXN_OF = {
    LocalTransactionState.COMMIT_MESSAGE: TxnType.COMMIT,
    LocalTransactionState.ROLLBACK_MESSAGE: TxnType.ROLLBACK,
    LocalTransactionState.UNKNOW: TxnType.NOT_TYPE,
}

LocalTransaction = Callable[
    [Message, Any], "LocalTransactionState | Awaitable[LocalTransactionState]"
]
TransactionChecker = Callable[
    [MessageExt], "LocalTransactionState | Awaitable[LocalTransactionState]"
]

# Set while send_in_transaction encodes its half message (each task has its own context).
_HALF: contextvars.ContextVar[bool] = contextvars.ContextVar("tidemq_half", default=False)


class TransactionSendResult(SendResult, gc=False):
    """A SendResult plus the local transaction's outcome."""

    local_transaction_state: LocalTransactionState = LocalTransactionState.UNKNOW
    transaction_id: str = ""


async def _call(fn: Callable[..., Any], *args: Any) -> Any:
    out = fn(*args)
    if inspect.isawaitable(out):
        out = await out
    return out


class TransactionProducer(Producer):
    """A Producer that also sends transactional messages. One event loop.

    ``checker(message_ext) -> LocalTransactionState`` answers the broker's checks; ``group`` is
    required (the broker asks a live producer of the same group). Other options as Producer
    (automatic batching is off: a half message travels alone).
    """

    def __init__(
        self,
        namesrv: str | Sequence[str],
        group: str,
        *,
        checker: TransactionChecker,
        heartbeat_interval: float = 30.0,
        **options: Any,
    ) -> None:
        if not group:
            raise ValueError("a transactional producer needs a group (the broker checks by it)")
        options.setdefault("auto_batch", False)
        super().__init__(namesrv, group, **options)
        self.checker = checker
        self.heartbeat_interval = heartbeat_interval
        self.client_id = f"{socket.gethostname()}@{os.getpid()}@{self.producer_id:016X}"
        self.checks_answered = 0
        self.pool.on_request = self._on_request
        self._hb_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> TransactionProducer:
        first = not self._started
        await super().start()
        if first:
            await self._heartbeat_all()
            self._hb_task = asyncio.get_running_loop().create_task(self._heartbeat_forever())
        return self

    async def close(self) -> None:
        if self._hb_task is not None:
            self._hb_task.cancel()
            await asyncio.gather(self._hb_task, return_exceptions=True)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await super().close()

    async def _heartbeat_all(self) -> None:
        """HEART_BEAT (listing this group) to every broker of the cluster: brokers learn a
        producer of the group is alive on this connection."""
        try:
            frame = await self.routes.namesrv_request(RequestCode.GET_BROKER_CLUSTER_INFO)
        except (ClientError, BrokerError) as exc:
            log.warning("transaction producer %s: no cluster info (%s)", self.group, exc)
            return
        info = frame.header
        if not isinstance(info, ClusterInfo):
            return
        header = HeartbeatRequestHeader(client_id=self.client_id, producer_groups=[self.group])
        for bd in info.broker_addr_table.values():
            for addr in bd.broker_addrs.values():
                try:
                    await self.pool.request(addr, RequestCode.HEART_BEAT, header)
                except (ClientError, BrokerError) as exc:
                    log.info("heartbeat to %s failed: %s", addr, exc)

    async def _heartbeat_forever(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            await self._heartbeat_all()

    # -- sending -----------------------------------------------------------------------------
    def _encode(self, *args: Any, **kwargs: Any) -> tuple[bytearray, int]:
        batch, seq = super()._encode(*args, **kwargs)
        if _HALF.get():
            mark_prepared(batch)
        return batch, seq

    async def send_in_transaction(
        self, msg: Message, execute: LocalTransaction, arg: Any = None, *,
        timeout: float | None = None,
    ) -> TransactionSendResult:
        """Send ``msg`` as a half message, run ``execute(msg, arg)``, then commit / roll back
        / leave it to the check according to its answer."""
        if msg.delay_level or msg.deliver_at:
            raise ValueError("a transactional message cannot be delayed (RocketMQ's rule too)")
        token = _HALF.set(True)
        try:
            # Not through the batch container: the half mark (a context variable) must
            # reach this message's encoding only.
            r = await self._send(msg.topic, (msg,), None, None, None, None, timeout,
                                 RequestCode.SEND_MESSAGE)
        finally:
            _HALF.reset(token)
        try:
            state = LocalTransactionState(await _call(execute, msg, arg))
        except Exception:
            log.exception("local transaction of %s failed; its state is UNKNOW", r.msg_id)
            state = LocalTransactionState.UNKNOW
        await self._end(r, state)
        return TransactionSendResult(
            r.status, r.msg_id, r.topic, r.queue_id, r.queue_offset, r.count, r.broker_name,
            r.producer_id, r.base_seq, r.commit_log_offset, state, r.msg_id,
        )

    async def _end(self, r: SendResult, state: LocalTransactionState) -> None:
        route = self.routes.cached(r.topic) or await self._route(r.topic)
        conn = await self.pool.get(route.broker_addrs[r.broker_name])
        conn.send_oneway(RequestCode.END_TRANSACTION, EndTransactionRequestHeader(
            producer_group=self.group, tran_state_table_offset=r.queue_offset,
            commit_log_offset=r.commit_log_offset, commit_or_rollback=_TXN_OF[state],
            msg_id=r.msg_id, transaction_id=r.msg_id,
        ))

    # -- the broker's check ------------------------------------------------------------------
    def _on_request(self, conn: Connection, frame: Frame) -> None:
        if frame.code != RequestCode.CHECK_TRANSACTION_STATE:
            log.debug("ignoring request code %d from %s", frame.code, conn.address)
            return
        task = asyncio.get_running_loop().create_task(self._check(conn, frame))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _check(self, conn: Connection, frame: Frame) -> None:
        h = frame.header
        if not isinstance(h, CheckTransactionStateRequestHeader):
            log.warning("CHECK_TRANSACTION_STATE from %s without its header", conn.address)
            return
        try:
            msgs = decode_batches(bytes(frame.body), from_offset=0)
        except CorruptBatchError as exc:
            log.error("transaction check for %s carries a damaged batch: %s", h.msg_id, exc)
            return
        if not msgs:
            return
        try:
            state = LocalTransactionState(await _call(self.checker, msgs[0]))
        except Exception:
            log.exception("transaction checker failed for %s; answering UNKNOW", h.msg_id)
            state = LocalTransactionState.UNKNOW
        if conn.is_closed:
            return
        conn.send_oneway(RequestCode.END_TRANSACTION, EndTransactionRequestHeader(
            producer_group=self.group, tran_state_table_offset=h.tran_state_table_offset,
            commit_log_offset=h.commit_log_offset, commit_or_rollback=_TXN_OF[state],
            msg_id=h.msg_id, transaction_id=h.transaction_id, from_transaction_check=True,
        ))
        self.checks_answered += 1
