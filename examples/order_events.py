"""The order-event producer of the example pipeline.

Orders go through ``created`` -> ``paid`` (90 %) -> ``shipped`` (85 % of the paid ones); every
event is one tidemq message on topic ``orders``, body JSON, tag = the event, key = the order::

    {"order_id": "o-000042", "customer": "c-017", "region": "eu-west",
     "event": "paid", "amount_cents": 4599, "ts": 1763894400123}

``ts`` is the event time (ms); it trails the wall clock by up to ``max_lateness_ms`` so the Spark
job's watermark has out-of-order data to deal with. Standalone::

    python examples/order_events.py --namesrv 127.0.0.1:9876 --seconds 30 --rate 400
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import tidemq

REGIONS = ("eu-west", "us-east", "us-west", "ap-south")
TOPIC = "orders"


@dataclass
class ProducedStats:
    """What the producer sent: counts per event type, revenue (paid amounts) per region."""

    events: Counter = field(default_factory=Counter)
    revenue_cents: Counter = field(default_factory=Counter)
    per_region: Counter = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.events.values())


def _event(order: dict, event: str, now_ms: int, rng: random.Random, lateness: int) -> dict:
    return {**order, "event": event, "ts": now_ms - rng.randrange(lateness + 1)}


def produce(namesrv: str, seconds: float, rate: int, stop: threading.Event | None = None,
            *, seed: int = 7, max_lateness_ms: int = 1500) -> ProducedStats:
    """Send about ``rate`` events per second for ``seconds`` (or until ``stop`` is set)."""
    rng = random.Random(seed)
    stats = ProducedStats()
    created: list[dict] = []  # orders waiting for payment
    paid: list[dict] = []  # orders waiting for shipping
    next_id = 0
    tick = 0.1
    per_tick = max(1, int(rate * tick))
    deadline = time.monotonic() + seconds
    with tidemq.Producer(namesrv, producer_name=None) as producer:
        while time.monotonic() < deadline and not (stop and stop.is_set()):
            t0 = time.monotonic()
            now_ms = int(time.time() * 1000)
            msgs = []
            for _ in range(per_tick):
                r = rng.random()
                if r < 0.45 or not created:
                    next_id += 1
                    order = {"order_id": f"o-{next_id:06d}",
                             "customer": f"c-{rng.randrange(500):03d}",
                             "region": rng.choice(REGIONS),
                             "amount_cents": rng.randrange(500, 20000)}
                    ev = _event(order, "created", now_ms, rng, max_lateness_ms)
                    created.append(order)
                elif r < 0.80 or not paid:
                    order = created.pop(rng.randrange(len(created)))
                    if rng.random() < 0.10:
                        continue  # abandoned: never paid
                    ev = _event(order, "paid", now_ms, rng, max_lateness_ms)
                    paid.append(order)
                    stats.revenue_cents[order["region"]] += order["amount_cents"]
                else:
                    order = paid.pop(rng.randrange(len(paid)))
                    if rng.random() < 0.15:
                        continue  # cancelled after payment (still revenue, never shipped)
                    ev = _event(order, "shipped", now_ms, rng, max_lateness_ms)
                stats.events[ev["event"]] += 1
                stats.per_region[ev["region"]] += 1
                msgs.append(tidemq.Message(TOPIC, json.dumps(ev).encode(), tags=ev["event"],
                                           keys=ev["order_id"]))
            if msgs:
                producer.send_batch(msgs)
            time.sleep(max(0.0, tick - (time.monotonic() - t0)))
    return stats


def send_watermark_flush(namesrv: str, ahead_ms: int = 120_000) -> None:
    """One ``flush`` event far in the future (event time): it moves the job's watermark past
    every real window, so the last windows are emitted. The job drops it after the watermark."""
    body = {"order_id": "-", "customer": "-", "region": "-", "event": "flush",
            "amount_cents": 0, "ts": int(time.time() * 1000) + ahead_ms}
    with tidemq.Producer(namesrv) as producer:
        producer.send(tidemq.Message(TOPIC, json.dumps(body).encode(), tags="flush"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--namesrv", default="127.0.0.1:9876")
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--rate", type=int, default=400, help="events per second")
    a = ap.parse_args()
    s = produce(a.namesrv, a.seconds, a.rate)
    print(f"sent {s.total} events {dict(s.events)}; revenue {sum(s.revenue_cents.values())} cents")


if __name__ == "__main__":
    main()
