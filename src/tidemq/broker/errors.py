"""Errors the broker and name server answer with (the server side of ``BrokerError``).

::

    TidemqError
    └── RequestRejected(response_code, message)   a request the server refuses; the connection
                                                  stays open and the client gets an error
                                                  response with this code and message

A request handler raises :class:`RequestRejected` for any client mistake (unknown topic, bad
queue id, missing group, oversize or damaged batch). Broken framing is not a RequestRejected:
the connection's FrameDecoder raises RemoteProtocolError and the connection is closed.
:func:`rejection_for_store_error` maps the store's refusals onto response codes.
"""

from __future__ import annotations

from tidemq.base.errors import RequestRejected  # shared with the name server
from tidemq.protocol.codes import ResponseCode
from tidemq.protocol.errors import (
    CorruptBatchError,
    DiskFullError,
    MessageTooLargeError,
    StoreClosedError,
    StoreWriteError,
    TidemqError,
)
from tidemq.protocol.names import group_name_problem

__all__ = ["RequestRejected", "rejection_for_store_error", "check_group"]


def rejection_for_store_error(exc: TidemqError) -> RequestRejected:
    """The response a send gets when the store refused its batch."""
    if isinstance(exc, MessageTooLargeError):
        return RequestRejected(ResponseCode.MESSAGE_TOO_LARGE, exc.message)
    if isinstance(exc, DiskFullError):
        return RequestRejected(ResponseCode.DISK_FULL, exc.message)
    if isinstance(exc, CorruptBatchError):
        return RequestRejected(ResponseCode.MESSAGE_ILLEGAL, f"batch rejected: {exc.message}")
    if isinstance(exc, StoreClosedError):
        return RequestRejected(
            ResponseCode.SERVICE_NOT_AVAILABLE, "the broker is shutting down; send elsewhere"
        )
    if isinstance(exc, StoreWriteError):
        return RequestRejected(ResponseCode.FLUSH_DISK_FAILED, exc.message)
    return RequestRejected(ResponseCode.SYSTEM_ERROR, f"store error: {exc.message}")


def check_group(group: str, field: str = "consumer_group", what: str = "consumer group") -> None:
    """RequestRejected(INVALID_ARGUMENT) unless ``group`` is a valid group name
    (``protocol.names``); ``field`` is the header field, for the message."""
    problem = group_name_problem(group, what)
    if problem:
        raise RequestRejected(
            ResponseCode.INVALID_ARGUMENT,
            f"{field} is empty; name the {what}" if not group else f"{field}: {problem}",
        )
