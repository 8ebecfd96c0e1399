"""The put path's mechanisms: large batches written with pwritev, single messages through the
consume-queue tail cache, space reserved before a batch is written, ASYNC flush by dirty bytes,
and group-commit rounds completed through one executor call."""

import os
import threading
import time

import pytest

from tidemq.protocol.errors import StoreError, StoreWriteError
from tidemq.protocol.record import BatchView
from tidemq.store.config import PWRITE_MIN_BYTES
from tidemq.store.flush import run_callbacks

from .helpers import FlushMode, batch, open_store, read_all
from .test_faults import crash_image


def test_large_and_small_batches_are_stamped_alike_and_survive_a_crash(tmp_path):
    big_body = bytes(range(256)) * (PWRITE_MIN_BYTES // 256 + 8)
    s = open_store(tmp_path / "live", segment_size=1 << 20)
    results = []
    for k in range(6):  # alternate the two write paths, across a segment roll
        body = big_body if k % 2 else f"small-{k}".encode()
        results.append(s.put(batch("t", [body, body[:10]], queue_id=1, keys=f"key{k}",
                                   producer_id=5, base_seq=2 * k)))
    assert any(r.size >= PWRITE_MIN_BYTES for r in results)
    assert any(r.size < PWRITE_MIN_BYTES for r in results)
    for r in results:  # the store header is stamped and sealed on both paths
        v = s.read_batch(r.phys_offset)
        v.verify()
        assert (v.phys_offset, v.queue_offset, v.queue_id) == (r.phys_offset, r.queue_offset, 1)
        assert v.store_ts == r.store_ts
    img = crash_image(s, tmp_path / "img")
    s.close()
    with open_store(img, segment_size=1 << 20) as s2:
        assert s2.recovery_report.truncated == [] and s2.recovery_report.quarantined == []
        msgs, _ = read_all(s2, "t", 1)
        assert [m.queue_offset for m in msgs] == list(range(12))
        assert msgs[2].body == big_body and msgs[3].body == big_body[:10]
        assert [m.keys for m in s2.query_by_key("t", "key3")] == ["key3", "key3"]
        assert s2.get_by_id(f"{5:016X}{7:016X}").body == big_body[:10]


def test_single_message_puts_keep_every_offset_across_consume_queue_files(tmp_path):
    # 7 units per file: the tail cache is left and rebuilt at every file boundary
    with open_store(tmp_path, cq_units_per_file=7, segment_size=1 << 20) as s:
        for i in range(50):
            r = s.put(batch("t", [f"m{i}".encode()], tags=f"tag{i % 3}", producer_id=9,
                            base_seq=i))
            assert r.queue_offset == i
        msgs, _ = read_all(s, "t")
        assert [m.body for m in msgs] == [f"m{i}".encode() for i in range(50)]
        assert [m.tags for m in msgs] == [f"tag{i % 3}" for i in range(50)]
        units = s.cqs.find("t", 0)
        assert [units.get(i)[0] for i in range(50)] == [m.phys_offset for m in msgs]


def test_no_room_for_the_consume_queue_log_loses_no_unit(tmp_path, monkeypatch):
    # Units wait in memory until the shared index log's next block (store/index_log.py): a put
    # needs no consume queue space. A block that cannot be written (disk full) leaves them
    # pending; the next flush writes them, and a crash before that recovers them from the
    # CommitLog (no checkpoint covers them).
    with open_store(tmp_path, segment_size=1 << 20) as s:
        for i in range(4):
            s.put(batch("t", [f"m{i}".encode()]))
        s.flush()
        real = os.pwritev

        def full(fd, parts, offset):
            raise OSError(28, "No space left on device")

        s.put(batch("t", [b"m4", b"m5"]))
        monkeypatch.setattr(os, "pwritev", full)
        with pytest.raises(StoreWriteError, match="No space left"):
            s.cqs.flush()
        monkeypatch.setattr(os, "pwritev", real)
        assert [m.body for m in read_all(s, "t")[0]] == [b"m0", b"m1", b"m2", b"m3", b"m4", b"m5"]
        img = crash_image(s, tmp_path.parent / (tmp_path.name + "-img"))
        s.put(batch("t", [b"m6"]))
        s.flush()
        assert s.cqs.pending_bytes == 0
    with open_store(tmp_path, segment_size=1 << 20) as s2:
        assert [m.body for m in read_all(s2, "t")[0]][-3:] == [b"m4", b"m5", b"m6"]
    with open_store(img, segment_size=1 << 20) as s3:
        msgs, _ = read_all(s3, "t")
        assert [m.queue_offset for m in msgs] == list(range(6))


def test_async_flush_runs_when_dirty_bytes_pile_up(tmp_path):
    with open_store(tmp_path, flush_interval_ms=60_000, flush_dirty_bytes=256 * 1024,
                    segment_size=4 << 20) as s:
        time.sleep(0.05)
        before = s.flush_service.flush_count
        for _ in range(40):  # ~400 KiB: past the threshold once
            s.put(batch("t", [b"x" * 10_000]))
        deadline = time.time() + 5
        while s.flush_service.flush_count == before and time.time() < deadline:
            time.sleep(0.01)
        assert s.flush_service.flush_count > before
        assert s.commitlog.flushed_pos >= 256 * 1024


def test_async_flush_by_dirty_bytes_can_be_turned_off(tmp_path):
    with open_store(tmp_path, flush_interval_ms=60_000, flush_dirty_bytes=0,
                    segment_size=4 << 20) as s:
        time.sleep(0.05)
        before = s.flush_service.flush_count
        for _ in range(40):
            s.put(batch("t", [b"x" * 10_000]))
        time.sleep(0.3)
        assert s.flush_service.flush_count == before


def test_group_commit_rounds_reach_the_executor_whole(tmp_path):
    with open_store(tmp_path, flush_mode=FlushMode.SYNC) as s:
        rounds: list[int] = []
        done: list[object] = []
        all_done = threading.Event()
        n = 300

        def executor(requests, err):
            rounds.append(len(requests))
            run_callbacks(requests, err)

        def cb(err):
            done.append(err)
            if len(done) == n:
                all_done.set()

        s.flush_service.complete_on(executor)
        for _ in range(n):
            s.put(batch("t", [b"y"]), on_durable=cb)
        assert all_done.wait(10)
        assert done == [None] * n and sum(rounds) <= n  # (a put already durable is called at once)
        assert len(rounds) < n  # rounds, not puts
        assert max(rounds) > 1


def test_a_blocking_sync_put_never_depends_on_the_executor(tmp_path):
    with open_store(tmp_path, flush_mode=FlushMode.SYNC) as s:
        s.flush_service.complete_on(lambda requests, err: None)  # an executor that never runs
        t0 = time.monotonic()
        r = s.put(batch("t", [b"z"]))  # waits for its fsync on the flush thread itself
        assert r.status.value == "PUT_OK" and time.monotonic() - t0 < 5
        assert s.commitlog.flushed_pos >= r.end_offset


def test_a_broken_executor_does_not_stop_the_flush_thread(tmp_path):
    with open_store(tmp_path, flush_mode=FlushMode.SYNC) as s:
        def broken(requests, err):
            raise RuntimeError("boom")

        s.flush_service.complete_on(broken)
        s.put(batch("t", [b"a"]), on_durable=lambda err: None)
        r = s.put(batch("t", [b"b"]))  # the flush thread is still alive
        assert r.status.value == "PUT_OK"


def test_a_put_refused_before_writing_leaves_the_batch_view_usable(tmp_path):
    # a refused put (closed store) raises StoreError and never touches the caller's bytes
    s = open_store(tmp_path)
    b = batch("t", [b"x"])
    before = bytes(b)
    s.close()
    with pytest.raises(StoreError):
        s.put(b)
    assert bytes(b) == before
    BatchView(b).verify()


def test_when_durable_fires_after_the_group_commit_covering_every_put_so_far(tmp_path):
    with open_store(tmp_path / "sync", flush_mode=FlushMode.SYNC) as s:
        for _ in range(20):
            s.put(batch("t", [b"x" * 100]), on_durable=lambda err: None)
        end = s.commitlog.write_pos
        seen: list[tuple[object, int]] = []
        done = threading.Event()

        def cb(err):
            seen.append((err, s.commitlog.flushed_pos))
            done.set()

        s.when_durable(cb)
        assert done.wait(5)
        assert seen[0][0] is None and seen[0][1] >= end
    with open_store(tmp_path / "async", flush_mode=FlushMode.ASYNC) as s:
        s.put(batch("t", [b"y"]))
        seen2: list[object] = []
        s.when_durable(seen2.append)  # ASYNC_FLUSH: at once, as a put's on_durable
        assert seen2 == [None]
