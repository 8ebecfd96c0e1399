"""tune_gc: the young-generation threshold is raised once per process, only over CPython's
defaults, and the operator can say no."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import gc, sys
if sys.argv[1] == "own":
    gc.set_threshold(1000, 10, 10)
from tidemq.base import gc_tune
first = gc_tune.tune_gc()
again = gc_tune.tune_gc()
# What the tuned threshold does: 5,000 short-lived containers start no young collection.
before = gc.get_stats()[0]["collections"]
junk = [[i] for i in range(5000)]
print(first, again, gc.get_threshold()[0], gc.get_stats()[0]["collections"] - before)
"""


def _probe(env: dict[str, str], own: bool = False) -> tuple[bool, bool, int, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, "own" if own else "-"],
                         capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", **env},
                         check=True, timeout=60)
    first, again, gen0, collections = out.stdout.split()
    return first == "True", again == "True", int(gen0), int(collections)


def test_tuned_process_collects_young_objects_less_often_and_an_opt_out_is_respected():
    first, again, gen0, collections = _probe({})
    assert first and again and gen0 == 20_000
    assert collections == 0
    off, _, gen0_off, collections_off = _probe({"TIDEMQ_GC_TUNE": "0"})
    assert not off and gen0_off == 700
    assert collections_off >= 5  # 5,000 containers at the default 700
    own, _, gen0_own, _ = _probe({}, own=True)
    assert not own and gen0_own == 1000  # the process's own thresholds win
