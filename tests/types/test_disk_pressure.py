"""Disk pressure without silent loss against a real broker (issue 13, medium row: "at 85 % disk
the broker deleted 7,844 of 19,630 unconsumed acknowledged messages").

- On a real small filesystem (a 48 MiB tmpfs with the default watermarks; skipped where mount
  is not allowed): sends run until DISK_FULL, every acknowledged message is still there for a
  consumer, and once a group has consumed them retention frees the space and sends work again.
- With the watermarks at 0 (always "under pressure", on any disk): retention deletes what a
  group consumed and never what it has not, never a topic without a group; at the refuse-writes
  watermark the answer is DISK_FULL naming the queue that holds the space; with
  ``store.clean_file_forcibly=true`` unconsumed messages go, and the log says which.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import pytest
from producer_path_helpers import drain, make_topic

from support.cluster import DevCluster
from tidemq import aio
from tidemq.bench.dev_process import DevProcess

FAST = ("store.retention_check_interval_ms=200", "store.checkpoint_interval_ms=100")


def _start(data_dir: str, *options: str, log_path: str | None = None) -> DevCluster:
    return DevProcess(data_dir, *FAST, *options, log_path=log_path).start(30)


async def _send(namesrv: str, topic: str, n: int, size: int = 1024, batch: int = 16) -> int:
    """Send ``n`` messages in batches; how many were acknowledged before DISK_FULL."""
    acked = 0
    async with aio.Producer(namesrv, retries=0, auto_batch=False) as p:
        while acked < n:
            msgs = [aio.Message(topic, f"{acked + i:08d}".encode().ljust(size, b"."))
                    for i in range(batch)]
            try:
                await p.send_batch(msgs, queue_id=0)
            except aio.BrokerError as exc:
                # DISK_FULL past the watermark; or, when writes outran the retention check
                # (every 200 ms here), the allocation of the next segment failing first --
                # a clear error as well, with nothing of the batch stored
                if exc.code == "DISK_FULL" or "No space left on device" in exc.message:
                    return acked
                raise
            acked += batch
    return acked


async def _min_offset(namesrv: str, topic: str) -> int:
    async with aio.PullConsumer(namesrv, "probe") as c:
        await c.start()
        mq = aio.MessageQueue(topic, "broker-a", 0)
        from tidemq.client import offsets

        addr = await c.routes.addr_of(mq)
        return await offsets.min_offset(c.pool, addr, mq)


async def _consume(namesrv: str, topic: str, group: str, n: int, commit: bool = True
                   ) -> list[int]:
    async with aio.PullConsumer(namesrv, group, consume_from="first", pull_batch_size=256,
                                auto_commit=False) as c:
        c.subscribe(topic)
        got = (await drain(c, n, 60))[:n]
        if commit and got:  # exactly these: the group's offset is right after the n-th
            await c.commit({got[-1].message_queue: got[-1].queue_offset + 1})
        return [int(m.body[:8]) for m in got]


def _settle(namesrv: str, topic: str, rounds: float = 1.2) -> int:
    """The queue's min offset once retention stopped moving it (no change for ``rounds`` s)."""
    last, since = -1, time.monotonic()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        mn = asyncio.run(_min_offset(namesrv, topic))
        if mn != last:
            last, since = mn, time.monotonic()
        elif time.monotonic() - since >= rounds:
            return mn
        time.sleep(0.2)
    raise AssertionError("retention never settled")


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "fs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mnt)],
                       capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_small_disk_refuses_sends_and_loses_no_acknowledged_message(small_fs):
    dev = _start(str(small_fs / "dev"), "store.segment_size=1048576")
    try:
        topic = "dp-full"
        asyncio.run(make_topic(dev.namesrv, topic, 1))
        acked = asyncio.run(_send(dev.namesrv, topic, 200_000))
        assert 20_000 < acked < 60_000, acked  # ~40 MiB of 1 KiB messages, then DISK_FULL
        time.sleep(1.5)  # several retention rounds past 85 %: nothing unconsumed may go
        assert asyncio.run(_min_offset(dev.namesrv, topic)) == 0
        got = asyncio.run(_consume(dev.namesrv, topic, "dp-full-g", acked))
        assert got == list(range(acked))  # every acknowledged message, in order
        # consumed now: retention frees the oldest segments and sends are accepted again
        deadline = time.monotonic() + 30
        more = 0
        while not more and time.monotonic() < deadline:
            time.sleep(0.5)
            more = asyncio.run(_send(dev.namesrv, topic, 16))
        assert more == 16
        assert asyncio.run(_min_offset(dev.namesrv, topic)) > 0
    finally:
        dev.stop()


def test_retention_under_pressure_keeps_what_no_group_consumed(tmp_path):
    d = str(tmp_path / "dev")
    log_path = str(tmp_path / "broker.log")
    pressure = ("store.segment_size=65536", "store.disk_max_used_ratio=0.0",
                "store.disk_clean_forcibly_ratio=0.0")
    dev = _start(d, *pressure, "store.disk_refuse_writes_ratio=0.9999")
    try:
        a, b = "dp-consumed", "dp-nogroup"
        asyncio.run(make_topic(dev.namesrv, a, 1))
        asyncio.run(make_topic(dev.namesrv, b, 1))
        assert asyncio.run(_send(dev.namesrv, a, 1600)) == 1600
        assert asyncio.run(_send(dev.namesrv, b, 400)) == 400
        assert _settle(dev.namesrv, a) == 0  # nobody has consumed anything yet
        assert asyncio.run(_consume(dev.namesrv, a, "dp-g", 800)) == list(range(800))
        mn = _settle(dev.namesrv, a)
        assert 0 < mn <= 800, mn  # consumed segments went, unconsumed stayed
        assert asyncio.run(_consume(dev.namesrv, a, "dp-g", 800)) == list(range(800, 1600))
        assert _settle(dev.namesrv, a) > 1000
        assert asyncio.run(_min_offset(dev.namesrv, b)) == 0  # no group: by age only
        # all still there (read without committing: the topic stays without a group)
        assert asyncio.run(_consume(dev.namesrv, b, "dp-late", 400, False)) == list(range(400))
    finally:
        dev.stop()

    # The refuse-writes watermark reached: DISK_FULL, naming what holds the space.
    dev = _start(d, *pressure, "store.disk_refuse_writes_ratio=0.0", log_path=log_path)
    try:
        time.sleep(1.0)  # a retention round
        with pytest.raises(aio.BrokerError) as err:
            asyncio.run(_send_one(dev.namesrv, "dp-nogroup"))
        assert err.value.code == "DISK_FULL"
        assert "holds unconsumed messages" in err.value.message
        assert "clean_file_forcibly" in err.value.message
    finally:
        dev.stop()

    # RocketMQ's cleanFileForciblyEnable: unconsumed messages go, and the log says which.
    dev = _start(d, *pressure, "store.disk_refuse_writes_ratio=0.9999",
                 "store.clean_file_forcibly=true", log_path=log_path)
    try:
        deadline = time.monotonic() + 30
        while asyncio.run(_min_offset(dev.namesrv, b)) == 0:
            assert time.monotonic() < deadline, "forced deletion never happened"
            time.sleep(0.3)
    finally:
        dev.stop()
    text = Path(log_path).read_text()
    assert "unconsumed messages of" in text and "by forced deletion" in text, text[-3000:]
    assert "topic dp-nogroup queue 0 offsets [0, " in text, text[-3000:]


async def _send_one(namesrv: str, topic: str) -> None:
    async with aio.Producer(namesrv, retries=0) as p:
        await p.send(aio.Message(topic, b"x"), queue_id=0)
