"""Passes over every queue of a consumer give the event loop back as they go (issue 17).

A push consumer of 10,000 queues walks all of them in its periodic jobs: the rebalance pass
(1,250 topics, every 20 s), the offset persist (every 5 s) and the expired-message check. Each
step awaits only what is already cached, so without a yield a pass is one stretch of the loop:
measured at 10,000 queues on the loaded 2-core machine (docs/benchmarks.md, "the push
consumer's tail at 10,000 queues"), 15.5 ms of CPU for a rebalance pass and 7.6 ms for a
persist, during which no answer is read and no listener runs -- every message arriving then
waits for the pass. :class:`Slicer` lets such a loop yield once it has held the loop for
``SLICE`` seconds."""

from __future__ import annotations

import time

__all__ = ["Slicer", "SLICE"]

#: how long a pass holds the loop before it yields (a message's p99 target is 5 ms)
SLICE = 0.001


class Slicer:
    """``if s.due(): await asyncio.sleep(0)`` in a loop: True once ``SLICE`` has passed since
    the start or the last time it said so."""

    __slots__ = ("_t",)

    def __init__(self) -> None:
        self._t = time.perf_counter()

    def due(self) -> bool:
        now = time.perf_counter()
        if now - self._t < SLICE:
            return False
        self._t = now
        return True
