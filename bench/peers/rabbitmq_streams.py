"""tidemq's three benchmark workloads against RabbitMQ Streams (the rabbitmq_stream plugin's
binary protocol), through the asyncio ``rstream`` client on uvloop when it is installed.

- produce: ``Producer.send_batch`` of ``--batch`` raw messages (one Publish frame each), with up
  to ``--inflight`` batches awaiting their publish confirms; timed from the first send to the
  last confirm.
- consume: a ``Consumer`` subscribed from the FIRST offset of a stream that already holds at
  least ``--count`` messages (run ``produce`` first on the same ``--stream``); the broker
  delivers whole chunks (one per producer batch) under ``--credit`` chunks of credit; timed
  from subscribe to the ``--count``-th message.
- e2e: one ``send_batch([msg])`` per message at ``--rate`` for ``--seconds`` (messages owed
  after an overshooting sleep go in one frame), the send time stamped in the body; a consumer
  in another process subscribed to the stream records receive - send.

Prints one JSON object per run. Each run is one asyncio loop in one thread; the e2e consumer
runs its own loop in a separate process.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import time

import common
import rstream
from rstream import ConsumerOffsetSpecification, OffsetType

try:
    import uvloop
except ImportError:  # plain asyncio still works, only slower
    uvloop = None

PEER = "rabbitmq-streams"
USER = PASSWORD = "guest"
E2E_GRACE_S = 5.0
# rstream's Publish frames must fit the negotiated frame_max (1 MiB by default, the broker's
# default too); send_batch does not split, so a batch is cut to what fits.
FRAME_MAX = 1024 * 1024
PUBLISH_FRAME_OVERHEAD = 13
MESSAGE_OVERHEAD = 12


def _run(coro):
    if uvloop is not None:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)
    return asyncio.run(coro)


def _client_info() -> dict:
    loop = f"uvloop {uvloop.__version__}" if uvloop is not None else "asyncio"
    return {"client": f"rstream {rstream.__version__}", "loop": loop}


async def _server_version(entity) -> str:
    props = (await entity.default_client).server_properties or {}
    return f"rabbitmq {props.get('version', '?')}"


def _producer(args) -> rstream.Producer:
    return rstream.Producer(args.host, args.port, username=USER, password=PASSWORD)


def _consumer(args) -> rstream.Consumer:
    return rstream.Consumer(args.host, args.port, username=USER, password=PASSWORD)


async def _produce(args) -> dict:
    stream = args.stream or f"bench-{args.size}"
    per_frame = (FRAME_MAX - PUBLISH_FRAME_OVERHEAD) // (args.size + MESSAGE_OVERHEAD)
    batch = min(args.batch, per_frame)
    body = b"x" * args.size
    msgs = [body] * batch
    window = args.inflight * batch
    loop = asyncio.get_running_loop()
    sent = confirmed = failed = 0
    waiter: asyncio.Future | None = None
    limit = window  # the waiter wakes once fewer than this many messages await confirms

    def on_confirm(status: rstream.ConfirmationStatus) -> None:
        nonlocal confirmed, failed
        if status.is_confirmed:
            confirmed += 1
        else:
            failed += 1
        if waiter is not None and not waiter.done() and sent - confirmed - failed < limit:
            waiter.set_result(None)

    async def pending_below(n: int, deadline: float) -> None:
        nonlocal waiter, limit
        limit = n
        while sent - confirmed - failed >= n:
            left = deadline - time.monotonic()
            if left <= 0:
                common.fail(f"produce timed out: {sent} sent, {confirmed} confirmed")
            waiter = loop.create_future()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter, left)
        waiter = None

    async with _producer(args) as producer:
        await producer.delete_stream(stream, missing_ok=True)  # fresh: consume reads this run
        await producer.create_stream(stream, exists_ok=True)
        server = await _server_version(producer)
        deadline = time.monotonic() + args.timeout
        t0 = time.perf_counter()
        while sent < args.count:
            k = min(batch, args.count - sent)
            await pending_below(window, deadline)
            sent += k
            await producer.send_batch(
                stream, msgs if k == batch else msgs[:k], on_publish_confirm=on_confirm
            )
        await pending_below(1, deadline)
        seconds = time.perf_counter() - t0
    if failed:
        common.fail(f"{failed} of {sent} messages were not confirmed")
    return common.result(
        PEER,
        "produce",
        size=args.size,
        count=confirmed,
        batch=batch,
        seconds=seconds,
        inflight=args.inflight,
        stream=stream,
        server=server,
        **_client_info(),
    )


async def _consume(args) -> dict:
    stream = args.stream or f"bench-{args.size}"
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    got = 0
    nbytes = 0
    count = args.count

    def on_message(msg: bytes, ctx: rstream.MessageContext) -> None:
        nonlocal got, nbytes
        if got < count:
            got += 1
            nbytes += len(msg)
            if got == count and not done.done():
                done.set_result(None)

    async with _consumer(args) as consumer:
        server = await _server_version(consumer)
        if not await consumer.stream_exists(stream):
            common.fail(
                f"stream {stream} does not exist: run produce with the same --stream/--size first"
            )
        t0 = time.perf_counter()
        await consumer.subscribe(
            stream,
            on_message,
            initial_credit=args.credit,
            offset_specification=ConsumerOffsetSpecification(OffsetType.FIRST, None),
        )
        try:
            await asyncio.wait_for(done, args.timeout)
        except TimeoutError:
            common.fail(
                f"consume timed out after {got} of {count} messages (is the backlog large enough?)"
            )
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
        credit=args.credit,
        stream=stream,
        server=server,
        **_client_info(),
    )


def _e2e_consumer(host, port, stream, ready, expected, stop_at, out) -> None:
    """Runs in a child process: subscribe from the (fresh) stream's first offset and record
    receive - send until ``expected`` messages arrived or ``stop_at`` (monotonic) passed."""
    lat: list[int] = []

    def on_message(msg: bytes, ctx: rstream.MessageContext) -> None:
        lat.append(common.latency_ns(msg, time.monotonic_ns()))

    async def run() -> None:
        async with rstream.Consumer(host, port, username=USER, password=PASSWORD) as consumer:
            await consumer.subscribe(
                stream,
                on_message,
                offset_specification=ConsumerOffsetSpecification(OffsetType.FIRST, None),
            )
            ready.set()
            while time.monotonic() < stop_at:
                want = expected.value
                if 0 <= want <= len(lat):
                    break
                await asyncio.sleep(0.01)

    _run(run())
    out.put((len(lat), common.latency_summary(lat)))


async def _e2e_send(args, stream: str) -> tuple[int, float]:
    buf = bytearray(b"x" * args.size)
    async with _producer(args) as producer:
        # Declares the publisher before the clock starts; a real, stamped and counted message.
        await producer.send_wait(stream, common.stamped(buf))
        pacer = common.Pacer(args.rate, args.seconds)
        while not pacer.done():
            k = pacer.due()
            if k:
                await producer.send_batch(stream, [common.stamped(buf) for _ in range(k)])
                pacer.sent += k
            d = pacer.delay()
            await asyncio.sleep(d if d > 0 else 0)
        return pacer.sent + 1, time.monotonic() - pacer.t0


def _e2e(args) -> dict:
    stream = args.stream or f"e2e-{os.getpid()}-{args.size}"

    async def create() -> None:
        async with _producer(args) as producer:
            await producer.delete_stream(stream, missing_ok=True)
            await producer.create_stream(stream)
            return await _server_version(producer)

    server = _run(create())
    ctx = mp.get_context("spawn")
    ready, expected, out = ctx.Event(), ctx.Value("q", -1), ctx.Queue()
    stop_at = time.monotonic() + args.seconds + E2E_GRACE_S + 30  # + consumer start-up
    consumer = ctx.Process(
        target=_e2e_consumer,
        args=(args.host, args.port, stream, ready, expected, stop_at, out),
        daemon=True,
    )
    consumer.start()
    try:
        if not ready.wait(30):
            common.fail("e2e consumer did not start")
        sent, send_s = _run(_e2e_send(args, stream))
        expected.value = sent
        received, lat = out.get(timeout=max(1.0, stop_at - time.monotonic() + 5))
        consumer.join(10)
    finally:
        if consumer.is_alive():
            consumer.kill()
    return common.result(
        PEER,
        "e2e",
        size=args.size,
        count=received,
        batch=1,
        seconds=send_s,
        rate=args.rate,
        sent=sent,
        lost=sent - received,
        **lat,
        server=server,
        **_client_info(),
    )


def _extra_args(p) -> None:
    p.add_argument(
        "--inflight", type=int, default=8, help="produce: batches awaiting confirms at once"
    )
    p.add_argument(
        "--credit",
        type=int,
        default=10,
        help="consume: chunks of credit granted up front (rstream's default: 10)",
    )


def main(argv=None) -> None:
    args = common.parse_args("rabbitmq_streams", argv, extra=_extra_args)
    if args.workload == "produce":
        record = _run(_produce(args))
    elif args.workload == "consume":
        record = _run(_consume(args))
    else:
        record = _e2e(args)
    common.emit(record)


if __name__ == "__main__":
    main()
