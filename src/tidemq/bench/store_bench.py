"""`tidemq bench store` and `tidemq bench recovery`: the storage engine's numbers, with the
disk's own limits measured in the same run for comparison.

- raw_seq_write_mb_per_s: the same number of bytes written sequentially in 1 MiB writes, the
  better of one fsync at the end and an fdatasync every 64 MiB (what a perfect append-only log
  could do on this disk right now); both are reported.
- raw_fsync_per_s: 4 KiB appends each followed by fdatasync for one second (what a naive
  "fsync every message" SYNC_FLUSH could do).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from tidemq.protocol.record import MessageData, encode_batch
from tidemq.store.config import StoreConfig
from tidemq.store.flush import FlushMode, handoff_to
from tidemq.store.message_store import MessageStore

Progress = Callable[[int], None]


def raw_sequential_write(directory: Path, nbytes: int, sync_every: int = 0) -> float:
    """MB/s of writing ``nbytes`` in 1 MiB chunks then fsync; with ``sync_every``, also an
    fdatasync after every that many bytes (as the store's ASYNC flush does under load)."""
    path = directory / "raw-seq.bin"
    chunk = os.urandom(1 << 20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        t0 = time.perf_counter()
        left = nbytes
        since = 0
        while left > 0:
            n = os.write(fd, chunk if left >= len(chunk) else chunk[:left])
            left -= n
            since += n
            if sync_every and since >= sync_every:
                os.fdatasync(fd)
                since = 0
        os.fsync(fd)
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink()
    return nbytes / dt / 1e6


def raw_fsync_rate(directory: Path, seconds: float = 1.0) -> float:
    """Appends of 4 KiB each followed by fdatasync, per second."""
    path = directory / "raw-fsync.bin"
    block = os.urandom(4096)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    try:
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            os.write(fd, block)
            os.fdatasync(fd)
            n += 1
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink()
    return n / dt


def _batches(size: int, batch: int, count: int, topic: str) -> list[bytearray]:
    """A few distinct pre-encoded batches (encoding is the producer's work, not the store's)."""
    out = []
    for k in range(4):
        body = bytes([65 + k]) * size
        msgs = [MessageData(body, tags="bench", born_ts=time.time_ns() // 1_000_000)] * min(
            batch, count
        )
        out.append(encode_batch(topic, msgs, producer_id=0xBE4C + k, base_seq=0))
    return out


def _write_async(
    store: MessageStore, batches: list[bytearray], n_puts: int, tick: Progress
) -> None:
    put = store.put
    nb = len(batches)
    step = max(1, n_puts // 100)
    for i in range(n_puts):
        put(batches[i % nb])
        if i % step == 0:
            tick(step)


def _write_sync(
    store: MessageStore, batches: list[bytearray], n_puts: int, writers: int, tick: Progress
) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        # as the broker does: each group commit's callbacks reach the loop in one wake-up
        store.flush_service.complete_on(handoff_to(loop.call_soon_threadsafe))
        counter = iter(range(n_puts))
        step = max(1, n_puts // 100)

        async def writer(w: int) -> None:
            nb = len(batches)
            put = store.put
            for i in counter:
                fut = loop.create_future()
                put(batches[(i + w) % nb], on_durable=partial(_resolve, fut))
                await fut
                if i % step == 0:
                    tick(step)

        await asyncio.gather(*(writer(w) for w in range(writers)))

    # The broker's loop is uvloop; measure group commit on the same kind of loop.
    from tidemq.bench.client_bench import run_loop

    run_loop(main())


def _resolve(fut: asyncio.Future[None], err: BaseException | None) -> None:
    if fut.done():
        return
    if err is None:
        fut.set_result(None)
    else:
        fut.set_exception(err)


def _read_all(store: MessageStore, topic: str, expected: int) -> int:
    offset = 0
    n = 0
    get = store.get_messages
    while True:
        res = get(topic, 0, offset, 1024)
        if not res.batches:
            break
        n += res.message_count
        offset = res.next_begin_offset
    if n != expected:
        raise RuntimeError(f"read back {n} messages, expected {expected}")
    return n


def bench_store(
    *,
    data_dir: str | None,
    size: int,
    count: int,
    batch: int,
    flush: str,
    writers: int,
    segment_size: int,
    progress: Progress = lambda n: None,
) -> dict[str, Any]:
    base = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="tidemq-bench-"))
    run_dir = base / f"bench-store-{os.getpid()}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    topic = "bench"
    n_puts = (count + batch - 1) // batch
    count = n_puts * batch
    batches = _batches(size, batch, count, topic)
    stored_bytes = n_puts * len(batches[0])
    try:
        raw_bytes = min(stored_bytes, 2 << 30)
        # The baseline is the better of one fsync at the end and an fdatasync every 64 MiB.
        raw_end = raw_sequential_write(run_dir, raw_bytes)
        raw_streamed = raw_sequential_write(run_dir, raw_bytes, sync_every=64 << 20)
        raw_mb = max(raw_end, raw_streamed)
        raw_fsync = raw_fsync_rate(run_dir)
        cfg = StoreConfig(
            data_dir=str(run_dir / "store"),
            segment_size=segment_size,
            flush_mode=FlushMode(flush),
        )
        store = MessageStore(cfg)
        try:
            t0 = time.perf_counter()
            if flush == "sync":
                _write_sync(store, batches, n_puts, writers, progress)
            else:
                _write_async(store, batches, n_puts, progress)
            store.commitlog.flush()  # writes are measured until durable
            write_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            _read_all(store, topic, count)
            read_s = time.perf_counter() - t1
        finally:
            store.close()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    body_mb = count * size / 1e6
    stored_mb = stored_bytes / 1e6
    return {
        "bench": "store",
        "size": size,
        "count": count,
        "batch": batch,
        "flush": flush,
        "writers": writers if flush == "sync" else 1,
        "msgs_per_s": round(count / write_s),
        "mb_per_s": round(body_mb / write_s, 1),
        "stored_mb_per_s": round(stored_mb / write_s, 1),
        "read_msgs_per_s": round(count / read_s),
        "read_mb_per_s": round(stored_mb / read_s, 1),
        "write_seconds": round(write_s, 3),
        "raw_seq_write_mb_per_s": round(raw_mb, 1),
        "raw_one_fsync_mb_per_s": round(raw_end, 1),
        "raw_fsync_every_64mib_mb_per_s": round(raw_streamed, 1),
        "raw_fsync_per_s": round(raw_fsync),
        "vs_raw_bandwidth": round(stored_mb / write_s / raw_mb, 2),
        "vs_fsync_per_write": round(count / write_s / raw_fsync, 1),
    }


_CRASH_WRITER = r"""
import os, signal, sys
from tidemq.protocol.record import MessageData, encode_batch
from tidemq.store.config import StoreConfig
from tidemq.store.message_store import MessageStore
d, total = sys.argv[1], int(sys.argv[2])
store = MessageStore(StoreConfig(data_dir=d, segment_size=int(sys.argv[3])))
b = encode_batch("bench", [MessageData(b"r" * 1024, keys="k")] * 100, producer_id=7)
n = 0
while n < total:
    store.put(b)
    n += len(b)
os.kill(os.getpid(), signal.SIGKILL)
"""


def bench_recovery(*, data_dir: str | None, gib: float, segment_size: int) -> dict[str, Any]:
    """Write ``gib`` GiB, SIGKILL the writer, then time recovery twice: from the checkpoint (the
    normal crash path) and with the checkpoint removed (every index rebuilt from the log)."""
    base = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="tidemq-bench-"))
    run_dir = base / f"bench-recovery-{os.getpid()}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    total = int(gib * (1 << 30))
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _CRASH_WRITER, str(run_dir), str(total), str(segment_size)],
            capture_output=True,
            text=True,
        )
        if proc.returncode != -signal.SIGKILL:
            raise RuntimeError(f"crash writer exited {proc.returncode}: {proc.stderr[-2000:]}")
        t0 = time.perf_counter()
        store = MessageStore(StoreConfig(data_dir=str(run_dir), segment_size=segment_size))
        crash_s = time.perf_counter() - t0
        rep = store.recovery_report
        crash_info = {
            "scanned_bytes": rep.end_offset - rep.scanned_from,
            "clean_shutdown": rep.clean_shutdown,
        }
        messages = store.max_offset("bench", 0)
        store.close()
        (run_dir / "checkpoint").unlink()
        (run_dir / "abort").touch()
        t1 = time.perf_counter()
        store = MessageStore(StoreConfig(data_dir=str(run_dir), segment_size=segment_size))
        rebuild_s = time.perf_counter() - t1
        rep2 = store.recovery_report
        rebuilt_messages = store.max_offset("bench", 0)
        store.close()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return {
        "bench": "recovery",
        "gib": gib,
        "messages": messages,
        "crash_recovery_s": round(crash_s, 3),
        "crash_scanned_bytes": crash_info["scanned_bytes"],
        "full_rebuild_s": round(rebuild_s, 3),
        "full_rebuild_scanned_bytes": rep2.end_offset - rep2.scanned_from,
        "rebuilt_messages": rebuilt_messages,
    }
