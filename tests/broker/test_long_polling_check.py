"""The periodic check of held pulls gives the broker's loop back between steps (issue 17): at
10,000 standing queues one tick's 4,096 keys in one stretch held the loop 7-12 ms of CPU."""

from __future__ import annotations

import asyncio
import collections
from types import SimpleNamespace

from tidemq.broker import long_polling
from tidemq.broker.long_polling import HeldPull, PullRequestHoldService


def test_one_tick_of_the_check_is_spread_over_loop_turns_and_covers_each_key_once() -> None:
    async def go() -> tuple[collections.Counter[int], collections.Counter[str]]:
        loop = asyncio.get_running_loop()
        turn = [0]

        def tick() -> None:  # counts the loop's turns
            turn[0] += 1
            loop.call_soon(tick)

        per_turn: collections.Counter[int] = collections.Counter()
        per_key: collections.Counter[str] = collections.Counter()

        def max_offset(topic: str, qid: int) -> int:
            per_turn[turn[0]] += 1
            per_key[f"{topic}@{qid}"] += 1
            return 0  # nothing new: every pull stays held

        hold = PullRequestHoldService(loop, lambda held: None, max_offset, check_interval_s=0.01)
        conn = SimpleNamespace(held=set(), closed=False)
        for i in range(1000):
            header = SimpleNamespace(topic=f"t{i // 8}", queue_id=i % 8, queue_offset=0)
            hold.suspend(HeldPull(conn, i, header, None, 60.0, loop.time()), timed=False)
        loop.call_soon(tick)
        task = loop.create_task(hold.run_checks())
        while sum(per_key.values()) < 1000:
            await asyncio.sleep(0.001)
        task.cancel()
        hold.close()
        return per_turn, per_key

    per_turn, per_key = asyncio.run(go())
    assert len(per_key) == 1000 and set(per_key.values()) == {1}  # one pass, no key twice
    assert max(per_turn.values()) <= long_polling.CHECK_KEYS_PER_STEP
    assert len(per_turn) >= 1000 // long_polling.CHECK_KEYS_PER_STEP
