"""Chaos: a SYNC_FLUSH broker killed with SIGKILL again and again under producers (single and
batch sends) and a consumer group, restarted on the same data directory each time.

What must hold afterwards:
- every message whose send was acknowledged is stored and reaches the group (nothing lost);
- a fresh read of the whole topic holds each message once (recovery never dispatches a batch
  twice) with gap-free queue offsets;
- the group's redeliveries after the kills are counted and printed (at-least-once).

``make test`` runs 3 kills; ``make soak`` (TIDEMQ_SOAK=1) runs 30, or TIDEMQ_SOAK_KILLS.
"""

from __future__ import annotations

import collections
import os
import random
import socket
import threading
import time

import pytest

import tidemq
from tidemq.bench.dev_process import DevProcess

TOPIC = "chaos"
QUEUES = 4
KILLS = int(os.environ.get("TIDEMQ_SOAK_KILLS") or (30 if os.environ.get("TIDEMQ_SOAK") else 3))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Dev(DevProcess):
    """One SYNC_FLUSH `tidemq dev` on fixed ports, restartable on the same data directory."""

    def __init__(self, data_dir: str) -> None:
        super().__init__(
            data_dir, "flush_mode=sync",
            "store.segment_size=4194304",  # many segment rolls in a short run
            "store.cq_units_per_file=2048", "store.index_slots=4096",
            "store.index_max_entries=16384",
            namesrv_port=_free_port(), broker_port=_free_port(),
            log_path=os.path.join(os.path.dirname(data_dir), "dev.log"),
        )

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def start(self, timeout: float = 20.0) -> Dev:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return super().start(timeout)
            except RuntimeError as exc:
                # The killed process's sockets may linger for a moment after SIGKILL.
                if "address already in use" not in self.log().lower() \
                        or time.monotonic() > deadline:
                    raise AssertionError(f"{exc}\n{self.log()}") from None
                time.sleep(0.2)


@pytest.mark.slow
def test_acknowledged_messages_survive_repeated_kill_9(tmp_path) -> None:
    dev = Dev(str(tmp_path / "data"))
    dev.start()
    stop = threading.Event()
    acked: dict[bytes, tuple[int, int]] = {}  # body -> (queue id, queue offset) acknowledged
    failures = collections.Counter()
    lock = threading.Lock()

    def produce(prefix: bytes, batch: int) -> None:
        with tidemq.Producer(dev.namesrv, send_timeout=2.0, retries=0) as p:
            i = 0
            while not stop.is_set():
                bodies = [b"%s-%08d" % (prefix, i + k) for k in range(batch)]
                i += batch
                try:
                    if batch == 1:
                        r = p.send(tidemq.Message(TOPIC, bodies[0], keys=bodies[0].decode()))
                    else:
                        r = p.send_batch([tidemq.Message(TOPIC, b) for b in bodies])
                except Exception as exc:  # the broker is down: not acknowledged, go on
                    failures[type(exc).__name__] += 1
                    time.sleep(0.02)
                    continue
                if r.status == tidemq.SendStatus.SEND_OK:
                    with lock:
                        for k, body in enumerate(bodies):
                            acked[body] = (r.queue_id, r.queue_offset + k)

    consumed = collections.Counter()
    give_up = threading.Event()
    producers_done = threading.Event()
    positions: dict[int, int | None] = {}  # queue id -> the group consumer's position at the end

    def consume() -> None:
        with tidemq.PullConsumer(dev.namesrv, "chaos-g", consume_from="first",
                                 auto_commit=False) as c:
            c.subscribe(TOPIC)
            try:
                _consume(c)
            finally:
                positions.update({mq.queue_id: c.position(mq) for mq in c.assignment()})
                if not _caught_up():
                    _dump(c)

    def _consume(c) -> None:
        # Caught up only counts once no producer can still be waiting for an acknowledgement.
        while not give_up.is_set() and (not producers_done.is_set() or not _caught_up()):
            try:
                msgs = c.poll(timeout=0.5)
                with lock:
                    consumed.update(m.body for m in msgs)
                c.commit()
            except Exception:
                time.sleep(0.05)

    def _dump(c) -> None:
        """Print the consumer's per-queue state and where its pull tasks wait (diagnosis)."""
        import io

        from tidemq.client.blocking import _run

        async def state() -> str:
            out = io.StringIO()
            for mq, q in c._aio._queues.items():
                out.write(f"{mq.queue_id}: pull={q.pull_offset} consume={q.consume_offset} "
                          f"buffered={q.buffered} paused={q.paused} space={q.space.is_set()} "
                          f"chunks={len(q.chunks)}\n")
                if q.task is not None:
                    q.task.print_stack(file=out)
            return out.getvalue()

        print(_run(state()))

    def _caught_up() -> bool:
        with lock:
            return acked.keys() <= consumed.keys()

    with tidemq.Admin(dev.namesrv) as admin:
        admin.create_topic(TOPIC, QUEUES)
    threads = [threading.Thread(target=produce, args=(b"s", 1)),
               threading.Thread(target=produce, args=(b"b", 10))]
    consumer = threading.Thread(target=consume)
    for t in (*threads, consumer):
        t.start()
    rng = random.Random(int(os.environ.get("TIDEMQ_SOAK_SEED", "7")))
    try:
        for _ in range(KILLS):
            time.sleep(rng.uniform(0.5, 1.5))
            dev.kill9()
            time.sleep(rng.uniform(0.0, 0.3))
            dev.start()
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        producers_done.set()
    consumer.join(60)
    give_up.set()
    consumer.join(10)
    try:
        # A fresh read of the whole topic: each body once, offsets without gaps.
        seen: collections.Counter[bytes] = collections.Counter()
        where: dict[bytes, tuple[int, int]] = {}
        offsets: dict[int, list[int]] = collections.defaultdict(list)
        with tidemq.PullConsumer(dev.namesrv, "chaos-audit", consume_from="first",
                                 auto_commit=False) as audit:
            audit.subscribe(TOPIC)
            idle = 0
            while idle < 3:
                msgs = audit.poll(timeout=0.5)
                idle = 0 if msgs else idle + 1
                for m in msgs:
                    seen[m.body] += 1
                    where[m.body] = (m.queue_id, m.queue_offset)
                    offsets[m.queue_id].append(m.queue_offset)
        with tidemq.Admin(dev.namesrv) as admin:
            maxes = {mq.queue_id: admin.max_offset(mq) for mq in admin.topic_queues(TOPIC)}
        with lock:
            lost = {b: acked[b] for b in acked.keys() - seen.keys()}
            unconsumed = {b: (acked[b], where.get(b)) for b in acked.keys() - consumed.keys()}
        assert not lost, f"{len(lost)} acknowledged messages not stored: {list(lost.items())[:5]}"
        assert not unconsumed, (
            f"{len(unconsumed)} acknowledged messages stored but never delivered to the group "
            f"(acked at, stored at): {list(unconsumed.items())[:5]}; group consumer positions "
            f"{positions}, queue max offsets {maxes}\nbroker log:\n{dev.log()[-3000:]}"
        )
        redelivered = sum(n - 1 for n in consumed.values() if n > 1)
        print(f"{KILLS} kills: {len(acked)} acknowledged, {len(consumed)} consumed distinct, "
              f"{redelivered} redelivered, failed sends {dict(failures)}")
        assert len(acked) > 100, "too little traffic to prove anything"
        dupes = {b: n for b, n in seen.items() if n > 1}
        assert not dupes, f"stored twice: {list(dupes.items())[:5]}"
        for qid, offs in offsets.items():
            assert offs == list(range(offs[0], offs[0] + len(offs))), f"queue {qid} has gaps"
        moved = {b: (acked[b], where[b]) for b in acked if acked[b] != where[b]}
        assert not moved, f"queue positions changed after a crash: {list(moved.items())[:5]}"
    finally:
        stop.set()
        give_up.set()
        consumer.join(5)
        dev.stop()
