"""Auto-batching (PR3), compression (PR4), consumer CRC checks (CO9) and non-persistent topics
(BR13) against a real `tidemq dev`."""

from __future__ import annotations

import asyncio
import glob
import os

import pytest
from producer_path_helpers import dev_cluster, drain, make_topic, runtime_info

from tidemq import aio
from tidemq.client.codec import decode_pull_body
from tidemq.protocol.batch.fast import encode_messages
from tidemq.protocol.record import BatchView, Compression

NP_LIMIT = 100


@pytest.fixture(scope="module")
def cluster():
    # Reads are not verified by the broker here, so a damaged batch reaches the consumer (CO9).
    yield from dev_cluster("store.verify_reads=false",
                           f"non_persistent_max_pending_messages={NP_LIMIT}")


def test_auto_batching_respects_count_limit_and_delay(cluster):
    async def main():
        topic = "pp-autobatch"
        await make_topic(cluster.namesrv, topic, 1)
        async with aio.Producer(cluster.namesrv, batch_max_messages=100,
                                batch_max_delay=0.05) as p:
            futs = [p.send_async(aio.Message(topic, b"x" * 100)) for _ in range(250)]
            results = await asyncio.gather(*futs)
            assert [r.queue_offset for r in results] == list(range(250))
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await p.send_async(aio.Message(topic, b"alone"))  # waits out batch_max_delay
            waited = loop.time() - t0
        assert waited >= 0.045, waited
        async with aio.PullConsumer(cluster.namesrv, "g-ab", consume_from="first") as c:
            c.subscribe(topic)
            got = await drain(c, 251)
        sizes: dict[int, int] = {}
        for m in got:
            sizes[m.commit_log_offset] = sizes.get(m.commit_log_offset, 0) + 1
        # 250 messages sent in one loop iteration: full batches of 100, then the rest.
        assert sorted(sizes.values()) == [1, 50, 100, 100], sizes

    asyncio.run(main())


def test_explicit_sequence_sends_are_never_merged(cluster):
    async def main():
        topic = "pp-isolated"
        await make_topic(cluster.namesrv, topic, 1)
        async with aio.Producer(cluster.namesrv, producer_name="iso") as p:
            a = p.send_async(aio.Message(topic, b"a"))
            b = p.send_async(aio.Message(topic, b"b"), sequence_id=1000)  # a possible resend
            c = p.send_async(aio.Message(topic, b"c"))
            ra, rb, rc = await asyncio.gather(a, b, c)
        assert rb.base_seq == 1000 and rb.count == 1
        assert ra.base_seq != rb.base_seq and rc.base_seq != rb.base_seq

    asyncio.run(main())


@pytest.mark.parametrize("codec", ["lz4", "zstd", "zlib"])
def test_compression_above_threshold_round_trips(cluster, codec):
    async def main():
        topic = f"pp-comp-{codec}"
        await make_topic(cluster.namesrv, topic, 1)
        big = [aio.Message(topic, (f"row {i} " * 50).encode()) for i in range(20)]
        async with aio.Producer(cluster.namesrv, compression=codec) as p:
            batch, _ = p._encode(topic, big, 0, "127.0.0.1", 1)
            assert BatchView(batch).compression == Compression.NAMES[codec]
            small, _ = p._encode(topic, [aio.Message(topic, b"tiny")], 0, "127.0.0.1", 1)
            assert BatchView(small).compression == Compression.NONE  # below compress_min
            await p.send_batch(big)
            await p.send(aio.Message(topic, b"tiny"))
        async with aio.PullConsumer(cluster.namesrv, f"g-{codec}", consume_from="first") as c:
            c.subscribe(topic)
            got = await drain(c, 21)
        assert [m.body for m in got] == [m.body for m in big] + [b"tiny"]

    asyncio.run(main())


def test_corrupt_batch_is_skipped_and_reported_by_the_consumer(cluster, caplog):
    async def main():
        topic = "pp-crc"
        await make_topic(cluster.namesrv, topic, 1)
        async with aio.Producer(cluster.namesrv) as p:
            for k in range(3):
                await p.send_batch([aio.Message(topic, f"b{k}-{i}".encode()) for i in range(4)])
        async with aio.PullConsumer(cluster.namesrv, "g-crc-peek", consume_from="first") as c:
            c.subscribe(topic)
            got = await drain(c, 12)
        phys = sorted({m.commit_log_offset for m in got})
        # Flip the last body byte of the middle batch in the CommitLog file (the broker's
        # mapping shares the page cache, so the next read sees it).
        [seg] = sorted(glob.glob(os.path.join(cluster.data_dir, "commitlog", "*")))[:1]
        with open(seg, "r+b") as f:
            f.seek(phys[2] - 1)
            byte = f.read(1)
            f.seek(phys[2] - 1)
            f.write(bytes([byte[0] ^ 0xFF]))
        async with aio.PullConsumer(cluster.namesrv, "g-crc", consume_from="first") as c:
            c.subscribe(topic)
            got = await drain(c, 8)
            await asyncio.sleep(0.3)
            got += await c.poll(timeout=0.2)
            assert c.corrupt_batches == 1
            assert c.position(got[0].message_queue) == 12  # the queue moved past it
        assert [m.body for m in got] == [f"b{k}-{i}".encode() for k in (0, 2) for i in range(4)]

    with caplog.at_level("WARNING", logger="tidemq.client.consumer"):
        asyncio.run(main())
    assert any("skipped a corrupt record at topic pp-crc queue" in r.message and "offsets 4..7"
               in r.message for r in caplog.records)


def test_decode_reports_a_bad_crc_instead_of_raising():
    good = encode_messages("t", [aio.Message("t", b"ok")], queue_id=0, producer_id=1,
                           base_seq=0, born_ts=1)
    bad = bytearray(good)
    bad[-1] ^= 1
    seen = []
    msgs, end = decode_pull_body(bytes(bad), from_offset=0,
                                 on_corrupt=lambda *a: seen.append(a))
    assert msgs == [] and end == 1 and seen[0][:2] == (0, 1) and "CRC" in seen[0][2]


def test_non_persistent_topic_is_served_from_memory_and_drops_past_the_limit(cluster):
    async def main():
        topic = "%NP%metrics"
        before = await runtime_info(cluster.broker)
        async with aio.PullConsumer(cluster.namesrv, "g-np") as c:
            c.subscribe(topic)
            async with aio.Producer(cluster.namesrv) as p:
                r = await p.send(aio.Message(topic, b"first"), queue_id=0)
                await asyncio.sleep(1.5)  # the consumer finds the new topic's route
                for i in range(10):
                    await p.send(aio.Message(topic, f"live-{i}".encode()), queue_id=0)
                got = await drain(c, 11, timeout=20)
        assert r.status is aio.SendStatus.SEND_OK
        # The store knows no offsets of the topic: the consumer starts at the memory window.
        assert [m.body for m in got] == [b"first"] + [f"live-{i}".encode() for i in range(10)]
        mid = await runtime_info(cluster.broker)
        # Nothing of it was written to the CommitLog.
        assert mid["commitlog_max_offset"] == before["commitlog_max_offset"]
        async with aio.Producer(cluster.namesrv) as p:
            for _ in range(5):
                await p.send_batch([aio.Message(topic, b"x" * 10)] * 100, queue_id=1)
        after = await runtime_info(cluster.broker)
        assert after["np_dropped_msgs"] >= 400 - NP_LIMIT, after
        assert after["commitlog_max_offset"] == before["commitlog_max_offset"]

    asyncio.run(main())


def test_send_async_is_bounded_by_max_pending_messages(cluster):
    async def main():
        topic = "pp-bounded"
        await make_topic(cluster.namesrv, topic, 1)
        async with aio.Producer(cluster.namesrv, max_pending_messages=10,
                                batch_max_delay=0.05) as p:
            futs = [p.send_async(aio.Message(topic, f"{i}".encode())) for i in range(9)]
            futs.append(p.send_async([aio.Message(topic, b"list")]))  # a list counts too
            with pytest.raises(aio.ProducerQueueFullError, match="max_pending_messages=10"):
                p.send_async(aio.Message(topic, b"one too many"))
            await p.flush()
            assert all(f.done() and not f.exception() for f in futs)
            assert p._npending == 0
            r = await p.send_async(aio.Message(topic, b"room again"))
            assert r.status is aio.SendStatus.SEND_OK

    asyncio.run(main())
