"""Committed consumer offsets (RocketMQ's ConsumerOffsetManager; ref BR4, CO7).

An offset is the next queue offset the group will consume, per (group, topic, queue id). It is
committed explicitly (UPDATE_CONSUMER_OFFSET) or piggy-backed on a pull (PullSysFlag
COMMIT_OFFSET), kept in memory, and persisted every ``offset_persist_interval_ms`` (5 s) and on
shutdown to ``<data_dir>/config/consumer_offsets.json`` (base.atomic_file: tmp, fsync, rename,
fsync dir)::

    {"offset_table": {"<topic>@<group>": {"0": 1200, "1": 1180}}}

The key is RocketMQ's ``topic@group`` (neither name may contain '@'). A kill -9 loses at most
the commits of the last interval: consumers then re-read a few messages (at-least-once), never
skip any.

Threads: the broker's event loop only; :meth:`snapshot` returns bytes another thread may write.
"""

from __future__ import annotations

import msgspec

from tidemq.base.atomic_file import read_file, write_atomic

__all__ = ["ConsumerOffsetManager", "NO_OFFSET"]

NO_OFFSET = -1


class _OffsetsFile(msgspec.Struct):
    offset_table: dict[str, dict[int, int]] = {}


_decoder = msgspec.json.Decoder(_OffsetsFile)
_encoder = msgspec.json.Encoder()


class ConsumerOffsetManager:
    """Committed offsets of every group on this broker and their file (event loop only)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._table: dict[str, dict[int, int]] = {}
        self.dirty = False
        #: A slave's own commits since they last reached its master (None on a master): they
        #: flow back when the master is reachable (docs/cluster.md), the larger offset wins.
        self.local_commits: dict[str, dict[int, int]] | None = None

    def load(self) -> None:
        raw = read_file(self.path)
        if raw is None:
            return
        try:
            self._table = _decoder.decode(raw).offset_table
        except msgspec.DecodeError as exc:
            raise ValueError(
                f"{self.path} is not a valid consumer offsets file ({exc}); fix or remove it "
                "(groups would then start from their consume-from position)"
            ) from exc

    def snapshot(self) -> bytes:
        """The file's bytes as of now; clears ``dirty``."""
        self.dirty = False
        return _encoder.encode(_OffsetsFile(self._table))

    def persist(self) -> None:
        write_atomic(self.path, self.snapshot())

    # -- commits and queries --------------------------------------------------------------------
    def commit(self, group: str, topic: str, queue_id: int, offset: int) -> None:
        key = f"{topic}@{group}"
        queues = self._table.get(key)
        if queues is None:
            queues = self._table[key] = {}
        if queues.get(queue_id) != offset:
            queues[queue_id] = offset
            self.dirty = True
            if self.local_commits is not None:
                self.local_commits.setdefault(key, {})[queue_id] = offset

    def query(self, group: str, topic: str, queue_id: int) -> int:
        """The committed offset, or NO_OFFSET (-1) when the group has none for this queue."""
        queues = self._table.get(f"{topic}@{group}")
        if queues is None:
            return NO_OFFSET
        return queues.get(queue_id, NO_OFFSET)

    def offsets(self, group: str, topic: str) -> dict[int, int]:
        return dict(self._table.get(f"{topic}@{group}", {}))

    def by_topic(self) -> dict[str, list[tuple[str, dict[int, int]]]]:
        """topic -> [(group, {queue id: offset})], copied. Safe from another thread (retention):
        each copy is one C-level dict copy, atomic under the GIL."""
        out: dict[str, list[tuple[str, dict[int, int]]]] = {}
        for key, queues in dict(self._table).items():
            topic, _, group = key.partition("@")
            out.setdefault(topic, []).append((group, dict(queues)))
        return out

    def topics_of_group(self, group: str) -> list[str]:
        suffix = f"@{group}"
        return sorted(k[: -len(suffix)] for k in self._table if k.endswith(suffix))

    def groups_of_topic(self, topic: str) -> list[str]:
        prefix = f"{topic}@"
        return sorted(k[len(prefix):] for k in self._table if k.startswith(prefix))

    def groups(self) -> list[str]:
        return sorted({k.partition("@")[2] for k in self._table})

    def delete_topic(self, topic: str) -> None:
        prefix = f"{topic}@"
        for key in [k for k in self._table if k.startswith(prefix)]:
            del self._table[key]
            self.dirty = True

    # -- replication (docs/cluster.md) ------------------------------------------------------------
    def table(self) -> dict[str, dict[int, int]]:
        """A copy of the whole table ("topic@group" -> queue id -> offset)."""
        return {k: dict(v) for k, v in self._table.items()}

    def merge_max(self, table: dict[str, dict[int, int]]) -> int:
        """Take every offset of ``table`` that is larger than ours (offsets a slave took while
        this master was away); returns how many moved."""
        moved = 0
        for key, queues in table.items():
            mine = self._table.setdefault(key, {})
            for qid, off in queues.items():
                if off > mine.get(qid, NO_OFFSET):
                    mine[qid] = off
                    moved += 1
        if moved:
            self.dirty = True
        return moved

    def adopt(self, master: dict[str, dict[int, int]]) -> None:
        """A slave takes its master's table, keeping its own commits the master has not
        received yet where they are larger."""
        new = {k: dict(v) for k, v in master.items()}
        for key, queues in (self.local_commits or {}).items():
            mine = new.setdefault(key, {})
            for qid, off in queues.items():
                if off > mine.get(qid, NO_OFFSET):
                    mine[qid] = off
        if new != self._table:
            self._table = new
            self.dirty = True

    def delivered_back(self, sent: dict[str, dict[int, int]]) -> None:
        """The master took ``sent``: forget the local commits that have not changed since."""
        local = self.local_commits
        if local is None:
            return
        for key, queues in sent.items():
            mine = local.get(key)
            if mine is None:
                continue
            for qid, off in queues.items():
                if mine.get(qid) == off:
                    del mine[qid]
            if not mine:
                del local[key]
