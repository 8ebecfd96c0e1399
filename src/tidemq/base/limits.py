"""The memory and connection limits of one server (broker or name server).

Both servers' configurations (``BrokerConfig``, ``NamesrvConfig``) carry these as settings of
the same names and build a :class:`ConnectionLimits` from them; ``docs/configuration.md``
documents each and ``docs/operations.md`` explains how they bound a server's memory:

    RSS  <=  idle RSS
           + max_partial_frame_bytes                       (all partial frames together)
           + connections x (write_buffer_high_water + the largest response + one read)
"""

from __future__ import annotations

from dataclasses import dataclass

from tidemq.protocol.frame import DEFAULT_MAX_FRAME_SIZE, PREFIX_SIZE

__all__ = ["ConnectionLimits", "KiB", "MiB"]

KiB = 1 << 10
MiB = 1 << 20


@dataclass(frozen=True)
class ConnectionLimits:
    """Limits of one :class:`~tidemq.base.server.FrameServer`; plain data, checked by
    :meth:`validate`."""

    #: Connections served at once; one more is answered SYSTEM_BUSY and closed.
    max_connections: int = 10_000
    #: Largest frame accepted (length field included); a bigger one closes the connection.
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    #: SO_SNDBUF of each connection's socket (the kernel doubles it); 0 = the kernel's
    #: autotuning, up to net.ipv4.tcp_wmem's maximum (4 MiB). Responses a peer does not read
    #: wait there too, so it bounds the kernel memory and the work a non-reading peer costs.
    socket_send_buffer: int = 256 * KiB
    #: Stop handling a connection's requests (and reading them) while this many bytes of its
    #: responses are unsent ...
    write_buffer_high_water: int = 64 * KiB
    #: ... and resume once fewer than this many are.
    write_buffer_low_water: int = 16 * KiB
    #: A connection whose unsent responses pass this is closed (only responses produced
    #: without a request being read -- held pulls, notifications -- can get there).
    max_queued_response_bytes: int = 64 * MiB
    #: Bytes of partial frames held across all connections; past it the oldest partial frame
    #: is dropped (its sender gets SYSTEM_BUSY once the frame's last byte is in).
    max_partial_frame_bytes: int = 128 * MiB
    #: A frame incomplete this long after its first byte closes its connection.
    partial_frame_timeout_ms: int = 30_000
    #: The retry hint sent with SYSTEM_BUSY (``ErrorResponseHeader.retry_after_ms``).
    busy_retry_ms: int = 1000

    def validate(self, what: str = "server") -> None:
        """Raise ValueError, naming the setting, for limits that cannot work."""
        for name in (
            "max_connections", "write_buffer_high_water", "max_queued_response_bytes",
            "max_partial_frame_bytes", "partial_frame_timeout_ms",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{what} setting {name} must be > 0, got {getattr(self, name)}")
        if self.max_frame_size < PREFIX_SIZE:
            raise ValueError(
                f"{what} setting max_frame_size must be at least {PREFIX_SIZE}, got "
                f"{self.max_frame_size}"
            )
        if not 0 <= self.write_buffer_low_water <= self.write_buffer_high_water:
            raise ValueError(
                f"{what} setting write_buffer_low_water must be 0..write_buffer_high_water "
                f"({self.write_buffer_high_water}), got {self.write_buffer_low_water}"
            )
        if self.max_queued_response_bytes < self.write_buffer_high_water:
            raise ValueError(
                f"{what} setting max_queued_response_bytes ({self.max_queued_response_bytes}) "
                f"must be at least write_buffer_high_water ({self.write_buffer_high_water})"
            )
        if self.socket_send_buffer < 0:
            raise ValueError(f"{what} setting socket_send_buffer must be >= 0, got "
                             f"{self.socket_send_buffer}")
        if self.busy_retry_ms < 0:
            raise ValueError(f"{what} setting busy_retry_ms must be >= 0, got "
                             f"{self.busy_retry_ms}")
