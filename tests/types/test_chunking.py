"""Chunked messages (ref PR5): split above the broker limit, reassembled by the consumer."""

from __future__ import annotations

import asyncio
import hashlib
import os

import pytest
from producer_path_helpers import dev_cluster, drain, make_topic

from tidemq import aio
from tidemq.client import chunking
from tidemq.client.codec import decode_pull_body
from tidemq.protocol.batch.fast import encode_messages
from tidemq.protocol.record import STORE_FIELDS, STORE_FIELDS_OFFSET, seal_store_header


@pytest.fixture(scope="module")
def cluster():
    yield from dev_cluster()


def received(msgs: list[aio.Message], first_offset: int) -> list[aio.MessageExt]:
    """``msgs`` as a consumer receives them: one stored batch each, consecutive offsets."""
    out = []
    for k, m in enumerate(msgs):
        b = encode_messages(m.topic, [m], queue_id=0, producer_id=1, base_seq=k, born_ts=1)
        STORE_FIELDS.pack_into(b, STORE_FIELDS_OFFSET, 0, first_offset + k, 2)
        seal_store_header(b, 0, 72 + len(m.topic))
        out += decode_pull_body(bytes(b), from_offset=first_offset + k)[0]
    return out


def test_split_and_reassemble_with_interleaved_messages():
    body = os.urandom(10_000)
    parts = chunking.split(aio.Message("t", body, tags="T", properties={"a": "1"}), "p-7", 3000)
    assert len(parts) == 4
    assert [p.properties[chunking.CHUNK_ID] for p in parts] == ["0", "1", "2", "3"]
    assert {p.properties[chunking.CHUNK_UUID] for p in parts} == {"p-7"}
    plain = aio.Message("t", b"plain")
    stream = received([parts[0], plain, parts[1], parts[2], parts[3]], 100)
    a = chunking.ChunkAssembler()
    first = a.feed(stream[:3])
    assert [m.body for m in first] == [b"plain"]
    assert a.low_water() == 100  # commit no further than the first chunk
    [whole] = a.feed(stream[3:])
    assert whole.body == body and whole.queue_offset == 104
    assert whole.properties == {"a": "1"} and whole.tags == "T"
    assert a.low_water() is None and a.assembled == 1


def test_incomplete_chunks_expire_after_60_s():
    now = [0.0]
    a = chunking.ChunkAssembler(clock=lambda: now[0])
    parts = chunking.split(aio.Message("t", b"x" * 5000), "p-1", 2000)
    stream = received(parts, 0)
    assert a.feed(stream[:2]) == []
    now[0] = 59.0
    assert a.feed([]) == [] and a.expired == 0 and a.low_water() == 0
    now[0] = 61.0
    assert a.feed(stream[2:]) == []  # the last chunk arrives after its message expired
    assert a.expired == 1 and a.low_water() is None


def test_50_mib_message_round_trips(cluster):
    async def main():
        topic = "chunk-big"
        await make_topic(cluster.namesrv, topic, 1)
        body = os.urandom(50 * 1024 * 1024)
        async with aio.Producer(cluster.namesrv, producer_name="chunker",
                                send_timeout=30) as p:
            r = await p.send(aio.Message(topic, body, properties={"k": "v"}))
            small = await p.send(aio.Message(topic, b"after"))
        assert r.status is aio.SendStatus.SEND_OK
        assert small.queue_offset == r.queue_offset + 1 >= 13  # 4 MiB broker limit: 13 chunks
        async with aio.PullConsumer(cluster.namesrv, "g-chunk", consume_from="first") as c:
            c.subscribe(topic)
            got = await drain(c, 2, timeout=60)
            assert c.position(got[0].message_queue) == small.queue_offset + 1
        assert len(got) == 2
        assert hashlib.sha256(got[0].body).digest() == hashlib.sha256(body).digest()
        assert got[0].properties == {"k": "v"} and got[1].body == b"after"

    asyncio.run(main())


def test_process_queue_never_commits_past_a_chunk_in_flight_or_held():
    from tidemq.client.process_queue import ProcessQueue

    parts = chunking.split(aio.Message("t", b"y" * 5000, properties={"a": "1"}), "p-9", 2000)
    plain = [aio.Message("t", b"p%d" % i) for i in range(3)]
    # offsets 100..105: chunk0, plain0, chunk1, plain1, chunk2, plain2
    stream = received([parts[0], plain[0], parts[1], plain[1], parts[2], plain[2]], 100)
    pq = ProcessQueue()
    first = pq.assemble(stream[:3], 60.0)
    assert [m.body for m in first] == [b"p0"]
    pq.put_messages(first)
    assert pq.remove_messages(first) == 100  # chunk 0 (offset 100) is still being assembled
    rest = pq.assemble(stream[3:], 60.0)
    assert [m.body for m in rest] == [b"p1", b"y" * 5000, b"p2"]
    whole = rest[1]
    assert whole.queue_offset == 104 and whole.properties == {"a": "1"}
    pq.put_messages(rest)
    assert pq.remove_messages([rest[0], rest[2]]) == 100  # the whole message is in flight
    assert pq.remove_messages([whole]) == 106  # consumed: past everything


def test_a_chunked_message_reaches_a_push_listener_whole(cluster):
    got: list[aio.MessageExt] = []

    async def listener(msgs, ctx):
        got.extend(msgs)
        return aio.ConsumeStatus.SUCCESS

    async def main():
        topic = "chunk-push"
        await make_topic(cluster.namesrv, topic, 1)
        body = os.urandom(5 * 1024 * 1024)
        async with aio.Producer(cluster.namesrv, producer_name="chunker-push",
                                send_timeout=30) as p:
            await p.send(aio.Message(topic, b"before"))
            r = await p.send(aio.Message(topic, body, properties={"k": "v"}))
            await p.send(aio.Message(topic, b"after"))
        async with aio.PushConsumer(cluster.namesrv, "g-chunk-push", listener,
                                    consume_from="first", persist_interval=0.2) as c:
            c.subscribe(topic)
            for _ in range(600):
                if len(got) >= 3:
                    break
                await asyncio.sleep(0.05)
            stats = c.stats()
        assert [len(m.body) for m in got] == [6, len(body), 5]
        assert hashlib.sha256(got[1].body).digest() == hashlib.sha256(body).digest()
        assert got[1].properties == {"k": "v"} and got[1].queue_offset == r.queue_offset
        assert stats["chunks_assembled"] == 1 and stats["chunks_expired"] == 0

    asyncio.run(main())


def test_cli_consume_prints_a_chunked_message_whole_and_filters_by_sql(cluster):
    import json

    from click.testing import CliRunner

    from tidemq.cli.main import cli

    async def produce():
        await make_topic(cluster.namesrv, "chunk-cli", 1)
        async with aio.Producer(cluster.namesrv, producer_name="chunker-cli",
                                send_timeout=30) as p:
            await p.send(aio.Message("chunk-cli", b"a" * (5 * 1024 * 1024),
                                     properties={"kind": "big"}))
            await p.send(aio.Message("chunk-cli", b"small", properties={"kind": "small"}))

    asyncio.run(produce())
    base = ["consume", "--namesrv", cluster.namesrv, "--topic", "chunk-cli", "--from-beginning",
            "--timeout", "2", "--json"]
    r = CliRunner().invoke(cli, [*base, "--group", "g-cli-all"])
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in r.output.splitlines() if x.startswith("{")]
    assert len(lines) == 2 and lines[1]["properties"] == {"kind": "small"}
    assert lines[0]["properties"] == {"kind": "big"}
    r = CliRunner().invoke(cli, [*base, "--group", "g-cli-sql", "--sql", "kind = 'big'"])
    lines = [json.loads(x) for x in r.output.splitlines() if x.startswith("{")]
    assert [x["properties"] for x in lines] == [{"kind": "big"}]
    r = CliRunner().invoke(cli, [*base, "--group", "g-cli-bad", "--sql", "kind ="])
    assert r.exit_code != 0 and "ends too early" in r.output


def test_a_chunk_after_a_batch_of_several_messages_is_found_in_one_pull():
    """The pre-check looks at each batch once: a multi-message batch (never a chunk, even with
    properties) and the chunk after it in the same pull -- the chunk is still found, both by
    the push consumer's ProcessQueue and by may_hold_chunks itself."""
    from tidemq.client.process_queue import ProcessQueue

    batch = [aio.Message("t", b"b%d" % i, properties={"p": "v"}) for i in range(3)]
    b = encode_messages("t", batch, queue_id=0, producer_id=1, base_seq=0, born_ts=1)
    STORE_FIELDS.pack_into(b, STORE_FIELDS_OFFSET, 0, 50, 2)
    seal_store_header(b, 0, 72 + 1)
    several = decode_pull_body(bytes(b), from_offset=50)[0]
    assert not chunking.may_hold_chunks(several)
    parts = chunking.split(aio.Message("t", b"z" * 3000), "u-1", 2000)
    msgs = several + received(parts, 53)
    assert chunking.may_hold_chunks(msgs)
    assert not chunking.may_hold_chunks(msgs[:3] + received([aio.Message("t", b"x")], 53))
    pq = ProcessQueue()
    out = pq.assemble(msgs, 60.0)
    assert [m.body for m in out] == [b"b0", b"b1", b"b2", b"z" * 3000]
    assert pq.assembler is not None and pq.assembler.assembled == 1
