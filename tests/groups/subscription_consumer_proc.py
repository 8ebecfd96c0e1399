"""A blocking Pulsar-style Consumer in its own process, for crash tests: receives, writes one
line per message (``monotonic_ns body attempt``; CLOCK_MONOTONIC is one clock for every process
of the machine, so the lines of several processes can be ordered) to a file, then acks; runs
until killed (SIGTERM: closes cleanly).

Usage: python subscription_consumer_proc.py NAMESRV TOPIC SUBSCRIPTION TYPE NAME OUT_FILE [PAUSE]

PAUSE: seconds slept after each batch (a slow consumer keeps its receiver queue full).
"""

from __future__ import annotations

import signal
import sys
import threading
import time

import tidemq


def main() -> None:
    namesrv, topic, sub, sub_type, name, out_path = sys.argv[1:7]
    pause = float(sys.argv[7]) if len(sys.argv) > 7 else 0.0
    out = open(out_path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    with tidemq.Consumer(namesrv, topic, sub, subscription_type=sub_type, consumer_name=name,
                         initial_position="earliest", receiver_queue_size=64,
                         heartbeat_interval=1.0, await_duration=0.5) as c:
        print("ready", flush=True)
        while not done.is_set():
            msgs = c.batch_receive(16, timeout=0.5)
            out.write("".join(f"{time.monotonic_ns()} {m.body.decode()} {m.delivery_attempt}\n"
                              for m in msgs))
            for f in [c.acknowledge_async(m) for m in msgs]:
                try:
                    f.result()
                except tidemq.StaleReceiptError:
                    pass
            if pause and msgs:
                time.sleep(pause)


if __name__ == "__main__":
    main()
