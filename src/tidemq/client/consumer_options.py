"""The push consumer's options: one typed, documented value (RocketMQ's defaults).

``PushConsumer(namesrv, group, listener, options)`` takes one; the same fields are accepted as
keywords (``PushConsumer(..., pull_batch_size=64)``), and keywords given with ``options``
override its fields. A wrong name is a TypeError, a wrong value a ValueError, both raised when
the options are built.

Plain value: any thread.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tidemq.client.connection import DEFAULT_TIMEOUT
from tidemq.client.listener import ConsumeHook, MessageModel
from tidemq.client.message import ConsumeFrom, MessageQueue
from tidemq.client.rebalance import AllocateStrategy
from tidemq.protocol.batch.codec import DEFAULT_MAX_RAW_SIZE

__all__ = ["PushConsumerOptions"]

MiB = 1 << 20


@dataclass
class PushConsumerOptions:
    """How a push consumer consumes. Every field has RocketMQ's default."""

    #: Consume each queue in order, one listener call at a time, holding the queue's lock on
    #: the broker (ConsumeOrderlyService) instead of concurrently.
    orderly: bool = False
    #: "clustering" (the group shares the queues) or "broadcasting" (every member gets all).
    message_model: MessageModel = MessageModel.CLUSTERING
    #: Where a group without a committed offset starts: "last", "first" or "timestamp"
    #: (with ``consume_timestamp``, ms since the epoch).
    consume_from: ConsumeFrom = ConsumeFrom.LAST
    consume_timestamp: int | None = None
    #: How queues are shared among the group's members; ``allocate_config`` /
    #: ``consumer_rooms`` for AllocateStrategy.CONFIG / MACHINE_ROOM.
    allocate_strategy: AllocateStrategy = AllocateStrategy.AVG
    allocate_config: Sequence[MessageQueue] = ()
    consumer_rooms: Sequence[str] = ()
    #: Threads that run sync listeners.
    consume_thread_max: int = 20
    #: Messages per listener call.
    consume_message_batch_max_size: int = 1
    #: Messages per pull.
    pull_batch_size: int = 32
    #: A queue stops pulling while it holds this many unconsumed messages ...
    pull_threshold_for_queue: int = 1000
    #: ... or this many bytes of them ...
    pull_threshold_size_for_queue: int = 100 * MiB
    #: ... or (concurrently) the offsets it holds span more than this.
    consume_concurrently_max_span: int = 2000
    #: Seconds between two pulls of one queue.
    pull_interval: float = 0.0
    #: Retries before a message goes to the dead-letter queue; None: the group's
    #: ``retry_max_times`` on the broker (16 unless changed with ``tidemq group update``);
    #: orderly consumers count 16 locally.
    max_reconsume_times: int | None = None
    #: Orderly: seconds a queue waits after a listener asked to suspend it.
    suspend_current_queue_time: float = 1.0
    #: Seconds a listener call may take before its messages are sent back for a retry.
    consume_timeout: float = 15 * 60.0
    heartbeat_interval: float = 30.0
    rebalance_interval: float = 20.0
    #: Seconds between two commits of the consumed offsets.
    persist_interval: float = 5.0
    #: Orderly: seconds between two renewals of the queue locks.
    lock_interval: float = 20.0
    #: Seconds a broker holds a pull that found nothing (long polling).
    suspend_timeout: float = 15.0
    #: Part of the client id; in broadcasting it names the local offset file, so keep it
    #: stable across restarts (None: a random one).
    instance_name: str | None = None
    #: Where broadcasting consumers keep their offsets (None: ~/.tidemq_offsets).
    offset_dir: str | None = None
    #: ConsumeHook objects called around every listener call.
    hooks: Sequence[ConsumeHook] = field(default_factory=tuple)
    #: Verify both CRCs of every received batch.
    check_crc: bool = True
    #: Seconds a request to a broker may take.
    request_timeout: float = DEFAULT_TIMEOUT
    #: Seconds between two route refreshes from the name server.
    route_refresh: float = 30.0
    #: The largest records section of one received batch, uncompressed (4 MiB + 64 KiB);
    #: raise it with the broker's ``max_message_size``.
    max_uncompressed_bytes: int = DEFAULT_MAX_RAW_SIZE
    #: Seconds a chunked message still incomplete after its first chunk arrived is dropped
    #: (``stats()`` counts ``chunks_assembled`` and ``chunks_expired`` of the queues held).
    chunk_expire: float = 60.0
    #: From this many assigned queues on (256), the queues' pulls to one broker are made by
    #: one driver as standing PULL_MULTI_QUEUE requests (up to 1,000 queues each; one held
    #: request per broker instead of one held pull per queue, no task per queue:
    #: docs/consumer-groups.md, "Many queues"); 0 = always queue by queue, 1 = always
    #: multi-queue.
    multi_queue_min: int = 256

    def __post_init__(self) -> None:
        if self.max_uncompressed_bytes < 1:
            raise ValueError("max_uncompressed_bytes must be >= 1")
        if self.consume_message_batch_max_size < 1 or self.pull_batch_size < 1:
            raise ValueError("batch sizes must be >= 1")
        self.message_model = MessageModel(str(self.message_model).lower())
        self.consume_from = ConsumeFrom(self.consume_from)
        if self.consume_from is ConsumeFrom.TIMESTAMP and self.consume_timestamp is None:
            raise ValueError("consume_from='timestamp' needs consume_timestamp (ms since epoch)")
        self.allocate_strategy = AllocateStrategy(self.allocate_strategy)
        if self.max_reconsume_times is not None and self.max_reconsume_times < 0:
            raise ValueError("max_reconsume_times must be >= 0 (None: the group's setting)")

    @classmethod
    def of(
        cls, options: PushConsumerOptions | None, keywords: dict[str, Any]
    ) -> PushConsumerOptions:
        """``options`` with ``keywords`` applied (TypeError naming an unknown keyword)."""
        if options is None:
            return cls(**keywords)
        return dataclasses.replace(options, **keywords) if keywords else options
