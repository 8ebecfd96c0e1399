"""Garbage-collector thresholds for a process that handles frames of thousands of small objects.

CPython collects its youngest generation after every 700 new container objects (lists, tuples,
class instances...) and promotes what is alive at that moment; an object promoted twice waits
for a full collection, which walks *every* tracked object of the process. A broker holding
100,000 queues has a few hundred thousand long-lived tracked objects (each queue's index
state, its topic's config), and a SEND_MULTI_QUEUE frame of 1,000 one-message batches keeps
~7,000 small objects alive until it is answered: with the default threshold a young collection
runs every ~100 batches, catches most of the frame alive, promotes it, and the promoted objects
soon trigger a full collection over the whole heap. Measured here (a broker with 100,000 queues
storing frames of 1,000 one-message batches): 12 µs per batch in the collector, of ~28 µs in
all; with a young threshold of 20,000 it was under 0.4 µs (the frame's objects are mostly freed
before a collection looks at them, so nearly nothing reaches the old generations). The producer
side is the same story at a smaller scale (its per-batch lists and tuples while a frame is built
and answered).

:func:`tune_gc` raises the youngest generation's threshold to :data:`GEN0_THRESHOLD` (the older
generations keep their defaults), once per process, and only while the thresholds are CPython's
defaults: a process that set its own keeps them, and ``TIDEMQ_GC_TUNE=0`` turns it off. The
cost is up to that many young objects between collections (a few megabytes at most) and
garbage cycles that live a little longer. The broker calls it when it starts, a client when its
first connection pool is created (as ``tidemq.base.malloc.tune_malloc``).

:func:`freeze_long_lived` is for a moment after which most of what is alive stays alive: a push
consumer calls it when a rebalance pass has added many queues (``client/rebalance.py``). At
10,000 queues the assignment leaves ~58,000 tracked objects (each queue's ProcessQueue, pull
request, MessageQueue, offset entries) in the young generations and ~83,000 alive in all; the
next collection of generation 1 walks the former (7.8 ms of CPU), every full collection all of
them (27-33 ms of CPU, 48-102 ms wall, in one stretch of the consumer's loop; a loaded machine,
``bench/push_tail/gc_walk.py``; docs/benchmarks.md, "Many queues: the push consumer's tail,
sixth session"); after this call 0.6 and 0.2-0.7 ms. It collects once (the pause falls on
the rebalance, not on a message) and moves everything alive into the collector's permanent
generation (``gc.freeze``), which no later collection walks. Frozen objects are still freed
by reference counting; cyclic garbage among them waits for the next call, which first gives
them back (``gc.unfreeze``) to that collection. Only in a process whose thresholds
:func:`tune_gc` set (``TIDEMQ_GC_TUNE=0`` or a process's own thresholds: never).
"""

from __future__ import annotations

import gc
import os

__all__ = ["tune_gc", "freeze_long_lived", "GEN0_THRESHOLD"]

GEN0_THRESHOLD = 20_000
_DEFAULT = (700, 10, 10)

_state: bool | None = None  # None: not tried yet; else whether the threshold was raised


def tune_gc() -> bool:
    """Raise the young-generation threshold as the module docstring says, once per process;
    True if this process's thresholds are the tuned ones."""
    global _state
    if _state is not None:
        return _state
    _state = False
    if os.environ.get("TIDEMQ_GC_TUNE", "1") == "0":
        return False
    t = gc.get_threshold()
    if t != _DEFAULT:
        return False
    gc.set_threshold(GEN0_THRESHOLD, t[1], t[2])
    _state = True
    return True


def freeze_long_lived() -> bool:
    """Collect once and freeze what is alive, as the module docstring says; True if done
    (only after :func:`tune_gc` raised this process's threshold)."""
    if not _state:
        return False
    gc.unfreeze()  # what an earlier call froze and has died since is collected now
    gc.collect()
    gc.freeze()
    return True
