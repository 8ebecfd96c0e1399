"""The data source's options, parsed and checked once on the driver.

Names follow Spark's Kafka source where the meaning is the same (docs/spark.md lists them all):
``topics`` / ``topicPattern`` / ``assign``, ``startingOffsets`` / ``endingOffsets``,
``startingTimestamp`` / ``endingTimestamp``, ``maxOffsetsPerTrigger``, ``maxBytesPerTrigger``,
``minPartitions``, ``failOnDataLoss``, plus tidemq's ``namesrv``, ``tags`` and ``group``.

Offsets in JSON options and in the streaming checkpoint: ``{"topic": {"<queue>": offset}}``
where ``<queue>`` is ``"brokerName:queueId"`` (what the checkpoint stores) or a bare
``"queueId"`` (every broker's queue of that id, convenient on one broker). In starting/ending
offsets ``-2`` means earliest and ``-1`` latest, as in Kafka.

Plain values: any thread.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import overload

from tidemq.client.errors import ClientError

__all__ = ["ReadOptions", "WriteOptions", "OptionError", "queue_key", "parse_queue_key",
           "EARLIEST", "LATEST"]

EARLIEST = -2
LATEST = -1


class OptionError(ClientError):
    """A data source option is missing or malformed."""

    code = "BAD_OPTION"


def queue_key(broker_name: str, queue_id: int) -> str:
    return f"{broker_name}:{queue_id}"


def parse_queue_key(key: str) -> tuple[str | None, int]:
    """``"broker-a:3"`` -> ("broker-a", 3); ``"3"`` -> (None, 3)."""
    broker, _, qid = key.rpartition(":")
    try:
        return (broker or None), int(qid)
    except ValueError:
        raise OptionError(f"queue {key!r} is neither 'queueId' nor 'brokerName:queueId'")


class _Options(dict[str, str]):
    """Options looked up by name whatever the case, as Spark's own options are: Spark hands a
    data source its options with lower-cased names (``batchrows``), and a plain dict of them
    (what a writer receives when the options were copied) would miss ``batchRows``."""

    def __init__(self, opts: Mapping[str, str]) -> None:
        super().__init__({str(k).lower(): v for k, v in opts.items()})

    @overload  # type: ignore[override]
    def get(self, name: str) -> str | None: ...
    @overload
    def get(self, name: str, default: str) -> str: ...

    def get(self, name: str, default: str | None = None) -> str | None:
        return super().get(name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return super().__getitem__(name.lower())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and super().__contains__(name.lower())


def _bool(opts: Mapping[str, str], name: str, default: bool) -> bool:
    v = opts.get(name)
    if v is None:
        return default
    if str(v).lower() in ("true", "1", "yes"):
        return True
    if str(v).lower() in ("false", "0", "no"):
        return False
    raise OptionError(f"option {name}={v!r} must be true or false")


def _int(opts: Mapping[str, str], name: str, default: int | None = None) -> int | None:
    v = opts.get(name)
    if v is None or v == "":
        return default
    try:
        n = int(str(v))
    except ValueError:
        raise OptionError(f"option {name}={v!r} must be an integer")
    if n < 0:
        raise OptionError(f"option {name}={v!r} must not be negative")
    return n


def _offsets(opts: Mapping[str, str], name: str, default: str
             ) -> str | dict[str, dict[str, int]]:
    v = opts.get(name, default)
    if v in ("earliest", "latest"):
        return v
    try:
        spec = json.loads(v)
    except ValueError:
        raise OptionError(f"option {name} must be earliest, latest or JSON "
                          '{"topic": {"queueId": offset}}, got ' + repr(v))
    if not isinstance(spec, dict) or not all(isinstance(q, dict) for q in spec.values()):
        raise OptionError(f"option {name} must map topics to {{queue: offset}}, got {v!r}")
    out: dict[str, dict[str, int]] = {}
    for topic, queues in spec.items():
        out[topic] = {}
        for q, off in queues.items():
            parse_queue_key(str(q))
            if not isinstance(off, int) or off < EARLIEST:
                raise OptionError(f"{name}: offset of {topic}/{q} must be an integer >= -2")
            out[topic][str(q)] = off
    return out


@dataclass
class ReadOptions:
    namesrv: str
    topics: list[str] = field(default_factory=list)
    topic_pattern: re.Pattern[str] | None = None
    assign: dict[str, list[int]] | None = None
    starting: str | dict[str, dict[str, int]] = "latest"
    ending: str | dict[str, dict[str, int]] = "latest"
    starting_timestamp: int | None = None
    ending_timestamp: int | None = None
    max_offsets_per_trigger: int | None = None
    max_bytes_per_trigger: int | None = None
    min_partitions: int | None = None
    max_records_per_partition: int | None = None
    fail_on_data_loss: bool = True
    tags: str | None = None
    group: str | None = None
    request_timeout: float = 10.0

    @classmethod
    def parse(cls, opts: Mapping[str, str], *, streaming: bool) -> ReadOptions:
        opts = _Options(opts)
        namesrv = opts.get("namesrv")
        if not namesrv:
            raise OptionError("option namesrv (name server host:port) is required")
        chosen = [k for k in ("topics", "topicPattern", "assign") if opts.get(k)]
        if len(chosen) != 1:
            raise OptionError("set exactly one of the options topics, topicPattern, assign "
                              f"(got {chosen or 'none'})")
        r = cls(namesrv=namesrv)
        if opts.get("topics"):
            r.topics = [t.strip() for t in opts["topics"].split(",") if t.strip()]
        elif opts.get("topicPattern"):
            try:
                r.topic_pattern = re.compile(opts["topicPattern"])
            except re.error as exc:
                raise OptionError(f"topicPattern is not a regular expression: {exc}")
        else:
            try:
                spec = json.loads(opts["assign"])
                r.assign = {str(t): [int(q) for q in qs] for t, qs in spec.items()}
            except (ValueError, TypeError, AttributeError):
                raise OptionError('assign must be JSON {"topic": [queueId, ...]}, got '
                                  + repr(opts["assign"]))
        r.starting = _offsets(opts, "startingOffsets", "latest" if streaming else "earliest")
        r.ending = _offsets(opts, "endingOffsets", "latest")
        if streaming and "endingOffsets" in opts:
            raise OptionError("endingOffsets is for batch reads only")
        if not streaming and r.starting == "latest":
            raise OptionError("startingOffsets=latest makes an empty batch read; use earliest "
                              "or JSON offsets")
        if not streaming and r.ending == "earliest":
            raise OptionError("endingOffsets=earliest makes an empty batch read")
        r.starting_timestamp = _int(opts, "startingTimestamp")
        r.ending_timestamp = _int(opts, "endingTimestamp")
        if streaming and r.ending_timestamp is not None:
            raise OptionError("endingTimestamp is for batch reads only")
        r.max_offsets_per_trigger = _int(opts, "maxOffsetsPerTrigger")
        r.max_bytes_per_trigger = _int(opts, "maxBytesPerTrigger")
        r.min_partitions = _int(opts, "minPartitions")
        r.max_records_per_partition = _int(opts, "maxRecordsPerPartition")
        for name in ("maxOffsetsPerTrigger", "maxBytesPerTrigger", "minPartitions",
                     "maxRecordsPerPartition"):
            if opts.get(name) is not None and _int(opts, name) == 0:
                raise OptionError(f"option {name} must be positive")
        r.fail_on_data_loss = _bool(opts, "failOnDataLoss", True)
        r.tags = opts.get("tags") or None
        r.group = opts.get("group") or None
        r.request_timeout = float(opts.get("requestTimeoutMs", "10000")) / 1000
        return r


@dataclass
class WriteOptions:
    namesrv: str
    topic: str | None = None
    request_timeout: float = 10.0
    #: Rows / bytes per sent batch (a fixed function of the rows, so a retry sends the same).
    batch_rows: int = 1024
    batch_bytes: int = 1 << 20
    #: Sort each partition's rows before numbering them (replays that reorder rows stay exact).
    sort_rows: bool = True
    #: Fault-injection point for tests (option ``testPauseAfterRows`` with ``testPauseDir``):
    #: in a task's first attempt, once this many rows of the partition are stored, touch
    #: ``paused-<partition>`` in the directory and wait (at most 2 min) for a ``release`` file,
    #: so a test can kill -9 the task at a known point. 0 = off.
    test_pause_after_rows: int = 0
    test_pause_dir: str | None = None

    @classmethod
    def parse(cls, opts: Mapping[str, str]) -> WriteOptions:
        opts = _Options(opts)
        namesrv = opts.get("namesrv")
        if not namesrv:
            raise OptionError("option namesrv (name server host:port) is required")
        w = cls(namesrv=namesrv, topic=opts.get("topic") or None)
        w.request_timeout = float(opts.get("requestTimeoutMs", "10000")) / 1000
        w.batch_rows = _int(opts, "batchRows", 1024) or 1024
        w.batch_bytes = _int(opts, "batchBytes", 1 << 20) or 1 << 20
        if w.batch_bytes > 3 << 20:
            raise OptionError("batchBytes must be at most 3 MiB (a sent batch is at most 4 MiB)")
        w.sort_rows = _bool(opts, "sortRows", True)
        w.test_pause_after_rows = _int(opts, "testPauseAfterRows", 0) or 0
        w.test_pause_dir = opts.get("testPauseDir") or None
        if w.test_pause_after_rows and not w.test_pause_dir:
            raise OptionError("option testPauseAfterRows needs testPauseDir")
        return w
