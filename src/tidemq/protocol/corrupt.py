"""Counting and reporting records a reader could not decode ("tolerate on the way out").

Every reader of stored batches -- the broker's timer and delay services, recovery, index
building, send-back, the transaction check, the client's decoders, the Spark source -- treats a
record it cannot decode (a tag, key, property or topic that is not UTF-8, sizes that do not add
up, records that do not decompress or decompress to more than the reader allows, a CRC
mismatch) as corrupt: it skips it, counts it, says where it was, and moves on. A queue is never
stalled and a restart never fails because of what a message holds.

:class:`CorruptRecords` is the one place those skips are counted (per reader, for the metrics
and the stats) and logged: the first ``burst`` skips of each ``interval`` seconds are logged
with topic, queue and offset; the rest are counted and summed up in the next line that is
logged, so a queue full of damaged records cannot flood the log.

Not thread-safe by itself: the counters are plain ints updated by whichever thread reads (a
lost increment under a race costs one count, never a crash).
"""

from __future__ import annotations

import logging
import time

__all__ = ["CorruptRecords"]


class CorruptRecords:
    """Skipped-record counters of one process part, with rate-limited logging."""

    def __init__(self, logger: logging.Logger, *, interval: float = 10.0, burst: int = 5) -> None:
        self.log = logger
        self.interval = interval
        self.burst = burst
        #: reader name -> records skipped (messages; a skipped batch counts its messages, a
        #: body whose framing broke counts 1)
        self.counts: dict[str, int] = {}
        #: skips reported (one per damaged batch or undecodable message)
        self.events = 0
        self._window_start = -1e18
        self._logged = 0
        self._suppressed = 0

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def skipped(self, reader: str, where: str, reason: str, n: int = 1) -> None:
        """Count ``n`` records skipped by ``reader`` and log ``where`` (topic, queue, offset)
        and ``reason``, rate-limited."""
        self.counts[reader] = self.counts.get(reader, 0) + max(n, 1)
        self.events += 1
        now = time.monotonic()
        if now - self._window_start >= self.interval:
            self._window_start = now
            self._logged = 0
        if self._logged >= self.burst:
            self._suppressed += 1
            return
        self._logged += 1
        more = ""
        if self._suppressed:
            more = f" ({self._suppressed} more skipped records were not logged)"
            self._suppressed = 0
        self.log.error("%s skipped a corrupt record at %s: %s%s", reader, where, reason, more)
