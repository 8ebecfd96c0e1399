"""The consumer at the end of the example pipeline: prints each window's order stats.

Standalone: ``python examples/print_stats.py --namesrv 127.0.0.1:9876``.
"""

from __future__ import annotations

import argparse
import json
import threading
from collections import Counter
from dataclasses import dataclass, field

import tidemq

TOPIC = "order-stats"
GROUP = "order-stats-printer"


@dataclass
class ReceivedStats:
    messages: int = 0
    by_key: Counter = field(default_factory=Counter)
    revenue_cents: Counter = field(default_factory=Counter)
    counts: Counter = field(default_factory=Counter)  # created/paid/shipped over all windows

    @property
    def duplicates(self) -> int:
        return sum(n - 1 for n in self.by_key.values() if n > 1)


def describe(row: dict) -> str:
    start, end = row["window_start"][11:19], row["window_end"][11:19]
    return (f"  [{start}-{end}] {row['region']:<9} created {row['created']:>4}  "
            f"paid {row['paid']:>4}  shipped {row['shipped']:>4}  "
            f"revenue {row['revenue_cents'] / 100:>10,.2f}")


def consume(namesrv: str, stop: threading.Event, stats: ReceivedStats,
            quiet: bool = False) -> None:
    """Poll ``order-stats`` until ``stop`` is set, counting (and printing) every result."""
    with tidemq.PullConsumer(namesrv, GROUP, consume_from="first") as consumer:
        consumer.subscribe(TOPIC)
        while not stop.is_set():
            for msg in consumer.poll(timeout=0.5):
                row = json.loads(msg.body)
                key = f"{row['region']}@{row['window_start']}"
                stats.messages += 1
                stats.by_key[key] += 1
                if stats.by_key[key] == 1:  # a duplicate must not count twice
                    stats.revenue_cents[row["region"]] += row["revenue_cents"]
                    for k in ("created", "paid", "shipped"):
                        stats.counts[k] += row[k]
                if not quiet:
                    print(describe(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--namesrv", default="127.0.0.1:9876")
    a = ap.parse_args()
    stop = threading.Event()
    try:
        consume(a.namesrv, stop, ReceivedStats())
    except KeyboardInterrupt:
        stop.set()


if __name__ == "__main__":
    main()
