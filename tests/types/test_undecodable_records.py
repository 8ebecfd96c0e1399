"""Issue 13's "tolerate on the way out" rows against a real `tidemq dev`, with restarts and
kill -9: every reader skips, counts and logs a record it cannot decode, and moves on.

The hostile batches are CRC-valid (tests/hostile_records.py) and are written straight into the
broker's store while it is stopped -- the way such bytes may already be on disk (stored before
validation at the door existed, by a bug, a replica or a bit flip that kept the CRC) -- so
nothing at the door can stop them. Then the broker starts on that data:

- a timed (deliver_at) batch holding a key that is not UTF-8 used to fail every start-up
  ("cannot start: 'utf-8' codec ..."); a delay-level one blocked its level for good;
- a tag or property that is not UTF-8 in a CRC-valid batch stalled every consumer of the
  queue; a zlib bomb took 500 MB and 1-2 s of the broker's loop per send-back and 575 MB in the
  consumer;
- an unreadable half message stopped the transaction check round for every later one.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterator

import pytest
from producer_path_helpers import drain, make_topic, runtime_info

from hostile_records import bomb, poison
from support.cluster import DevCluster, start_dev, stop_dev
from tidemq import aio
from tidemq.broker.config import BrokerConfig
from tidemq.broker.envelope import wrap
from tidemq.broker.schedule_service import DELAY, SCHEDULE_TOPIC
from tidemq.broker.timer_service import TIMER_TOPIC
from tidemq.broker.transaction_service import (
    CHECK_TIMES,
    FIRST_BORN,
    HALF_TOPIC,
    PGROUP,
    TRAN_ID,
)
from tidemq.protocol.codes import RequestCode, ResponseCode
from tidemq.protocol.headers import ConsumerSendMsgBackRequestHeader
from tidemq.protocol.record import (
    BatchView,
    Compression,
    MessageData,
    TxnType,
    encode_batch,
    unique_id,
)
from tidemq.store.message_store import MessageStore, PutResult

OPTIONS = ("message_delay_level=300ms 600ms 1s", "timer_bucket_ms=1000",
           "timer_checkpoint_ms=200", "transaction_check_interval_ms=300",
           "transaction_timeout_ms=100")
PID = 0x0BAD_0000_0000_0001
MiB = 1 << 20


def _ms() -> int:
    return time.time_ns() // 1_000_000


class Cluster:
    """One `tidemq dev` that tests stop, write into and start again."""

    def __init__(self, data_dir: str) -> None:
        self.dir = data_dir
        self.dev: DevCluster = start_dev(data_dir, *OPTIONS)

    @property
    def namesrv(self) -> str:
        return self.dev.namesrv

    def inject(self, batches: list[tuple[bytes | bytearray, int]]) -> list[PutResult]:
        """Stop the broker, put ``(batch, queue id)`` straight into its store, start it again
        (on the same data: a start-up that fails raises here)."""
        stop_dev(self.dev)
        with MessageStore(BrokerConfig(data_dir=self.dir).store_config()) as store:
            out = [store.put(b, queue_id=q) for b, q in batches]
        self.dev = start_dev(self.dir, *OPTIONS)
        return out

    def kill9_and_start(self) -> None:
        self.dev.kill9()
        self.dev = start_dev(self.dir, *OPTIONS)

    def info(self) -> dict[str, int]:
        raw = asyncio.run(runtime_info(self.dev.broker))
        return {k: int(v) for k, v in raw.items() if str(v).lstrip("-").isdigit()}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with tempfile.TemporaryDirectory(prefix="tidemq-hostile-") as d:
        c = Cluster(d)
        try:
            yield c
        finally:
            stop_dev(c.dev)


async def _consume(namesrv: str, topic: str, group: str, n: int, timeout: float = 20.0,
                   **options) -> tuple[list, dict]:
    async with aio.PullConsumer(namesrv, group, consume_from="first", **options) as c:
        c.subscribe(topic)
        got = await drain(c, n, timeout)
        got += await c.poll(timeout=0.3)
        return got, c.stats()


def test_timed_batch_with_a_non_utf8_key_never_fails_a_start_up(cluster):
    topic = "hx-timer"
    asyncio.run(make_topic(cluster.namesrv, topic))
    due = _ms() - 300  # due before the broker stops: start-up itself delivers them
    bad = poison(encode_batch(topic, [MessageData(b"bad", keys="KEYZ"),
                                      MessageData(b"timed-0", keys="k0")],
                              producer_id=PID, base_seq=100, deliver_at=due), "KEYZ")
    good = encode_batch(topic, [MessageData(b"timed-1", keys="k1")], producer_id=PID,
                        base_seq=102, deliver_at=due + 1)
    envs = [(wrap(TIMER_TOPIC, 0, b, real_topic=topic, real_qid=0, producer_id=PID,
                  base_seq=BatchView(b).base_seq, count=BatchView(b).count,
                  born_ts=due - 1000, deliver_at=due + i), 0) for i, b in enumerate((bad, good))]
    before = cluster.info()
    cluster.inject(envs)  # starts: the delivery of the bad key no longer kills start-up
    info = cluster.info()
    assert info["timer_delivered"] == 2 and info.get("timer_dropped", 0) == 0, info
    # the store left the key that does not decode out of its index, and said so
    assert info["corrupt_skipped_index"] >= before.get("corrupt_skipped_index", 0) + 1

    got, stats = asyncio.run(_consume(cluster.namesrv, topic, "hx-timer-g", 2))
    assert [m.body for m in got] == [b"timed-0", b"timed-1"]
    assert stats["corrupt_skipped"] == 1  # the consumer skipped the bad message, not the batch
    assert [m.keys for m in got] == [["k0"], ["k1"]]

    cluster.kill9_and_start()  # and after a crash: starts, nothing doubled, nothing lost
    got, stats = asyncio.run(_consume(cluster.namesrv, topic, "hx-timer-g2", 2))
    assert [m.body for m in got] == [b"timed-0", b"timed-1"] and stats["corrupt_skipped"] == 1
    assert cluster.info()["timer_delivered"] == 0  # delivered once, before the crash


def test_delay_level_is_never_blocked_by_what_a_batch_holds(cluster):
    topic = "hx-delay"
    asyncio.run(make_topic(cluster.namesrv, topic))

    def env(inner: bytearray, level: int, extra: dict | None = None) -> tuple[bytearray, int]:
        v = BatchView(inner)
        return wrap(SCHEDULE_TOPIC, level - 1, inner, real_topic=topic, real_qid=0,
                    producer_id=PID, base_seq=v.base_seq, count=v.count, born_ts=_ms(),
                    extra={DELAY: str(level), **(extra or {})}), level - 1

    def inner(seq: int, *msgs: MessageData) -> bytearray:
        return encode_batch(topic, list(msgs), producer_id=PID, base_seq=seq, delay_level=1)

    bad_key = poison(inner(200, MessageData(b"bad", keys="KEYQ"), MessageData(b"delay-0")),
                     "KEYQ")
    bad_tag = poison(inner(202, MessageData(b"bad", tags="TAGQ")), "TAGQ")
    # an envelope that does not decode itself: dropped by the level, counted
    bad_env = env(inner(203, MessageData(b"never")), 1, {"JUNKPROP": "1"})
    bad_env = (poison(bad_env[0], "JUNKPROP"), bad_env[1])
    good = inner(204, MessageData(b"delay-1"))
    before = cluster.info()
    cluster.inject([env(bad_key, 1), env(bad_tag, 1), bad_env, env(good, 1)])

    async def then_send() -> None:  # the level still works for what comes next
        async with aio.Producer(cluster.namesrv) as p:
            await p.send(aio.Message(topic, b"delay-2", delay_level=1))

    asyncio.run(then_send())
    got, stats = asyncio.run(_consume(cluster.namesrv, topic, "hx-delay-g", 3))
    assert [m.body for m in got] == [b"delay-0", b"delay-1", b"delay-2"]
    assert stats["corrupt_skipped"] == 2  # the bad key and the bad tag, one message each
    info = cluster.info()
    assert info["delay_delivered"] >= 4 and info["corrupt_skipped_delay"] == \
        before.get("corrupt_skipped_delay", 0) + 1, info
    assert info["delay_pending"] == 0

    cluster.kill9_and_start()
    got, stats = asyncio.run(_consume(cluster.namesrv, topic, "hx-delay-g2", 3))
    assert [m.body for m in got] == [b"delay-0", b"delay-1", b"delay-2"]


GOOD = [b"q0", b"q1"] + [f"q{i}".encode() for i in range(2, 42) if i != 20] + [b"q42"]
BAD_RECORDS = 6


@pytest.fixture(scope="module")
def hostile(cluster) -> dict:
    """One queue holding good messages between every kind of record a consumer cannot decode:
    a tag, a property, a key that are not UTF-8 (in batches of one and of many), a zlib bomb
    (261 KB -> 256 MiB) declaring its size, the same bomb declaring 1 MiB."""
    topic = "hx-queue"
    asyncio.run(make_topic(cluster.namesrv, topic))
    seq = iter(range(300, 10_000, 100))

    def b(*msgs: MessageData) -> bytearray:
        return encode_batch(topic, list(msgs), producer_id=PID, base_seq=next(seq))

    batches = [
        b(MessageData(b"q0", tags="a")),
        poison(b(MessageData(b"x", tags="TAGA")), "TAGA"),
        poison(b(MessageData(b"x", properties={"PROPA": "1"})), "PROPA"),
        poison(b(MessageData(b"x", keys="KEYA"), MessageData(b"q1", keys="ok")), "KEYA"),
        bomb(topic, Compression.ZLIB, 256 * MiB, producer_id=PID, base_seq=next(seq)),
        bomb(topic, Compression.ZLIB, 256 * MiB, declared=MiB, producer_id=PID,
             base_seq=next(seq)),
        poison(b(*[MessageData(f"q{i}".encode(), tags="TAGB" if i == 20 else "t")
                   for i in range(2, 42)]), "TAGB"),
        b(MessageData(b"q42")),
    ]
    puts = cluster.inject([(x, 0) for x in batches])
    return {"topic": topic, "puts": puts, "max": puts[-1].queue_offset + 1}


def test_lite_consumer_moves_past_every_undecodable_record(cluster, hostile):
    topic = hostile["topic"]
    tracemalloc.start()
    try:
        got, stats = asyncio.run(_consume(cluster.namesrv, topic, "hx-lite", len(GOOD)))
        _cur, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [m.body for m in got] == GOOD
    assert stats["corrupt_skipped"] == BAD_RECORDS
    assert peak < 64 * MiB, f"{peak / MiB:.0f} MiB allocated while consuming two bombs"

    async def committed() -> int | None:
        async with aio.PullConsumer(cluster.namesrv, "hx-lite") as c:
            return await c.committed(aio.MessageQueue(topic, "broker-a", 0))

    assert asyncio.run(committed()) == hostile["max"]  # not stalled: the queue is done


@pytest.mark.parametrize("orderly", [False, True], ids=["concurrently", "orderly"])
def test_push_consumer_moves_past_every_undecodable_record(cluster, hostile, orderly):
    topic = hostile["topic"]
    group = f"hx-push-{'o' if orderly else 'c'}"

    async def main() -> tuple[list[bytes], dict, int | None]:
        seen: list[bytes] = []

        def listener(msgs, ctx):
            seen.extend(m.body for m in msgs)
            for m in msgs:  # every field of what is handed out decodes
                m.to_dict()
            return aio.ConsumeOrderlyStatus.SUCCESS if orderly else None

        async with aio.PushConsumer(cluster.namesrv, group, listener, orderly=orderly,
                                    consume_from="first", persist_interval=0.2) as c:
            c.subscribe(topic)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while len(seen) < len(GOOD) and loop.time() < deadline:
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)
            stats = c.stats()
        async with aio.PullConsumer(cluster.namesrv, group) as pc:
            off = await pc.committed(aio.MessageQueue(topic, "broker-a", 0))
        return seen, stats, off

    seen, stats, off = asyncio.run(main())
    # A concurrent consumer's listener threads may hand out one pull's messages before an
    # earlier one's: every good message exactly once, in order only when orderly.
    assert (seen if orderly else sorted(seen)) == (GOOD if orderly else sorted(GOOD))
    assert stats["corrupt_skipped"] == BAD_RECORDS
    assert off == hostile["max"]


def test_send_back_of_a_bomb_is_refused_quickly_and_costs_no_memory(cluster, hostile):
    from tidemq.client.connection import ConnectionPool

    honest, lying = hostile["puts"][4], hostile["puts"][5]
    rss0 = cluster.dev.memory()["VmRSS"]

    async def send_back(phys: int) -> tuple[int, str, float]:
        pool = ConnectionPool()
        try:
            await pool.get(cluster.dev.broker)
            t0 = time.perf_counter()
            with pytest.raises(aio.BrokerError) as err:
                await pool.request(cluster.dev.broker, RequestCode.CONSUMER_SEND_MSG_BACK,
                                   ConsumerSendMsgBackRequestHeader(
                                       consumer_group="hx-sendback", commit_log_offset=phys,
                                       origin_topic="hx-queue"), timeout=10)
            return err.value.response_code, err.value.message, time.perf_counter() - t0
        finally:
            pool.close()

    for r, why in ((honest, "declares 268435456 bytes uncompressed, over this reader's limit"),
                   (lying, "zlib stream does not end within the batch's raw_size")):
        for _ in range(3):
            code, remark, secs = asyncio.run(send_back(r.phys_offset))
            assert code == ResponseCode.INVALID_ARGUMENT, (code, remark)
            assert "CORRUPT_BATCH" in remark and why in remark, remark
            assert secs < 0.5, secs
    grown = cluster.dev.memory()["VmRSS"] - rss0
    assert grown < 32 * MiB, f"broker RSS grew {grown / MiB:.0f} MiB"
    assert cluster.info()["corrupt_skipped_send_back"] >= 6


def test_range_reader_of_the_spark_source_skips_and_counts_not_lost(cluster, hostile):
    from tidemq.client.range_reader import RangeReader

    mq = aio.MessageQueue(hostile["topic"], "broker-a", 0)
    with RangeReader(cluster.namesrv) as r:  # fail_on_data_loss=True: corrupt is not lost
        chunks = list(r.read(mq, 0, hostile["max"]))
    assert [x for c in chunks for x in c.bodies()] == GOOD
    assert sum(c.corrupt for c in chunks) == BAD_RECORDS and sum(c.lost for c in chunks) == 0


def test_cli_consume_prints_the_good_messages_and_counts_the_rest(cluster, hostile):
    p = subprocess.run(
        [sys.executable, "-m", "tidemq.cli.main", "consume", "--namesrv", cluster.namesrv,
         "--topic", hostile["topic"], "--group", "hx-cli", "--from-beginning", "--timeout", "3"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert [line.rsplit(" ", 1)[1] for line in p.stdout.splitlines()] == \
        [g.decode() for g in GOOD]
    assert f"skipped {BAD_RECORDS} corrupt records" in p.stderr


def test_an_unreadable_half_message_does_not_stop_the_transaction_check(cluster):
    topic = "hx-txn"
    asyncio.run(make_topic(cluster.namesrv, topic))
    inner = poison(encode_batch(topic, [MessageData(b"x", properties={"PROPT": "1"})],
                                producer_id=PID, base_seq=900, txn=TxnType.PREPARED), "PROPT")
    txn = unique_id(PID, 900)
    half = wrap(HALF_TOPIC, 0, inner, real_topic=topic, real_qid=0, producer_id=PID,
                base_seq=900, count=1, born_ts=_ms(),
                extra={PGROUP: "hx-txn-pg", TRAN_ID: txn, CHECK_TIMES: "0",
                       FIRST_BORN: str(_ms())})
    cluster.inject([(half, 0)])

    async def main() -> list:
        def checker(m):
            return aio.LocalTransactionState.COMMIT_MESSAGE

        async with aio.TransactionProducer(cluster.namesrv, "hx-txn-pg", checker=checker) as p:
            await p.send_in_transaction(aio.Message(topic, b"checked"),
                                        lambda m, a: aio.LocalTransactionState.UNKNOW)
            got, _stats = await _consume(cluster.namesrv, topic, "hx-txn-g", 1, timeout=15)
        return got

    got = asyncio.run(main())
    assert [m.body for m in got] == [b"checked"]  # checked after the unreadable one
