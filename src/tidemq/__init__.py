"""tidemq: a message queue on RocketMQ's storage design, in Python.

The blocking client API (any thread; runs the asyncio core on one background loop)::

    import tidemq

    with tidemq.Producer("127.0.0.1:9876") as producer:
        result = producer.send(tidemq.Message("orders", b"paid", tags="paid", keys="order-1"))

    with tidemq.PullConsumer("127.0.0.1:9876", "billing") as consumer:
        consumer.subscribe("orders")
        for msg in consumer.poll(timeout=1.0):
            print(msg.queue_offset, msg.body)

The asyncio API is ``tidemq.aio``. Names load lazily, so the broker and the storage engine
(``import tidemq.store``) do not pay for the client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tidemq.base.lazy import lazy_names

__all__ = [
    "Consumer",
    "SimpleConsumer",
    "ReceivedMessage",
    "StaleReceiptError",
    "Producer",
    "TransactionProducer",
    "LocalTransactionState",
    "TransactionSendResult",
    "PullConsumer",
    "PushConsumer",
    "PushConsumerOptions",
    "ConsumeStatus",
    "ConsumeOrderlyStatus",
    "ConsumeContext",
    "MessageModel",
    "AllocateStrategy",
    "Admin",
    "Message",
    "MessageExt",
    "MessageQueue",
    "SendResult",
    "SendStatus",
    "ConsumeFrom",
    "GroupLag",
    "QueueLag",
    "QueueStatus",
    "TidemqError",
    "BrokerError",
    "ClientError",
    "ClientClosedError",
    "ConnectError",
    "ConnectionLostError",
    "RequestTimeoutError",
    "NoRouteError",
    "MessageRejectedError",
    "ProducerQueueFullError",
    "SqlFilterError",
]

_WHERE = {
    "Consumer": "tidemq.client.blocking_consumer",
    "SimpleConsumer": "tidemq.client.blocking_simple",
    "ReceivedMessage": "tidemq.client.simple_consumer",
    "StaleReceiptError": "tidemq.client.simple_consumer",
    "Producer": "tidemq.client.blocking",
    "TransactionProducer": "tidemq.client.blocking",
    "LocalTransactionState": "tidemq.client.transaction_producer",
    "TransactionSendResult": "tidemq.client.transaction_producer",
    "PullConsumer": "tidemq.client.blocking",
    "PushConsumer": "tidemq.client.blocking",
    "PushConsumerOptions": "tidemq.client.consumer_options",
    "ConsumeStatus": "tidemq.client.listener",
    "ConsumeOrderlyStatus": "tidemq.client.listener",
    "ConsumeContext": "tidemq.client.listener",
    "MessageModel": "tidemq.client.listener",
    "AllocateStrategy": "tidemq.client.rebalance",
    "Admin": "tidemq.client.blocking",
    "Message": "tidemq.client.message",
    "MessageExt": "tidemq.client.message",
    "MessageQueue": "tidemq.client.message",
    "SendResult": "tidemq.client.message",
    "SendStatus": "tidemq.client.message",
    "ConsumeFrom": "tidemq.client.message",
    "GroupLag": "tidemq.client.admin",
    "QueueLag": "tidemq.client.admin",
    "QueueStatus": "tidemq.client.admin",
    "TidemqError": "tidemq.client.errors",
    "BrokerError": "tidemq.client.errors",
    "ClientError": "tidemq.client.errors",
    "ClientClosedError": "tidemq.client.errors",
    "ConnectError": "tidemq.client.errors",
    "ConnectionLostError": "tidemq.client.errors",
    "RequestTimeoutError": "tidemq.client.errors",
    "NoRouteError": "tidemq.client.errors",
    "MessageRejectedError": "tidemq.client.errors",
    "ProducerQueueFullError": "tidemq.client.errors",
    "SqlFilterError": "tidemq.client.selection",
}

if TYPE_CHECKING:
    from tidemq.client.admin import GroupLag, QueueLag, QueueStatus
    from tidemq.client.blocking import (
        Admin,
        Producer,
        PullConsumer,
        PushConsumer,
        TransactionProducer,
    )
    from tidemq.client.blocking_consumer import Consumer
    from tidemq.client.blocking_simple import SimpleConsumer
    from tidemq.client.consumer_options import PushConsumerOptions
    from tidemq.client.errors import (
        BrokerError,
        ClientClosedError,
        ClientError,
        ConnectError,
        ConnectionLostError,
        MessageRejectedError,
        NoRouteError,
        ProducerQueueFullError,
        RequestTimeoutError,
        TidemqError,
    )
    from tidemq.client.listener import (
        ConsumeContext,
        ConsumeOrderlyStatus,
        ConsumeStatus,
        MessageModel,
    )
    from tidemq.client.message import (
        ConsumeFrom,
        Message,
        MessageExt,
        MessageQueue,
        SendResult,
        SendStatus,
    )
    from tidemq.client.rebalance import AllocateStrategy
    from tidemq.client.selection import SqlFilterError
    from tidemq.client.simple_consumer import ReceivedMessage, StaleReceiptError
    from tidemq.client.transaction_producer import LocalTransactionState, TransactionSendResult


__getattr__ = lazy_names(globals(), _WHERE)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
