"""The push consumer's CPU per one-message queue result, from the pull driver's hand-over
(``PullService.on_result``: decode, ProcessQueue, consume dispatch) through an ``async def``
listener to the commit (ProcessQueue, offset store), over 10,000 queues, in slices of 64 with
the loop turning between them as the driver does; no network (the consumer's own pieces --
offset store, pull service, consume service -- built as ``PushConsumer.start`` builds them).
Thread CPU, best of 6 rounds; steadier than a whole run on a loaded machine.

    PYTHONPATH=src python bench/push_tail/consumer_cpu.py
"""

import asyncio
import time

from tidemq.client.consume_concurrently import ConsumeConcurrentlyService
from tidemq.client.listener import ConsumeStatus
from tidemq.client.message import Message, MessageQueue
from tidemq.client.offset_store import RemoteOffsetStore
from tidemq.client.process_queue import ProcessQueue
from tidemq.client.pull_service import PullRequest, PullService
from tidemq.client.push_consumer import PushConsumer
from tidemq.protocol.batch.fast import encode_messages
from tidemq.protocol.headers import MultiQueuePullResult
from tidemq.protocol.record import STORE_FIELDS, STORE_FIELDS_OFFSET, seal_store_header

N = 10_000
ROUNDS = 6

def body(topic: str, off: int) -> bytes:
    """One stored message of 1 KiB at queue offset ``off``, as a pull answer carries it."""
    b = encode_messages(topic, [Message(topic, b"x" * 1024)], queue_id=0, producer_id=1,
                        base_seq=off, born_ts=1)
    STORE_FIELDS.pack_into(b, STORE_FIELDS_OFFSET, 0, off, 2)
    seal_store_header(b, 0, 72 + len(topic))
    return bytes(b)

async def main() -> None:
    got = [0]

    async def listener(msgs, ctx):  # noqa: ANN001, ANN202
        got[0] += len(msgs)
        return ConsumeStatus.SUCCESS
    c = PushConsumer("127.0.0.1:1", "micro", listener, consume_message_batch_max_size=32)
    topics = [f"topic-{i}" for i in range(N // 8)]
    for t in topics:
        c.subscribe(t)
    c.offset_store = RemoteOffsetStore(None, None, c.group, 3.0)  # type: ignore[arg-type]
    c.pull_service = PullService(c)
    c.consume_service = ConsumeConcurrentlyService(c)
    reqs = []
    for i in range(N):
        mq = MessageQueue(topics[i // 8], "b", i % 8)
        reqs.append(PullRequest(mq, ProcessQueue(), 0))
    bodies = [[body(r.mq.topic, k) for r in reqs] for k in range(ROUNDS)]
    best = 1e9
    for k in range(ROUNDS):
        res = [MultiQueuePullResult(0, next_begin_offset=k + 1, body_bytes=len(bodies[k][0]),
                                    stands=True) for _ in reqs]
        t = time.thread_time()
        on_result = c.pull_service.on_result
        for j in range(0, N, 64):  # slices of 64 queues, the loop turning between them
            for r, rr, bb in zip(reqs[j:j + 64], res[j:j + 64], bodies[k][j:j + 64],
                                 strict=True):
                on_result(r, rr, bb, "addr")
            await asyncio.sleep(0)
        while got[0] < N * (k + 1):
            await asyncio.sleep(0)
        best = min(best, time.thread_time() - t)
    print(f"consumer per one-message queue result: {best / N * 1e6:.2f} us (best of {ROUNDS})")

if __name__ == "__main__":
    asyncio.run(main())
