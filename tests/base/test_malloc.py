"""tune_malloc: glibc's thresholds are set once per process, and the operator can say no."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import ctypes, os, sys
from tidemq.base import malloc
first = malloc.tune_malloc()
again = malloc.tune_malloc()
# What a tuned process does with the thresholds: a 4 MiB block comes from the heap (below the
# 16 MiB mmap threshold), and freeing 8 MiB at the heap's top keeps it (below the 32 MiB trim
# threshold), so a second 8 MiB round faults no new pages in.
def faults():
    with open(f"/proc/{os.getpid()}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])  # minflt
for _ in range(2):
    blocks = [bytearray(4 << 20) for _ in range(2)]
    del blocks
before = faults()
blocks = [bytearray(4 << 20) for _ in range(2)]
print(first, again, faults() - before)
"""


def _probe(env: dict[str, str]) -> tuple[bool, bool, int]:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", **env}, check=True, timeout=60)
    first, again, faults = out.stdout.split()
    return first == "True", again == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_tuned_process_reuses_freed_heap_pages_and_an_opt_out_is_respected():
    first, again, tuned_faults = _probe({})
    assert first and again
    off, _, default_faults = _probe({"TIDEMQ_MALLOC_TUNE": "0"})
    assert not off
    # 8 MiB is 2048 pages: the untuned process faults them in again, the tuned one does not.
    assert tuned_faults < 200 < default_faults
    operator, _, _ = _probe({"MALLOC_TRIM_THRESHOLD_": "1048576"})
    assert not operator  # the environment's own setting wins
