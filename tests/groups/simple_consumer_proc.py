"""A blocking SimpleConsumer in its own process, for crash tests: receives, writes one line per
message (``body attempt``) to a file, then acks; runs until killed.

Usage: python simple_consumer_proc.py NAMESRV GROUP TOPIC OUT_FILE
"""

from __future__ import annotations

import signal
import sys
import threading

import tidemq


def main() -> None:
    namesrv, group, topic, out_path = sys.argv[1:5]
    out = open(out_path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    with tidemq.SimpleConsumer(namesrv, group, await_duration=0.5, init_mode="earliest",
                               heartbeat_interval=1.0) as c:
        c.subscribe(topic)
        print("ready", flush=True)
        while not done.is_set():
            msgs = c.receive(32, invisible_duration=2.0)
            out.write("".join(f"{m.body.decode()} {m.delivery_attempt}\n" for m in msgs))
            for f in [c.ack_async(m) for m in msgs]:
                try:
                    f.result()
                except tidemq.StaleReceiptError:
                    pass


if __name__ == "__main__":
    main()
