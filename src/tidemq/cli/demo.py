"""`tidemq demo store`: what `make run` shows at this stage — the storage engine at work."""

from __future__ import annotations

import time

import click

from tidemq.protocol.record import MessageData, encode_batch
from tidemq.store.config import StoreConfig
from tidemq.store.message_store import MessageStore


@click.group()
def demo() -> None:
    """Short demonstrations on a local data directory."""


@demo.command("store")
@click.option("--data-dir", default="./data", show_default=True, type=click.Path(file_okay=False))
@click.option("--messages", default=200_000, show_default=True)
@click.option("--batch", default=100, show_default=True)
def demo_store(data_dir: str, messages: int, batch: int) -> None:
    """Write MESSAGES in batches to topic 'demo', read them back, look one up by key."""
    store = MessageStore(StoreConfig(data_dir=f"{data_dir}/store", segment_size=64 << 20))
    try:
        click.echo(f"store opened at {store.dir}: {store.recovery_report.summary()}")
        queues = 4
        before = {q: store.max_offset("demo", q) for q in range(queues)}
        run = int(time.time())
        t0 = time.perf_counter()
        sent = 0
        seq = 0
        with click.progressbar(length=messages, label="writing") as bar:
            while sent < messages:
                n = min(batch, messages - sent)
                msgs = [
                    MessageData(
                        f"order {run}-{seq + i} paid".encode() * 8,
                        tags="paid",
                        keys=f"order-{run}-{seq + i}",
                    )
                    for i in range(n)
                ]
                store.put(
                    encode_batch(
                        "demo",
                        msgs,
                        queue_id=(seq // batch) % queues,
                        producer_id=run,
                        base_seq=seq,
                    )
                )
                seq += n
                sent += n
                bar.update(n)
        store.flush()
        wt = time.perf_counter() - t0
        t1 = time.perf_counter()
        got = 0
        for q in range(queues):
            off = before[q]
            while True:
                res = store.get_messages("demo", q, off, 1024)
                if not res.batches:
                    break
                got += sum(len(b.messages()) for b in res.batches)
                off = res.next_begin_offset
        rt = time.perf_counter() - t1
        key = f"order-{run}-{messages // 2}"
        found = store.query_by_key("demo", key)
        click.echo(f"wrote {sent} messages in {wt:.2f} s ({sent / wt:,.0f} msg/s, durable)")
        click.echo(f"read and decoded {got} messages in {rt:.2f} s ({got / rt:,.0f} msg/s)")
        click.echo(f"lookup by key {key!r}: {[m.body[:24] for m in found]}")
        for q in range(queues):
            click.echo(
                f"queue demo/{q}: offsets [{store.min_offset('demo', q)}, "
                f"{store.max_offset('demo', q)})"
            )
        if got != sent or not found:
            raise click.ClickException("read-back did not match what was written")
    finally:
        store.close()
