"""A push consumer in its own process, for crash tests: writes one line per consumed message
(``body monotonic-time``) to a file and runs until killed.

Usage: python consumer_proc.py NAMESRV GROUP TOPIC OUT_FILE
"""

from __future__ import annotations

import signal
import sys
import threading
import time

import tidemq


def main() -> None:
    namesrv, group, topic, out_path = sys.argv[1:5]
    out = open(out_path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
    lock = threading.Lock()

    def handle(msgs, ctx):
        now = time.monotonic()
        with lock:
            out.write("".join(f"{m.body.decode()} {now:.3f}\n" for m in msgs))
        return tidemq.ConsumeStatus.SUCCESS

    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    with tidemq.PushConsumer(namesrv, group, handle, consume_from="first",
                             persist_interval=1.0, heartbeat_interval=1.0) as c:
        c.subscribe(topic)
        while not any(mq.topic == topic for mq in c.assignment()):
            time.sleep(0.02)
        print("ready", flush=True)
        done.wait()


if __name__ == "__main__":
    main()
