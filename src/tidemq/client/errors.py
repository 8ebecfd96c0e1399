"""Errors the client raises on its own (the broker's error responses are ``BrokerError``).

::

    TidemqError                              (tidemq.protocol.errors)
    ├── BrokerError(response_code)           an error response from a broker or name server
    └── ClientError                          the client could not do what was asked
        ├── ClientClosedError                the producer/consumer/admin was closed
        ├── ConnectError                     no TCP connection to the address
        ├── ConnectionLostError              the connection broke with the request in flight
        ├── RequestTimeoutError              no response within the timeout
        ├── NoRouteError                     the name servers know no route for the topic
        ├── InvalidConfigurationError        not allowed with this consumer's configuration
        └── MessageRejectedError             the client refused the message (size, topic, ...)
            └── ProducerQueueFullError       max_pending_messages async sends are unanswered

Every error says what to do in its message; ``code`` is the stable machine name.
"""

from __future__ import annotations

from tidemq.protocol.errors import BrokerError, TidemqError

__all__ = [
    "TidemqError",
    "BrokerError",
    "ClientError",
    "ClientClosedError",
    "ConnectError",
    "ConnectionLostError",
    "RequestTimeoutError",
    "NoRouteError",
    "InvalidConfigurationError",
    "MessageRejectedError",
    "ProducerQueueFullError",
]


class ClientError(TidemqError):
    code = "CLIENT_ERROR"


class ClientClosedError(ClientError):
    code = "CLIENT_CLOSED"


class ConnectError(ClientError):
    code = "CONNECT_FAILED"


class ConnectionLostError(ClientError):
    code = "CONNECTION_LOST"


class RequestTimeoutError(ClientError):
    code = "REQUEST_TIMEOUT"


class NoRouteError(ClientError):
    code = "NO_ROUTE"


class InvalidConfigurationError(ClientError):
    """Pulsar's InvalidConfigurationException: e.g. a cumulative ack on a Shared subscription."""

    code = "INVALID_CONFIGURATION"


class MessageRejectedError(ClientError):
    code = "MESSAGE_REJECTED"


class ProducerQueueFullError(MessageRejectedError):
    """``send_async`` with ``max_pending_messages`` messages already unanswered (Pulsar's
    ProducerQueueIsFullError): await some of the futures, or ``await producer.flush()``."""

    code = "PRODUCER_QUEUE_FULL"
