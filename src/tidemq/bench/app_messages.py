"""The varied messages of `tidemq bench app` (and of its Redis peer, bench/peers/redis_app.py),
shaped like what applications send: bodies of different sizes, one of 8 tags, a key of its own,
two properties.

Message ``i`` of a run: body ``BODIES[i % 4096]`` (sizes drawn once, uniformly 100..2000 bytes,
mean ~1 KiB), tag ``Tag{i % 8}``, key ``order-{i}``, properties ``region`` (one of 3) and
``attempt`` (``i % 3``). Both sides build each message from these at send time, as an
application builds its messages, so the cost of building one is part of what is measured.
"""

from __future__ import annotations

import random

__all__ = ["BODIES", "REGIONS", "TAGS", "mean_size", "fields"]

_rng = random.Random(20261126)
BODIES: list[bytes] = [_rng.randbytes(_rng.randint(100, 2000)) for _ in range(4096)]
TAGS = [f"Tag{i}" for i in range(8)]
REGIONS = ["eu-west-1", "us-east-1", "ap-south-1"]
ATTEMPTS = ["0", "1", "2"]


def mean_size() -> float:
    return sum(map(len, BODIES)) / len(BODIES)


def fields(i: int) -> tuple[bytes, str, str, dict[str, str]]:
    """(body, tag, key, properties) of message ``i``."""
    return (BODIES[i & 4095], TAGS[i & 7], f"order-{i}",
            {"region": REGIONS[i % 3], "attempt": ATTEMPTS[i % 3]})
