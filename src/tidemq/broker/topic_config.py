"""Topic configs of one broker (RocketMQ's TopicConfigManager; ref BR11).

A topic has read and write queue counts, permission bits (``Perm``) and an order flag. Producers
send only to queues below ``write_queue_nums``; consumers pull only from queues below
``read_queue_nums`` (RocketMQ lets them differ so queues can be drained before they shrink).

The table is persisted to ``<data_dir>/config/topics.json`` (base.atomic_file: tmp, fsync, rename,
fsync dir)::

    {"data_version": 7, "topics": {"orders": {"topic_name": "orders", "read_queue_nums": 8, ...}}}

``data_version`` grows with every change; the broker sends it with its registration so the name
server can tell a changed topic set from a heartbeat.

Topic names follow RocketMQ's rule ``^[%|a-zA-Z0-9_-]{1,127}$`` (``%`` and ``|`` appear in
RocketMQ's system topics such as ``%RETRY%group``); the rule lives in ``protocol/names.py``.

Threads: the broker's event loop only. :meth:`snapshot` returns bytes another thread may write.
"""

from __future__ import annotations

import logging

import msgspec

from tidemq.base.atomic_file import read_file, write_atomic
from tidemq.protocol.headers import Perm, TopicConfig
from tidemq.protocol.names import topic_name_problem

__all__ = ["TopicConfigManager", "topic_name_problem", "MAX_QUEUE_NUMS"]

log = logging.getLogger(__name__)

#: Most queues one topic may have on one broker (a bound against typos like 80000).
MAX_QUEUE_NUMS = 16_384


class _TopicsFile(msgspec.Struct, omit_defaults=True):
    data_version: int = 0
    topics: dict[str, TopicConfig] = {}


_decoder = msgspec.json.Decoder(_TopicsFile)
_encoder = msgspec.json.Encoder()


def config_problem(tc: TopicConfig) -> str | None:
    """Why ``tc`` cannot be stored, for a person; None when it can."""
    problem = topic_name_problem(tc.topic_name)
    if problem:
        return problem
    for name in ("read_queue_nums", "write_queue_nums"):
        n = getattr(tc, name)
        if not 1 <= n <= MAX_QUEUE_NUMS:
            return f"{name} must be 1..{MAX_QUEUE_NUMS}, got {n}"
    if tc.perm & ~(Perm.PRIORITY | Perm.READ | Perm.WRITE | Perm.INHERIT):
        return f"perm {tc.perm:#x} has unknown bits; use READ (4) | WRITE (2)"
    return None


class TopicConfigManager:
    """The topic table of one broker and its file (event loop only; see the module doc)."""

    def __init__(self, path: str, *, default_queue_nums: int = 8) -> None:
        self.path = path
        self.default_queue_nums = default_queue_nums
        self.data_version = 0
        self._topics: dict[str, TopicConfig] = {}
        #: Names of the topics with ``shrinking_to`` set, kept with every change so the
        #: shrinker's once-a-second pass looks at these, not at every topic.
        self._shrinking: set[str] = set()
        #: Grows with every change of the table (``data_version`` can stay put when a slave
        #: adopts a table): the broker's writer compares it, not a second encoding.
        self.changes = 0

    # -- persistence ---------------------------------------------------------------------------
    def load(self) -> None:
        raw = read_file(self.path)
        if raw is None:
            return
        try:
            data = _decoder.decode(raw)
        except msgspec.DecodeError as exc:
            raise ValueError(
                f"{self.path} is not a valid topics file ({exc}); fix or remove it (topics are "
                "re-created by auto-create or by `tidemq topic create`)"
            ) from exc
        self._topics = dict(data.topics)
        self.data_version = data.data_version
        self._shrinking = {n for n, tc in self._topics.items() if tc.shrinking_to}
        self.changes += 1  # configs remembered by ``changes`` (the send door's) are stale

    def snapshot(self) -> bytes:
        return _encoder.encode(_TopicsFile(self.data_version, self._topics))

    def persist(self) -> None:
        write_atomic(self.path, self.snapshot())

    # -- queries -------------------------------------------------------------------------------
    def get(self, topic: str) -> TopicConfig | None:
        return self._topics.get(topic)

    def all(self) -> dict[str, TopicConfig]:
        return dict(self._topics)

    def shrinking(self) -> list[TopicConfig]:
        """The configs of the topics whose read queues are being shrunk (queue_shrink.py)."""
        return [self._topics[n] for n in sorted(self._shrinking)]

    def __len__(self) -> int:
        return len(self._topics)

    def total_queues(self) -> int:
        return sum(max(t.read_queue_nums, t.write_queue_nums) for t in self._topics.values())

    # -- changes ---------------------------------------------------------------------------------
    def update(self, tc: TopicConfig) -> TopicConfig:
        """Create or replace a topic; ValueError (the message says what is wrong) if invalid."""
        problem = config_problem(tc)
        if problem:
            raise ValueError(problem)
        old = self._topics.get(tc.topic_name)
        self._topics[tc.topic_name] = tc
        if tc.shrinking_to:
            self._shrinking.add(tc.topic_name)
        else:
            self._shrinking.discard(tc.topic_name)
        if old != tc:
            self.changes += 1
            self.data_version += 1
            log.info("topic %s %s: %s", tc.topic_name, "updated" if old else "created", tc)
        return tc

    def auto_create(self, topic: str) -> TopicConfig:
        """The config a send to an unknown topic creates (RocketMQ autoCreateTopicEnable)."""
        n = self.default_queue_nums
        return self.update(TopicConfig(topic_name=topic, read_queue_nums=n, write_queue_nums=n))

    def delete(self, topic: str) -> bool:
        if self._topics.pop(topic, None) is None:
            return False
        self._shrinking.discard(topic)
        self.changes += 1
        self.data_version += 1
        log.info("topic %s deleted", topic)
        return True

    def adopt(self, topics: dict[str, TopicConfig], data_version: int) -> bool:
        """A slave takes its master's topic table as it is; True if it changed."""
        if topics == self._topics and data_version == self.data_version:
            return False
        self._topics = dict(topics)
        self.data_version = data_version
        self._shrinking = {n for n, tc in self._topics.items() if tc.shrinking_to}
        self.changes += 1
        return True
