"""CONSUMER_SEND_MSG_BACK: retry and dead-letter queues (RocketMQ's
SendMessageProcessor#consumerSendMsgBack; ref BR7).

A concurrent consumer whose listener failed (RECONSUME_LATER or an exception) sends the message
back by its place in the CommitLog: the physical offset of its batch and its index inside it.
The broker reads that message and stores a copy, a batch of one:

- into ``%RETRY%<group>`` (queue 0 of the group's ``retry_queue_nums``, created with read and
  write permission if missing) with reconsume times + 1 and delay level ``3 + reconsume times``
  (or the level the client asked for), so the n-th retry waits level 3+n of
  ``message_delay_level`` (10 s, 30 s, 1 m, ... 2 h with RocketMQ's default schedule);
- into ``%DLQ%<group>`` (1 queue, write-only permission, as RocketMQ: nobody consumes it by
  accident) once reconsume times reach the maximum (the client's ``max_reconsume_times``, else
  the group's ``retry_max_times``, 16), or when the client asks for it (delay level -1: an
  orderly consumer out of local retries).

The copy keeps body, tags, keys, flag, born time/host and the unique id (so a listener sees the
same ``msg_id`` on every attempt, as RocketMQ's UNIQ_KEY), and records where it came from in
two properties: ``RETRY_TOPIC`` (the original topic; the client restores it before calling the
listener) and ``ORIGIN_MESSAGE_ID``; both are set only on the first send-back.

The group must be a valid group name (``protocol.names``; a bad one is refused, never
persisted) and the message must be on a readable topic: a write-only topic (a dead-letter
topic, perm WRITE) or a system topic is never read through a send-back (NO_PERMISSION).

The copy is stored with ``Broker.put_internal`` when the broker has it (delayed delivery holds
it until its level is due), else straight into the store (delivered at once).

Threads: the broker's event loop only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from tidemq.broker.connection import decode_request
from tidemq.broker.consumer_manager import DLQ_PREFIX, RETRY_PREFIX
from tidemq.broker.errors import RequestRejected, check_group, rejection_for_store_error
from tidemq.protocol.codes import RequestCode, ResponseCode
from tidemq.protocol.errors import TidemqError
from tidemq.protocol.headers import ConsumerSendMsgBackRequestHeader, EmptyHeader
from tidemq.protocol.names import is_system_topic
from tidemq.protocol.record import (
    MAX_DELAY_LEVEL,
    BatchView,
    MessageData,
    StoredMessage,
    encode_batch,
    unpack_host,
)

if TYPE_CHECKING:
    from tidemq.broker.broker import Broker
    from tidemq.broker.connection import BrokerConnection
    from tidemq.protocol.frame import Frame

__all__ = ["SendBackProcessor", "store_copy", "PROPERTY_RETRY_TOPIC", "PROPERTY_ORIGIN_MESSAGE_ID"]

log = logging.getLogger(__name__)

PROPERTY_RETRY_TOPIC = "RETRY_TOPIC"
PROPERTY_ORIGIN_MESSAGE_ID = "ORIGIN_MESSAGE_ID"
_EMPTY = EmptyHeader()


class SendBackProcessor:
    """Handles CONSUMER_SEND_MSG_BACK (event loop only)."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.retried = 0  # copies put into retry topics (runtime info)
        self.dead = 0  # copies put into dead-letter queues

    def handlers(self) -> dict[int, Callable[..., None]]:
        return {RequestCode.CONSUMER_SEND_MSG_BACK: self.handle}

    def handle(self, conn: BrokerConnection, frame: Frame) -> None:
        h: ConsumerSendMsgBackRequestHeader = decode_request(
            frame, ConsumerSendMsgBackRequestHeader
        )
        broker = self.broker
        group = h.consumer_group
        check_group(group)
        found = False  # a batch is there: a failure after this is its content, not the ask
        try:
            v = broker.store.read_batch(h.commit_log_offset)
            v.verify()
            if not 0 <= h.index < v.count:
                raise ValueError(f"the batch holds {v.count} messages")
            found = True
            # Decompression is capped at the store's largest batch: a bomb costs at most that
            # much memory and time on the loop, and is refused as corrupt.
            m = next(v.messages(h.index, broker.store.config.max_batch_bytes))
        except (TidemqError, ValueError) as exc:
            if found:
                broker.store.corrupt.skipped(
                    "send-back", f"batch at CommitLog offset {h.commit_log_offset} message "
                    f"{h.index} (group {group})", str(exc))
            raise RequestRejected(
                ResponseCode.INVALID_ARGUMENT,
                f"no message at commit log offset {h.commit_log_offset} index {h.index}: "
                f"{exc}; send back the message exactly as it was received",
            ) from None
        if is_system_topic(m.topic) or not broker.admin_processor.readable(m.topic):
            # The copy would make it readable through %RETRY%<group>.
            raise RequestRejected(
                ResponseCode.NO_PERMISSION,
                f"the message at commit log offset {h.commit_log_offset} is on topic "
                f"{m.topic!r}, which is not readable; only a message a consumer received "
                "can be sent back",
            )
        sg = broker.subscription_groups.ensure(group)
        max_times = h.max_reconsume_times if h.max_reconsume_times >= 0 else sg.retry_max_times
        times = m.reconsume_times
        props = dict(m.properties)
        props.setdefault(PROPERTY_RETRY_TOPIC, h.origin_topic or m.topic)
        props.setdefault(PROPERTY_ORIGIN_MESSAGE_ID, h.origin_msg_id or m.msg_id)
        if times >= max_times or h.delay_level < 0:
            topic = DLQ_PREFIX + group
            broker.ensure_dlq_topic(group)
            delay = 0
            self.dead += 1
            log.info("message %s of group %s goes to %s after %d reconsumes",
                     m.msg_id, group, topic, times)
        else:
            topic = RETRY_PREFIX + group
            broker.ensure_retry_topic(group)
            delay = h.delay_level if h.delay_level > 0 else 3 + times
            delay = min(delay, broker.max_delay_level(), MAX_DELAY_LEVEL)
            self.retried += 1
        try:
            store_copy(broker, v, h.index, m, topic, delay=delay, reconsume_times=times + 1,
                       properties=props)
        except TidemqError as exc:
            raise rejection_for_store_error(exc) from None
        if not frame.is_oneway:
            # answered once durable (SYNC_FLUSH) and held by the slaves (SYNC_MASTER), as
            # RocketMQ answers a send-back after its put
            broker.store.when_durable(_Answer(conn, frame.opaque))


def store_copy(broker: Broker, v: BatchView, index: int, m: StoredMessage, topic: str, *,
               delay: int, reconsume_times: int, properties: dict[str, str] | None = None
               ) -> None:
    """Store a copy of message ``index`` of batch ``v`` (``m``, decoded) into queue 0 of
    ``topic``, as a batch of one (a retry or dead-letter copy; also POP's dead letters).
    Without ``properties``: the message's own plus RETRY_TOPIC / ORIGIN_MESSAGE_ID."""
    if properties is None:
        properties = dict(m.properties)
        properties.setdefault(PROPERTY_RETRY_TOPIC, m.topic)
        properties.setdefault(PROPERTY_ORIGIN_MESSAGE_ID, m.msg_id)
    batch = encode_batch(
        topic,
        [MessageData(body=m.body, tags=m.tags, keys=m.keys, properties=properties,
                     flag=m.flag, born_ts=m.born_ts)],
        queue_id=0,
        producer_id=v.producer_id,
        base_seq=v.base_seq + index,
        born_host=unpack_host(v.born_host_raw),
        born_port=v.born_port,
        delay_level=delay,
        reconsume_times=reconsume_times,
    )
    broker.put_for_consumer(batch, 0)


class _Answer:
    """when_durable callback of a send-back: answer the consumer (event loop)."""

    __slots__ = ("conn", "opaque")

    def __init__(self, conn: BrokerConnection, opaque: int) -> None:
        self.conn = conn
        self.opaque = opaque

    def __call__(self, err: object) -> None:
        if err is None:
            self.conn.respond(self.opaque, ResponseCode.SUCCESS, _EMPTY)
        else:
            self.conn.respond_error(
                self.opaque, ResponseCode.SYSTEM_ERROR,
                f"the retry copy was stored but its fsync failed ({err}); send it back again",
            )
