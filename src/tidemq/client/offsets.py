"""Queue and consumer-group offsets on a broker: the requests the consumer and Admin share.

Queue offsets (GET_MIN_OFFSET, GET_MAX_OFFSET, SEARCH_OFFSET_BY_TIMESTAMP) say what a queue
holds: ``[min, max)``, max being the offset the next message will get. A consumer group's offset
(QUERY_CONSUMER_OFFSET / UPDATE_CONSUMER_OFFSET, ref BR4) is the next offset the group will
consume, as RocketMQ stores it. UPDATE_CONSUMER_OFFSETS carries many queues' offsets to one
broker in one request (issue 17); a broker that does not know it answers
REQUEST_CODE_NOT_SUPPORTED, and :func:`update_consumer_offsets` returns False (send them one by
one).

Threading: coroutines for one event loop.
"""

from __future__ import annotations

from tidemq.client.connection import DEFAULT_TIMEOUT, ConnectionPool
from tidemq.client.message import MessageQueue
from tidemq.protocol.codes import RequestCode, ResponseCode
from tidemq.protocol.headers import (
    OffsetResponseHeader,
    QueryConsumerOffsetRequestHeader,
    QueryConsumerOffsetResponseHeader,
    QueueCommit,
    QueueOffsetRequestHeader,
    SearchOffsetRequestHeader,
    UpdateConsumerOffsetRequestHeader,
    UpdateConsumerOffsetsRequestHeader,
)

__all__ = [
    "min_offset",
    "max_offset",
    "search_offset",
    "query_consumer_offset",
    "update_consumer_offset",
    "update_consumer_offsets",
]


def _offset(header: object) -> int:
    if isinstance(header, OffsetResponseHeader | QueryConsumerOffsetResponseHeader):
        return header.offset
    if isinstance(header, dict) and isinstance(header.get("offset"), int):
        off: int = header["offset"]
        return off
    raise TypeError(f"response carries no offset: {header!r}")


async def min_offset(
    pool: ConnectionPool, addr: str, mq: MessageQueue, *, timeout: float = DEFAULT_TIMEOUT
) -> int:
    f = await pool.request(addr, RequestCode.GET_MIN_OFFSET,
                           QueueOffsetRequestHeader(topic=mq.topic, queue_id=mq.queue_id),
                           timeout=timeout)
    return _offset(f.header)


async def max_offset(
    pool: ConnectionPool, addr: str, mq: MessageQueue, *, timeout: float = DEFAULT_TIMEOUT
) -> int:
    f = await pool.request(addr, RequestCode.GET_MAX_OFFSET,
                           QueueOffsetRequestHeader(topic=mq.topic, queue_id=mq.queue_id),
                           timeout=timeout)
    return _offset(f.header)


async def search_offset(
    pool: ConnectionPool, addr: str, mq: MessageQueue, timestamp_ms: int, *,
    timeout: float = DEFAULT_TIMEOUT,
) -> int:
    f = await pool.request(
        addr, RequestCode.SEARCH_OFFSET_BY_TIMESTAMP,
        SearchOffsetRequestHeader(topic=mq.topic, queue_id=mq.queue_id, timestamp=timestamp_ms),
        timeout=timeout,
    )
    return _offset(f.header)


async def query_consumer_offset(
    pool: ConnectionPool, addr: str, group: str, mq: MessageQueue, *,
    timeout: float = DEFAULT_TIMEOUT,
) -> int | None:
    """The group's committed offset of the queue, None when it has none."""
    f = await pool.request(
        addr, RequestCode.QUERY_CONSUMER_OFFSET,
        QueryConsumerOffsetRequestHeader(consumer_group=group, topic=mq.topic,
                                         queue_id=mq.queue_id),
        timeout=timeout, ok_codes=(ResponseCode.SUCCESS, ResponseCode.QUERY_NOT_FOUND),
    )
    if f.code == ResponseCode.QUERY_NOT_FOUND:
        return None
    return _offset(f.header)


async def update_consumer_offset(
    pool: ConnectionPool, addr: str, group: str, mq: MessageQueue, offset: int, *,
    timeout: float = DEFAULT_TIMEOUT,
) -> None:
    await pool.request(
        addr, RequestCode.UPDATE_CONSUMER_OFFSET,
        UpdateConsumerOffsetRequestHeader(consumer_group=group, topic=mq.topic,
                                          queue_id=mq.queue_id, commit_offset=offset),
        timeout=timeout,
    )


async def update_consumer_offsets(
    pool: ConnectionPool, addr: str, group: str, offsets: dict[MessageQueue, int], *,
    timeout: float = DEFAULT_TIMEOUT,
) -> bool:
    """Commit the offsets of many queues of the broker at ``addr`` in one request; False when
    the broker does not serve UPDATE_CONSUMER_OFFSETS (nothing was committed)."""
    f = await pool.request(
        addr, RequestCode.UPDATE_CONSUMER_OFFSETS,
        UpdateConsumerOffsetsRequestHeader(
            consumer_group=group,
            offsets=[QueueCommit(mq.topic, mq.queue_id, off) for mq, off in offsets.items()]),
        timeout=timeout,
        ok_codes=(ResponseCode.SUCCESS, ResponseCode.REQUEST_CODE_NOT_SUPPORTED),
    )
    return f.code == ResponseCode.SUCCESS
