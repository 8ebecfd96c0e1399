"""Everything a broker answers besides send and pull (RocketMQ's AdminBrokerProcessor and
ConsumerManageProcessor): topics, consumer offsets, queue offsets, stats, message queries.

+-----------------------------+------------------------------------------------------------+
| request                     | answer                                                     |
+-----------------------------+------------------------------------------------------------+
| UPDATE_AND_CREATE_TOPIC     | persisted, then SUCCESS; the name servers hear at once     |
| DELETE_TOPIC                | consume queues and offsets dropped; TOPIC_NOT_EXIST if none |
|                             | (both NO_PERMISSION for system, retry and dead-letter      |
|                             | topics: ``protocol.names.topic_admin_problem``)            |
| GET_ALL_TOPIC_CONFIG        | TopicConfigTable                                           |
| UPDATE_CONSUMER_OFFSET      | SUCCESS (also one-way)                                     |
| UPDATE_CONSUMER_OFFSETS     | SUCCESS once every queue is checked and committed; else   |
|                             | the first queue's refusal, nothing committed               |
| QUERY_CONSUMER_OFFSET       | offset, or QUERY_NOT_FOUND when the group has none         |
| GET_MIN/MAX_OFFSET          | the queue's min / max offset (0 for an unknown queue)      |
| SEARCH_OFFSET_BY_TIMESTAMP  | first offset stored at or after the time                   |
| GET_CONSUME_STATS           | per queue: max offset, committed offset, lag; group TPS    |
| GET_TOPIC_STATS             | per queue: min/max offset, last store time                 |
| QUERY_MESSAGE               | stored batches holding messages with the key               |
| VIEW_MESSAGE_BY_ID          | the stored batch holding the message                       |
|                             | (both NO_PERMISSION for a topic without READ permission:   |
|                             | a write-only topic is read by no path)                     |
| GET_BROKER_RUNTIME_INFO     | counters, rates, latency histogram, held pulls, RSS        |
+-----------------------------+------------------------------------------------------------+

These are not on the hot path; they may walk every queue of a topic.

Threads: the broker's event loop only (file writes go to a worker thread).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tidemq.broker.connection import decode_request
from tidemq.broker.errors import RequestRejected, check_group
from tidemq.protocol.codes import ResponseCode
from tidemq.protocol.headers import (
    BrokerRuntimeInfo,
    ConsumeStats,
    DeleteTopicRequestHeader,
    EmptyHeader,
    FoundMessagesHeader,
    GetConsumeStatsRequestHeader,
    GetTopicStatsRequestHeader,
    OffsetResponseHeader,
    Perm,
    QueryConsumerOffsetRequestHeader,
    QueryConsumerOffsetResponseHeader,
    QueryMessageRequestHeader,
    QueueConsumeStats,
    QueueOffsetRequestHeader,
    QueueStats,
    SearchOffsetRequestHeader,
    TopicConfig,
    TopicConfigTable,
    TopicStats,
    UpdateConsumerOffsetRequestHeader,
    UpdateConsumerOffsetsRequestHeader,
    ViewMessageRequestHeader,
)
from tidemq.protocol.names import topic_admin_problem
from tidemq.protocol.record import BatchView, StoredMessage, parse_unique_id

if TYPE_CHECKING:
    from tidemq.broker.broker import Broker
    from tidemq.broker.connection import BrokerConnection
    from tidemq.protocol.frame import Frame

__all__ = ["AdminProcessor"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_EMPTY = EmptyHeader()
#: Largest body of a QUERY_MESSAGE / VIEW_MESSAGE_BY_ID response (whole batches).
_MAX_FOUND_BYTES = 8 * 1024 * 1024


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0



def _perm(tc: TopicConfig | None) -> int:
    return tc.perm if tc is not None else 0

class AdminProcessor:
    """Handles the admin and query requests of the module table (event loop only)."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.store = broker.store
        self.topics = broker.topics
        self.offsets = broker.offsets
        self.stats = broker.stats
        self.config = broker.config

    def handlers(self) -> dict[int, Callable[..., None]]:
        from tidemq.protocol.codes import RequestCode as C

        return {
            C.UPDATE_AND_CREATE_TOPIC: self.update_and_create_topic,
            C.DELETE_TOPIC: self.delete_topic,
            C.GET_ALL_TOPIC_CONFIG: self.get_all_topic_config,
            C.UPDATE_CONSUMER_OFFSET: self.update_consumer_offset,
            C.UPDATE_CONSUMER_OFFSETS: self.update_consumer_offsets,
            C.QUERY_CONSUMER_OFFSET: self.query_consumer_offset,
            C.GET_MIN_OFFSET: self.get_min_offset,
            C.GET_MAX_OFFSET: self.get_max_offset,
            C.SEARCH_OFFSET_BY_TIMESTAMP: self.search_offset_by_timestamp,
            C.GET_CONSUME_STATS: self.get_consume_stats,
            C.GET_TOPIC_STATS: self.get_topic_stats,
            C.QUERY_MESSAGE: self.query_message,
            C.VIEW_MESSAGE_BY_ID: self.view_message_by_id,
            C.GET_BROKER_RUNTIME_INFO: self.get_broker_runtime_info,
        }

    # -- checks ----------------------------------------------------------------------------------
    def _topic(self, topic: str) -> TopicConfig:
        tc = self.topics.get(topic)
        if tc is None:
            raise RequestRejected(
                ResponseCode.TOPIC_NOT_EXIST,
                f"topic {topic!r} does not exist on broker {self.config.broker_name}",
            )
        return tc

    def _queue(self, topic: str, queue_id: int) -> TopicConfig:
        tc = self._topic(topic)
        n = max(tc.read_queue_nums, tc.write_queue_nums)
        if queue_id >= n:
            raise RequestRejected(
                ResponseCode.INVALID_ARGUMENT,
                f"queue id {queue_id} is out of range: topic {topic!r} has {n} queues "
                f"(0..{n - 1}) on broker {self.config.broker_name}",
            )
        return tc

    @staticmethod
    def _group(group: str) -> None:
        check_group(group)

    @staticmethod
    def _not_reserved(topic: str) -> None:
        problem = topic_admin_problem(topic)
        if problem:
            raise RequestRejected(ResponseCode.NO_PERMISSION, problem)

    def readable(self, topic: str) -> bool:
        """False for a topic this broker has without READ permission (write-only: a
        dead-letter topic, or perm WRITE); True otherwise (a topic it does not have -- a
        deleted one, or a system topic -- is read the way the store has it)."""
        tc = self.topics.get(topic)
        return tc is None or bool(tc.perm & Perm.READ)

    def _check_readable(self, topic: str) -> None:
        if not self.readable(topic):
            raise RequestRejected(
                ResponseCode.NO_PERMISSION,
                f"topic {topic!r} is not readable on broker {self.config.broker_name} (perm "
                f"{_perm(self.topics.get(topic)):#x}); a write-only topic is read by no request",
            )

    @staticmethod
    def _reply(conn: BrokerConnection, frame: Frame, header: Any,
               bodies: list[Any] | None = None) -> None:
        if not frame.is_oneway:
            conn.respond(frame.opaque, ResponseCode.SUCCESS, header, bodies)

    # -- topics ----------------------------------------------------------------------------------
    def update_and_create_topic(self, conn: BrokerConnection, frame: Frame) -> None:
        tc: TopicConfig = decode_request(frame, TopicConfig)
        self._not_reserved(tc.topic_name)
        try:
            self.topics.update(self.broker.shrinker.plan(tc))
        except ValueError as exc:
            raise RequestRejected(ResponseCode.INVALID_ARGUMENT, str(exc)) from None
        self.broker.topics_changed(then=lambda: self._reply(conn, frame, _EMPTY))

    def delete_topic(self, conn: BrokerConnection, frame: Frame) -> None:
        h: DeleteTopicRequestHeader = decode_request(frame, DeleteTopicRequestHeader)
        self._not_reserved(h.topic)
        self._topic(h.topic)
        self.broker.delete_topic(h.topic)
        self.broker.topics_changed(then=lambda: self._reply(conn, frame, _EMPTY))

    def get_all_topic_config(self, conn: BrokerConnection, frame: Frame) -> None:
        table = TopicConfigTable(topics=self.topics.all(), broker_name=self.config.broker_name)
        self._reply(conn, frame, table)

    # -- consumer offsets ------------------------------------------------------------------------
    def update_consumer_offset(self, conn: BrokerConnection, frame: Frame) -> None:
        h: UpdateConsumerOffsetRequestHeader = decode_request(
            frame, UpdateConsumerOffsetRequestHeader
        )
        self._group(h.consumer_group)
        self._queue(h.topic, h.queue_id)
        pop = self.broker.pop
        if pop is not None and (h.consumer_group, h.topic, h.queue_id) in pop.windows:
            # a POP group's offset is its window's start: an offset reset moves the window
            pop.types.move(h.consumer_group, h.topic, h.queue_id, h.commit_offset)
            pop.types.wake(h.consumer_group)
        else:
            self.offsets.commit(h.consumer_group, h.topic, h.queue_id, h.commit_offset)
        self._reply(conn, frame, _EMPTY)

    def update_consumer_offsets(self, conn: BrokerConnection, frame: Frame) -> None:
        h: UpdateConsumerOffsetsRequestHeader = decode_request(
            frame, UpdateConsumerOffsetsRequestHeader
        )
        self._group(h.consumer_group)
        for q in h.offsets:  # every queue checked before any is committed
            self._queue(q.topic, q.queue_id)
        commit = self.offsets.commit
        for q in h.offsets:
            commit(h.consumer_group, q.topic, q.queue_id, q.commit_offset)
        self._reply(conn, frame, _EMPTY)

    def query_consumer_offset(self, conn: BrokerConnection, frame: Frame) -> None:
        h: QueryConsumerOffsetRequestHeader = decode_request(
            frame, QueryConsumerOffsetRequestHeader
        )
        self._group(h.consumer_group)
        offset = self.offsets.query(h.consumer_group, h.topic, h.queue_id)
        if offset < 0:
            raise RequestRejected(
                ResponseCode.QUERY_NOT_FOUND,
                f"group {h.consumer_group!r} has no committed offset for {h.topic!r} queue "
                f"{h.queue_id} on broker {self.config.broker_name}",
            )
        self._reply(conn, frame, QueryConsumerOffsetResponseHeader(offset=offset))

    # -- queue offsets ---------------------------------------------------------------------------
    def get_min_offset(self, conn: BrokerConnection, frame: Frame) -> None:
        h: QueueOffsetRequestHeader = decode_request(frame, QueueOffsetRequestHeader)
        self._reply(
            conn, frame, OffsetResponseHeader(offset=self.store.min_offset(h.topic, h.queue_id))
        )

    def get_max_offset(self, conn: BrokerConnection, frame: Frame) -> None:
        h: QueueOffsetRequestHeader = decode_request(frame, QueueOffsetRequestHeader)
        self._reply(
            conn, frame, OffsetResponseHeader(offset=self.store.max_offset(h.topic, h.queue_id))
        )

    def search_offset_by_timestamp(self, conn: BrokerConnection, frame: Frame) -> None:
        h: SearchOffsetRequestHeader = decode_request(frame, SearchOffsetRequestHeader)
        offset = self.store.offset_for_timestamp(h.topic, h.queue_id, h.timestamp)
        self._reply(conn, frame, OffsetResponseHeader(offset=max(0, offset)))

    # -- stats -----------------------------------------------------------------------------------
    def _store_ts_at(self, topic: str, queue_id: int, offset: int) -> int:
        """Store time of the message at ``offset`` (0 when there is none)."""
        if offset < 0:
            return 0
        r = self.store.get_messages(topic, queue_id, offset, 1)
        if not r.batches:
            return 0
        return BatchView(r.batches[0].data).store_ts

    def get_consume_stats(self, conn: BrokerConnection, frame: Frame) -> None:
        h: GetConsumeStatsRequestHeader = decode_request(frame, GetConsumeStatsRequestHeader)
        group = h.consumer_group
        self._group(group)
        if h.topic:
            self._topic(h.topic)
            topics = [h.topic]
        else:
            topics = self.offsets.topics_of_group(group)
        queues: list[QueueConsumeStats] = []
        total = 0
        for topic in topics:
            tc = self.topics.get(topic)
            if tc is None:
                continue
            for qid in range(tc.read_queue_nums):
                broker_offset = self.store.max_offset(topic, qid)
                committed = self.offsets.query(group, topic, qid)
                consumer_offset = max(committed, 0)
                lag = max(0, broker_offset - consumer_offset)
                pop = self.broker.pop
                w = pop.windows.get((group, topic, qid)) if pop is not None else None
                if w is not None:  # a POP group: what is not acked, holes included
                    lag = w.unacked(broker_offset)
                total += lag
                queues.append(
                    QueueConsumeStats(
                        topic=topic,
                        queue_id=qid,
                        broker_offset=broker_offset,
                        consumer_offset=consumer_offset,
                        lag=lag,
                        last_timestamp=self._store_ts_at(topic, qid, consumer_offset - 1),
                    )
                )
        pulled_msgs = pulled_bytes = 0
        for topic in topics:
            c = self.stats.get.get(f"{topic}@{group}")
            if c is not None:
                pulled_msgs += c[0]
                pulled_bytes += c[1]
        stats = ConsumeStats(
            broker_name=self.config.broker_name,
            queues=queues,
            consume_tps=round(self.stats.get_tps(group, h.topic or None), 3),
            total_lag=total,
            pulled_msgs=pulled_msgs,
            pulled_bytes=pulled_bytes,
        )
        self._reply(conn, frame, stats)

    def get_topic_stats(self, conn: BrokerConnection, frame: Frame) -> None:
        h: GetTopicStatsRequestHeader = decode_request(frame, GetTopicStatsRequestHeader)
        tc = self._topic(h.topic)
        queues = []
        for qid in range(max(tc.read_queue_nums, tc.write_queue_nums)):
            mx = self.store.max_offset(h.topic, qid)
            queues.append(
                QueueStats(
                    queue_id=qid,
                    min_offset=self.store.min_offset(h.topic, qid),
                    max_offset=mx,
                    last_update_timestamp=self._store_ts_at(h.topic, qid, mx - 1),
                )
            )
        put = self.stats.put.get(h.topic, (0, 0, 0))
        self._reply(
            conn,
            frame,
            TopicStats(
                broker_name=self.config.broker_name,
                queues=queues,
                put_tps=round(self.stats.put_tps(h.topic), 3),
                put_msgs=put[0],
                put_bytes=put[1],
            ),
        )

    def get_broker_runtime_info(self, conn: BrokerConnection, frame: Frame) -> None:
        self._reply(conn, frame, BrokerRuntimeInfo(table=self.broker.runtime_info()))

    # -- message queries -------------------------------------------------------------------------
    def _found(self, conn: BrokerConnection, frame: Frame, found: list[StoredMessage]) -> None:
        bodies: list[Any] = []
        indexes = []
        total = 0
        for m in found:
            try:
                v = self.store.read_batch(m.phys_offset)
            except Exception:  # aged out between the lookup and now
                continue
            if bodies and total + v.total_size > _MAX_FOUND_BYTES:
                break  # keep the response frame well under the frame limit
            bodies.append(v.bytes_view)
            indexes.append(m.index)
            total += v.total_size
        if not bodies:
            raise RequestRejected(ResponseCode.QUERY_NOT_FOUND, "no message matched")
        self._reply(conn, frame, FoundMessagesHeader(indexes=indexes), bodies)

    def query_message(self, conn: BrokerConnection, frame: Frame) -> None:
        h: QueryMessageRequestHeader = decode_request(frame, QueryMessageRequestHeader)
        if not h.key:
            raise RequestRejected(ResponseCode.INVALID_ARGUMENT, "the key to look up is empty")
        self._check_readable(h.topic)
        found = self.store.query_by_key(
            h.topic, h.key, h.begin_timestamp, h.end_timestamp, min(h.max_num, 64)
        )
        if not found:
            raise RequestRejected(
                ResponseCode.QUERY_NOT_FOUND,
                f"no message of topic {h.topic!r} with key {h.key!r} between "
                f"{h.begin_timestamp} and {h.end_timestamp} on broker {self.config.broker_name}",
            )
        self._found(conn, frame, found)

    def view_message_by_id(self, conn: BrokerConnection, frame: Frame) -> None:
        h: ViewMessageRequestHeader = decode_request(frame, ViewMessageRequestHeader)
        try:
            parse_unique_id(h.msg_id)
        except ValueError as exc:
            raise RequestRejected(ResponseCode.INVALID_ARGUMENT, str(exc)) from None
        m = self.store.get_by_id(h.msg_id)
        if m is None:
            raise RequestRejected(
                ResponseCode.QUERY_NOT_FOUND,
                f"no message with id {h.msg_id} on broker {self.config.broker_name}",
            )
        self._check_readable(m.topic)
        self._found(conn, frame, [m])
