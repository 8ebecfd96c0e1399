"""The numbers in a frame's ``code`` field (u16): request codes and response codes.

A request frame carries a :class:`RequestCode`; a response frame (flag RESPONSE) carries a
:class:`ResponseCode`. The two spaces overlap numerically and are told apart by the flag.
Values are RocketMQ's (``RequestCode.java`` / ``ResponseCode.java``) so that a packet capture reads
the same; tidemq's own codes live in a range RocketMQ does not use::

    +---------------+---------------+------------------------------------------------------+
    | space         | values        | who                                                  |
    +---------------+---------------+------------------------------------------------------+
    | RequestCode   |    10 ..   99 | client -> broker: send, pull, offsets, heartbeat ... |
    |               |   100 ..  199 | broker/client -> name server: register, route info   |
    |               |   200 ..  399 | admin and batch sends (RocketMQ's numbers)           |
    | ResponseCode  |     0 ..    4 | generic: SUCCESS, SYSTEM_ERROR, SYSTEM_BUSY, ...     |
    |               |    10 ..  299 | RocketMQ's broker codes (flush, topic, pull, ...)    |
    |               |  1000 .. 1099 | tidemq additions (DISK_FULL, INVALID_ARGUMENT, ...)  |
    +---------------+---------------+------------------------------------------------------+

Some non-zero response codes are outcomes, not errors: a pull answers PULL_NOT_FOUND when there
is nothing new (:func:`pull_status`), and a send answers FLUSH_DISK_TIMEOUT when the batch is
stored but not yet on disk. :func:`describe` gives every response code a sentence saying what
happened and what to do; :func:`is_retryable` says whether the same request may succeed later.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = [
    "RequestCode",
    "ResponseCode",
    "PullStatus",
    "describe",
    "is_retryable",
    "pull_status",
]


class RequestCode(IntEnum):
    # -- client -> broker ------------------------------------------------------------------
    SEND_MESSAGE = 10
    PULL_MESSAGE = 11
    QUERY_MESSAGE = 12  # by key, through the key index
    QUERY_CONSUMER_OFFSET = 14
    UPDATE_CONSUMER_OFFSET = 15
    UPDATE_AND_CREATE_TOPIC = 17
    GET_ALL_TOPIC_CONFIG = 21
    GET_BROKER_RUNTIME_INFO = 28
    SEARCH_OFFSET_BY_TIMESTAMP = 29
    GET_MAX_OFFSET = 30
    GET_MIN_OFFSET = 31
    VIEW_MESSAGE_BY_ID = 33
    HEART_BEAT = 34
    UNREGISTER_CLIENT = 35
    CONSUMER_SEND_MSG_BACK = 36
    END_TRANSACTION = 37
    GET_CONSUMER_LIST_BY_GROUP = 38
    CHECK_TRANSACTION_STATE = 39  # broker -> producer
    NOTIFY_CONSUMER_IDS_CHANGED = 40  # broker -> consumer
    LOCK_BATCH_MQ = 41
    UNLOCK_BATCH_MQ = 42
    # -- to the name server ----------------------------------------------------------------
    REGISTER_BROKER = 103
    UNREGISTER_BROKER = 104
    GET_ROUTEINFO_BY_TOPIC = 105
    GET_BROKER_CLUSTER_INFO = 106
    GET_ROUTES_CHANGED = 107  # tidemq: topics and broker groups whose routes changed since
    # -- admin -----------------------------------------------------------------------------
    GET_TOPIC_STATS = 202  # RocketMQ GET_TOPIC_STATS_INFO
    GET_ALL_TOPIC_LIST_FROM_NAMESERVER = 206
    GET_CONSUME_STATS = 208
    UPDATE_AND_CREATE_SUBSCRIPTION_GROUP = 200
    GET_CONSUMER_CONNECTION_LIST = 203
    DELETE_TOPIC = 215  # RocketMQ DELETE_TOPIC_IN_BROKER
    SEND_BATCH = 320  # RocketMQ SEND_BATCH_MESSAGE
    SEND_MULTI_QUEUE = 321  # tidemq: batches for many queues of one broker (multi_queue.py)
    PULL_MULTI_QUEUE = 322  # tidemq: one held pull serving many queues of one broker
    UPDATE_CONSUMER_OFFSETS = 323  # tidemq: a group's offsets of many queues of one broker
    GET_LAST_SEQUENCE = 330  # tidemq: highest persisted sequence of a producer name (BR12)
    CANCEL_TIMER_MESSAGE = 340  # tidemq: cancel a deliver_at message by its id (BR8)
    # -- replication (BR15): slave <-> master and operator -> slave ------------------------
    GET_BROKER_METADATA = 350  # tidemq: topics, groups, offsets, delay/txn progress (slave sync)
    MERGE_CONSUMER_OFFSETS = 351  # tidemq: offsets committed on a slave flow back (max wins)
    PROMOTE_TO_MASTER = 352  # tidemq: make this slave the master of its group (new epoch)
    # -- server-side dispatch (POP; docs/pop-dispatch.md). RocketMQ 5 numbers them 200050..,
    # which do not fit the u16 code field: tidemq's own range.
    POP_MESSAGE = 360
    ACK_MESSAGE = 361  # many receipt handles per frame
    CHANGE_INVISIBLE_TIME = 362
    SEEK_SUBSCRIPTION = 366  # tidemq: move a POP group's queues to an offset or a time
    NOTIFICATION = 363  # held until something is poppable for the group/topic


class ResponseCode(IntEnum):
    SUCCESS = 0
    SYSTEM_ERROR = 1
    SYSTEM_BUSY = 2
    REQUEST_CODE_NOT_SUPPORTED = 3
    TRANSACTION_FAILED = 4
    FLUSH_DISK_TIMEOUT = 10
    SLAVE_NOT_AVAILABLE = 11
    FLUSH_SLAVE_TIMEOUT = 12
    MESSAGE_ILLEGAL = 13
    SERVICE_NOT_AVAILABLE = 14
    VERSION_NOT_SUPPORTED = 15
    NO_PERMISSION = 16
    TOPIC_NOT_EXIST = 17
    TOPIC_EXIST_ALREADY = 18
    PULL_NOT_FOUND = 19
    PULL_RETRY_IMMEDIATELY = 20
    PULL_OFFSET_MOVED = 21
    QUERY_NOT_FOUND = 22
    SUBSCRIPTION_PARSE_FAILED = 23
    SUBSCRIPTION_NOT_EXIST = 24
    SUBSCRIPTION_NOT_LATEST = 25
    SUBSCRIPTION_GROUP_NOT_EXIST = 26
    FLUSH_DISK_FAILED = 29
    CONSUMER_NOT_ONLINE = 206
    NO_MESSAGE = 208  # RocketMQ 5: an ack / invisible-time change of a stale receipt handle
    # -- tidemq additions ------------------------------------------------------------------
    DISK_FULL = 1000
    DUPLICATE = 1001  # the batch's producer sequence was already stored (deduplication)
    RETRY_LATER = 1002
    MESSAGE_TOO_LARGE = 1003
    INVALID_ARGUMENT = 1004  # a request field is missing, malformed or out of range
    CONSUME_MODE_CONFLICT = 1010  # a POP group pulled, or a pull group popped
    CONSUMER_BUSY = 1013  # an exclusive subscription has its consumer already


class PullStatus(IntEnum):
    """What a pull found, as RocketMQ's PullStatus (derived from the response code)."""

    FOUND = 0
    NO_NEW_MSG = 1
    NO_MATCHED_MSG = 2
    OFFSET_ILLEGAL = 3


_PULL_STATUS: dict[int, PullStatus] = {
    ResponseCode.SUCCESS: PullStatus.FOUND,
    ResponseCode.PULL_NOT_FOUND: PullStatus.NO_NEW_MSG,
    ResponseCode.PULL_RETRY_IMMEDIATELY: PullStatus.NO_MATCHED_MSG,
    ResponseCode.PULL_OFFSET_MOVED: PullStatus.OFFSET_ILLEGAL,
}


def pull_status(code: int) -> PullStatus | None:
    """The PullStatus of a PULL_MESSAGE response code; None means an error response."""
    return _PULL_STATUS.get(code)


_R = ResponseCode
_DESCRIPTIONS: dict[int, str] = {
    _R.SUCCESS: "success",
    _R.SYSTEM_ERROR: (
        "the broker failed while handling the request; the broker log has the cause. "
        "Retrying may work, report it if it persists"
    ),
    _R.SYSTEM_BUSY: (
        "the broker is overloaded (its request queue or page cache is busy); back off and "
        "retry, or send to another broker"
    ),
    _R.REQUEST_CODE_NOT_SUPPORTED: (
        "the peer does not know this request code; it runs an older or different version. "
        "Upgrade the peer or do not use this feature"
    ),
    _R.TRANSACTION_FAILED: "the transaction could not be committed or rolled back; retry",
    _R.FLUSH_DISK_TIMEOUT: (
        "the message is stored but was not flushed to disk in time (SYNC_FLUSH); it is lost "
        "only if the broker machine crashes now. Check the broker's disk latency"
    ),
    _R.SLAVE_NOT_AVAILABLE: (
        "the message is stored on the master but no slave is available to replicate it "
        "(SYNC_MASTER); bring the slave back"
    ),
    _R.FLUSH_SLAVE_TIMEOUT: (
        "the message is stored on the master but the slave did not confirm it in time "
        "(SYNC_MASTER); check the replication link"
    ),
    _R.MESSAGE_ILLEGAL: (
        "the broker rejected the message: bad topic name, bad properties or a batch that fails "
        "its checks. Fix the message; retrying the same bytes fails again"
    ),
    _R.SERVICE_NOT_AVAILABLE: (
        "the broker is starting, shutting down, or is a slave that cannot accept writes; retry "
        "after a moment or send to another broker"
    ),
    _R.VERSION_NOT_SUPPORTED: "the peer does not support this protocol version; upgrade one side",
    _R.NO_PERMISSION: (
        "the broker or topic does not allow this operation (perm bits: the topic may be "
        "read-only or the broker write-disabled); check the topic config and ACLs"
    ),
    _R.TOPIC_NOT_EXIST: (
        "the topic does not exist on this broker; create it (UPDATE_AND_CREATE_TOPIC) or "
        "refresh the route from the name server"
    ),
    _R.TOPIC_EXIST_ALREADY: "the topic already exists; use it or delete it first",
    _R.PULL_NOT_FOUND: "no new message at this offset yet; pull again (long polling waits)",
    _R.PULL_RETRY_IMMEDIATELY: (
        "messages were found but none matched the subscription; pull again from "
        "next_begin_offset"
    ),
    _R.PULL_OFFSET_MOVED: (
        "the requested offset is outside the queue's [min_offset, max_offset]; continue from "
        "next_begin_offset and persist it"
    ),
    _R.QUERY_NOT_FOUND: "nothing matched the query (key, id, or consumer offset); check the input",
    _R.SUBSCRIPTION_PARSE_FAILED: (
        "the subscription expression does not parse; fix the tag or SQL expression"
    ),
    _R.SUBSCRIPTION_NOT_EXIST: (
        "the broker has no subscription for this consumer group and topic; send a heartbeat "
        "with the subscription before pulling"
    ),
    _R.SUBSCRIPTION_NOT_LATEST: (
        "the broker's subscription for this group is older than the one pulled with; send a "
        "heartbeat and retry"
    ),
    _R.SUBSCRIPTION_GROUP_NOT_EXIST: (
        "the consumer group does not exist and the broker does not auto-create groups; "
        "create the subscription group"
    ),
    _R.FLUSH_DISK_FAILED: (
        "the broker could not write the message to disk (I/O error); the message is not "
        "stored. Check the broker's disk and log"
    ),
    _R.CONSUMER_NOT_ONLINE: (
        "the consumer is not connected to this broker; check the client id and that the "
        "consumer is running"
    ),
    _R.NO_MESSAGE: (
        "the receipt handle is stale: the message was acked already, or its invisible time "
        "passed and it was delivered again (to this or another consumer). Nothing changed"
    ),
    _R.CONSUME_MODE_CONFLICT: (
        "this consumer group is consumed in another mode on this broker (POP consumers and "
        "pull/push consumers cannot share one group name); use another group name"
    ),
    _R.CONSUMER_BUSY: (
        "the subscription is exclusive and another consumer holds it (the message names it); "
        "wait until it closes, or use a failover or shared subscription"
    ),
    _R.DISK_FULL: (
        "the broker's disk is past its refuse-writes watermark; nothing was stored. Free disk "
        "space, shorten retention, or send to another broker"
    ),
    _R.DUPLICATE: (
        "this batch's producer sequence was already stored (deduplication); it was not stored "
        "again. Treat the send as successful"
    ),
    _R.RETRY_LATER: "the broker cannot take this request right now; retry after a short backoff",
    _R.MESSAGE_TOO_LARGE: (
        "the batch is over the broker's size limit; send fewer or smaller messages per batch"
    ),
    _R.INVALID_ARGUMENT: (
        "a field of the request is missing, malformed or out of range (the message names it); "
        "fix the request, sending it again unchanged fails again"
    ),
}
del _R

_RETRYABLE = frozenset(
    {
        ResponseCode.SYSTEM_ERROR,
        ResponseCode.SYSTEM_BUSY,
        ResponseCode.TRANSACTION_FAILED,
        ResponseCode.SERVICE_NOT_AVAILABLE,
        ResponseCode.SUBSCRIPTION_NOT_LATEST,
        ResponseCode.RETRY_LATER,
    }
)


def describe(code: int) -> str:
    """One sentence for a person: what response ``code`` means and what to do about it."""
    text = _DESCRIPTIONS.get(code)
    if text is not None:
        return text
    return (
        f"unknown response code {code}: the peer is newer than this side; upgrade the client "
        "or check the peer's log"
    )


def is_retryable(code: int) -> bool:
    """True when the very same request may succeed if sent again later.

    Codes that mean "stored, but ..." (FLUSH_DISK_TIMEOUT, FLUSH_SLAVE_TIMEOUT,
    SLAVE_NOT_AVAILABLE) are not: resending would store the batch twice.
    """
    return code in _RETRYABLE


#: The consumer group of admin tools (RocketMQ's MixAll.TOOLS_CONSUMER_GROUP). Its pulls may read
#: a dead-letter topic ``%DLQ%<group>``, which is write-only for everyone else (`tidemq dlq`).
TOOLS_CONSUMER_GROUP = "TOOLS_CONSUMER"

#: Topic of a consumer group's retries (RocketMQ MixAll.RETRY_GROUP_TOPIC_PREFIX + group) ...
RETRY_PREFIX = "%RETRY%"
#: ... and of its dead letters (MixAll.DLQ_GROUP_TOPIC_PREFIX + group).
DLQ_PREFIX = "%DLQ%"
