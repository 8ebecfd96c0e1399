"""Driver-side planning: which queues, which offsets, how much per trigger, how many tasks.

The planner asks the brokers (through the blocking ``tidemq.Admin``) for the queues of the
subscribed topics and their ``[min, max)`` offsets, resolves starting/ending offsets (earliest,
latest, JSON, timestamps), applies the admission limits (``maxOffsetsPerTrigger`` rows and
``maxBytesPerTrigger`` bytes, shared between queues in proportion to their backlog as Spark's
Kafka source does), checks the planned ranges against what is still stored (``failOnDataLoss``)
and cuts them into :class:`QueueRange` partitions, splitting big ranges to reach
``minPartitions`` / ``maxRecordsPerPartition``.

Offsets are ``{"topic": {"brokerName:queueId": offset}}`` (options.py), the form the
streaming checkpoint stores.

Threading: the driver's Python process, one thread.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from pyspark.sql.datasource import InputPartition

import tidemq
from tidemq.client.range_reader import DataLossError, RangeReader
from tidemq.spark.options import EARLIEST, LATEST, ReadOptions, parse_queue_key, queue_key

__all__ = ["Planner", "QueueRange", "Offsets"]

log = logging.getLogger(__name__)

Offsets = dict[str, dict[str, int]]
#: Bytes a message costs beyond its body when estimating maxBytesPerTrigger.
_MESSAGE_OVERHEAD = 64


class QueueRange(InputPartition):
    """One task's work: queue offsets ``[start, end)`` of one queue, and everything needed to
    read them (the task sees nothing else: the driver-side reader is not shipped)."""

    def __init__(self, namesrv: str, broker_addrs: dict[str, str], topic: str, broker_name: str,
                 queue_id: int, start: int, end: int, tags: str | None, fail_on_data_loss: bool,
                 request_timeout: float) -> None:
        super().__init__(f"{topic}/{broker_name}:{queue_id}[{start},{end})")
        self.namesrv = namesrv
        self.broker_addrs = broker_addrs
        self.topic = topic
        self.broker_name = broker_name
        self.queue_id = queue_id
        self.start = start
        self.end = end
        self.tags = tags
        self.fail_on_data_loss = fail_on_data_loss
        self.request_timeout = request_timeout

    def read(self) -> RangeReader:
        return RangeReader(self.namesrv, broker_addrs=self.broker_addrs,
                           request_timeout=self.request_timeout)

    @property
    def queue(self) -> tidemq.MessageQueue:
        return tidemq.MessageQueue(self.topic, self.broker_name, self.queue_id)


@dataclass
class _Queue:
    topic: str
    broker_name: str
    queue_id: int
    min_offset: int
    max_offset: int

    @property
    def key(self) -> str:
        return queue_key(self.broker_name, self.queue_id)

    @property
    def mq(self) -> tidemq.MessageQueue:
        return tidemq.MessageQueue(self.topic, self.broker_name, self.queue_id)


class Planner:
    """See the module docstring. ``close()`` releases the admin connection."""

    def __init__(self, opts: ReadOptions) -> None:
        self.opts = opts
        self.admin = tidemq.Admin(opts.namesrv, timeout=opts.request_timeout)
        self.broker_addrs: dict[str, str] = {}
        self._avg_size: dict[str, float] = {}

    def close(self) -> None:
        self.admin.close()

    # -- what exists -------------------------------------------------------------------------
    def topics(self) -> list[str]:
        o = self.opts
        if o.topics:
            return list(o.topics)
        if o.assign is not None:
            return sorted(o.assign)
        assert o.topic_pattern is not None
        return [t for t in self.admin.list_topics() if o.topic_pattern.fullmatch(t)]

    def queues(self) -> dict[str, dict[str, _Queue]]:
        """topic -> queue key -> the queue's current [min, max)."""
        out: dict[str, dict[str, _Queue]] = {}
        for topic in self.topics():
            try:
                route = self.admin.topic_route(topic)
            except tidemq.TidemqError as exc:
                if self.opts.topics or self.opts.assign:
                    raise
                log.warning("topic %s vanished while listing queues: %s", topic, exc)
                continue
            for bd in route.broker_datas:
                addr = bd.broker_addrs.get(0) or bd.broker_addrs.get("0")  # type: ignore[call-overload]
                if addr:
                    self.broker_addrs[bd.broker_name] = addr
            wanted = None if self.opts.assign is None else set(self.opts.assign.get(topic, []))
            qs = out.setdefault(topic, {})
            for st in self.admin.topic_status(topic):
                if wanted is not None and st.queue.queue_id not in wanted:
                    continue
                q = _Queue(topic, st.queue.broker_name, st.queue.queue_id, st.min_offset,
                           st.max_offset)
                qs[q.key] = q
        return out

    # -- offsets -----------------------------------------------------------------------------
    def resolve(self, spec: str | Offsets, timestamp: int | None,
                queues: dict[str, dict[str, _Queue]], *, default: int) -> Offsets:
        """Concrete offsets for every queue: by timestamp when given, else by ``spec``
        (earliest / latest / JSON; queues the JSON does not name get ``default``)."""
        out: Offsets = {}
        for topic, qs in queues.items():
            named = spec.get(topic, {}) if isinstance(spec, dict) else {}
            for key, q in qs.items():
                if timestamp is not None:
                    off = self.admin.search_offset(q.mq, timestamp)
                elif spec == "earliest":
                    off = EARLIEST
                elif spec == "latest":
                    off = LATEST
                else:
                    off = named.get(key, named.get(str(q.queue_id), default))
                if off == EARLIEST:
                    off = q.min_offset
                elif off == LATEST:
                    off = q.max_offset
                out.setdefault(topic, {})[key] = off
        if isinstance(spec, dict):
            for topic, named in spec.items():
                for key in named:
                    b, qid = parse_queue_key(key)
                    if not any(q.queue_id == qid and (b is None or q.broker_name == b)
                               for q in queues.get(topic, {}).values()):
                        raise DataLossError(f"offsets name queue {key} of topic {topic}, which "
                                            "does not exist (check the topic and queue ids)")
        return out

    # -- limits ------------------------------------------------------------------------------
    def avg_message_size(self, topic: str, queues: dict[str, _Queue]) -> float:
        """Bytes per message of ``topic``, from a sample of up to 64 stored messages."""
        size = self._avg_size.get(topic)
        if size is not None:
            return size
        for q in queues.values():
            if q.max_offset > q.min_offset:
                lo = max(q.min_offset, q.max_offset - 64)
                with RangeReader(self.opts.namesrv, broker_addrs=self.broker_addrs) as r:
                    n = b = 0
                    for chunk in r.read(q.mq, lo, q.max_offset, fail_on_data_loss=False):
                        n += len(chunk)
                        b += chunk.nbytes
                if n:
                    size = b / n + _MESSAGE_OVERHEAD
                    self._avg_size[topic] = size
                    return size
        return 1024.0 + _MESSAGE_OVERHEAD  # nothing stored yet: assume 1 KiB messages

    def limit(self, start: Offsets, latest: Offsets, queues: dict[str, dict[str, _Queue]],
              max_rows: int | None, max_bytes: int | None) -> Offsets:
        """``latest`` cut down so that at most ``max_rows`` messages and about ``max_bytes``
        bytes are planned; each queue gets a share proportional to its backlog."""
        lags: list[tuple[str, str, int, float]] = []
        for topic, qs in latest.items():
            size = None
            for key, end in qs.items():
                lag = end - start.get(topic, {}).get(key, end)
                if lag > 0:
                    if max_bytes is not None and size is None:
                        size = self.avg_message_size(topic, queues.get(topic, {}))
                    lags.append((topic, key, lag, size or 1.0))
        if not lags:
            return latest
        total = sum(lag for *_, lag, _s in lags)
        budget = total if max_rows is None else min(total, max_rows)
        if max_bytes is not None:
            avg = sum(lag * s for *_, lag, s in lags) / total
            budget = min(budget, max(1, int(max_bytes // avg)))
        if budget >= total:
            return latest
        out = {t: dict(qs) for t, qs in latest.items()}
        takes = {(t, k): lag * budget // total for t, k, lag, _s in lags}
        left = budget - sum(takes.values())
        for t, k, lag, _s in sorted(lags, key=lambda x: -x[2]):  # the biggest backlogs first
            if left <= 0:
                break
            extra = min(left, lag - takes[(t, k)])
            takes[(t, k)] += extra
            left -= extra
        for (t, k), take in takes.items():
            out[t][k] = start[t][k] + take
        return out

    # -- ranges ------------------------------------------------------------------------------
    def ranges(self, start: Offsets, end: Offsets, queues: dict[str, dict[str, _Queue]] | None
               ) -> list[QueueRange]:
        """Partitions covering ``[start, end)`` of every queue; a queue absent from ``start``
        (found after the query started) is read from its earliest offset."""
        o = self.opts
        plan: list[tuple[str, str, int, int]] = []
        for topic, qs in sorted(end.items()):
            for key, hi in sorted(qs.items()):
                lo = start.get(topic, {}).get(key)
                if lo is None:
                    lo = 0
                    if queues is None:
                        queues = self.queues()
                    q = queues.get(topic, {}).get(key)
                    lo = q.min_offset if q is not None else 0
                    lo = min(lo, hi)
                if hi > lo:
                    plan.append((topic, key, lo, hi))
        if plan:
            if queues is None:
                queues = self.queues()
            plan = self._check_loss(plan, queues)
        pieces = self._split(plan)
        out = []
        for topic, key, lo, hi in pieces:
            broker, qid = parse_queue_key(key)
            assert broker is not None
            out.append(QueueRange(o.namesrv, dict(self.broker_addrs), topic, broker, qid, lo, hi,
                                  o.tags, o.fail_on_data_loss, o.request_timeout))
        return out

    def _check_loss(self, plan: list[tuple[str, str, int, int]],
                    queues: dict[str, dict[str, _Queue]]) -> list[tuple[str, str, int, int]]:
        out = []
        for topic, key, lo, hi in plan:
            q = queues.get(topic, {}).get(key)
            if q is None:
                self._lost(f"queue {key} of topic {topic} no longer exists; offsets "
                           f"[{lo}, {hi}) cannot be read")
                continue
            if lo < q.min_offset:
                self._lost(f"offsets [{lo}, {min(hi, q.min_offset)}) of {topic}/{key} were "
                           f"deleted by retention (the queue now starts at {q.min_offset})")
                lo = min(q.min_offset, hi)
            if hi > q.max_offset:
                self._lost(f"offsets [{max(lo, q.max_offset)}, {hi}) of {topic}/{key} were "
                           f"planned but the queue ends at {q.max_offset} (was it truncated?)")
                hi = max(lo, q.max_offset)
            if hi > lo:
                out.append((topic, key, lo, hi))
        return out

    def _lost(self, text: str) -> None:
        if self.opts.fail_on_data_loss:
            raise DataLossError(text + ". Restart from later offsets (a new checkpoint), or set "
                                "failOnDataLoss=false to skip lost data with a warning")
        log.warning("%s; skipping (failOnDataLoss=false)", text)

    def _split(self, plan: list[tuple[str, str, int, int]]) -> list[tuple[str, str, int, int]]:
        """Split ranges so there are at least ``minPartitions`` pieces (the biggest ranges
        are split, in proportion to their size) and none exceeds ``maxRecordsPerPartition``."""
        o = self.opts
        counts = [1] * len(plan)
        total = sum(hi - lo for *_, lo, hi in plan)
        if o.min_partitions and len(plan) < o.min_partitions and total:
            counts = [max(1, math.ceil((hi - lo) * o.min_partitions / total))
                      for *_, lo, hi in plan]
        if o.max_records_per_partition:
            counts = [max(c, math.ceil((hi - lo) / o.max_records_per_partition))
                      for c, (*_, lo, hi) in zip(counts, plan, strict=True)]
        out = []
        for c, (topic, key, lo, hi) in zip(counts, plan, strict=True):
            c = min(c, hi - lo)
            for i in range(c):
                a = lo + (hi - lo) * i // c
                b = lo + (hi - lo) * (i + 1) // c
                out.append((topic, key, a, b))
        return out

    # -- consumer group ----------------------------------------------------------------------
    def commit_group(self, offsets: Offsets) -> None:
        """Store ``offsets`` as the consumer group's (``group`` option): ``tidemq group lag``
        then shows how far behind the pipeline is."""
        group = self.opts.group
        if not group:
            return
        for topic, qs in offsets.items():
            for key, off in qs.items():
                broker, qid = parse_queue_key(key)
                assert broker is not None
                self.admin.reset_consumer_offset(group, tidemq.MessageQueue(topic, broker, qid),
                                                 off)
