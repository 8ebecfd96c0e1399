"""Transactional messages end to end (ref BR9, PR7) against a real `tidemq dev` with a
test-sized check service (a round every 150 ms, 1 s immunity, the default 15 checks).

- commit makes the message visible, and nothing is visible while the local transaction runs;
- rollback drops it;
- UNKNOW, then the broker's check, answered COMMIT by the checker, makes it visible;
- a producer killed with SIGKILL right after its half message: a producer of the same group
  started later (which has sent nothing, only its heartbeat) is asked and resolves it;
- a transaction the checker never resolves is checked 15 times, then moved to the discard topic.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time
from collections import Counter

import pytest
from producer_path_helpers import dev_cluster, drain, make_topic, runtime_info

from tidemq import aio
from tidemq.aio import LocalTransactionState as S

OPTIONS = (
    "transaction_check_interval_ms=150",
    "transaction_timeout_ms=1000",
)


@pytest.fixture(scope="module", params=["async", "sync"])
def cluster(request):
    """Both flush modes: under SYNC_FLUSH the end of a transaction is answered from the op
    record's group commit, not by blocking the broker's loop on an fsync."""
    yield from dev_cluster(*OPTIONS, f"flush_mode={request.param}")


async def visible(namesrv: str, topic: str, group: str, n: int, timeout: float) -> list:
    async with aio.PullConsumer(namesrv, group, consume_from="first") as c:
        c.subscribe(topic)
        got = await drain(c, n, timeout)
        got += await c.poll(timeout=0.3)
    return got


def test_commit_is_visible_only_after_commit_and_rollback_never(cluster):
    async def main():
        topic = "txn-basic"
        await make_topic(cluster.namesrv, topic, 2)
        seen_during: list = []

        async def commit_after_looking(msg, arg):
            # the half message is stored; no consumer may see it yet
            seen_during.extend(await visible(cluster.namesrv, topic, "txn-peek", 1, 0.6))
            return S.COMMIT_MESSAGE

        async with aio.TransactionProducer(
            cluster.namesrv, "txn-basic-pg", checker=lambda m: S.UNKNOW
        ) as p:
            r1 = await p.send_in_transaction(aio.Message(topic, b"committed"),
                                             commit_after_looking)
            r2 = await p.send_in_transaction(aio.Message(topic, b"rolled back"),
                                             lambda m, a: S.ROLLBACK_MESSAGE)
        assert seen_during == []
        assert r1.local_transaction_state is S.COMMIT_MESSAGE
        assert r2.local_transaction_state is S.ROLLBACK_MESSAGE
        got = await visible(cluster.namesrv, topic, "txn-basic-g", 1, 5)
        assert [m.body for m in got] == [b"committed"]
        info = await runtime_info(cluster.broker)
        assert int(info["txn_committed"]) >= 1 and int(info["txn_rolled_back"]) >= 1

    asyncio.run(main())


def test_unknown_then_check_commits(cluster):
    async def main():
        topic = "txn-check"
        await make_topic(cluster.namesrv, topic, 1)
        asked: list[bytes] = []

        def checker(m):
            asked.append(m.body)
            return S.COMMIT_MESSAGE

        async with aio.TransactionProducer(cluster.namesrv, "txn-check-pg",
                                           checker=checker) as p:
            t0 = time.monotonic()
            r = await p.send_in_transaction(aio.Message(topic, b"decided later"),
                                            lambda m, a: S.UNKNOW)
            assert r.local_transaction_state is S.UNKNOW
            assert await visible(cluster.namesrv, topic, "txn-check-g0", 1, 0.2) == []
            got = await visible(cluster.namesrv, topic, "txn-check-g", 1, 10)
            waited = time.monotonic() - t0
        assert [m.body for m in got] == [b"decided later"]
        assert asked[:1] == [b"decided later"]
        assert waited >= 1.0, "checked before its immunity time"

    asyncio.run(main())


_KILLED_PRODUCER = textwrap.dedent("""
    import asyncio, os, signal, sys
    from tidemq import aio

    async def main():
        p = aio.TransactionProducer(sys.argv[1], "txn-restart-pg",
                                    checker=lambda m: aio.LocalTransactionState.UNKNOW)
        await p.start()

        def die(msg, arg):
            print("half stored", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # after the half message, before the end

        await p.send_in_transaction(aio.Message("txn-restart", b"orphan"), die)

    asyncio.run(main())
""")


def test_producer_killed_after_half_message_is_resolved_by_a_restarted_one(cluster):
    async def main():
        await make_topic(cluster.namesrv, "txn-restart", 1)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _KILLED_PRODUCER, cluster.namesrv,
            stdout=subprocess.PIPE,
        )
        out, _ = await proc.communicate()
        assert out.strip() == b"half stored" and proc.returncode == -9
        assert await visible(cluster.namesrv, "txn-restart", "txn-restart-g0", 1, 0.3) == []
        asked: list[bytes] = []

        def checker(m):
            asked.append(m.body)
            return S.COMMIT_MESSAGE

        # A new producer of the same group that sends nothing: its heartbeat makes it known.
        async with aio.TransactionProducer(cluster.namesrv, "txn-restart-pg",
                                           checker=checker):
            got = await visible(cluster.namesrv, "txn-restart", "txn-restart-g", 1, 10)
        assert [m.body for m in got] == [b"orphan"]
        assert asked and set(asked) == {b"orphan"}

    asyncio.run(main())


def test_unresolved_transaction_is_checked_15_times_then_discarded(cluster):
    async def main():
        topic = "txn-never"
        await make_topic(cluster.namesrv, topic, 1)
        asked: Counter[bytes] = Counter()

        def checker(m):
            asked[m.body] += 1
            return S.UNKNOW

        async with aio.TransactionProducer(cluster.namesrv, "txn-never-pg",
                                           checker=checker) as p:
            await p.send_in_transaction(aio.Message(topic, b"undecided"),
                                        lambda m, a: S.UNKNOW)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 15
            while loop.time() < deadline:
                info = await runtime_info(cluster.broker)
                if int(info["txn_discarded"]) >= 1:
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.4)  # any (wrong) further check would arrive by now
        assert int(info["txn_discarded"]) >= 1
        assert asked == {b"undecided": 15}
        assert await visible(cluster.namesrv, topic, "txn-never-g", 1, 0.3) == []

    asyncio.run(main())
