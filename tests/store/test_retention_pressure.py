"""Disk pressure without silent loss (issue 13, a deliberate change from RocketMQ's
cleanFileForciblyEnable=true), and index files sized to the disk.

- By default an unexpired segment is deleted under pressure only when every message in it was
  consumed (the ``consumed`` positions the broker provides); otherwise it is kept and past the
  refuse-writes watermark puts fail with DISK_FULL naming the queue that holds the space.
- ``clean_file_forcibly=True`` deletes anyway, and logs what went: topic, queue, offset range,
  count. Expired segments are deleted as before, their unconsumed messages logged the same way.
- An index file never takes more than ``index_max_free_ratio`` of the free space: on a real
  small filesystem (a tmpfs; skipped where mount is not allowed) a store with RocketMQ's index
  geometry (a 420 MB file) works instead of failing every put with DISK_FULL.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time

import pytest

from tidemq.protocol.errors import DiskFullError
from tidemq.store.index_file import (
    MIN_SCALED_ENTRIES,
    IndexFile,
    IndexService,
    geometry_for_space,
    geometry_of_length,
)

from .helpers import batch, open_store, read_all

GiB = 1 << 30
MiB = 1 << 20


def _fill(s, topic: str = "t", n: int = 40, queue_id: int = 0) -> None:
    for _ in range(n):
        s.put(batch(topic, [b"z" * 500], queue_id=queue_id))


def _expire(s, count: int) -> None:
    old = time.time() - 7200
    for seg in s.commitlog.segments[:count]:
        os.utime(seg.path, (old, old))


def test_by_default_unconsumed_segments_are_kept_and_writes_refused_with_the_reason(data_dir):
    with open_store(data_dir, segment_size=8192, file_reserved_hours=1.0) as s:
        _fill(s)
        nseg = len(s.commitlog.segments)
        s.retention.usage = lambda: 0.95
        res = s.retention.run_once()
        assert res.segments_deleted == 0 and res.refuse_writes
        assert "topic t queue 0 from offset 0" in res.kept_unconsumed
        with pytest.raises(DiskFullError, match="holds unconsumed messages .*topic t queue 0 "
                                                ".*clean_file_forcibly=true"):
            s.put(batch("t", [b"no"]))
        assert len(s.commitlog.segments) == nseg and s.min_offset("t", 0) == 0
        # expiry still applies (RocketMQ semantics): the two oldest segments go
        _expire(s, 2)
        res = s.retention.run_once()
        assert res.segments_deleted == 2
        assert res.dropped and res.dropped[0].first == 0
        assert res.dropped[0].end == s.min_offset("t", 0) > 0


def test_consumed_segments_go_under_pressure_one_per_round_and_never_past_a_reader(data_dir):
    with open_store(data_dir, segment_size=8192) as s:
        _fill(s, "a", 40)
        _fill(s, "b", 4)  # a few of b's in the tail segments
        cl = s.commitlog
        # a's group consumed 25 of 40; b's reader is done
        s.retention.consumed = lambda: {("a", 0): (25, "consumer group ga at offset 25"),
                                        ("b", 0): (4, "consumer group gb at offset 4")}
        s.retention.usage = lambda: 0.87  # past clean-forcibly, below refuse-writes
        phys_25 = s.cqs.find("a", 0).get(25)[0]
        deleted = 0
        for _ in range(len(cl.segments)):
            res = s.retention.run_once()
            assert res.dropped == []
            deleted += res.segments_deleted
            if not res.segments_deleted:
                break
        assert deleted >= 1
        assert cl.min_offset <= phys_25 < cl.segments[0].end  # stopped at the first unconsumed
        assert "topic a queue 0 from offset 25 (consumer group ga at offset 25)" in \
            res.kept_unconsumed
        msgs, _ = read_all(s, "a", 0, s.min_offset("a", 0))
        assert msgs[-1].queue_offset == 39 and s.min_offset("a", 0) <= 25


def test_clean_file_forcibly_deletes_and_logs_what_it_dropped(data_dir, caplog):
    with open_store(data_dir, segment_size=8192, clean_file_forcibly=True) as s:
        _fill(s, "a", 40)
        s.retention.consumed = lambda: {("a", 0): (3, "consumer group ga at offset 3")}
        s.retention.usage = lambda: 0.87
        with caplog.at_level(logging.WARNING, logger="tidemq.store.retention"):
            res = s.retention.run_once()
        assert res.segments_deleted == 1
        [d] = res.dropped
        assert (d.topic, d.queue_id, d.first, d.end) == ("a", 0, 3, s.min_offset("a", 0))
        text = caplog.text
        assert f"retention dropped {d.count} unconsumed messages of 1 queues by forced deletion" \
            in text
        assert f"topic a queue 0 offsets [3, {d.end}): {d.count} messages (consumer group ga " \
               "at offset 3)" in text


def test_index_geometry_keeps_rocketmq_defaults_on_big_disks_and_shrinks_on_small_ones():
    default = (5_000_000, 20_000_000)
    assert geometry_for_space(*default, 100 * GiB, 0.05) == default
    assert IndexFile.file_size(*default) > 400 * MiB
    s, e = geometry_for_space(*default, 1 * GiB, 0.05)
    assert IndexFile.file_size(s, e) <= 0.05 * GiB and e >= MIN_SCALED_ENTRIES
    assert IndexFile.file_size(s * 2, e * 2) > 0.05 * GiB  # the largest halving that fits
    assert geometry_for_space(*default, 1, 0.05)[1] >= MIN_SCALED_ENTRIES  # never below
    for k in range(0, 13):
        g = (default[0] >> k, default[1] >> k)
        assert geometry_of_length(IndexFile.file_size(*g), *default) == g
    assert geometry_of_length(IndexFile.file_size(*default) + 1, *default) is None


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "fs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)],
                       capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_index_files_on_a_small_disk_do_not_fill_it(small_fs):
    # RocketMQ's geometry (one 420 MB file) on a 64 MiB disk: used to fail every put
    with open_store(small_fs / "store", segment_size=4 * MiB, index_slots=5_000_000,
                    index_max_entries=20_000_000) as s:
        for k in range(2000):
            s.put(batch("t", [b"x" * 100], keys=f"k{k}", base_seq=k))
        [path] = s.index.files
        size = os.path.getsize(path)
        assert size <= 0.05 * 64 * MiB, size
        assert [m.body for m in s.query_by_key("t", "k1999")] == [b"x" * 100]
        used = 1 - os.statvfs(small_fs).f_bavail / os.statvfs(small_fs).f_blocks
        assert used < 0.5, used
    with open_store(small_fs / "store", segment_size=4 * MiB, index_slots=5_000_000,
                    index_max_entries=20_000_000) as s:  # reopened: the length says its size
        assert s.recovery_report.problems == [] and not s.recovery_report.rebuilt_indexes
        assert [m.body for m in s.query_by_key("t", "k7")] == [b"x" * 100]


def test_index_service_rolls_small_files_and_reloads_them(small_fs):
    svc = IndexService(small_fs / "index", 5_000_000, 20_000_000, 0.05)
    n = 0
    while len(svc.files) < 3:
        svc.put(f"key{n}", n * 100, 1000 + n)
        n += 1
    svc.close()
    again = IndexService(small_fs / "index", 5_000_000, 20_000_000, 0.05)
    assert again.load_errors == [] and len(again.files) == 3
    assert again.query("key0", 0, 2**62) == [0] and again.query(f"key{n - 1}", 0, 2**62)
    again.close()
