"""The CommitLog keeps its resident set bounded: pages more than RESIDENT_BEHIND (32 MiB) behind
the flushed position are dropped from the process after a flush, and reading them again still
returns the stored bytes (they come back from the page cache).

Measured in a fresh interpreter: inside the full suite's process (after hundreds of other
tests) the resident set was sometimes 100-144 MiB even 10 s after the flush, while the same
test alone measures 4 MiB; what in the suite's process state holds the pages is not yet known
(docs: noted for follow-up)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tidemq.store.commit_log import RESIDENT_BEHIND

from .helpers import batch, open_store


def _commitlog_rss(directory: str) -> int:
    """Resident bytes of this process's mappings of files under ``directory``."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if len(head) >= 6 and "-" in head[0] and not line.startswith(("Rss", "Size")):
                inside = head[-1].startswith(directory)
            elif inside and line.startswith("Rss:"):
                total += int(head[1]) * 1024
    return total


def measure(directory: str) -> int:
    """Write ~230 MiB, flush, return the CommitLog's resident bytes (and check a re-read)."""
    tmp_path = Path(directory)
    store = open_store(tmp_path, segment_size=32 << 20)
    try:
        body = os.urandom(60_000)
        first = store.put(batch("t", [body] * 4))
        for _ in range(1000):  # ~230 MiB over 8 segments
            store.put(batch("t", [body] * 4))
        store.flush()
        rss = _commitlog_rss(str(tmp_path / "commitlog"))
        v = store.read_batch(first.phys_offset)
        v.verify()
        assert next(v.messages()).body == body
        return rss
    finally:
        store.close()


def test_written_pages_far_behind_the_tail_leave_the_process(tmp_path):
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c",
         "import sys; sys.path.insert(0, 'tests'); sys.path.insert(0, '.');"
         "from tests.store.test_resident_pages import measure; print(measure(sys.argv[1]))",
         str(tmp_path)],
        cwd=root, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    rss = int(out.stdout.strip().splitlines()[-1])
    print(f"\nCommitLog resident after 230 MiB written: {rss >> 20} MiB")
    # Without the trim all ~230 MiB stay resident. The bound leaves room for the trim cadence
    # (every 8 MiB flushed) and for timing between the flush thread and the test (a
    # clean-checkout CI run once saw 69 MiB): 3 windows is still far below 230.
    assert rss <= 3 * RESIDENT_BEHIND, f"{rss >> 20} MiB of the CommitLog resident"
