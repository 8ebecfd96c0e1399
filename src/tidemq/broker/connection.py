"""One client connection to the broker: the shared server connection
(:class:`tidemq.base.connection.ServerConnection` -- framing, write coalescing, back-pressure and
the memory limits, documented there) plus what the broker keeps per connection: its held pulls.

``decode_request``, ``raw_headers`` and ``encode_response`` are re-exported from there for the
broker's processors.

Threads: the broker's event loop only.
"""

from __future__ import annotations

from typing import Any

from tidemq.base.connection import (
    ServerConnection,
    decode_request,
    encode_response,
    raw_headers,
)
from tidemq.base.server import FrameServer

__all__ = ["BrokerConnection", "decode_request", "raw_headers", "encode_response"]


class BrokerConnection(ServerConnection):
    """One client connection of the broker. Event loop only."""

    __slots__ = ("held",)

    def __init__(self, server: FrameServer) -> None:
        super().__init__(server)
        #: Held (long-polling) pulls of this connection, dropped when it closes.
        self.held: set[Any] = set()
