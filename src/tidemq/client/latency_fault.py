"""Latency-aware broker avoidance for sends (ref PR1; RocketMQ's MQFaultStrategy).

After every send the producer reports the broker's latency; a slow answer or a failure keeps
the broker out of the round robin for a while, so one sick broker does not slow every other
send down::

    latency >=   50  100   550  1000  2000  3000  15000 ms
    avoid for     0    0    30    60   120   180    600 s

A failed send (timeout, connection lost, busy) counts as 30 s of latency: 10 minutes, or until
it is the only broker left (the producer then uses it anyway, as RocketMQ's pickOneAtLeast).

Threading: one event loop (the producer's).
"""

from __future__ import annotations

import time

__all__ = ["LatencyFaultTable", "FAILURE_LATENCY_MS"]

_LATENCY_MAX = (50, 100, 550, 1000, 2000, 3000, 15000)
_NOT_AVAILABLE = (0, 0, 30_000, 60_000, 120_000, 180_000, 600_000)
FAILURE_LATENCY_MS = 30_000
# Latencies below the first step with a non-zero time avoid nothing.
_FIRST_AVOIDED = min(lim for lim, dur in zip(_LATENCY_MAX, _NOT_AVAILABLE, strict=True) if dur)


class LatencyFaultTable:
    """Brokers to avoid until a deadline (monotonic seconds), from send latencies."""

    __slots__ = ("_until",)

    def __init__(self) -> None:
        self._until: dict[str, float] = {}

    @property
    def avoiding(self) -> bool:
        """True when some broker is (or was until recently) avoided: only then does a queue
        choice need :meth:`available`."""
        return bool(self._until)

    def update(self, broker: str, latency_ms: float) -> None:
        if latency_ms < _FIRST_AVOIDED:  # the common answer: nothing to avoid, one compare
            if self._until:
                self._until.pop(broker, None)
            return
        for lim, dur in zip(reversed(_LATENCY_MAX), reversed(_NOT_AVAILABLE), strict=True):
            if latency_ms >= lim:
                if dur:
                    self._until[broker] = time.monotonic() + dur / 1000
                else:
                    self._until.pop(broker, None)
                return
        self._until.pop(broker, None)

    def available(self, broker: str) -> bool:
        until = self._until.get(broker)
        if until is None:
            return True
        if time.monotonic() >= until:
            del self._until[broker]
            return True
        return False
