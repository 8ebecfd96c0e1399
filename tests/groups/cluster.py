"""Helpers of the group tests: a real `tidemq dev` (name server + broker) with test-sized
group timings: silent consumers expire after 3 s (scanned every 0.3 s) and the delay schedule
is in tens of milliseconds so sixteen retries take seconds, not hours."""

from __future__ import annotations

import time

from support.cluster import DevCluster, start_dev, stop_dev

__all__ = ["DevCluster", "start_dev", "stop_dev", "wait_until", "GROUP_OPTIONS", "TEST_LEVELS_MS"]

#: Test-sized RocketMQ schedule: level L waits TEST_LEVELS_MS[L - 1] ms.
TEST_LEVELS_MS = [10, 20] + [100 + 20 * i for i in range(16)]
EXPIRY_MS = 3000

GROUP_OPTIONS = (
    f"client_channel_expired_ms={EXPIRY_MS}",
    "client_scan_interval_ms=300",
    "message_delay_level=" + " ".join(f"{ms}ms" for ms in TEST_LEVELS_MS),
)


def wait_until(pred, timeout: float, step: float = 0.02) -> float:  # noqa: ANN001
    """Seconds until ``pred()`` held; raises AssertionError after ``timeout``."""
    t0 = time.monotonic()
    while True:
        if pred():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(step)
