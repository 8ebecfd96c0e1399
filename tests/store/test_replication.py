"""A slave's store (MessageStore.append_replicated / truncate_to / reset_to, ReplicaAppender):
the master's CommitLog bytes in, cut anywhere; the same bytes at the same offsets out, and the
same consume queues and index as the master's, built by the slave's own dispatch."""

from __future__ import annotations

import filecmp
import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidemq.protocol.errors import StoreError
from tidemq.store.replica import ReplicaAppender

from .helpers import batch, open_store, read_all

TOPICS = ("A", "B", "C")


def _fill(store, rnd: random.Random, n: int, seq0: int = 0) -> int:
    for i in range(n):
        k = rnd.choice([1, 1, 2, 7])
        store.put(batch(
            rnd.choice(TOPICS), [os.urandom(rnd.randint(1, 2500)) for _ in range(k)],
            queue_id=rnd.randrange(3), keys=f"k{seq0 + i}", tags=rnd.choice(["x", "y"]),
            producer_id=5, base_seq=(seq0 + i) * 10,
        ))
    return seq0 + n


def _stream(master, slave_app: ReplicaAppender, rnd: random.Random, start: int | None = None,
            max_chunk: int = 20_000) -> None:
    """Feed the master's bytes from ``start`` (default: where the slave is) in random cuts,
    never across a segment (as the master sends them)."""
    cl = master.commitlog
    pos = slave_app.position if start is None else start
    end = cl.write_pos
    while pos < end:
        seg = cl.segment_for(pos)
        k = min(rnd.randint(1, max_chunk), end - pos, seg.end - pos)
        slave_app.feed(pos, seg.mm[pos - seg.start : pos - seg.start + k])
        pos += k


def _same_queues(master, slave) -> None:
    assert master.queues() == slave.queues()
    for topic, qid in master.queues():
        assert master.min_offset(topic, qid) == slave.min_offset(topic, qid)
        assert master.max_offset(topic, qid) == slave.max_offset(topic, qid)
        a, _ = read_all(master, topic, qid, master.min_offset(topic, qid))
        b, _ = read_all(slave, topic, qid, slave.min_offset(topic, qid))
        assert [(m.queue_offset, m.body, m.tags) for m in a] == \
               [(m.queue_offset, m.body, m.tags) for m in b]


def _same_files(master_dir, slave_dir) -> None:
    names = sorted(os.listdir(master_dir / "commitlog"))
    assert names == sorted(os.listdir(slave_dir / "commitlog"))
    for name in names:
        assert filecmp.cmp(master_dir / "commitlog" / name, slave_dir / "commitlog" / name,
                           shallow=False), name


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), max_chunk=st.sampled_from([7, 300, 5000, 70_000]))
def test_replicated_store_is_the_masters(tmp_path_factory, seed, max_chunk):
    rnd = random.Random(seed)
    root = tmp_path_factory.mktemp("r")
    mdir, sdir = root / "m", root / "s"
    master = open_store(mdir, pwrite_min_bytes=300)
    slave = open_store(sdir)
    app = ReplicaAppender(slave)
    try:
        seq = _fill(master, rnd, rnd.randint(20, 120))
        while master.max_phys_offset < 2.5 * master.config.segment_size:
            seq = _fill(master, rnd, 10, seq)  # several segments: rolls and fillers copied
        _stream(master, app, rnd, max_chunk=max_chunk)
        assert slave.max_phys_offset == master.max_phys_offset
        assert len(master.commitlog.segments) > 1  # fillers and rolls were copied
        _same_queues(master, slave)
        for key in ("k0", "k5", "k17"):
            for topic in TOPICS:
                assert [m.body for m in master.query_by_key(topic, key)] == \
                       [m.body for m in slave.query_by_key(topic, key)]
    finally:
        master.close()
        slave.close()
    _same_files(mdir, sdir)
    reopened = open_store(sdir)  # the slave's own recovery trusts what it wrote
    try:
        assert not reopened.recovery_report.truncated
        assert not reopened.recovery_report.quarantined
    finally:
        reopened.close()


def test_listeners_see_replicated_batches(tmp_path):
    master, slave = open_store(tmp_path / "m"), open_store(tmp_path / "s")
    seen = []
    slave.add_dispatch_listener(lambda t, q, mx, v: seen.append((t, q, mx, v.count)))
    try:
        master.put(batch("A", [b"1", b"2"], queue_id=1))
        master.put(batch("A", [b"3"], queue_id=1))
        _stream(master, ReplicaAppender(slave), random.Random(1))
        assert seen == [("A", 1, 2, 2), ("A", 1, 3, 1)]
    finally:
        master.close()
        slave.close()


def test_truncate_cuts_a_divergent_tail(tmp_path):
    """A slave that holds bytes its (new) master never had cuts them and continues from the
    master's bytes: the old tail is gone from the CommitLog, the queues and the index."""
    rnd = random.Random(7)
    master, slave = open_store(tmp_path / "m"), open_store(tmp_path / "s")
    try:
        _fill(master, rnd, 60)
        app = ReplicaAppender(slave)
        _stream(master, app, rnd)
        common = master.max_phys_offset
        # the slave gets a tail the master never had (an old master kept writing) ...
        for i in range(30):
            slave.put(batch("A", [b"old tail %d" % i], keys=f"old{i}", producer_id=9))
        assert slave.max_phys_offset > common
        # ... while the master takes other writes
        _fill(master, rnd, 40, seq0=1000)
        slave.truncate_to(common)
        assert slave.max_phys_offset == common
        assert slave.query_by_key("A", "old3") == []
        app.reset()
        _stream(master, app, rnd)
        _same_queues(master, slave)
    finally:
        master.close()
        slave.close()
    _same_files(tmp_path / "m", tmp_path / "s")


def test_reset_starts_over_at_the_masters_oldest_segment(tmp_path):
    """A slave whose data the master no longer has (or a wiped one) starts empty at the
    master's oldest retained offset: its queues start at the queue offsets found there."""
    rnd = random.Random(3)
    master, slave = open_store(tmp_path / "m"), open_store(tmp_path / "s")
    try:
        _fill(master, rnd, 150)
        slave.put(batch("Z", [b"stale"]))  # something the master never had
        gone = master.commitlog.delete_segments(2)  # retention on the master
        assert gone
        for cq in master.cqs.all():
            cq.correct_min_offset(master.min_phys_offset)
        start = master.min_phys_offset
        assert start > 0
        slave.reset_to(start)
        assert slave.queues() == [] and slave.max_phys_offset == start
        app = ReplicaAppender(slave)
        _stream(master, app, rnd)
        for topic, qid in master.queues():
            lo = slave.min_offset(topic, qid)
            assert lo >= master.min_offset(topic, qid)
            assert slave.max_offset(topic, qid) == master.max_offset(topic, qid)
            a, _ = read_all(master, topic, qid, lo)
            b, _ = read_all(slave, topic, qid, lo)
            assert [m.body for m in a] == [m.body for m in b]
    finally:
        master.close()
        slave.close()
    again = open_store(tmp_path / "s")  # and it reopens: queues starting above 0 load fine
    try:
        assert again.min_phys_offset == start
        assert not again.recovery_report.problems
    finally:
        again.close()


def test_a_damaged_batch_is_copied_and_quarantined(tmp_path):
    """The logs stay identical; the slave never serves the damaged batch, and the messages
    after it keep their queue offsets."""
    master, slave = open_store(tmp_path / "m"), open_store(tmp_path / "s")
    try:
        offs = [master.put(batch("A", [b"m%d" % i], base_seq=i)).phys_offset for i in range(5)]
        seg = master.commitlog.segment_for(offs[2])
        data = bytearray(seg.mm[: master.max_phys_offset - seg.start])
        data[offs[2] - seg.start + 100] ^= 0xFF  # a bit flip in message 2's batch
        ReplicaAppender(slave).feed(seg.start, data)
        msgs, _ = read_all(slave, "A", 0)
        assert [(m.queue_offset, m.body) for m in msgs] == [
            (0, b"m0"), (1, b"m1"), (3, b"m3"), (4, b"m4")
        ]
        assert offs[2] in slave.quarantine
        assert slave.max_offset("A", 0) == 5
    finally:
        master.close()
        slave.close()


def test_a_broken_stream_is_refused(tmp_path):
    slave = open_store(tmp_path / "s")
    try:
        app = ReplicaAppender(slave)
        with pytest.raises(StoreError, match="not a CommitLog record"):
            app.feed(0, b"\x01" * 200)
        with pytest.raises(StoreError, match="skipped bytes"):
            app.feed(500, b"\x00" * 10)
        assert slave.max_phys_offset == 0
    finally:
        slave.close()


def test_consume_queue_start_at(tmp_path):
    """A queue whose first unit is at offset 70 (not a file boundary) reads and reloads."""
    from tidemq.store.consume_queue import ConsumeQueue

    cq = ConsumeQueue(tmp_path, "T", 0, units_per_file=64)
    cq.start_at(70)
    assert (cq.min_offset, cq.max_offset) == (70, 70)
    cq.append_batch(70, 5000, 100, bytes(12 * 3))
    assert cq.get(70) == (5000, 100, 0)
    assert cq.get(69) is None
    cq.close()
    again = ConsumeQueue(tmp_path, "T", 0, units_per_file=64)
    assert again.validate(10_000) is None
    again.correct_min_offset(4096)  # the store does this at load with its CommitLog start
    assert (again.min_offset, again.max_offset) == (70, 73)
    again.close()
