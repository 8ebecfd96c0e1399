"""The values a user handles: Message, MessageExt, MessageQueue, SendResult (ref PR9).

``Message`` is what a producer sends; ``MessageExt`` is what a consumer receives. Both are
msgspec Structs (``gc=False``) because the consume path creates one per message and a Struct is
built in ~0.1 µs where a ``__slots__`` class with ``__init__`` takes several times that.

A ``MessageExt`` carries its body, queue offset and tags eagerly; every other field (topic,
timestamps, hosts, keys, properties, msg id, ...) is read on first access from the batch it came
in (``_BatchMeta``), so a consumer that only reads bodies pays for bodies only. The batch's bytes
stay alive as long as one of its messages does.

All classes here are plain values: any thread may use them.
"""

from __future__ import annotations

import datetime
import enum
import time
from typing import Any

import msgspec

from tidemq.protocol.batch.layout import (
    H_ATTRIBUTES,
    H_BASE_SEQ,
    H_BORN_HOST,
    H_BORN_PORT,
    H_COUNT,
    H_DELIVER_AT,
    H_KEYS_SIZE,
    H_PHYS_OFFSET,
    H_PRODUCER_ID,
    H_QUEUE_ID,
    H_QUEUE_OFFSET,
    H_RECONSUME,
    H_STORE_HOST,
    H_STORE_PORT,
    H_STORE_TS,
    H_TOPIC_LEN,
)
from tidemq.protocol.errors import CorruptBatchError
from tidemq.protocol.record import (
    ATTR_DELAY_MASK,
    ATTR_DELAY_SHIFT,
    INDEX_ENTRY,
    INDEX_ENTRY_SIZE,
    KEYS_ENTRY,
    PRODUCER_HEADER_SIZE,
    RECORD_HEADER,
    RECORD_HEADER_SIZE,
    STORE_HEADER_SIZE,
    decode_properties,
    delay_level_for,
    deliver_at_for,
    unique_id,
    unpack_host,
)

__all__ = [
    "Message",
    "MessageExt",
    "MessageQueue",
    "SendStatus",
    "SendResult",
    "ConsumeFrom",
]


class Message(msgspec.Struct, gc=False):
    """A message to send.

    ``body`` is bytes (a str is encoded as UTF-8); ``tags`` one tag string (filtered on by
    consumers); ``keys`` a str or a list of str (indexed for lookup, no spaces inside a key);
    ``properties`` user properties (str -> str).

    Delayed delivery (ref PR8): ``delay_level`` 1..18 waits the broker's level time (RocketMQ's
    "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"; a higher level waits the
    highest, as in RocketMQ; a negative one is a ValueError); ``deliver_at`` (ms since the
    epoch, or a ``datetime``) delivers at that time to the millisecond, up to the broker's
    limit (40 days); ``deliver_after`` (seconds, or a ``timedelta``) is ``deliver_at = now +
    deliver_after``, fixed when the Message is built. Until then consumers do not see it; a
    timed message can be cancelled with ``Producer.cancel(send_result)``.
    """

    topic: str
    body: bytes
    tags: str | None = None
    keys: str | list[str] | None = None
    properties: dict[str, str] | None = None
    delay_level: int = 0
    deliver_at: int = 0
    deliver_after: float = 0

    def __post_init__(self) -> None:
        # One test for the common message (bytes body, no delay, no delivery time): this runs
        # for every Message an application builds (measured: ~30 ns a message less than three
        # separate tests, of ~140 for the whole construction).
        if (type(self.body) is bytes and not self.delay_level and not self.deliver_at
                and not self.deliver_after):
            return
        self._check_fields()

    def _check_fields(self) -> None:
        """The body as bytes, the delay level and the delivery time checked (what
        ``__post_init__`` leaves to this for a message that needs any of them)."""
        if type(self.body) is not bytes:
            body: Any = self.body
            self.body = body.encode() if isinstance(body, str) else bytes(body)
        if self.delay_level:
            # negative: ValueError; above 31 (what the format holds): 31, which the broker
            # clamps to its highest level (18 by default), as RocketMQ does
            self.delay_level = delay_level_for(self.delay_level)
        if self.deliver_at or self.deliver_after:
            self._resolve_delivery_time()

    def _resolve_delivery_time(self) -> None:
        at: Any = self.deliver_at
        if isinstance(at, datetime.datetime):
            self.deliver_at = int(at.timestamp() * 1000)
        elif not isinstance(at, int):
            self.deliver_at = int(at)
        after: Any = self.deliver_after
        if after:
            if isinstance(after, datetime.timedelta):
                after = after.total_seconds()
            if after < 0:
                raise ValueError(f"deliver_after must be >= 0 seconds, got {after}")
            self.deliver_at = time.time_ns() // 1_000_000 + int(after * 1000)
            self.deliver_after = 0
        if self.delay_level and self.deliver_at:
            raise ValueError("set either delay_level or deliver_at / deliver_after, not both")
        deliver_at_for(self.deliver_at)

    @property
    def keys_string(self) -> str | None:
        """Keys as stored (space separated), or None."""
        keys = self.keys
        if not keys:
            return None
        if isinstance(keys, str):
            return keys
        for k in keys:
            if not k or " " in k:
                raise ValueError(f"message key {k!r} must be non-empty and contain no space")
        return " ".join(keys)


class MessageQueue(msgspec.Struct, frozen=True, order=True, gc=False):
    """One queue of a topic on one broker (hashable, ordered by topic, broker, queue id)."""

    topic: str
    broker_name: str
    queue_id: int

    def __str__(self) -> str:
        return f"{self.topic}@{self.broker_name}:{self.queue_id}"


class SendStatus(enum.StrEnum):
    """RocketMQ's SendStatus: every value but SEND_OK means "stored, with a caveat"."""

    SEND_OK = "SEND_OK"
    FLUSH_DISK_TIMEOUT = "FLUSH_DISK_TIMEOUT"
    FLUSH_SLAVE_TIMEOUT = "FLUSH_SLAVE_TIMEOUT"
    SLAVE_NOT_AVAILABLE = "SLAVE_NOT_AVAILABLE"
    #: Deduplication (BR12): the broker already had this sequence and stored nothing; the
    #: result's queue_offset is -1 (Pulsar answers -1:-1 the same way).
    DUPLICATE = "DUPLICATE"


class SendResult(msgspec.Struct, gc=False):
    """Where a send landed. For a batch, message ``i`` has ``queue_offset + i`` and
    ``msg_ids[i]``; ``msg_id`` is message 0's unique id."""

    status: SendStatus
    msg_id: str
    topic: str
    queue_id: int
    queue_offset: int
    count: int = 1
    broker_name: str = ""
    producer_id: int = 0
    base_seq: int = 0
    #: CommitLog offset the broker stored it at, when it says (half messages: for
    #: END_TRANSACTION); -1 otherwise
    commit_log_offset: int = -1

    @property
    def msg_ids(self) -> list[str]:
        return [unique_id(self.producer_id, self.base_seq + i) for i in range(self.count)]

    @property
    def message_queue(self) -> MessageQueue:
        return MessageQueue(self.topic, self.broker_name, self.queue_id)


class ConsumeFrom(enum.StrEnum):
    """Where a consumer group without a committed offset starts (RocketMQ's ConsumeFromWhere)."""

    LAST = "last"  # the queue's max offset: only messages sent from now on
    FIRST = "first"  # the queue's min offset: everything still stored
    TIMESTAMP = "timestamp"  # the first message stored at or after consume_timestamp


# Fields of ``_BatchMeta.h``: the tuple of ``batch.layout.heads_struct``, read by the
# layout's H_* indexes.
_INDEX_AT = STORE_HEADER_SIZE + PRODUCER_HEADER_SIZE  # + topic_len: the index in a batch


class _BatchMeta(msgspec.Struct, gc=False):
    """What the messages of one received batch share; decoded lazily (see MessageExt).

    Built once per received batch, so it is a Struct of what the decoder already holds (the
    header tuple and where the bytes are) rather than ~20 attributes copied out of it: a pull
    of single-message batches builds one per message.
    """

    topic: str
    broker_name: str
    #: STORE_HEADER + PRODUCER_HEADER fields (may carry more after them; see layout.H_*)
    h: tuple[Any, ...]
    src: bytes  # holds the batch as received (index, keys) at ``pos``
    pos: int
    raw: bytes  # holds the records section, uncompressed, at raw_off
    raw_off: int
    _keys: dict[int, str] | None = None

    @property
    def queue_id(self) -> int:
        v: int = self.h[H_QUEUE_ID]
        return v

    @property
    def queue_offset(self) -> int:
        v: int = self.h[H_QUEUE_OFFSET]
        return v

    @property
    def phys_offset(self) -> int:
        v: int = self.h[H_PHYS_OFFSET]
        return v

    @property
    def store_ts(self) -> int:
        v: int = self.h[H_STORE_TS]
        return v

    @property
    def reconsume_times(self) -> int:
        v: int = self.h[H_RECONSUME]
        return v

    @property
    def producer_id(self) -> int:
        v: int = self.h[H_PRODUCER_ID]
        return v

    @property
    def base_seq(self) -> int:
        v: int = self.h[H_BASE_SEQ]
        return v

    @property
    def born_host_raw(self) -> bytes:
        v: bytes = self.h[H_BORN_HOST]
        return v

    @property
    def born_port(self) -> int:
        v: int = self.h[H_BORN_PORT]
        return v

    @property
    def store_host_raw(self) -> bytes:
        v: bytes = self.h[H_STORE_HOST]
        return v

    @property
    def store_port(self) -> int:
        v: int = self.h[H_STORE_PORT]
        return v

    @property
    def delay_level(self) -> int:
        v: int = (self.h[H_ATTRIBUTES] & ATTR_DELAY_MASK) >> ATTR_DELAY_SHIFT
        return v

    @property
    def deliver_at(self) -> int:
        v: int = self.h[H_DELIVER_AT]
        return v

    @property
    def count(self) -> int:
        v: int = self.h[H_COUNT]
        return v

    def index_pos(self) -> int:
        """Where the message index starts in ``src``."""
        at: int = self.pos + _INDEX_AT + self.h[H_TOPIC_LEN]
        return at

    def keys(self) -> dict[int, str]:
        if self._keys is None:
            out: dict[int, str] = {}
            h = self.h
            q = self.index_pos() + h[H_COUNT] * INDEX_ENTRY_SIZE
            end = q + h[H_KEYS_SIZE]
            raw = self.src
            while q + 6 <= end:
                i, n = KEYS_ENTRY.unpack_from(raw, q)
                # The decoders check keys before they hand out a message (an undecodable one
                # is skipped and counted); "replace" only keeps a hand-made one from raising.
                out[i] = raw[q + 6 : q + 6 + n].decode(errors="replace")
                q += 6 + n
            self._keys = out
        return self._keys

    def record(self, i: int) -> tuple[int, int, int, int, int, int]:
        """(position in raw, born_ts, flag, tags_len, props_len, body_len) of message ``i``."""
        _th, rel = INDEX_ENTRY.unpack_from(self.src, self.index_pos() + i * INDEX_ENTRY_SIZE)
        rel += self.raw_off
        _size, born_ts, flag, tl, _r, pl, bl = RECORD_HEADER.unpack_from(self.raw, rel)
        return rel, born_ts, flag, tl, pl, bl


class MessageExt(msgspec.Struct, array_like=True, gc=False):
    """A received message. Build them with the client's decoder, not by hand.

    ``body``, ``queue_offset`` and ``tags`` are stored; the other fields are properties read
    from the batch the message arrived in.
    """

    body: bytes
    queue_offset: int
    tags: str | None
    _b: _BatchMeta
    _i: int  # index of this message in its batch

    @property
    def topic(self) -> str:
        return self._b.topic

    @property
    def queue_id(self) -> int:
        return self._b.queue_id

    @property
    def broker_name(self) -> str:
        return self._b.broker_name

    @property
    def message_queue(self) -> MessageQueue:
        b = self._b
        return MessageQueue(b.topic, b.broker_name, b.queue_id)

    @property
    def msg_id(self) -> str:
        b = self._b
        return unique_id(b.producer_id, b.base_seq + self._i)

    @property
    def keys(self) -> list[str]:
        ks = self._b.keys().get(self._i)
        return [k for k in ks.split(" ") if k] if ks else []

    @property
    def properties(self) -> dict[str, str]:
        rel, _ts, _f, tl, pl, _bl = self._b.record(self._i)
        if not pl:
            return {}
        q = rel + RECORD_HEADER_SIZE + tl
        raw = self._b.raw[q : q + pl]
        try:
            return decode_properties(raw)
        except CorruptBatchError:  # the decoders skip such records; see _BatchMeta.keys
            return decode_properties(raw.decode(errors="replace").encode())

    @property
    def flag(self) -> int:
        return self._b.record(self._i)[2]

    @property
    def born_timestamp(self) -> int:
        """When the producer built the message, ms since the epoch."""
        return self._b.record(self._i)[1]

    @property
    def store_timestamp(self) -> int:
        """When the broker stored the batch, ms since the epoch."""
        return self._b.store_ts

    @property
    def born_host(self) -> str:
        b = self._b
        return f"{unpack_host(b.born_host_raw)}:{b.born_port}"

    @property
    def store_host(self) -> str:
        b = self._b
        return f"{unpack_host(b.store_host_raw)}:{b.store_port}"

    @property
    def reconsume_times(self) -> int:
        return self._b.reconsume_times

    @property
    def commit_log_offset(self) -> int:
        """Physical offset of the batch holding this message."""
        return self._b.phys_offset

    @property
    def delay_level(self) -> int:
        return self._b.delay_level

    @property
    def deliver_at(self) -> int:
        return self._b.deliver_at

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain values (body left as bytes)."""
        return {
            "topic": self.topic,
            "queue_id": self.queue_id,
            "queue_offset": self.queue_offset,
            "msg_id": self.msg_id,
            "tags": self.tags,
            "keys": self.keys,
            "properties": self.properties,
            "born_timestamp": self.born_timestamp,
            "store_timestamp": self.store_timestamp,
            "born_host": self.born_host,
            "store_host": self.store_host,
            "reconsume_times": self.reconsume_times,
            "body": self.body,
        }

    def __repr__(self) -> str:
        return (
            f"MessageExt(topic={self.topic!r}, queue_id={self.queue_id}, "
            f"queue_offset={self.queue_offset}, msg_id={self.msg_id!r}, tags={self.tags!r}, "
            f"body={self.body[:40]!r}{'...' if len(self.body) > 40 else ''})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MessageExt):
            return NotImplemented
        return self.msg_id == other.msg_id and self.queue_offset == other.queue_offset

    def __hash__(self) -> int:
        return hash((self.msg_id, self.queue_offset))
