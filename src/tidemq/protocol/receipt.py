"""Receipt handles of server-side dispatch (POP; docs/pop-dispatch.md).

A popped message's receipt handle names the message and *which delivery* of it the consumer
holds, so that an ack or an invisible-time change reaches the right state and a stale one (the
message was delivered again since) is recognised. It is one printable ASCII string, fields
separated by single spaces (RocketMQ's ExtraInfoUtil uses the same kind of form), so it crosses
gRPC, logs and the CLI unchanged::

    v1 <broker> <topic> <queue id> <queue offset> <pop time ms> <invisible ms>
       <revive queue id> <attempt> [<message group hash>]

==================  =====================================================================
``broker``          broker name (``protocol/names.py`` rules: no spaces)
``topic``           topic name (no spaces)
``queue id``        0 .. 2^31-1
``queue offset``    0 .. 2^63-1
``pop time ms``     when this delivery was popped (ms since the epoch)
``invisible ms``    how long it stays invisible from ``pop time`` (1 .. 12 h)
``revive queue id`` which revive queue tracks it (0 .. 2^31-1)
``attempt``         delivery attempt, 1 for the first
``message group``   orderly POP only: hash of the message group, 16 hex digits
==================  =====================================================================

:func:`decode_receipt` refuses anything else with :class:`ReceiptError` (a ValueError saying
which field), so a broker answers a mangled handle with a clear INVALID_ARGUMENT.

Sans-IO; any thread.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["ReceiptHandle", "ReceiptError", "encode_receipt", "decode_receipt",
           "MAX_INVISIBLE_MS"]

VERSION = "v1"
MAX_INVISIBLE_MS = 12 * 3600 * 1000  # RocketMQ 5's longest invisible duration
_MAX_I31 = 2**31 - 1
_MAX_I63 = 2**63 - 1
_NAME = re.compile(r"[%|A-Za-z0-9_@.:-]{1,255}\Z")
_DIGITS = re.compile(r"(0|[1-9][0-9]{0,18})\Z")
_HEX16 = re.compile(r"[0-9a-f]{16}\Z")


class ReceiptError(ValueError):
    """A receipt handle that does not decode; the message names the field."""


@dataclass(frozen=True, slots=True)
class ReceiptHandle:
    broker: str
    topic: str
    queue_id: int
    offset: int
    pop_time: int
    invisible_ms: int
    revive_queue_id: int = 0
    attempt: int = 1
    message_group: int | None = None  # 64-bit hash of the message group (orderly POP)

    @property
    def visible_at(self) -> int:
        """When the message becomes visible again unless acked (ms since the epoch)."""
        return self.pop_time + self.invisible_ms


def _check(h: ReceiptHandle) -> None:
    for name, value in (("broker", h.broker), ("topic", h.topic)):
        if not isinstance(value, str) or not _NAME.match(value):
            raise ReceiptError(f"receipt handle {name} {value!r} is not a valid name")
    limits: tuple[tuple[str, object, int, int], ...] = (
              ("queue_id", h.queue_id, 0, _MAX_I31), ("offset", h.offset, 0, _MAX_I63),
              ("pop_time", h.pop_time, 0, _MAX_I63),
              ("invisible_ms", h.invisible_ms, 1, MAX_INVISIBLE_MS),
              ("revive_queue_id", h.revive_queue_id, 0, _MAX_I31),
              ("attempt", h.attempt, 1, _MAX_I31))
    for field, number, lo, hi in limits:
        if type(number) is not int or not lo <= number <= hi:
            raise ReceiptError(f"receipt handle {field} {number!r} is outside {lo}..{hi}")
    g = h.message_group
    if g is not None and (type(g) is not int or not 0 <= g < 2**64):
        raise ReceiptError(f"receipt handle message group {g!r} is not a 64-bit hash")


def encode_receipt(h: ReceiptHandle) -> str:
    """The handle's string; ReceiptError for a field out of its range."""
    _check(h)
    parts = [VERSION, h.broker, h.topic, str(h.queue_id), str(h.offset), str(h.pop_time),
             str(h.invisible_ms), str(h.revive_queue_id), str(h.attempt)]
    if h.message_group is not None:
        parts.append(f"{h.message_group:016x}")
    return " ".join(parts)


_INT_FIELDS = ("queue_id", "offset", "pop_time", "invisible_ms", "revive_queue_id", "attempt")


def decode_receipt(text: str) -> ReceiptHandle:
    """The handle of ``text``; ReceiptError naming what is wrong otherwise."""
    if not isinstance(text, str) or not text.isascii() or len(text) > 1024:
        raise ReceiptError("a receipt handle is an ASCII string of at most 1024 characters")
    parts = text.split(" ")
    if parts[0] != VERSION:
        raise ReceiptError(f"unknown receipt handle version {parts[0][:16]!r} (expected v1)")
    if len(parts) not in (9, 10):
        raise ReceiptError(f"a v1 receipt handle has 9 or 10 fields, this one {len(parts)}")
    for name, raw in (("broker", parts[1]), ("topic", parts[2])):
        if not _NAME.match(raw):
            raise ReceiptError(f"receipt handle {name} {raw[:40]!r} is not a valid name")
    ints = {}
    for name, raw in zip(_INT_FIELDS, parts[3:9], strict=True):
        # the _DIGITS rule (ASCII digits, no leading zero, <= 19 digits) without a regex: the
        # broker decodes one handle per acked message
        if not (raw.isdigit() and raw.isascii() and len(raw) <= 19
                and (raw[0] != "0" or len(raw) == 1)):
            raise ReceiptError(f"receipt handle {name} {raw[:24]!r} is not a decimal number")
        ints[name] = int(raw)
    group = None
    if len(parts) == 10:
        if not _HEX16.match(parts[9]):
            raise ReceiptError(f"receipt handle message group {parts[9][:24]!r} is not 16 "
                               "lowercase hex digits")
        group = int(parts[9], 16)
    h = ReceiptHandle(parts[1], parts[2], message_group=group, **ints)
    _check(h)
    return h
