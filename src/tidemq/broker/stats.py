"""Broker statistics (RocketMQ's BrokerStatsManager / StoreStatsService; ref BR14).

Counters only grow: messages and bytes put per topic, messages and bytes got per
``topic@group``, batches, and a histogram of store put latency. They are updated once per batch
(never per message) on the send and pull paths.

Rates come from samples: every ``sample_interval`` seconds the counters are copied into a ring
that covers the last minute; a rate is (counter now - counter at the oldest sample) / elapsed.
That is RocketMQ's "TPS over the last minute" in spirit, without a timer per key. A sample
copies only the counters that changed since the previous one (the hot path notes the key in a
set), so a broker with 12,500 topics of which a few are busy samples a few keys, not all: a
key's value at the oldest sample is that sample's copy if it has one, else ``_base`` (the
values of the samples that left the ring, merged as they leave).

Backlog (lag) is not counted here: it is computed on demand from the queue's max offset and the
group's committed offset (see admin_processor), so it is exact and costs nothing on the hot path.

Threads: the broker's event loop only.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable

__all__ = ["BrokerStats", "LATENCY_BUCKETS_MS"]

#: Upper bounds (ms) of the put latency histogram buckets; the last bucket is open-ended.
LATENCY_BUCKETS_MS = (0.1, 0.5, 1.0, 5.0, 10.0, 50.0, 100.0, 500.0)

_WINDOW_S = 60.0


# (time, put messages by topic, get messages by topic@group, put total, get total)
_Sample = tuple[float, dict[str, int], dict[str, int], int, int]


class BrokerStats:
    """Counters and rate samples of one broker (event loop only)."""

    def __init__(
        self, sample_interval_s: float = 5.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._clock = clock
        self.started = clock()
        self.started_wall_ms = time.time_ns() // 1_000_000
        # topic -> [messages, bytes, batches]
        self.put: dict[str, list[int]] = {}
        # "topic@group" -> [messages, bytes, pulls that found messages]
        self.get: dict[str, list[int]] = {}
        self.put_total = [0, 0, 0]
        self.get_total = [0, 0, 0]
        self.put_latency_buckets = [0] * (len(LATENCY_BUCKETS_MS) + 1)
        self.put_latency_max_ms = 0.0
        self.put_latency_sum_ms = 0.0
        self.send_errors = 0
        n = max(2, int(_WINDOW_S / max(sample_interval_s, 0.001)) + 1)
        # (time, put totals by topic, get totals by topic@group, put total, get total) of the
        # keys that changed since the previous sample
        self._samples: deque[_Sample] = deque(maxlen=n)
        self._put_changed: set[str] = set()
        self._get_changed: set[str] = set()
        # values at the newest sample that left the ring (keys absent: 0)
        self._base_put: dict[str, int] = {}
        self._base_get: dict[str, int] = {}
        #: keys copied by the last :meth:`sample` (what a pass cost; tests read it)
        self.last_sample_keys = 0

    # -- hot path: once per batch ----------------------------------------------------------------
    def record_put(self, topic: str, msgs: int, nbytes: int, latency_s: float) -> None:
        c = self.put.get(topic)
        if c is None:
            c = self.put[topic] = [0, 0, 0]
        self._put_changed.add(topic)
        c[0] += msgs
        c[1] += nbytes
        c[2] += 1
        t = self.put_total
        t[0] += msgs
        t[1] += nbytes
        t[2] += 1
        # _record_latency(ms, 1), inlined: this runs once per stored batch
        ms = latency_s * 1000.0
        self.put_latency_sum_ms += ms
        if ms > self.put_latency_max_ms:
            self.put_latency_max_ms = ms
        self.put_latency_buckets[bisect_left(LATENCY_BUCKETS_MS, ms)] += 1

    def record_puts(self, puts: list[tuple[str, int, int]], latency_s: float) -> None:
        """:meth:`record_put` of several batches (topic, messages, bytes) stored together,
        each taking ``latency_s``: the per-topic counters per batch, the totals and the
        latency histogram once (a SEND_MULTI_QUEUE run of one-message batches)."""
        counter = self.put_counter
        self.record_put_counters([(t, counter(t), m, b) for t, m, b in puts], latency_s)

    def put_counter(self, topic: str) -> list[int]:
        """The topic's [messages, bytes, batches] counter (created at zero): the same list for
        the broker's lifetime (counters only grow), so a caller may keep it for
        :meth:`record_put_counters`."""
        c = self.put.get(topic)
        if c is None:
            c = self.put[topic] = [0, 0, 0]
        return c

    def record_put_counters(self, puts: list[tuple[str, list[int], int, int]],
                            latency_s: float) -> None:
        """:meth:`record_puts` of batches (topic, its :meth:`put_counter`, messages, bytes)
        whose counters the caller already holds: no lookup of the topic per batch (a
        SEND_MULTI_QUEUE frame over 12,500 topics, issue 17)."""
        if not puts:
            return
        changed = self._put_changed
        msgs = nbytes = 0
        for topic, c, m, b in puts:
            changed.add(topic)
            c[0] += m
            c[1] += b
            c[2] += 1
            msgs += m
            nbytes += b
        n = len(puts)
        t = self.put_total
        t[0] += msgs
        t[1] += nbytes
        t[2] += n
        self._record_latency(latency_s * 1000.0, n)

    def _record_latency(self, ms: float, n: int) -> None:
        """``n`` puts of ``ms`` each into the latency sum, maximum and histogram."""
        self.put_latency_sum_ms += ms * n
        if ms > self.put_latency_max_ms:
            self.put_latency_max_ms = ms
        # the first bucket whose bound is >= ms (the last one past every bound)
        self.put_latency_buckets[bisect_left(LATENCY_BUCKETS_MS, ms)] += n

    def record_get(self, group: str, topic: str, msgs: int, nbytes: int) -> None:
        key = f"{topic}@{group}"
        c = self.get.get(key)
        if c is None:
            c = self.get[key] = [0, 0, 0]
        self._get_changed.add(key)
        c[0] += msgs
        c[1] += nbytes
        c[2] += 1
        t = self.get_total
        t[0] += msgs
        t[1] += nbytes
        t[2] += 1

    # -- sampling and rates ----------------------------------------------------------------------
    def sample(self) -> None:
        """Record the counters that changed since the last sample (called every sample
        interval by the broker)."""
        if len(self._samples) == self._samples.maxlen:
            _t, put, get, _pt, _gt = self._samples[0]  # leaves the ring now
            self._base_put.update(put)
            self._base_get.update(get)
        put_keys, self._put_changed = self._put_changed, set()
        get_keys, self._get_changed = self._get_changed, set()
        self.last_sample_keys = len(put_keys) + len(get_keys)
        self._samples.append(
            (
                self._clock(),
                {k: self.put[k][0] for k in put_keys},
                {k: self.get[k][0] for k in get_keys},
                self.put_total[0],
                self.get_total[0],
            )
        )

    def _base(self) -> _Sample:
        if self._samples:
            return self._samples[0]
        return (self.started, {}, {}, 0, 0)

    def _put_at_base(self, topic: str) -> int:
        if not self._samples:
            return 0
        return self._samples[0][1].get(topic, self._base_put.get(topic, 0))

    def _get_at_base(self, key: str) -> int:
        if not self._samples:
            return 0
        return self._samples[0][2].get(key, self._base_get.get(key, 0))

    def _elapsed(self, since: float) -> float:
        return max(self._clock() - since, 1e-3)

    def put_tps(self, topic: str | None = None) -> float:
        ts, _p, _g, total, _gt = self._base()
        if topic is None:
            return (self.put_total[0] - total) / self._elapsed(ts)
        now = self.put.get(topic, (0,))[0]
        return (now - self._put_at_base(topic)) / self._elapsed(ts)

    def get_tps(self, group: str | None = None, topic: str | None = None) -> float:
        """Messages per second got by ``group`` (all its topics unless ``topic``), or by all."""
        ts, _p, _g, _pt, total = self._base()
        if group is None:
            return (self.get_total[0] - total) / self._elapsed(ts)
        got = 0
        for key, c in self.get.items():
            t, _, g = key.rpartition("@")
            if g == group and (topic is None or t == topic):
                got += c[0] - self._get_at_base(key)
        return got / self._elapsed(ts)

    def uptime_s(self) -> float:
        return self._clock() - self.started

    def summary(self) -> dict[str, int | float]:
        n = self.put_total[2]
        out: dict[str, int | float] = {
            "put_total_msgs": self.put_total[0],
            "put_total_bytes": self.put_total[1],
            "put_total_batches": n,
            "get_total_msgs": self.get_total[0],
            "get_total_bytes": self.get_total[1],
            "put_tps": round(self.put_tps(), 3),
            "get_tps": round(self.get_tps(), 3),
            "put_latency_avg_ms": round(self.put_latency_sum_ms / n, 4) if n else 0.0,
            "put_latency_max_ms": round(self.put_latency_max_ms, 4),
            "send_errors": self.send_errors,
        }
        for bound, count in zip(
            (*LATENCY_BUCKETS_MS, float("inf")), self.put_latency_buckets, strict=True
        ):
            out[f"put_latency_le_{bound:g}ms"] = count
        return out
