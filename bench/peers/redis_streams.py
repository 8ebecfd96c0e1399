"""tidemq's three benchmark workloads against Redis Streams, through redis-py with hiredis.

- produce: ``XADD key * d <body>`` in non-transactional pipelines of ``--batch`` (one round
  trip per pipeline), timed from the first pipeline to the last reply.
- consume: ``XRANGE key <after last id> + COUNT <batch>`` pages from the start of a stream that
  already holds at least ``--count`` entries (run ``produce`` first on the same ``--stream``).
- e2e: one ``XADD`` per message at ``--rate`` for ``--seconds``, the send time stamped in the
  body; a consumer in another process reads with ``XREAD BLOCK`` and records receive - send.

The server should run with ``appendonly yes`` and ``appendfsync everysec`` (servers.py does).
Prints one JSON object per run. Single-threaded; the e2e consumer is a separate process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import common
import redis
from redis.utils import HIREDIS_AVAILABLE

PEER = "redis-streams"
FIELD = b"d"
E2E_GRACE_S = 5.0


def _client(args) -> redis.Redis:
    r = redis.Redis(host=args.host, port=args.port, socket_timeout=30)
    r.ping()  # connect before any clock starts
    return r


def _client_info(r: redis.Redis) -> dict:
    return {
        "client": f"redis-py {redis.__version__}" + (" + hiredis" if HIREDIS_AVAILABLE else ""),
        "server": f"redis {r.info('server')['redis_version']}",
        "appendfsync": r.config_get("appendfsync").get("appendfsync"),
    }


def produce(args) -> dict:
    r = _client(args)
    key = args.stream or f"bench-{args.size}"
    r.delete(key)  # a fresh stream, so consume reads exactly what this run wrote
    fields = {FIELD: b"x" * args.size}
    pipe = r.pipeline(transaction=False)
    deadline = time.monotonic() + args.timeout
    sent = 0
    t0 = time.perf_counter()
    while sent < args.count:
        k = min(args.batch, args.count - sent)
        for _ in range(k):
            pipe.xadd(key, fields)
        pipe.execute()
        sent += k
        if time.monotonic() > deadline:
            common.fail(f"produce timed out after {sent} of {args.count} messages")
    seconds = time.perf_counter() - t0
    stored = r.xlen(key)
    if stored < sent:
        common.fail(f"stream {key} holds {stored} entries after {sent} were sent")
    return common.result(
        PEER,
        "produce",
        size=args.size,
        count=sent,
        batch=args.batch,
        seconds=seconds,
        stream=key,
        **_client_info(r),
    )


def consume(args) -> dict:
    r = _client(args)
    key = args.stream or f"bench-{args.size}"
    have = r.xlen(key)
    if have < args.count:
        common.fail(
            f"stream {key} holds {have} entries, fewer than --count {args.count}: "
            "run produce with the same --stream/--size first"
        )
    deadline = time.monotonic() + args.timeout
    start = "-"
    got = 0
    nbytes = 0
    t0 = time.perf_counter()
    while got < args.count:
        page = r.xrange(key, min=start, max="+", count=min(args.batch, args.count - got))
        if not page:
            common.fail(f"stream {key} ended after {got} entries")
        got += len(page)
        nbytes += len(page[-1][1][FIELD]) * len(page)
        start = b"(" + page[-1][0]  # exclusive: the page after the last id seen
        if time.monotonic() > deadline:
            common.fail(f"consume timed out after {got} of {args.count} messages")
    seconds = time.perf_counter() - t0
    if nbytes != got * args.size:
        common.fail(f"bodies are not {args.size} bytes: produce with the same --size first")
    return common.result(
        PEER,
        "consume",
        size=args.size,
        count=got,
        batch=args.batch,
        seconds=seconds,
        stream=key,
        **_client_info(r),
    )


def _e2e_consumer(host, port, key, ready, expected, stop_at, out) -> None:
    """Runs in a child process: XREAD BLOCK from the stream's start until ``expected`` (set by
    the producer when it is done) messages arrived or ``stop_at`` (monotonic) passed."""
    r = redis.Redis(host=host, port=port, socket_timeout=30)
    r.ping()
    last = b"0-0"
    lat: list[int] = []
    ready.set()
    while time.monotonic() < stop_at:
        want = expected.value
        if 0 <= want <= len(lat):
            break
        resp = r.xread({key: last}, count=1000, block=100)
        now = time.monotonic_ns()
        for _, entries in resp or ():
            for _msg_id, fields in entries:
                lat.append(common.latency_ns(fields[FIELD], now))
            last = entries[-1][0]
    out.put((len(lat), common.latency_summary(lat)))


def e2e(args) -> dict:
    r = _client(args)
    key = args.stream or f"e2e-{os.getpid()}-{args.size}"
    r.delete(key)
    ctx = mp.get_context("spawn")
    ready, expected, out = ctx.Event(), ctx.Value("q", -1), ctx.Queue()
    stop_at = time.monotonic() + args.seconds + E2E_GRACE_S + 30  # + consumer start-up
    consumer = ctx.Process(
        target=_e2e_consumer,
        args=(args.host, args.port, key, ready, expected, stop_at, out),
        daemon=True,
    )
    consumer.start()
    try:
        if not ready.wait(30):
            common.fail("e2e consumer did not start")
        buf = bytearray(b"x" * args.size)
        pacer = common.Pacer(args.rate, args.seconds)
        pipe = r.pipeline(transaction=False)
        while not pacer.done():
            k = pacer.due()
            if k == 1:
                r.xadd(key, {FIELD: common.stamped(buf)})
            elif k > 1:
                # Behind schedule (a sleep overshot): send what is owed in one round trip.
                for _ in range(k):
                    pipe.xadd(key, {FIELD: common.stamped(buf)})
                pipe.execute()
            pacer.sent += k
            pacer.wait()
        send_s = time.monotonic() - pacer.t0
        expected.value = pacer.sent
        received, lat = out.get(timeout=max(1.0, stop_at - time.monotonic() + 5))
        consumer.join(10)
    finally:
        if consumer.is_alive():
            consumer.kill()
        r.delete(key)
    return common.result(
        PEER,
        "e2e",
        size=args.size,
        count=received,
        batch=1,
        seconds=send_s,
        rate=args.rate,
        sent=pacer.sent,
        lost=pacer.sent - received,
        **lat,
        **_client_info(r),
    )


def main(argv=None) -> None:
    args = common.parse_args("redis_streams", argv)
    run = {"produce": produce, "consume": consume, "e2e": e2e}[args.workload]
    common.emit(run(args))


if __name__ == "__main__":
    main()
