"""Prometheus metrics of one broker (ref BR14; docs/operations.md lists every metric).

``tidemq broker --metrics-port 9100`` (or ``-o metrics_port=9100``; 0 = any free port, -1 =
off, the default) serves the text exposition format at ``http://HOST:PORT/metrics``.

The metric families are built by :class:`BrokerCollector` at scrape time from the counters the
broker keeps anyway (:class:`~tidemq.broker.stats.BrokerStats`, the consumer offsets, the store),
so serving metrics adds nothing to the send and pull paths. prometheus-client encodes the
families (``generate_latest``); the HTTP endpoint is served from the broker's own event loop
rather than with prometheus-client's ``start_http_server`` because that server runs in a thread
and would read loop-owned dictionaries while the loop mutates them.

Threads: the broker's event loop only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from tidemq.broker.stats import LATENCY_BUCKETS_MS

if TYPE_CHECKING:
    from tidemq.broker.broker import Broker

__all__ = ["BrokerCollector", "MetricsServer"]

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: Runtime-info keys exported as plain gauges ``tidemq_<key>`` (counters are typed below).
_GAUGES = {
    "topics": "Topics on this broker.",
    "queues": "Consume queues in the store.",
    "connections": "Open client connections.",
    "held_pulls": "Pull requests held by long polling now.",
    "online_groups": "Consumer groups with live members.",
    "rss_bytes": "Resident set size of the broker process.",
    "delay_pending": "Messages waiting on a delay level.",
    "txn_half_pending": "Half (prepared) transactional messages not yet resolved.",
    "timer_bucket_files": "Timer-index bucket files holding pending timed messages.",
    "epoch": "Replication epoch of this broker's group (docs/cluster.md).",
    "ha_slaves": "Slaves connected to this master.",
    "ha_in_sync_slaves": "Slaves in sync (they count for SYNC_MASTER sends).",
    "ha_max_lag_bytes": "CommitLog bytes the furthest-behind slave lacks (master).",
    "ha_max_lag_ms": "Age in ms of the oldest byte a slave lacks (master).",
    "ha_waiting_sends": "SYNC_MASTER sends waiting for their slaves.",
    "ha_lag_bytes": "CommitLog bytes this slave lacks, as its master last said (slave).",
    "ha_last_heard_ms": "Milliseconds since this slave last heard from its master (slave).",
    "partial_frame_bytes": "Bytes held in frames that have not fully arrived, all connections.",
    "connections_paused": "Connections not read from because their client does not read.",
}
_COUNTERS = {
    "held_woken_by_arrival": "Held pulls answered because a message arrived.",
    "held_woken_by_check": "Held pulls answered by the periodic fallback check.",
    "held_timed_out": "Held pulls answered NOT_FOUND at their suspend timeout.",
    "sent_back_retry": "Messages a consumer sent back to its retry topic.",
    "sent_back_dlq": "Messages moved to a dead-letter queue.",
    "delay_delivered": "Delay-level messages delivered to their real topic.",
    "timer_delivered": "Timed (deliver_at) messages delivered to their real topic.",
    "consumer_notifications": "Group-change notifications sent to consumers.",
    "ha_slave_not_available": "SYNC_MASTER sends answered SLAVE_NOT_AVAILABLE.",
    "ha_truncated_bytes": "CommitLog bytes a slave cut because its master never had them.",
    "ha_offsets_flowed_back": "Consumer offsets a slave took that reached this master.",
    "connections_refused": "Connections refused (SYSTEM_BUSY) at max_connections.",
    "frames_dropped_busy": "Partial frames dropped (SYSTEM_BUSY) at max_partial_frame_bytes.",
    "partial_frame_timeouts": "Connections closed for a frame incomplete past its timeout.",
    "connections_overflowed": "Connections closed past max_queued_response_bytes.",
}


class BrokerCollector:
    """A prometheus-client collector reading one broker's state at scrape time."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    def collect(self) -> Iterator[Metric]:
        b = self.broker
        info = b.runtime_info()
        up = GaugeMetricFamily("tidemq_up", "1 while the broker serves.", labels=["broker"])
        up.add_metric([b.config.broker_name], 1.0)
        yield up
        for key, doc in _GAUGES.items():
            if key in info:
                yield GaugeMetricFamily(f"tidemq_{key}", doc, value=float(info[key]))
        for key, doc in _COUNTERS.items():
            if key in info:
                yield CounterMetricFamily(f"tidemq_{key}", doc, value=float(info[key]))
        yield GaugeMetricFamily(
            "tidemq_disk_full", "1 while the store refuses writes (disk nearly full).",
            value=1.0 if info.get("disk_full") else 0.0,
        )
        cl = GaugeMetricFamily(
            "tidemq_commitlog_offset_bytes", "CommitLog offsets: min (oldest kept), max "
            "(written), flushed (durable).", labels=["kind"],
        )
        cl.add_metric(["min"], float(info["commitlog_min_offset"]))
        cl.add_metric(["max"], float(info["commitlog_max_offset"]))
        cl.add_metric(["flushed"], float(info["commitlog_flushed_offset"]))
        yield cl
        corrupt = CounterMetricFamily(
            "tidemq_corrupt_records", "Records skipped because they do not decode (non-UTF-8 "
            "strings, bad sizes, decompression over the limit), per reader.", labels=["reader"])
        for reader, n in sorted(b.store.corrupt.counts.items()):
            corrupt.add_metric([reader], float(n))
        yield corrupt
        yield GaugeMetricFamily(
            "tidemq_quarantined_batches", "Damaged CommitLog batches found by recovery or a "
            "read, never served.", value=float(info["quarantined_batches"]))
        yield from self._traffic()
        yield from self._lag()

    def _traffic(self) -> Iterator[Metric]:
        stats = self.broker.stats
        put_msgs = CounterMetricFamily(
            "tidemq_put_messages", "Messages stored, per topic.", labels=["topic"])
        put_bytes = CounterMetricFamily(
            "tidemq_put_bytes", "Bytes stored, per topic.", labels=["topic"])
        put_batches = CounterMetricFamily(
            "tidemq_put_batches", "Batches stored, per topic.", labels=["topic"])
        for topic, (msgs, nbytes, batches) in list(stats.put.items()):
            put_msgs.add_metric([topic], float(msgs))
            put_bytes.add_metric([topic], float(nbytes))
            put_batches.add_metric([topic], float(batches))
        yield from (put_msgs, put_bytes, put_batches)
        got_msgs = CounterMetricFamily(
            "tidemq_got_messages", "Messages served to pulls, per topic and group.",
            labels=["topic", "group"])
        got_bytes = CounterMetricFamily(
            "tidemq_got_bytes", "Bytes served to pulls, per topic and group.",
            labels=["topic", "group"])
        for key, (msgs, nbytes, _pulls) in list(stats.get.items()):
            topic, _, group = key.rpartition("@")
            got_msgs.add_metric([topic, group], float(msgs))
            got_bytes.add_metric([topic, group], float(nbytes))
        yield from (got_msgs, got_bytes)
        errors = CounterMetricFamily("tidemq_send_errors", "Sends answered with an error.")
        errors.add_metric([], float(stats.send_errors))
        yield errors
        # The stats keep per-bucket counts; Prometheus wants cumulative ones, in seconds.
        buckets = []
        running = 0
        for bound, n in zip(
            (*LATENCY_BUCKETS_MS, float("inf")), stats.put_latency_buckets, strict=True
        ):
            running += n
            le = "+Inf" if bound == float("inf") else repr(bound / 1000)
            buckets.append((le, float(running)))
        yield HistogramMetricFamily(
            "tidemq_put_latency_seconds", "Store put latency of one batch (per batch).",
            buckets=buckets, sum_value=stats.put_latency_sum_ms / 1000,
        )

    def _lag(self) -> Iterator[Metric]:
        """Backlog per group and queue: the queue's max offset minus the committed offset,
        exact and computed only here (as GET_CONSUME_STATS does)."""
        b = self.broker
        lag = GaugeMetricFamily(
            "tidemq_consumer_lag_messages",
            "Messages not yet consumed, per consumer group, topic and queue.",
            labels=["group", "topic", "queue"])
        for group in b.offsets.groups():
            for topic in b.offsets.topics_of_group(group):
                tc = b.topics.get(topic)
                if tc is None:
                    continue
                for qid in range(tc.read_queue_nums):
                    committed = max(b.offsets.query(group, topic, qid), 0)
                    behind = max(0, b.store.max_offset(topic, qid) - committed)
                    lag.add_metric([group, topic, str(qid)], float(behind))
        yield lag


class MetricsServer:
    """``GET /metrics`` over HTTP/1.0-style one-request connections, on the broker's loop.

    Hand-written on purpose (see the module docstring): a scrape is one small request per
    interval, so a minimal reader is all that is needed; anything but ``GET /metrics`` (or ``/``)
    gets 404, a malformed request 400."""

    def __init__(self, broker: Broker) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(BrokerCollector(broker))
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._serve, host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("metrics on http://%s:%d/metrics", host, self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            parts = head.split(b"\r\n", 1)[0].split()
            if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
                status, body, ctype = b"400 Bad Request", b"malformed request line\n", b"text/plain"
            elif parts[0] != b"GET" or parts[1].split(b"?")[0] not in (b"/metrics", b"/"):
                status, body, ctype = b"404 Not Found", b"try GET /metrics\n", b"text/plain"
            else:
                body = generate_latest(self.registry)
                status, ctype = b"200 OK", CONTENT_TYPE.encode()
            writer.write(
                b"HTTP/1.1 " + status + b"\r\nContent-Type: " + ctype
                + b"\r\nContent-Length: " + str(len(body)).encode()
                + b"\r\nConnection: close\r\n\r\n" + body
            )
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError,
                ConnectionError):
            pass
        except Exception:  # a scrape must never take the broker down
            log.exception("metrics request failed")
        finally:
            writer.close()
