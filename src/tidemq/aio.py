"""tidemq's asyncio client: the core the blocking API (``tidemq``) runs on.

::

    from tidemq import aio

    async with aio.Producer("127.0.0.1:9876") as producer:
        result = await producer.send(aio.Message("orders", b"paid"))

    async with aio.PullConsumer("127.0.0.1:9876", "billing") as consumer:
        consumer.subscribe("orders")
        messages = await consumer.poll(timeout=1.0)

Every object belongs to the event loop it was first used on.
"""

from __future__ import annotations

from tidemq.client.admin import Admin, GroupLag, QueueLag, QueueStatus
from tidemq.client.connection import Connection, ConnectionPool
from tidemq.client.consumer import PullConsumer
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
    ConsumeHook,
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
from tidemq.client.producer import Producer, Selector, SendCallback
from tidemq.client.push_consumer import PushConsumer
from tidemq.client.rebalance import AllocateStrategy
from tidemq.client.simple_consumer import ReceivedMessage, SimpleConsumer, StaleReceiptError
from tidemq.client.subscription_consumer import Consumer
from tidemq.client.transaction_producer import (
    LocalTransactionState,
    TransactionProducer,
    TransactionSendResult,
)

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
    "ConsumeHook",
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
    "Selector",
    "SendCallback",
    "Connection",
    "ConnectionPool",
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
]
