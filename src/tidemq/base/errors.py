"""The error a server's request handler raises to refuse a request (the server side of
``BrokerError``).

::

    TidemqError
    └── RequestRejected(response_code, message)   a request the server refuses; the connection
                                                  stays open and the client gets an error
                                                  response with this code and message

Broken framing is not a RequestRejected: the connection's FrameDecoder raises
RemoteProtocolError and the connection is closed.
"""

from __future__ import annotations

from tidemq.protocol.codes import ResponseCode
from tidemq.protocol.errors import TidemqError

__all__ = ["RequestRejected"]


class RequestRejected(TidemqError):
    """Answer the request with ``response_code`` and ``message``; keep the connection."""

    code = "REQUEST_REJECTED"

    def __init__(self, response_code: int, message: str) -> None:
        super().__init__(message, code=ResponseCode(response_code).name)
        self.response_code = response_code
