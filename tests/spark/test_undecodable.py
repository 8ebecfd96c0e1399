"""The Spark source skips what it cannot decode (issue 13, "tolerate on the way out"): a batch
read of a queue holding records whose tag, keys or properties are not UTF-8, and a zlib bomb,
returns every other message and fails nothing -- skipped-as-corrupt is not data loss, so the
default failOnDataLoss=true read succeeds.

The hostile batches are written into the broker's store while it is stopped, as such bytes may
already be on disk (tests/hostile_records.py builds them CRC-valid)."""

from __future__ import annotations

import tempfile

import pytest
from tests.hostile_records import bomb, poison
from tests.spark.conftest import create_topic

from support.cluster import start_dev, stop_dev
from tidemq.broker.config import BrokerConfig
from tidemq.protocol.record import Compression, MessageData, encode_batch
from tidemq.store.message_store import MessageStore

pytestmark = pytest.mark.timeout(300)

TOPIC = "sx-hostile"


def test_batch_read_skips_undecodable_records(spark):
    with tempfile.TemporaryDirectory(prefix="tidemq-spark-hostile-") as d:
        dev = start_dev(d)
        try:
            create_topic(dev, TOPIC, 1)
        finally:
            stop_dev(dev)

        def b(seq: int, *msgs: MessageData) -> bytearray:
            return encode_batch(TOPIC, list(msgs), producer_id=7, base_seq=seq)

        batches = [
            b(0, MessageData(b"s0", tags="a")),
            poison(b(10, MessageData(b"x", tags="TAGS"), MessageData(b"s1", keys="k")), "TAGS"),
            poison(b(20, MessageData(b"x", properties={"PROPS": "1"})), "PROPS"),
            bomb(TOPIC, Compression.ZLIB, 256 << 20, producer_id=7, base_seq=30),
            poison(b(40, MessageData(b"x", keys="KEYS"), MessageData(b"s2")), "KEYS"),
        ]
        with MessageStore(BrokerConfig(data_dir=d).store_config()) as store:
            for x in batches:
                store.put(x, queue_id=0)
        dev = start_dev(d)
        try:
            rows = (spark.read.format("tidemq").option("namesrv", dev.namesrv)
                    .option("topics", TOPIC).load()
                    .select("queue_offset", "body", "tags", "keys").collect())
        finally:
            stop_dev(dev)
    got = sorted((r.queue_offset, bytes(r.body)) for r in rows)
    assert got == [(0, b"s0"), (2, b"s1"), (6, b"s2")]
