"""A really full disk (ref ST7, non-negotiable 4): a store on a small tmpfs is written until
the filesystem has no space left.

A memory-mapped store that writes into pages without reserved blocks dies of SIGBUS when the
disk fills; the store reserves blocks first (fallocate), so the writer must get a clear
StoreError, stay alive, keep every acknowledged put, and write again once space is freed.
The writer runs in a subprocess, so a SIGBUS would show as its exit status instead of killing
pytest. Needs root (to mount a tmpfs); skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import open_store, read_all

ROOT = Path(__file__).resolve().parents[2]

WRITER = r"""
import json, os, sys
sys.path.insert(0, os.path.join(sys.argv[2], "src"))
from tidemq.protocol.errors import StoreError
from tidemq.store.config import StoreConfig
from tidemq.store.message_store import MessageStore
from tidemq.protocol.record import MessageData, encode_batch

data_dir, ballast = sys.argv[1], sys.argv[3]
cfg = StoreConfig(
    data_dir=data_dir, segment_size=1 << 20, cq_units_per_file=4096, index_slots=1024,
    index_max_entries=4096, checkpoint_interval_ms=50,
    # no refusal and no retention: let the filesystem itself run out
    disk_refuse_writes_ratio=2.0, disk_max_used_ratio=2.0, disk_clean_forcibly_ratio=2.0,
)
store = MessageStore(cfg)
acked = []
error = None
for k in range(100_000):
    b = encode_batch("t", [MessageData(f"{k}-".encode() * 200, keys=f"key{k}")],
                     producer_id=9, base_seq=k)
    try:
        r = store.put(b)
    except StoreError as exc:
        error = f"{type(exc).__name__}: {exc}"
        break
    acked.append([k, r.queue_offset])
after = None
if error is not None:
    os.unlink(ballast)  # the operator frees space: writes work again
    b = encode_batch("t", [MessageData(b"after")], producer_id=9, base_seq=len(acked))
    after = store.put(b).queue_offset
store.close()
print(json.dumps({"acked": acked, "error": error, "after": after}))
"""


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "fs"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)], capture_output=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_gives_a_clear_error_and_loses_nothing(small_fs):
    ballast = small_fs / "ballast"
    ballast.write_bytes(b"\xff" * (3 << 20))  # 3 MiB the "operator" deletes afterwards
    data_dir = small_fs / "store"
    p = subprocess.run(
        [sys.executable, "-c", WRITER, str(data_dir), str(ROOT), str(ballast)],
        capture_output=True, text=True, timeout=300,
    )
    assert p.returncode == 0, f"writer died (exit {p.returncode}): {p.stderr[-3000:]}"
    out = json.loads(p.stdout.strip().splitlines()[-1])
    acked, error = out["acked"], out["error"]
    assert error is not None, "24 MiB filled without an error?"
    assert "No space left on device" in error, error
    assert len(acked) > 1000  # ~20 MiB of 1.3 KiB batches went in before the disk was full
    assert out["after"] == len(acked)  # the next offset: nothing skipped, nothing doubled
    os.sync()
    with open_store(
        data_dir, segment_size=1 << 20, cq_units_per_file=4096, index_slots=1024,
        index_max_entries=4096, disk_refuse_writes_ratio=2.0, disk_max_used_ratio=2.0,
        disk_clean_forcibly_ratio=2.0,
    ) as s:
        rep = s.recovery_report
        assert rep.quarantined == [] and rep.truncated == [], rep.summary()
        msgs, _ = read_all(s, "t")
        assert [m.queue_offset for m in msgs] == list(range(len(acked) + 1))
        for (k, qoff), m in zip(acked, msgs, strict=False):
            assert m.queue_offset == qoff and m.body == f"{k}-".encode() * 200
        assert msgs[-1].body == b"after"
        # the key index survived too
        assert [m.body for m in s.query_by_key("t", f"key{acked[-1][0]}")] == [msgs[-2].body]
    print(f"{len(acked)} puts acknowledged before: {error}")
