"""``send_async``'s SendFuture (client/send_future.py): resolved per batch, each message's
SendResult the one ``split_result`` gives, and usable wherever an asyncio.Future is (await,
gather, wait, wait_for, callbacks, cancel)."""

from __future__ import annotations

import asyncio
import gc

import pytest

from tidemq import aio
from tidemq.bench.client_bench import ensure_topic
from tidemq.client.accumulator import split_result
from tidemq.client.message import SendResult, SendStatus
from tidemq.client.send_future import SendFuture

pytestmark = pytest.mark.timeout(120)

BATCH = SendResult(SendStatus.SEND_OK, "X", "t", 3, 40, 5, "broker-a", 0xAB, 1000, 777)
DUP = SendResult(SendStatus.DUPLICATE, "X", "t", 3, -1, 5, "broker-a", 0xAB, 1000)


@pytest.mark.parametrize("batch", [BATCH, DUP])
def test_each_message_gets_what_split_result_gives(batch):
    async def main():
        loop = asyncio.get_running_loop()
        plain = [loop.create_future() for _ in range(5)]
        lazy = [SendFuture(loop) for _ in range(5)]
        split_result(batch, plain)
        split_result(batch, lazy)
        assert all(f.done() for f in lazy)
        assert [f.result() for f in lazy] == [f.result() for f in plain]
        assert len({f.result().msg_id for f in lazy}) == 5

    asyncio.run(main())


def test_await_gather_wait_and_callbacks_behave_as_with_asyncio_futures():
    async def main():
        loop = asyncio.get_running_loop()
        a, b, c = SendFuture(loop), SendFuture(loop), SendFuture(loop)
        assert asyncio.isfuture(a) and a.get_loop() is loop
        seen: list[object] = []
        a.add_done_callback(lambda f: seen.append(("a", f.result().queue_offset)))
        loop.call_later(0.01, split_result, BATCH, [SendFuture(loop), a])
        loop.call_later(0.01, b.set_exception, ValueError("refused"))
        assert (await a).queue_offset == 41
        assert seen == []  # callbacks run on the loop with call_soon, as asyncio's
        await asyncio.sleep(0)
        assert seen == [("a", 41)]
        out = await asyncio.gather(a, b, return_exceptions=True)
        assert out[0] is a.result() and isinstance(out[1], ValueError)
        with pytest.raises(ValueError, match="refused"):
            b.result()
        done, pending = await asyncio.wait({a, c}, timeout=0.01)
        assert done == {a} and pending == {c}
        late: list[object] = []
        a.add_done_callback(late.append)  # added after completion: still called, soon
        await asyncio.sleep(0)
        assert late == [a]

    asyncio.run(main())


def test_cancel_and_a_timed_out_wait_leave_the_late_answer_unread():
    async def main():
        loop = asyncio.get_running_loop()
        f = SendFuture(loop)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(f, 0.01)
        assert f.cancelled()
        f.in_batch(BATCH, 0)  # the batch's answer after the cancel: ignored
        assert f.cancelled()
        with pytest.raises(asyncio.CancelledError):
            f.result()
        g = SendFuture(loop)
        calls: list[object] = []
        g.add_done_callback(calls.append)
        assert g.remove_done_callback(calls.append) == 1
        g.set_result(BATCH)
        await asyncio.sleep(0)
        assert calls == [] and g.result() is BATCH
        assert not g.cancel()  # answered: cannot be cancelled

    asyncio.run(main())


def test_a_send_future_is_not_tracked_by_the_garbage_collector():
    async def main():
        f = SendFuture(asyncio.get_running_loop())
        assert not gc.is_tracked(f)

    asyncio.run(main())


def test_send_async_resolves_each_message_with_its_own_offset_and_one_bad_message_alone(dev):
    async def main():
        await ensure_topic(dev.namesrv, "sf-async", 1)
        async with aio.Producer(dev.namesrv, max_properties_size=1024) as p:
            await p.send(aio.Message("sf-async", b"warm"))
            msgs = [aio.Message("sf-async", f"m{i}".encode()) for i in range(50)]
            msgs[7] = aio.Message("sf-async", b"bad", properties={"big": "x" * 4000})
            futs = [p.send_async(m) for m in msgs]
            assert all(isinstance(f, SendFuture) for f in futs)
            await p.flush()
            return futs

    futs = asyncio.run(main())
    assert isinstance(futs[7].exception(), aio.MessageRejectedError)
    good = [f.result() for i, f in enumerate(futs) if i != 7]
    offsets = [r.queue_offset for r in good]
    assert offsets == sorted(offsets) and len(set(offsets)) == 49
    assert len({r.msg_id for r in good}) == 49 and all(r.count == 1 for r in good)


def _acc_answering(answers: list[int]):
    """An Accumulator whose batches are answered at once with SendResults of consecutive
    offsets (the broker's part: each batch's message count appended to ``answers``)."""
    from tidemq.client.accumulator import Accumulator

    async def send(topic, mq, msgs, timeout, prepared=None):
        await asyncio.sleep(0.005)  # in flight for a while: callers may await, cancel...
        off = 100 * len(answers)
        answers.append(len(msgs))
        return SendResult(SendStatus.SEND_OK, "X", topic, 0, off, len(msgs), "b", 0xAB, off)

    return Accumulator(send, batch_max_messages=1000, batch_max_bytes=1 << 20,
                       batch_max_delay=0.001, max_pending_messages=100_000)


def test_a_batch_answered_as_a_whole_resolves_every_future_of_it_callbacks_and_awaits_too():
    async def main():
        from tidemq.client.message import Message

        answers: list[int] = []
        acc = _acc_answering(answers)
        futs = [acc.add_async(Message("t", b"x%d" % i)) for i in range(40)]
        seen: list[int] = []
        futs[3].add_done_callback(lambda f: seen.append(f.result().queue_offset))
        waiter = asyncio.ensure_future(_read(futs[5]))
        futs[6].cancel()  # stops waiting; the message is still sent
        while not all(f.done() for f in futs):
            await asyncio.sleep(0.001)
        assert answers == [40]
        assert [f.result().queue_offset for i, f in enumerate(futs) if i != 6] == \
            [i for i in range(40) if i != 6]
        assert futs[6].cancelled() and not futs[6].cancel()
        assert await waiter == 5
        await asyncio.sleep(0)
        assert seen == [3]
        assert not futs[0].cancel()  # answered: cannot be cancelled
        with pytest.raises(asyncio.InvalidStateError):
            futs[0].set_exception(ValueError("late"))
        assert acc.npending == 0

    asyncio.run(main())


async def _read(f: SendFuture) -> int:
    return (await f).queue_offset


def test_send_async_futures_sharing_a_batch_with_a_waiting_caller_each_get_their_own():
    async def main():
        from tidemq.client.message import Message

        answers: list[int] = []
        acc = _acc_answering(answers)
        loop = asyncio.get_running_loop()
        futs: list[object] = [acc.add_async(Message("t", b"a")) for _ in range(3)]
        acc.npending += 1
        futs.append(acc.add(Message("t", b"w"), deadline=loop.time() + 5))  # awaits send()
        futs += [acc.add_async(Message("t", b"b")) for _ in range(3)]
        await asyncio.wait_for(asyncio.gather(*futs), 5)
        # one batch of all 7 (the waiting caller's bucket left at the end of the iteration)
        assert answers == [7]
        assert [f.result().queue_offset for f in futs] == list(range(7))
        # the bucket's next batch: send_async alone again, offsets of the second answer
        more = [acc.add_async(Message("t", b"c")) for _ in range(4)]
        await asyncio.gather(*more)
        assert answers == [7, 4]
        assert [f.result().queue_offset for f in more] == [100, 101, 102, 103]
        assert acc.npending == 0

    asyncio.run(main())


def test_send_async_batches_are_cut_at_the_byte_limit_and_each_message_gets_its_offset():
    async def main():
        from tidemq.client.accumulator import Accumulator
        from tidemq.client.message import Message

        sent: list[list[bytes]] = []

        async def send(topic, mq, msgs, timeout, prepared=None):
            off = 100 * len(sent)
            sent.append([m.body for m in msgs])
            return SendResult(SendStatus.SEND_OK, "X", topic, 0, off, len(msgs), "b", 1, off)

        acc = Accumulator(send, batch_max_messages=1000, batch_max_bytes=1000,
                          batch_max_delay=0.001, max_pending_messages=1000)
        bodies = [bytes([i]) * (300 + 50 * (i % 3)) for i in range(10)]
        futs = [acc.add_async(Message("t", b)) for b in bodies]
        await asyncio.wait_for(asyncio.gather(*futs), 5)
        # 300, 350, 400, 300, ...: the message that would take a batch past 1000 bytes
        # starts the next one
        assert [len(b) for b in sent] == [2, 2, 2, 2, 2]
        assert [x for b in sent for x in b] == bodies
        assert [f.result().queue_offset for f in futs] == [
            100 * j + i for j in range(5) for i in range(2)]
        bodies = [b"y" * 250 for _ in range(9)]  # exactly at the limit: leaves at once
        futs = [acc.add_async(Message("t", b)) for b in bodies]
        await asyncio.wait_for(asyncio.gather(*futs), 5)
        assert [len(b) for b in sent[5:]] == [4, 4, 1]
        assert acc.npending == 0

    asyncio.run(main())
