"""The one error hierarchy of tidemq. Every error has a machine code and a human message.

::

    TidemqError(code, message)             base; ``code`` is a stable upper-case name
    ├── ProtocolError                      bytes that break the format (peer or file)
    │   ├── CorruptBatchError              a batch fails its framing or CRC checks
    │   ├── LocalProtocolError             our caller broke the wire rules (nothing was sent)
    │   └── RemoteProtocolError            the peer sent bytes that break the frame format;
    │                                      the connection is unusable and must be closed
    ├── StoreError                         the storage engine refused or failed an operation
    │   ├── StoreLockedError               another process holds the data directory
    │   ├── DiskFullError                  disk use is past the refuse-writes watermark
    │   ├── StoreWriteError                an OS write / fsync failed; the put did not happen
    │   ├── MessageTooLargeError           a batch is over the configured size limit
    │   ├── OffsetOutOfRangeError          a read asked for an offset the store does not have
    │   └── StoreClosedError               the store was closed
    ├── BrokerError(response_code, msg)    a broker/name server answered with an error
    │                                      response; ``code`` is the ResponseCode name
    └── (later layers add their own, e.g. client and broker errors)

Rules: an error raised for a caller's mistake says what to change; an error for a damaged file
names the file and the byte position.
"""

from __future__ import annotations

from tidemq.protocol.codes import ResponseCode, describe, is_retryable


class TidemqError(Exception):
    """Base of every tidemq error: ``code`` (machine) and ``message`` (for a person)."""

    code = "INTERNAL"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"


class ProtocolError(TidemqError):
    code = "PROTOCOL_ERROR"


class CorruptBatchError(ProtocolError):
    code = "CORRUPT_BATCH"


class StoreError(TidemqError):
    code = "STORE_ERROR"


class StoreLockedError(StoreError):
    code = "STORE_LOCKED"


class DiskFullError(StoreError):
    code = "DISK_FULL"


class StoreWriteError(StoreError):
    code = "STORE_WRITE_FAILED"


class MessageTooLargeError(StoreError):
    code = "MESSAGE_TOO_LARGE"


class OffsetOutOfRangeError(StoreError):
    code = "OFFSET_OUT_OF_RANGE"


class StoreClosedError(StoreError):
    code = "STORE_CLOSED"


class LocalProtocolError(ProtocolError):
    """Our own caller broke the protocol's rules (a value out of range, a header that does not
    encode, a frame over the size limit). Nothing was written; fix the call."""

    code = "LOCAL_PROTOCOL_ERROR"


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes that break the frame format. The byte stream cannot be resynchronised:
    the caller closes the connection (after, at most, answering with an error it can frame)."""

    code = "REMOTE_PROTOCOL_ERROR"


class BrokerError(TidemqError):
    """An error response from a broker or name server, raised by the client.

    ``response_code`` is the wire code (a :class:`~tidemq.protocol.codes.ResponseCode` value,
    or an unknown int from a newer peer); ``code`` is its name, e.g. ``"TOPIC_NOT_EXIST"``.
    """

    code = "BROKER_ERROR"

    def __init__(
        self, message: str, *, response_code: int, code: str | None = None,
        retry_after: float = 0.0,
    ) -> None:
        super().__init__(message, code=code)
        self.response_code = response_code
        #: Seconds the server asked us to wait before sending the request again (its
        #: ``retry_after_ms`` hint, given with SYSTEM_BUSY); 0.0 = no hint.
        self.retry_after = retry_after

    @classmethod
    def from_response(
        cls, response_code: int, message: str | None = None, retry_after_ms: int = 0
    ) -> BrokerError:
        """The error for an error response; an empty ``message`` takes :func:`describe`'s text."""
        if response_code == ResponseCode.SUCCESS:
            raise ValueError("response code SUCCESS (0) is not an error")
        try:
            name = ResponseCode(response_code).name
        except ValueError:
            name = f"RESPONSE_{response_code}"
        return cls(message or describe(response_code), response_code=response_code, code=name,
                   retry_after=max(0, retry_after_ms) / 1000)

    @property
    def retryable(self) -> bool:
        """True when the same request may succeed if sent again later (busy, not available)."""
        return is_retryable(self.response_code)
