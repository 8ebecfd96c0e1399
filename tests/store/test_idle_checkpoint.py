"""An idle store writes no checkpoint; the first one after a put is written (issue 17)."""

from __future__ import annotations

import time

from tidemq.store.checkpoint import load_checkpoint

from .helpers import batch, open_store


def test_idle_store_skips_its_checkpoint_and_writes_the_next_after_a_put(tmp_path):
    store = open_store(tmp_path, segment_size=1 << 20, checkpoint_interval_ms=20)
    path = tmp_path / "checkpoint"
    try:
        store.put(batch("t", [b"a"]))
        store.flush()
        ino = path.stat().st_mtime_ns  # every write is a new file renamed over the old one
        time.sleep(0.3)  # ~15 housekeeper rounds with nothing new
        store.flush()
        assert path.stat().st_mtime_ns == ino, "an idle store replaced its checkpoint"
        store.put(batch("t", [b"b"]))
        deadline = time.monotonic() + 5
        while path.stat().st_mtime_ns == ino and time.monotonic() < deadline:
            time.sleep(0.02)
        assert path.stat().st_mtime_ns != ino, "no checkpoint after a put"
        cp, problem = load_checkpoint(path)
        assert problem is None and cp is not None
        assert cp.dispatched == store.commitlog.write_pos
    finally:
        store.close()
