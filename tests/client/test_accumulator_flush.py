"""The accumulator's timed flush (``batch_max_delay``) sends exactly the buckets that got
``send_async`` messages since the previous flush -- among thousands of idle ones, and again
for a bucket that fills after its last flush -- and gathers several topics' batches into one
``send_many`` call."""

from __future__ import annotations

import asyncio

from tidemq.client.accumulator import Accumulator
from tidemq.client.message import Message, SendResult, SendStatus


def test_timed_flush_sends_each_lingering_bucket_once_among_idle_ones():
    async def run() -> None:
        sent: list[tuple[str, int]] = []  # (topic, messages) per batch sent alone
        many: list[list[tuple[str, int]]] = []  # batches handed to send_many, per call

        async def send(topic, mq, msgs, timeout):
            sent.append((topic, len(msgs)))
            return SendResult(SendStatus.SEND_OK, "", topic, 0, 0, len(msgs), "b", 1, 0)

        acc = Accumulator(send, batch_max_messages=1000, batch_max_bytes=1 << 20,
                          batch_max_delay=0.002, max_pending_messages=100_000)
        # 2,000 buckets that exist but stay idle after their first flush
        futs = [acc.add_async(Message(f"t{i}", b"x")) for i in range(2000)]
        await asyncio.gather(*futs)
        assert len(sent) == 2000
        sent.clear()

        def take(batches):
            many.append([(t, len(m)) for t, m, _f in batches])
            return batches  # each goes alone after all

        acc.send_many = take
        futs = [acc.add_async(Message(t, b"y")) for t in ("t5", "t7", "t5", "t1999")]
        await asyncio.gather(*futs)
        assert many == [[("t5", 2), ("t7", 1), ("t1999", 1)]]
        assert sorted(sent) == [("t1999", 1), ("t5", 2), ("t7", 1)]
        # a bucket flushed before lingers again: the next timed flush sends it
        sent.clear()
        many.clear()
        f = acc.add_async(Message("t7", b"z"))
        await f
        assert sent == [("t7", 1)] and many == []  # one batch alone: no send_many call
        assert acc.npending == 0

    asyncio.run(run())
