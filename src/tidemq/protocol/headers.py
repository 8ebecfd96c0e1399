"""Typed frame headers: the MessagePack map between a frame's prefix and its body.

Every header is a msgspec Struct encoded as a map keyed by field name; fields equal to their
default are left out, and unknown keys are ignored on decode, so a peer may add a field with a
default without breaking older peers (renaming or removing one is a protocol change). Bodies
are not described here: a send request and a pull response carry batches (``batch/``).

Which header goes with which frame (request code -> request header / response header)::

    +-------------------------+----------------------------+----------------------------------+
    | request code            | request header             | response header                  |
    +-------------------------+----------------------------+----------------------------------+
    | SEND_MESSAGE/SEND_BATCH | SendMessageRequestHeader   | SendMessageResponseHeader        |
    |                         |   body: one batch          |   (also on FLUSH_*_TIMEOUT,      |
    |                         |                            |   SLAVE_NOT_AVAILABLE)           |
    | SEND_MULTI_QUEUE        | SendMultiQueueRequestHeader| SendMultiQueueResponseHeader     |
    |                         |   body: batches, any queues|   (one result per batch)         |
    | PULL_MULTI_QUEUE        | PullMultiQueueRequestHeader| PullMultiQueueResponseHeader     |
    |                         |                            |   body: the found batches        |
    | PULL_MESSAGE            | PullMessageRequestHeader   | PullMessageResponseHeader        |
    |                         |                            |   body: whole batches (SUCCESS); |
    |                         |                            |   also on PULL_NOT_FOUND,        |
    |                         |                            |   PULL_RETRY_IMMEDIATELY,        |
    |                         |                            |   PULL_OFFSET_MOVED              |
    | REGISTER_BROKER         | RegisterBrokerRequestHeader| RegisterBrokerResponseHeader     |
    | GET_ROUTEINFO_BY_TOPIC  | GetRouteInfoRequestHeader  | TopicRouteData                   |
    | (any, on an error code) |                            | ErrorResponseHeader              |
    +-------------------------+----------------------------+----------------------------------+

An error response's code is the frame's ``code`` field; its header carries only the message
(:func:`error_response` builds one, ``BrokerError.from_response`` turns one into an exception).
``docs/protocol.md`` lists every request code with its headers, body and responses.
"""

from __future__ import annotations

from hashlib import blake2b
from typing import Annotated

import msgspec

from tidemq.protocol import pop as _pop
from tidemq.protocol.codes import RequestCode, ResponseCode, describe
from tidemq.protocol.errors import LocalProtocolError
from tidemq.protocol.frame import Frame, decode_header, encode_header

__all__ = [
    "Header",
    "SendMessageRequestHeader",
    "SendMessageResponseHeader",
    "SendMultiQueueRequestHeader",
    "MultiQueueSendResult",
    "SendMultiQueueResponseHeader",
    "MultiQueuePull",
    "PullMultiQueueRequestHeader",
    "MultiQueuePullResult",
    "PullMultiQueueResponseHeader",
    "WokenPull",
    "PullSysFlag",
    "pull_sys_flag",
    "PullMessageRequestHeader",
    "PullMessageResponseHeader",
    "ErrorResponseHeader",
    "Perm",
    "TopicConfig",
    "RegisterBrokerRequestHeader",
    "RegisterBrokerResponseHeader",
    "GetRouteInfoRequestHeader",
    "BrokerData",
    "QueueData",
    "TopicRouteData",
    "RoutesChangedRequestHeader",
    "RoutesChangedResponseHeader",
    "EmptyHeader",
    "QueryConsumerOffsetRequestHeader",
    "QueryConsumerOffsetResponseHeader",
    "UpdateConsumerOffsetRequestHeader",
    "QueueCommit",
    "UpdateConsumerOffsetsRequestHeader",
    "QueueOffsetRequestHeader",
    "SearchOffsetRequestHeader",
    "OffsetResponseHeader",
    "DeleteTopicRequestHeader",
    "TopicConfigTable",
    "TopicList",
    "ClusterInfo",
    "GetConsumeStatsRequestHeader",
    "QueueConsumeStats",
    "ConsumeStats",
    "GetTopicStatsRequestHeader",
    "QueueStats",
    "TopicStats",
    "QueryMessageRequestHeader",
    "ViewMessageRequestHeader",
    "FoundMessagesHeader",
    "UnregisterBrokerRequestHeader",
    "BrokerRuntimeInfo",
    "SubscriptionData",
    "ConsumerData",
    "HeartbeatRequestHeader",
    "UnregisterClientRequestHeader",
    "ConsumerGroupRequestHeader",
    "ConsumerListResponseHeader",
    "QueueRef",
    "LockBatchRequestHeader",
    "LockBatchResponseHeader",
    "ConsumerSendMsgBackRequestHeader",
    "SubscriptionGroupConfig",
    "GroupInfoResponseHeader",
    "LastSequenceRequestHeader",
    "LastSequenceResponseHeader",
    "DEDUP_PRODUCER_BIT",
    "dedup_producer_id",
    "is_dedup_producer",
    "EndTransactionRequestHeader",
    "CheckTransactionStateRequestHeader",
    "CancelTimerMessageRequestHeader",
    "BrokerMetadata",
    "OffsetTable",
    "PromoteRequestHeader",
    "PromoteResponseHeader",
    "REQUEST_HEADER_TYPES",
    "RESPONSE_HEADER_TYPES",
    "request_header_type",
    "response_header_type",
    "error_response",
    "encode_header",
    "decode_header",
]

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
U32 = Annotated[int, msgspec.Meta(ge=0, le=0xFFFF_FFFF)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
MASTER_ID = 0  # broker id of a master in BrokerData.broker_addrs


class Header(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """Base of every header (map encoding, defaults omitted, never in a reference cycle)."""


# -- send ---------------------------------------------------------------------------------------


class SendMessageRequestHeader(Header):
    """SEND_MESSAGE / SEND_BATCH. The body is one batch; topic and queue_id repeat the batch's
    so the broker can route and check permissions before parsing it."""

    producer_group: str
    topic: str
    queue_id: U32
    born_timestamp: int = 0  # ms since the epoch, when the producer built the batch
    flag: int = 0
    properties: dict[str, str] = {}
    batch: bool = False  # True: SEND_BATCH semantics, the batch may hold many messages
    reconsume_times: NonNeg = 0


class SendMessageResponseHeader(Header):
    """The batch's place: message ``i`` has queue offset ``queue_offset + i``."""

    msg_id: str  # unique id of message 0 (record.unique_id); message i: base_seq + i
    queue_id: U32
    queue_offset: NonNeg
    count: Positive = 1  # messages stored
    transaction_id: str | None = None
    #: CommitLog offset of what was stored (a half message's, for END_TRANSACTION); -1 = unset
    commit_log_offset: int = -1


class SendMultiQueueRequestHeader(Header):
    """SEND_MULTI_QUEUE (issue 17): the body is ``batches`` whole batches back to back, each
    for any topic and queue of this broker (its own header says which; framing in
    ``protocol/multi_queue.py``). Each batch passes the broker's door as a SEND_BATCH would."""

    producer_group: str
    batches: Positive
    born_timestamp: int = 0


class MultiQueueSendResult(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One batch's outcome, in body order: ``code`` is what a SEND_BATCH of it would have
    been answered (SUCCESS, FLUSH_*_TIMEOUT, SLAVE_NOT_AVAILABLE, or an error code with
    ``message``); a stored batch's message ``i`` has queue offset ``queue_offset + i``."""

    code: int
    queue_offset: int = -1
    count: int = 0
    commit_log_offset: int = -1
    message: str = ""


class SendMultiQueueResponseHeader(Header):
    """The response (SUCCESS) to SEND_MULTI_QUEUE: one result per batch of the request."""

    results: list[MultiQueueSendResult] = []


# -- pull ---------------------------------------------------------------------------------------


class PullSysFlag:
    """Bits of PullMessageRequestHeader.sys_flag (RocketMQ's PullSysFlag)."""

    COMMIT_OFFSET = 0x1  # commit_offset is set: store it as the group's offset
    SUSPEND = 0x2  # long polling: hold the request up to suspend_timeout_millis
    SUBSCRIPTION = 0x4  # subscription is set: use it instead of the group's registered one
    CLASS_FILTER = 0x8  # filter class mode (reserved; tidemq filters by tag and SQL only)


def pull_sys_flag(
    *,
    commit_offset: bool = False,
    suspend: bool = False,
    subscription: bool = False,
    class_filter: bool = False,
) -> int:
    return (
        (PullSysFlag.COMMIT_OFFSET if commit_offset else 0)
        | (PullSysFlag.SUSPEND if suspend else 0)
        | (PullSysFlag.SUBSCRIPTION if subscription else 0)
        | (PullSysFlag.CLASS_FILTER if class_filter else 0)
    )


class PullMessageRequestHeader(Header):
    consumer_group: str
    topic: str
    queue_id: U32
    queue_offset: NonNeg  # first message wanted
    max_msg_nums: Positive = 32
    sys_flag: NonNeg = 0  # PullSysFlag bits
    commit_offset: NonNeg = 0
    suspend_timeout_millis: NonNeg = 15_000
    subscription: str | None = None  # tag expression ("TagA || TagB", "*") or SQL92
    sub_version: int = 0
    expression_type: str = "TAG"  # "TAG" or "SQL92"

    @property
    def has_commit_offset(self) -> bool:
        return bool(self.sys_flag & PullSysFlag.COMMIT_OFFSET)

    @property
    def has_suspend(self) -> bool:
        return bool(self.sys_flag & PullSysFlag.SUSPEND)

    @property
    def has_subscription(self) -> bool:
        return bool(self.sys_flag & PullSysFlag.SUBSCRIPTION)

    @property
    def has_class_filter(self) -> bool:
        return bool(self.sys_flag & PullSysFlag.CLASS_FILTER)


class PullMessageResponseHeader(Header):
    """The body holds whole batches; the first may start before the requested offset, so the
    client skips its messages below ``queue_offset`` (``BatchView.messages(start)``).

    ``members``: when the broker selected messages inside the batches (an SQL92 filter), one
    bitmap per body batch of the messages that are this consumer's (``protocol/members.py``);
    absent = every message of every batch."""

    next_begin_offset: NonNeg
    min_offset: NonNeg
    max_offset: NonNeg
    suggest_which_broker_id: NonNeg = MASTER_ID
    members: list[bytes] = []


class MultiQueuePull(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One queue of a PULL_MULTI_QUEUE: what a PULL_MESSAGE for it would carry."""

    topic: str
    queue_id: U32
    queue_offset: NonNeg
    max_msg_nums: Positive = 32
    sys_flag: NonNeg = 0  # PullSysFlag.COMMIT_OFFSET / SUBSCRIPTION (SUSPEND: the request's)
    commit_offset: NonNeg = 0
    subscription: str | None = None
    expression_type: str = "TAG"
    #: a queue without a start yet: 0 = pull from queue_offset; else the broker starts at the
    #: group's committed offset, or (none) at 1 = the queue's first, 2 = its last, 3 = the
    #: first stored at or after ``timestamp`` (ms) -- saving the consumer a lookup per queue
    resolve: NonNeg = 0
    timestamp: NonNeg = 0
    #: permits of a standing pull (docs/protocol.md 4.0, "kept standing"): the messages the
    #: broker may deliver for this queue, this answer's included, before the client names it
    #: again; while some are left a queue answered with messages stands on at its next offset
    #: (no re-pull per answer). 0: answered once, as a broker without permits does.
    keep: NonNeg = 0


class PullMultiQueueRequestHeader(Header):
    """PULL_MULTI_QUEUE (issue 17): many queues of this broker in one request, held as one
    long poll (``suspend``) until any of them has messages or the timeout passes."""

    consumer_group: str
    pulls: list[MultiQueuePull]
    suspend: bool = False
    suspend_timeout_millis: NonNeg = 15_000
    #: Standing pulls (docs/protocol.md 4.0): a queue answered PULL_NOT_FOUND stays held on
    #: the broker for this connection and group after the answer; when it receives messages
    #: its result travels in ``woken`` of a later answer on this connection, so a request
    #: names only the queues that moved (an empty ``pulls`` is then allowed: it only waits).
    standing: bool = False


class MultiQueuePullResult(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One queue's answer, in request order: ``code`` is what a PULL_MESSAGE would have been
    answered (SUCCESS, PULL_NOT_FOUND, ... or an error with ``message``); a SUCCESS result's
    batches are the next ``body_bytes`` bytes of the response body."""

    code: int
    next_begin_offset: int = 0
    min_offset: int = 0
    max_offset: int = 0
    body_bytes: int = 0
    message: str = ""
    members: list[bytes] = []
    suggest_which_broker_id: int = MASTER_ID
    #: with ``resolve``: the offset the pull started at (-1: not resolved), and whether it is
    #: the group's committed offset
    start_offset: int = -1
    start_committed: bool = False
    #: with ``keep`` permits: the queue still stands past this answer (at
    #: ``next_begin_offset``): its client does not pull it again
    stands: bool = False


class PullMultiQueueResponseHeader(Header):
    """The response (SUCCESS) to PULL_MULTI_QUEUE: one result per requested queue; the body is
    the SUCCESS results' batches, back to back in request order."""

    results: list[MultiQueuePullResult] = []
    #: ``standing`` requests: True when the broker holds the PULL_NOT_FOUND queues standing
    #: (an older broker does not, and the client pulls them again)
    standing: bool = False
    #: standing queues of earlier requests that received messages; their batches follow
    #: those of ``results`` in the body, in this order
    woken: list[WokenPull] = []


class WokenPull(msgspec.Struct, array_like=True, gc=False):
    """A standing queue's answer: which queue, and what its pull found."""

    topic: str
    queue_id: U32
    result: MultiQueuePullResult


# -- errors -------------------------------------------------------------------------------------


class ErrorResponseHeader(Header):
    """Header of any error response; the response code is the frame's ``code``.

    ``retry_after_ms``: with SYSTEM_BUSY, how long the server asks the client to wait before
    sending the request again (0 = no hint; omitted from the wire when 0)."""

    message: str = ""
    retry_after_ms: U32 = 0


# -- name server --------------------------------------------------------------------------------


class Perm:
    """Permission bits of a topic or broker (RocketMQ's PermName)."""

    PRIORITY = 0x8
    READ = 0x4
    WRITE = 0x2
    INHERIT = 0x1
    READ_WRITE = READ | WRITE


class TopicConfig(Header):
    """A topic on one broker. ``shrinking_to``: set by the broker only (a value sent is
    ignored) while read queues above it are kept until drained (broker/queue_shrink.py); 0 =
    not shrinking."""

    topic_name: str
    read_queue_nums: U32 = 8
    write_queue_nums: U32 = 8
    perm: int = Perm.READ_WRITE
    topic_sys_flag: int = 0
    order: bool = False
    shrinking_to: U32 = 0


class RegisterBrokerRequestHeader(Header):
    """REGISTER_BROKER, sent to every name server every 30 s; topics are all the broker has."""

    cluster_name: str
    broker_name: str
    broker_id: NonNeg  # 0 = master
    broker_addr: str  # "host:port" clients connect to
    ha_server_addr: str = ""  # a master's replication address ("host:port"); slaves connect
    heartbeat_timeout_millis: Positive = 120_000
    data_version: NonNeg = 0  # bumps when the topic set changes
    topics: dict[str, TopicConfig] = {}
    #: the master's epoch (replication, docs/cluster.md); a name server keeps the master of
    #: the highest epoch when two addresses claim id 0 of one broker name
    epoch: NonNeg = 0
    #: ``topics`` left out: the topic set is the one of ``data_version``, which this name
    #: server was sent before (a heartbeat; its size does not grow with the topics)
    topics_omitted: bool = False


class RegisterBrokerResponseHeader(Header):
    """The master of the group, for a slave: its replication and client addresses;
    ``need_topics``: a registration without topics came for a data version this name server
    does not hold -- register again with them."""

    ha_server_addr: str = ""
    master_addr: str = ""
    need_topics: bool = False


class GetRouteInfoRequestHeader(Header):
    topic: str


class BrokerData(Header):
    cluster: str
    broker_name: str
    broker_addrs: dict[int, str] = {}  # broker id -> "host:port"; MASTER_ID is the master


class QueueData(Header):
    broker_name: str
    read_queue_nums: U32
    write_queue_nums: U32
    perm: int = Perm.READ_WRITE
    topic_sys_flag: int = 0


class TopicRouteData(Header):
    """Response header of GET_ROUTEINFO_BY_TOPIC."""

    queue_datas: list[QueueData] = []
    broker_datas: list[BrokerData] = []
    order_topic_conf: str | None = None


class RoutesChangedRequestHeader(Header):
    """GET_ROUTES_CHANGED: what changed in the name server's routes after version ``since``
    of its history ``instance`` (both from the previous answer; "" the first time)."""

    instance: str = ""
    since: NonNeg = 0


class RoutesChangedResponseHeader(Header):
    """Response header of GET_ROUTES_CHANGED. ``full``: the changes since ``since`` are not
    known (another instance -- the name server restarted or is another one -- or older than
    the history it keeps, or too many): refresh every route. Otherwise ``topics`` whose queue
    data changed and ``brokers`` (groups) whose addresses changed: every topic they hold."""

    instance: str
    version: NonNeg
    full: bool = False
    topics: list[str] = []
    brokers: list[str] = []


class EmptyHeader(Header):
    """The header of frames that carry nothing (H = 0 on the wire decodes to it)."""


# -- consumer offsets (client -> broker) --------------------------------------------------------


class QueryConsumerOffsetRequestHeader(Header):
    """QUERY_CONSUMER_OFFSET; the broker answers QUERY_NOT_FOUND when the group has none."""

    consumer_group: str
    topic: str
    queue_id: U32


class QueryConsumerOffsetResponseHeader(Header):
    offset: NonNeg


class UpdateConsumerOffsetRequestHeader(Header):
    """UPDATE_CONSUMER_OFFSET (also sent one-way); ``commit_offset`` is the next offset to
    consume, as RocketMQ stores it."""

    consumer_group: str
    topic: str
    queue_id: U32
    commit_offset: NonNeg


class QueueCommit(msgspec.Struct, array_like=True, gc=False):
    """One queue's offset in an UPDATE_CONSUMER_OFFSETS."""

    topic: str
    queue_id: U32
    commit_offset: NonNeg


class UpdateConsumerOffsetsRequestHeader(Header):
    """UPDATE_CONSUMER_OFFSETS (issue 17): what an UPDATE_CONSUMER_OFFSET per queue would
    carry, for many queues of one broker in one request (a consumer persisting the offsets
    of 10,000 queues every 5 s would otherwise send 10,000 requests at once). All or nothing:
    the first queue the broker refuses refuses the request."""

    consumer_group: str
    offsets: list[QueueCommit] = []


# -- queue offsets (client -> broker) -----------------------------------------------------------


class QueueOffsetRequestHeader(Header):
    """GET_MIN_OFFSET / GET_MAX_OFFSET of one queue (max = the offset the next message gets)."""

    topic: str
    queue_id: U32


class SearchOffsetRequestHeader(Header):
    """SEARCH_OFFSET_BY_TIMESTAMP: the first offset whose store time is >= ``timestamp`` (ms)."""

    topic: str
    queue_id: U32
    timestamp: int


class OffsetResponseHeader(Header):
    """Response of GET_MIN_OFFSET, GET_MAX_OFFSET and SEARCH_OFFSET_BY_TIMESTAMP."""

    offset: NonNeg


# -- admin --------------------------------------------------------------------------------------


class DeleteTopicRequestHeader(Header):
    topic: str


class TopicConfigTable(Header):
    """Response header of GET_ALL_TOPIC_CONFIG: every topic the broker has."""

    topics: dict[str, TopicConfig] = {}
    broker_name: str = ""


class TopicList(Header):
    """Response header of GET_ALL_TOPIC_LIST_FROM_NAMESERVER."""

    topics: list[str] = []


class ClusterInfo(Header):
    """Response header of GET_BROKER_CLUSTER_INFO."""

    broker_addr_table: dict[str, BrokerData] = {}  # broker name -> addresses
    cluster_addr_table: dict[str, list[str]] = {}  # cluster name -> broker names


class GetConsumeStatsRequestHeader(Header):
    """GET_CONSUME_STATS; an empty ``topic`` means every topic the group has offsets for."""

    consumer_group: str
    topic: str = ""


class QueueConsumeStats(Header):
    topic: str
    queue_id: U32
    broker_offset: NonNeg  # max offset of the queue
    consumer_offset: NonNeg  # committed offset of the group (0 when none)
    lag: NonNeg = 0  # broker_offset - consumer_offset, never negative
    last_timestamp: int = 0  # store time of the last consumed message, ms (0 if unknown)


class ConsumeStats(Header):
    """Response header of GET_CONSUME_STATS (RocketMQ's ConsumeStats)."""

    broker_name: str = ""
    queues: list[QueueConsumeStats] = []
    consume_tps: float = 0.0
    total_lag: NonNeg = 0
    pulled_msgs: NonNeg = 0  # messages pulled by the group since the broker started
    pulled_bytes: NonNeg = 0


class GetTopicStatsRequestHeader(Header):
    topic: str


class QueueStats(Header):
    queue_id: U32
    min_offset: NonNeg
    max_offset: NonNeg
    last_update_timestamp: int = 0


class TopicStats(Header):
    """Response header of GET_TOPIC_STATS."""

    broker_name: str = ""
    queues: list[QueueStats] = []
    put_tps: float = 0.0  # messages per second put to the topic (last minute)
    put_msgs: NonNeg = 0  # messages put since the broker started
    put_bytes: NonNeg = 0


class QueryMessageRequestHeader(Header):
    """QUERY_MESSAGE: messages of ``topic`` carrying ``key``, stored within [begin, end] (ms)."""

    topic: str
    key: str
    max_num: Positive = 32
    begin_timestamp: int = 0
    end_timestamp: int = 2**62


class ViewMessageRequestHeader(Header):
    """VIEW_MESSAGE_BY_ID: the message with this unique id (32 hex digits)."""

    msg_id: str


class FoundMessagesHeader(Header):
    """Response header of QUERY_MESSAGE and VIEW_MESSAGE_BY_ID (QUERY_NOT_FOUND when none).

    The body is whole stored batches concatenated, one per found message (a batch may repeat);
    ``indexes[i]`` is the index of the found message inside the i-th batch.
    """

    indexes: list[NonNeg] = []


class UnregisterBrokerRequestHeader(Header):
    """UNREGISTER_BROKER: a broker leaving the cluster (sent on a clean shutdown)."""

    cluster_name: str
    broker_name: str
    broker_id: NonNeg
    broker_addr: str


class BrokerRuntimeInfo(Header):
    """Response header of GET_BROKER_RUNTIME_INFO (RocketMQ's KVTable): name -> value, e.g.
    ``put_tps``, ``get_tps``, ``put_total_msgs``, ``commitlog_max_offset``, ``held_pulls``."""

    table: dict[str, str | int | float | bool] = {}


# -- consumer groups (ref BR5-BR7, CO4; docs/consumer-groups.md) --------------------------------


class SubscriptionData(Header):
    """One subscription of a consumer group: a topic and its tag (or SQL92) expression."""

    topic: str
    expression: str = "*"
    expression_type: str = "TAG"
    sub_version: int = 0


class ConsumerData(Header):
    """What a push consumer tells the broker about its group in every heartbeat."""

    group: str
    consume_type: str = "PUSH"  # "PUSH", "PULL" (lite pull) or "POP" (SimpleConsumer)
    message_model: str = "CLUSTERING"  # or "BROADCASTING"
    consume_from: str = "last"
    subscriptions: list[SubscriptionData] = []
    #: consume_type "POP" only: the Pulsar subscription type of the consumer (Exclusive,
    #: Failover, Shared, Key_Shared; docs/consumer-groups.md), "" for a SimpleConsumer
    subscription_type: str = ""


class HeartbeatRequestHeader(Header):
    """HEART_BEAT (every 30 s, and at once after a subscription changes)."""

    client_id: str
    consumers: list[ConsumerData] = []
    producer_groups: list[str] = []


class UnregisterClientRequestHeader(Header):
    """UNREGISTER_CLIENT: a consumer leaving ``consumer_group`` cleanly."""

    client_id: str
    consumer_group: str = ""
    producer_group: str = ""


class ConsumerGroupRequestHeader(Header):
    """GET_CONSUMER_LIST_BY_GROUP; also the header of NOTIFY_CONSUMER_IDS_CHANGED (broker ->
    every member of the group, one-way, when the membership changed)."""

    consumer_group: str


class ConsumerListResponseHeader(Header):
    consumer_ids: list[str] = []


class QueueRef(Header):
    """A message queue on the wire (MessageQueue is the client's value type)."""

    topic: str
    broker_name: str
    queue_id: U32


class LockBatchRequestHeader(Header):
    """LOCK_BATCH_MQ / UNLOCK_BATCH_MQ of ordered consumption (BR6)."""

    consumer_group: str
    client_id: str
    queues: list[QueueRef] = []


class LockBatchResponseHeader(Header):
    """The queues ``client_id`` holds now (LOCK_BATCH_MQ)."""

    locked: list[QueueRef] = []


class ConsumerSendMsgBackRequestHeader(Header):
    """CONSUMER_SEND_MSG_BACK: the message at (``commit_log_offset``, ``index``) failed.

    ``delay_level`` 0 lets the broker choose (3 + reconsume times); -1 sends it straight to the
    dead-letter queue (an orderly consumer out of local retries)."""

    consumer_group: str
    commit_log_offset: NonNeg  # physical offset of the batch holding the message
    index: NonNeg = 0  # the message's index inside that batch
    delay_level: int = 0
    origin_msg_id: str = ""
    origin_topic: str = ""
    max_reconsume_times: int = -1  # -1: the group's configured maximum (16)


class SubscriptionGroupConfig(Header):
    """A consumer group's settings (RocketMQ's SubscriptionGroupConfig; BR11)."""

    group_name: str
    consume_enable: bool = True
    consume_broadcast_enable: bool = True
    retry_queue_nums: U32 = 1
    retry_max_times: NonNeg = 16
    which_broker_when_consume_slowly: NonNeg = 1


class GroupInfoResponseHeader(Header):
    """Response header of GET_CONSUMER_CONNECTION_LIST: members, their subscriptions, config."""

    consumer_ids: list[str] = []
    message_model: str = ""
    consume_from: str = ""
    subscriptions: list[SubscriptionData] = []
    config: SubscriptionGroupConfig | None = None
    consume_type: str = ""  # of the last heartbeat: PUSH, PULL or POP


class LastSequenceRequestHeader(Header):
    """GET_LAST_SEQUENCE: the highest sequence a broker persisted for a deduplicated producer
    (Pulsar's getLastSequenceId; docs/producer-path.md)."""

    producer_name: str


class LastSequenceResponseHeader(Header):
    producer_id: int  # dedup_producer_id(producer_name)
    last_sequence_id: int = -1  # -1: the broker has nothing of this producer


#: Bit 63 of a batch's producer_id marks a named, deduplicated producer (BR12).
DEDUP_PRODUCER_BIT = 1 << 63


def dedup_producer_id(producer_name: str) -> int:
    """The batch producer_id of the producer named ``producer_name``: bit 63 set, the low 63
    bits from BLAKE2b of the name -- the same on every machine and across restarts, so the
    broker recognises a restarted producer without parsing properties."""
    if not producer_name:
        raise ValueError("a producer name is a non-empty string")
    digest = blake2b(producer_name.encode(), digest_size=8).digest()
    return DEDUP_PRODUCER_BIT | (int.from_bytes(digest, "little") & (DEDUP_PRODUCER_BIT - 1))


def is_dedup_producer(producer_id: int) -> bool:
    """True for ids made by :func:`dedup_producer_id` (random instance ids keep bit 63 clear)."""
    return producer_id >= DEDUP_PRODUCER_BIT


# -- replication (ref BR15; docs/cluster.md) --------------------------------------------------


class BrokerMetadata(Header):
    """Response header of GET_BROKER_METADATA: the state a slave copies from its master (every
    ``ha_sync_metadata_interval_ms`` and when ``meta_version`` changes). The delay and
    transaction progress are the master's files, byte for byte."""

    topics: dict[str, TopicConfig] = {}
    topics_version: NonNeg = 0
    subscription_groups: dict[str, SubscriptionGroupConfig] = {}
    offset_table: dict[str, dict[int, int]] = {}  # "topic@group" -> queue id -> offset
    delay_offsets: bytes = b""
    transaction_progress: bytes = b""
    #: every timed message due before this (ms since the epoch) is delivered or cancelled
    timer_done_before: int = 0
    meta_version: NonNeg = 0


class OffsetTable(Header):
    """MERGE_CONSUMER_OFFSETS: offsets a slave took while its master was away; the master
    keeps, per queue, the larger of its own and these."""

    offset_table: dict[str, dict[int, int]] = {}


class PromoteRequestHeader(Header):
    """PROMOTE_TO_MASTER, sent by an operator (``tidemq cluster promote``) to a slave."""

    role: str = ""  # SYNC_MASTER / ASYNC_MASTER; empty: the role of the master it followed
    force: bool = False  # promote even though the slave still hears from its master


class PromoteResponseHeader(Header):
    broker_name: str
    epoch: NonNeg
    start_offset: NonNeg  # the new epoch starts here: the promoted slave's CommitLog end
    role: str
    #: bytes the old master had written (as last heard) that this slave never received
    unreplicated_bytes: NonNeg = 0
    previous_master: str = ""


# -- which header for which frame ---------------------------------------------------------------

# -- delayed and transactional messages (ref BR8, BR9; docs/delayed-and-transactional.md) ------


class EndTransactionRequestHeader(Header):
    """END_TRANSACTION (producer -> broker, usually one-way): the outcome of the local
    transaction of the half message at (``commit_log_offset``, ``tran_state_table_offset``).

    ``commit_or_rollback`` is ``record.TxnType``: COMMIT 2, ROLLBACK 3, NOT_TYPE 0 = unknown
    (the broker's check asks again later)."""

    producer_group: str
    tran_state_table_offset: NonNeg  # the half message's offset in RMQ_SYS_TRANS_HALF_TOPIC
    commit_log_offset: NonNeg  # the half message's CommitLog offset
    commit_or_rollback: int = 0
    msg_id: str = ""  # the transaction's message id (message 0 of the half batch)
    transaction_id: str = ""
    from_transaction_check: bool = False


class CheckTransactionStateRequestHeader(Header):
    """CHECK_TRANSACTION_STATE (broker -> producer, one-way): what is the state of this
    transaction? The body is the half batch as the producer sent it; the answer is an
    END_TRANSACTION carrying these offsets."""

    producer_group: str
    tran_state_table_offset: NonNeg
    commit_log_offset: NonNeg
    msg_id: str
    transaction_id: str = ""


class CancelTimerMessageRequestHeader(Header):
    """CANCEL_TIMER_MESSAGE: cancel the pending deliver_at message with this id
    (QUERY_NOT_FOUND when it is not pending)."""

    msg_id: str


REQUEST_HEADER_TYPES: dict[int, type[msgspec.Struct]] = {
    RequestCode.END_TRANSACTION: EndTransactionRequestHeader,
    RequestCode.CHECK_TRANSACTION_STATE: CheckTransactionStateRequestHeader,
    RequestCode.CANCEL_TIMER_MESSAGE: CancelTimerMessageRequestHeader,
    RequestCode.SEND_MESSAGE: SendMessageRequestHeader,
    RequestCode.SEND_BATCH: SendMessageRequestHeader,
    RequestCode.SEND_MULTI_QUEUE: SendMultiQueueRequestHeader,
    RequestCode.PULL_MULTI_QUEUE: PullMultiQueueRequestHeader,
    RequestCode.PULL_MESSAGE: PullMessageRequestHeader,
    RequestCode.REGISTER_BROKER: RegisterBrokerRequestHeader,
    RequestCode.GET_ROUTEINFO_BY_TOPIC: GetRouteInfoRequestHeader,
    RequestCode.QUERY_CONSUMER_OFFSET: QueryConsumerOffsetRequestHeader,
    RequestCode.UPDATE_CONSUMER_OFFSET: UpdateConsumerOffsetRequestHeader,
    RequestCode.UPDATE_CONSUMER_OFFSETS: UpdateConsumerOffsetsRequestHeader,
    RequestCode.GET_MIN_OFFSET: QueueOffsetRequestHeader,
    RequestCode.GET_MAX_OFFSET: QueueOffsetRequestHeader,
    RequestCode.SEARCH_OFFSET_BY_TIMESTAMP: SearchOffsetRequestHeader,
    RequestCode.UPDATE_AND_CREATE_TOPIC: TopicConfig,
    RequestCode.DELETE_TOPIC: DeleteTopicRequestHeader,
    RequestCode.GET_CONSUME_STATS: GetConsumeStatsRequestHeader,
    RequestCode.GET_TOPIC_STATS: GetTopicStatsRequestHeader,
    RequestCode.QUERY_MESSAGE: QueryMessageRequestHeader,
    RequestCode.VIEW_MESSAGE_BY_ID: ViewMessageRequestHeader,
    RequestCode.GET_ALL_TOPIC_CONFIG: EmptyHeader,
    RequestCode.GET_ALL_TOPIC_LIST_FROM_NAMESERVER: EmptyHeader,
    RequestCode.GET_BROKER_CLUSTER_INFO: EmptyHeader,
    RequestCode.GET_ROUTES_CHANGED: RoutesChangedRequestHeader,
    RequestCode.UNREGISTER_BROKER: UnregisterBrokerRequestHeader,
    RequestCode.GET_BROKER_RUNTIME_INFO: EmptyHeader,
    RequestCode.HEART_BEAT: HeartbeatRequestHeader,
    RequestCode.UNREGISTER_CLIENT: UnregisterClientRequestHeader,
    RequestCode.GET_CONSUMER_LIST_BY_GROUP: ConsumerGroupRequestHeader,
    RequestCode.NOTIFY_CONSUMER_IDS_CHANGED: ConsumerGroupRequestHeader,
    RequestCode.LOCK_BATCH_MQ: LockBatchRequestHeader,
    RequestCode.UNLOCK_BATCH_MQ: LockBatchRequestHeader,
    RequestCode.CONSUMER_SEND_MSG_BACK: ConsumerSendMsgBackRequestHeader,
    RequestCode.GET_CONSUMER_CONNECTION_LIST: ConsumerGroupRequestHeader,
    RequestCode.UPDATE_AND_CREATE_SUBSCRIPTION_GROUP: SubscriptionGroupConfig,
    RequestCode.GET_LAST_SEQUENCE: LastSequenceRequestHeader,
    RequestCode.GET_BROKER_METADATA: EmptyHeader,
    RequestCode.MERGE_CONSUMER_OFFSETS: OffsetTable,
    RequestCode.PROMOTE_TO_MASTER: PromoteRequestHeader,
}

RESPONSE_HEADER_TYPES: dict[int, type[msgspec.Struct]] = {
    RequestCode.END_TRANSACTION: EmptyHeader,
    RequestCode.CANCEL_TIMER_MESSAGE: EmptyHeader,
    RequestCode.SEND_MESSAGE: SendMessageResponseHeader,
    RequestCode.SEND_BATCH: SendMessageResponseHeader,
    RequestCode.SEND_MULTI_QUEUE: SendMultiQueueResponseHeader,
    RequestCode.PULL_MULTI_QUEUE: PullMultiQueueResponseHeader,
    RequestCode.PULL_MESSAGE: PullMessageResponseHeader,
    RequestCode.REGISTER_BROKER: RegisterBrokerResponseHeader,
    RequestCode.GET_ROUTEINFO_BY_TOPIC: TopicRouteData,
    RequestCode.QUERY_CONSUMER_OFFSET: QueryConsumerOffsetResponseHeader,
    RequestCode.GET_MIN_OFFSET: OffsetResponseHeader,
    RequestCode.GET_MAX_OFFSET: OffsetResponseHeader,
    RequestCode.SEARCH_OFFSET_BY_TIMESTAMP: OffsetResponseHeader,
    RequestCode.GET_ALL_TOPIC_CONFIG: TopicConfigTable,
    RequestCode.GET_ALL_TOPIC_LIST_FROM_NAMESERVER: TopicList,
    RequestCode.GET_BROKER_CLUSTER_INFO: ClusterInfo,
    RequestCode.GET_ROUTES_CHANGED: RoutesChangedResponseHeader,
    RequestCode.GET_CONSUME_STATS: ConsumeStats,
    RequestCode.GET_TOPIC_STATS: TopicStats,
    RequestCode.QUERY_MESSAGE: FoundMessagesHeader,
    RequestCode.VIEW_MESSAGE_BY_ID: FoundMessagesHeader,
    RequestCode.UPDATE_CONSUMER_OFFSET: EmptyHeader,
    RequestCode.UPDATE_CONSUMER_OFFSETS: EmptyHeader,
    RequestCode.UPDATE_AND_CREATE_TOPIC: EmptyHeader,
    RequestCode.DELETE_TOPIC: EmptyHeader,
    RequestCode.UNREGISTER_BROKER: EmptyHeader,
    RequestCode.GET_BROKER_RUNTIME_INFO: BrokerRuntimeInfo,
    RequestCode.HEART_BEAT: EmptyHeader,
    RequestCode.UNREGISTER_CLIENT: EmptyHeader,
    RequestCode.GET_CONSUMER_LIST_BY_GROUP: ConsumerListResponseHeader,
    RequestCode.LOCK_BATCH_MQ: LockBatchResponseHeader,
    RequestCode.UNLOCK_BATCH_MQ: EmptyHeader,
    RequestCode.CONSUMER_SEND_MSG_BACK: EmptyHeader,
    RequestCode.GET_CONSUMER_CONNECTION_LIST: GroupInfoResponseHeader,
    RequestCode.UPDATE_AND_CREATE_SUBSCRIPTION_GROUP: EmptyHeader,
    RequestCode.GET_LAST_SEQUENCE: LastSequenceResponseHeader,
    RequestCode.GET_BROKER_METADATA: BrokerMetadata,
    RequestCode.MERGE_CONSUMER_OFFSETS: EmptyHeader,
    RequestCode.PROMOTE_TO_MASTER: PromoteResponseHeader,
}

_SEND_OUTCOMES = frozenset(
    {
        ResponseCode.SUCCESS,
        ResponseCode.FLUSH_DISK_TIMEOUT,
        ResponseCode.FLUSH_SLAVE_TIMEOUT,
        ResponseCode.SLAVE_NOT_AVAILABLE,
    }
)
_PULL_OUTCOMES = frozenset(
    {
        ResponseCode.SUCCESS,
        ResponseCode.PULL_NOT_FOUND,
        ResponseCode.PULL_RETRY_IMMEDIATELY,
        ResponseCode.PULL_OFFSET_MOVED,
    }
)
_OUTCOMES: dict[int, frozenset[int]] = {
    RequestCode.SEND_MESSAGE: _SEND_OUTCOMES,
    RequestCode.SEND_BATCH: _SEND_OUTCOMES,
    RequestCode.PULL_MESSAGE: _PULL_OUTCOMES,
}
_SUCCESS_ONLY = frozenset({ResponseCode.SUCCESS})


def request_header_type(code: int) -> type[msgspec.Struct] | None:
    """Header type of a request; None (decode as a dict) for codes without one here."""
    return REQUEST_HEADER_TYPES.get(code)


def response_header_type(request_code: int, response_code: int) -> type[msgspec.Struct] | None:
    """Header type of the response to a ``request_code`` request that came back with
    ``response_code``: the request's response header for its non-error outcomes, else
    ErrorResponseHeader. None (decode as a dict) for success of requests without one here."""
    if response_code in _OUTCOMES.get(request_code, _SUCCESS_ONLY):
        return RESPONSE_HEADER_TYPES.get(request_code)
    return ErrorResponseHeader


def error_response(request: Frame, code: int, message: str | None = None) -> Frame:
    """The error response to ``request``; an empty ``message`` takes :func:`describe`'s text."""
    if code == ResponseCode.SUCCESS:
        raise LocalProtocolError("an error response needs a non-zero response code")
    return request.response(code, ErrorResponseHeader(message or describe(code)))



# -- server-side dispatch (POP): the headers live in protocol/pop.py, registered here ------------
REQUEST_HEADER_TYPES[RequestCode.POP_MESSAGE] = _pop.PopMessageRequestHeader
REQUEST_HEADER_TYPES[RequestCode.ACK_MESSAGE] = _pop.AckMessageRequestHeader
REQUEST_HEADER_TYPES[RequestCode.CHANGE_INVISIBLE_TIME] = _pop.ChangeInvisibleRequestHeader
RESPONSE_HEADER_TYPES[RequestCode.POP_MESSAGE] = _pop.PopMessageResponseHeader
RESPONSE_HEADER_TYPES[RequestCode.ACK_MESSAGE] = _pop.AckMessageResponseHeader
RESPONSE_HEADER_TYPES[RequestCode.CHANGE_INVISIBLE_TIME] = _pop.ChangeInvisibleResponseHeader
REQUEST_HEADER_TYPES[RequestCode.NOTIFICATION] = _pop.NotificationRequestHeader
RESPONSE_HEADER_TYPES[RequestCode.NOTIFICATION] = _pop.NotificationResponseHeader
_OUTCOMES[RequestCode.POP_MESSAGE] = frozenset({ResponseCode.SUCCESS, ResponseCode.PULL_NOT_FOUND})
REQUEST_HEADER_TYPES[RequestCode.SEEK_SUBSCRIPTION] = _pop.SeekRequestHeader
RESPONSE_HEADER_TYPES[RequestCode.SEEK_SUBSCRIPTION] = _pop.SeekResponseHeader
