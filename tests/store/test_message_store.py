"""MessageStore: puts, reads, statuses, lookups, rolls, reopen, locking, flush modes."""

import os
import threading
import time

import pytest

from tidemq.protocol.errors import (
    CorruptBatchError,
    DiskFullError,
    MessageTooLargeError,
    StoreLockedError,
    StoreWriteError,
)
from tidemq.protocol.record import FILLER_MAGIC, TOTAL_SIZE_MAGIC, BatchView, tag_hash
from tidemq.store.message_store import GetStatus, PutStatus

from .helpers import FlushMode, batch, open_store, read_all


def test_put_and_read_back_with_queue_offsets(data_dir):
    with open_store(data_dir) as s:
        r1 = s.put(batch("t", [b"a", b"b", b"c"]))
        r2 = s.put(batch("t", [b"d"]))
        assert (r1.queue_offset, r1.count, r2.queue_offset) == (0, 3, 3)
        assert r2.phys_offset == r1.phys_offset + r1.size
        msgs, last = read_all(s, "t")
        assert [m.body for m in msgs] == [b"a", b"b", b"c", b"d"]
        assert [m.queue_offset for m in msgs] == [0, 1, 2, 3]
        assert last.status is GetStatus.OFFSET_OVERFLOW_ONE and last.next_begin_offset == 4


def test_read_from_the_middle_of_a_batch_returns_the_whole_batch_and_first_index(data_dir):
    with open_store(data_dir) as s:
        s.put(batch("t", [b"0", b"1", b"2", b"3", b"4"]))
        res = s.get_messages("t", 0, 3, 32)
        assert res.status is GetStatus.FOUND
        (rb,) = res.batches
        assert rb.first_index == 3 and rb.queue_offset == 3 and rb.count == 2
        assert BatchView(rb.data).count == 5  # the stored batch, zero-copy, not re-encoded
        assert isinstance(rb.data, memoryview)
        assert [m.body for m in rb.messages()] == [b"3", b"4"]
        assert res.next_begin_offset == 5


def test_statuses_follow_rocketmq(data_dir):
    with open_store(data_dir) as s:
        assert s.get_messages("none", 0, 0).status is GetStatus.NO_MATCHED_LOGIC_QUEUE
        s.put(batch("t", [b"x"] * 3))
        assert s.get_messages("t", 0, 3).status is GetStatus.OFFSET_OVERFLOW_ONE
        bad = s.get_messages("t", 0, 10)
        assert bad.status is GetStatus.OFFSET_OVERFLOW_BADLY and bad.next_begin_offset == 0
        assert (bad.min_offset, bad.max_offset) == (0, 3)


def test_tag_filter_by_hash_skips_batches_without_match(data_dir):
    with open_store(data_dir) as s:
        s.put(batch("t", [b"1", b"2"], tags="a"))
        s.put(batch("t", [b"3", b"4"], tags=["b", "a"]))
        s.put(batch("t", [b"5"], tags="c"))
        res = s.get_messages("t", 0, 0, 32, frozenset({tag_hash("b")}))
        assert [(b.queue_offset, b.count) for b in res.batches] == [(2, 2)]
        assert res.next_begin_offset == 5
        none = s.get_messages("t", 0, 0, 32, frozenset({tag_hash("zzz")}))
        assert none.status is GetStatus.NO_MATCHED_MESSAGE and none.next_begin_offset == 5


def test_batches_roll_across_segments_with_filler(data_dir):
    with open_store(data_dir, segment_size=8192) as s:
        bodies = [os.urandom(300) for _ in range(100)]
        for i in range(0, 100, 2):
            s.put(batch("t", bodies[i : i + 2], queue_id=i % 3))
        assert len(s.commitlog.segments) > 3
        seg0 = s.commitlog.segments[0]
        # the first segment ends with a filler record
        pos = 0
        while True:
            total, magic = TOTAL_SIZE_MAGIC.unpack_from(seg0.mm, pos)
            if magic == FILLER_MAGIC:
                assert pos + total == seg0.size
                break
            pos += total
        got = []
        for q in range(3):
            msgs, _ = read_all(s, "t", q)
            got += [m.body for m in msgs]
        assert sorted(got) == sorted(bodies)
    names = sorted(os.listdir(data_dir / "commitlog"))
    assert all(len(n) == 20 and int(n) % 8192 == 0 for n in names)


def test_reopen_keeps_everything_and_continues_offsets(data_dir):
    with open_store(data_dir, segment_size=8192) as s:
        for i in range(30):
            s.put(batch("t", [f"m{i}".encode()] * 3, keys=f"k{i}"))
    with open_store(data_dir, segment_size=8192) as s:
        assert s.recovery_report.clean_shutdown
        assert s.max_offset("t", 0) == 90
        r = s.put(batch("t", [b"after"]))
        assert r.queue_offset == 90
        msgs, _ = read_all(s, "t")
        assert len(msgs) == 91 and msgs[-1].body == b"after"
        assert [m.body for m in s.query_by_key("t", "k7")] == [b"m7"] * 3


def test_lookup_by_key_and_unique_id(data_dir):
    with open_store(data_dir) as s:
        s.put(
            batch(
                "t", [b"a", b"b"], keys=["order-1", "order-2 other"], producer_id=42, base_seq=1020
            )
        )
        s.put(batch("u", [b"c"], keys="order-1", producer_id=42, base_seq=1022))
        assert [m.body for m in s.query_by_key("t", "order-1")] == [b"a"]
        assert [m.body for m in s.query_by_key("t", "other")] == [b"b"]
        assert [m.body for m in s.query_by_key("u", "order-1")] == [b"c"]
        assert s.query_by_key("t", "order-1", begin_ts=0, end_ts=1) == []
        from tidemq.protocol.record import unique_id

        # seq 1024 is in the next id block: the batch is indexed under both blocks
        assert s.get_by_id(unique_id(42, 1021)).body == b"b"
        assert s.get_by_id(unique_id(42, 1022)).body == b"c"
        assert s.get_by_id(unique_id(42, 5000)) is None
        # the time range applies to the id lookup too
        assert s.get_by_id(unique_id(42, 1021), begin_ts=0, end_ts=1) is None
        with pytest.raises(ValueError, match="32 hex digits"):
            s.get_by_id("nope")


def test_offset_for_timestamp(data_dir):
    with open_store(data_dir) as s:
        s.put(batch("t", [b"a"] * 2))
        time.sleep(0.02)
        mid = time.time_ns() // 1_000_000
        time.sleep(0.02)
        s.put(batch("t", [b"b"] * 2))
        assert s.offset_for_timestamp("t", 0, 0) == 0
        assert s.offset_for_timestamp("t", 0, mid) == 2
        assert s.offset_for_timestamp("t", 0, mid + 10**6) == 4


def test_second_process_cannot_open_the_same_store(data_dir):
    import subprocess
    import sys

    with open_store(data_dir):
        code = (
            "import sys; sys.path.insert(0, 'tests');"
            "from store.helpers import open_store;"
            "from tidemq.protocol.errors import StoreLockedError\n"
            "try:\n open_store(sys.argv[1])\nexcept StoreLockedError as e:\n print(e); sys.exit(3)"
        )
        p = subprocess.run(
            [sys.executable, "-c", code, str(data_dir)],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.dirname(__file__)) + "/..",
        )
        assert p.returncode == 3, p.stderr
        assert "in use by another tidemq process" in p.stdout
    with pytest.raises(StoreLockedError), open_store(data_dir):
        open_store(data_dir)


def test_oversize_and_damaged_batches_get_clear_errors(data_dir):
    with open_store(data_dir, max_batch_bytes=1000) as s:
        with pytest.raises(MessageTooLargeError, match="max_batch_bytes"):
            s.put(batch("t", [b"x" * 2000]))
        b = batch("t", [b"ok"])
        b[-1] ^= 0xFF
        with pytest.raises(CorruptBatchError, match="CRC"):
            s.put(b)
        assert s.put(batch("t", [b"fine"])).queue_offset == 0


def test_sync_flush_group_commit_acknowledges_after_fsync(data_dir):
    with open_store(data_dir, flush_mode=FlushMode.SYNC) as s:
        r = s.put(batch("t", [b"x"]))
        assert r.status is PutStatus.PUT_OK
        assert s.commitlog.flushed_pos >= r.end_offset
        done = []
        n = 200
        ev = threading.Event()

        def cb(err):
            done.append(err)
            if len(done) == n:
                ev.set()

        for _ in range(n):
            s.put(batch("t", [b"y"] * 3), on_durable=cb)
        assert ev.wait(10)
        assert done == [None] * n
        # group commit: far fewer fsyncs than puts
        assert s.flush_service.flush_count < n


def test_async_flush_flushes_on_interval(data_dir):
    with open_store(data_dir, flush_mode=FlushMode.ASYNC, flush_interval_ms=50) as s:
        r = s.put(batch("t", [b"x"]))
        deadline = time.time() + 5
        while s.commitlog.flushed_pos < r.end_offset and time.time() < deadline:
            time.sleep(0.01)
        assert s.commitlog.flushed_pos >= r.end_offset


def test_disk_nearly_full_refuses_writes_and_forced_retention_deletes_old_segments(data_dir):
    # RocketMQ's behaviour (cleanFileForciblyEnable): tidemq's default keeps unconsumed data
    # (tests/store/test_retention_pressure.py)
    with open_store(data_dir, segment_size=8192, clean_file_forcibly=True) as s:
        for _ in range(40):
            s.put(batch("t", [b"z" * 500]))
        nseg = len(s.commitlog.segments)
        assert nseg > 3
        s.retention.usage = lambda: 0.95
        res = s.retention.run_once()
        assert res.refuse_writes
        with pytest.raises(DiskFullError, match="full"):
            s.put(batch("t", [b"no"]))
        # forced clean removed the oldest segment; queue minimum moved past it
        assert res.segments_deleted >= 1
        assert s.min_offset("t", 0) > 0
        first = s.get_messages("t", 0, 0)
        assert first.status is GetStatus.OFFSET_TOO_SMALL
        assert first.next_begin_offset == s.min_offset("t", 0)
        s.retention.usage = lambda: 0.10
        s.retention.run_once()
        assert s.put(batch("t", [b"yes"])).count == 1


def test_expired_segments_are_deleted_by_time(data_dir):
    with open_store(data_dir, segment_size=8192, file_reserved_hours=1.0) as s:
        for _ in range(40):
            s.put(batch("t", [b"z" * 500]))
        segs = list(s.commitlog.segments)
        old = time.time() - 7200
        for seg in segs[:2]:
            os.utime(seg.path, (old, old))
        s.retention.usage = lambda: 0.10
        res = s.retention.run_once(force_time=True)
        assert res.segments_deleted == 2
        assert not segs[0].path.exists() and segs[2].path.exists()
        msgs, _ = read_all(s, "t", 0, s.min_offset("t", 0))
        assert msgs and all(m.phys_offset >= s.commitlog.min_offset for m in msgs)


def test_write_error_on_roll_is_clear_and_nothing_is_corrupted(data_dir, monkeypatch):
    with open_store(data_dir, segment_size=8192, preallocate=False) as s:
        for _ in range(5):
            s.put(batch("t", [b"a" * 500]))
        real = os.posix_fallocate

        def enospc(fd, off, n):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "posix_fallocate", enospc)
        with pytest.raises(StoreWriteError, match="No space left"):
            for _ in range(50):
                s.put(batch("t", [b"b" * 500]))
        written = s.max_offset("t", 0)
        monkeypatch.setattr(os, "posix_fallocate", real)
        s.put(batch("t", [b"c"]))
        msgs, _ = read_all(s, "t")
        assert len(msgs) == written + 1 and msgs[-1].body == b"c"
    with open_store(data_dir, segment_size=8192) as s:
        msgs, _ = read_all(s, "t")
        assert len(msgs) == written + 1
        assert s.recovery_report.quarantined == [] and s.recovery_report.truncated == []


def test_dispatch_listener_fires_per_batch(data_dir):
    seen = []
    with open_store(data_dir) as s:
        s.add_dispatch_listener(lambda t, q, mx, v: seen.append((t, q, mx, v.count)))
        s.put(batch("t", [b"a"] * 4, queue_id=1))
        s.put(batch("t", [b"b"], queue_id=1))
    assert seen == [("t", 1, 4, 4), ("t", 1, 5, 1)]


def test_delete_topic(data_dir):
    with open_store(data_dir) as s:
        s.put(batch("t", [b"a"]))
        s.delete_topic("t")
        assert s.get_messages("t", 0, 0).status is GetStatus.NO_MATCHED_LOGIC_QUEUE
        assert s.put(batch("t", [b"b"])).queue_offset == 0


def test_put_many_stores_each_batch_as_put_would_and_refuses_only_the_bad_one(data_dir):
    """One put lock for a frame's batches: each keeps its own queue offsets and store header
    (what a reader and a reopen see are the same as after separate puts); a damaged or
    oversized batch gets its own error in its slot and the batches around it are stored."""
    with open_store(data_dir, max_batch_bytes=1000) as s:
        s.put(batch("a", [b"a0"]))
        damaged = batch("b", [b"b0"])
        damaged[-1] ^= 0xFF
        items = [batch("a", [b"a1", b"a2"]), batch("b", [b"b1"], queue_id=3), damaged,
                 batch("a", [b"x" * 2000]), batch("b", [b"b2"], queue_id=3),
                 batch("a", [b"a3"])]
        out = s.put_many([(b, BatchView(b)) for b in items])
        assert isinstance(out[2], CorruptBatchError) and isinstance(out[3], MessageTooLargeError)
        ok = [out[i] for i in (0, 1, 4, 5)]
        assert [(r.topic, r.queue_id, r.queue_offset, r.count) for r in ok] == [
            ("a", 0, 1, 2), ("b", 3, 0, 1), ("b", 3, 1, 1), ("a", 0, 3, 1)]
        assert [r.phys_offset for r in ok[1:]] == [p.phys_offset + p.size for p in ok[:-1]]
    with open_store(data_dir) as s:  # reopened: what was stored reads back in order
        msgs, _ = read_all(s, "a")
        assert [(m.body, m.queue_offset) for m in msgs] == [
            (b"a0", 0), (b"a1", 1), (b"a2", 2), (b"a3", 3)]
        msgs, _ = read_all(s, "b", 3)
        assert [(m.body, m.queue_offset) for m in msgs] == [(b"b1", 0), (b"b2", 1)]
        for m in msgs:
            s.read_batch(m.phys_offset).verify()  # both CRCs hold, the store header stamped


def _frame(items):
    from tidemq.protocol.batch.columns import read_columns
    from tidemq.protocol.multi_queue import split_offsets

    body = b"".join(bytes(b) for b in items)
    starts, sizes = split_offsets(body, len(items), 1 << 20)
    return body, read_columns(body, starts, sizes)


def _stored(st):
    """Every stored batch's bytes, store CRC and store time zeroed (both differ by the clock)."""
    rows = []
    for topic, qid in (("a", 0), ("b", 3), ("c", 1)):
        for m in read_all(st, topic, qid)[0]:
            v = st.read_batch(m.phys_offset)
            v.verify()  # both CRCs hold: the store header is sealed
            raw = bytearray(v.buf[v.pos : v.pos + v.total_size])
            raw[8:12] = bytes(4)
            raw[28:36] = bytes(8)
            rows.append((topic, qid, m.queue_offset, m.phys_offset, bytes(raw)))
    return rows


def test_put_frame_stores_a_frame_as_put_many_would_in_one_write(data_dir, tmp_path):
    """A SEND_MULTI_QUEUE frame's plain singles as one unit (one CommitLog write): every byte
    stored equals what put_many stores for the same batches but the store time and the store
    CRC over it; each batch keeps its own queue offset (a queue twice in the frame too), a
    damaged one is refused alone, the id index finds each message, and a reopen (the
    checkpoint + CommitLog re-dispatch) reads the same."""
    items = [batch("a", [b"a1"], base_seq=1), batch("b", [b"b0"], queue_id=3, base_seq=2),
             batch("a", [b"a2", b"a3"], tags=["x", "y"], base_seq=1023),  # two id blocks
             batch("c", [b"c0"], queue_id=1, base_seq=4)]
    damaged = batch("b", [b"bx"], queue_id=3, base_seq=9)
    damaged[-1] ^= 0xFF
    frame = items[:2] + [damaged] + items[2:]
    body, cols = _frame(frame)
    arrived = []
    ref_dir = tmp_path / "ref"
    with open_store(data_dir) as s, open_store(ref_dir) as ref:
        for st in (s, ref):
            st.put(batch("a", [b"a0"]))
        s.add_dispatch_listener(lambda t, q, mx, b: arrived.append((t, q, mx, b)))
        writes = []
        real_advance = s.commitlog.advance
        s.commitlog.advance = lambda n: (writes.append(n), real_advance(n))[1]
        qoffs, errors = s.put_frame(body, cols, [0, 1, 2, 3, 4], ["a", "b", "b", "a", "c"])
        assert list(errors) == [2] and isinstance(errors[2], CorruptBatchError)
        assert qoffs == [1, 0, -1, 2, 0]  # "a" 2 holds two messages: 2 and 3
        assert writes == [sum(len(b) for b in items)]  # one CommitLog write for the frame
        assert [a[:3] for a in arrived] == [("a", 0, 2), ("b", 3, 1), ("a", 0, 4), ("c", 1, 1)]
        assert [a[3] for a in arrived] == [[0], [0], [tag_hash("x"), tag_hash("y")], [0]]
        want = ref.put_many([(b, BatchView(b)) for b in items])
        assert [r.queue_offset for r in want] == [1, 0, 2, 0]
        assert _stored(s) == _stored(ref)
        for st in (s, ref):  # each message by its id, in either id block
            for want_m in read_all(st, "a")[0][2:]:  # seq 1023 and 1024
                m = st.get_by_id(want_m.msg_id)
                assert m is not None and m.body == want_m.body, (st is ref, want_m.msg_id)
        m = s.get_by_id(read_all(s, "c", 1)[0][0].msg_id)
        assert m is not None and m.body == b"c0"
    with open_store(data_dir) as s:
        assert [m.body for m in read_all(s, "a")[0]] == [b"a0", b"a1", b"a2", b"a3"]
        assert [m.queue_offset for m in read_all(s, "b", 3)[0]] == [0]
        s.put(batch("b", [b"b1"], queue_id=3))
        assert [m.queue_offset for m in read_all(s, "b", 3)[0]] == [0, 1]


def test_messages_past_a_producers_first_id_block_are_found_by_id(data_dir):
    """The id index holds each batch under the block(s) of its sequence ids: messages with
    sequence 1,024 and up (a producer's second block onwards), and a batch spanning two
    blocks, are found by their ids -- before, every batch was indexed under block 0 (the block
    number was shifted twice) and get_by_id found nothing past the first 1,024 messages."""
    with open_store(data_dir) as s:
        s.put(batch("a", [b"x"], base_seq=5000))
        s.put(batch("a", [b"y", b"z"], base_seq=2047))
        s.put(batch("a", [b"w"], base_seq=3))
        msgs = read_all(s, "a")[0]
        assert len(msgs) == 4
        for m in msgs:
            got = s.get_by_id(m.msg_id)
            assert got is not None and got.body == m.body, m.msg_id


def test_put_frame_rolls_segments_and_falls_back_for_frames_near_a_segments_size(data_dir):
    """Frames that do not fit the active segment roll it (a filler closes the old one) and
    frames over half a segment are stored batch by batch: every message reads back in order,
    also after a reopen (the CommitLog scan passes the fillers)."""
    seg = 64 * 1024
    sent: list[bytes] = []
    with open_store(data_dir, segment_size=seg) as s:
        seq = 0
        for round_ in range(12):
            n = 20 if round_ % 4 else 90  # ~22 KB frames, and ~99 KB: past half a segment
            items = []
            for _ in range(n):
                body = f"m{seq}".encode() + b"x" * 1000
                items.append(batch("a", [body], queue_id=seq % 3, base_seq=seq))
                sent.append(body)
                seq += 1
            frame, cols = _frame(items)
            qoffs, errors = s.put_frame(frame, cols, list(range(n)), ["a"] * n)
            assert not errors and min(qoffs) >= 0
        assert len(s.commitlog.segments) > 3
    with open_store(data_dir, segment_size=seg) as s:
        got = sorted((m.body for q in range(3) for m in read_all(s, "a", q)[0]),
                     key=lambda b: int(b[1 : b.index(b"x")]))
        assert got == sent
