"""WarmAhead follows the writer: the warmed range stays a window ahead of the write position,
moves to the next segment after a roll, and the thread stops with the store."""

from __future__ import annotations

import time

from .helpers import batch, open_store

WINDOW = 256 * 1024


def _wait(pred, timeout=5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "warmer did not catch up"
        time.sleep(0.01)


def test_warm_window_follows_the_writer_across_segments(tmp_path) -> None:
    store = open_store(tmp_path, segment_size=2 * 1024 * 1024, warm_ahead_bytes=WINDOW,
                       cq_units_per_file=4096, index_slots=4096, index_max_entries=16384)
    cl = store.commitlog
    warmer = cl._warmer
    assert warmer is not None
    b = batch("w", [b"x" * 1000] * 50)  # ~51 KB per batch
    seen_segments = set()
    for _ in range(120):  # ~6 MB: three segments
        store.put(b)
        seg = cl.segments[-1]
        rel = cl.write_pos - seg.start
        _wait(lambda seg=seg, rel=rel: warmer._seg_start == seg.start
              and warmer._warmed >= min(seg.size, rel + WINDOW // 2))
        seen_segments.add(seg.start)
        # Never far beyond the window: the whole segment is not pulled in at once.
        assert warmer._warmed <= rel + WINDOW + (1 << 20)
    assert len(seen_segments) >= 3
    store.close()
    assert cl._warmer is None and not warmer._thread.is_alive()


def test_no_warmer_without_preallocation(tmp_path) -> None:
    store = open_store(tmp_path, preallocate=False)
    store.put(batch("w", [b"x"]))
    assert store.commitlog._warmer is None
    store.close()
