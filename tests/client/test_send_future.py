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
