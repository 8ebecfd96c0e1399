"""The transaction check round gives the event loop a turn every 256 half messages (an
in-process broker: a backlog of half messages must not stall sends and pulls for a round)."""

from __future__ import annotations

import asyncio

from tidemq.broker.broker import Broker
from tidemq.broker.config import BrokerConfig
from tidemq.broker.transaction_service import _SLICE
from tidemq.protocol.record import BatchView, MessageData, TxnType, encode_batch


def test_check_round_yields_to_the_loop_while_judging_a_backlog(tmp_path):
    cfg = BrokerConfig(listen_port=0, data_dir=str(tmp_path / "data"),
                       transaction_timeout_ms=1, transaction_check_interval_ms=3_600_000,
                       store={"segment_size": 1 << 24, "index_slots": 1024,
                              "index_max_entries": 8192, "cq_units_per_file": 4096})
    broker = Broker(cfg)
    n = 4 * _SLICE

    async def main() -> tuple[int, int]:
        await broker.start()
        try:
            txn = broker.transactions
            for i in range(n):
                b = encode_batch("orders", [MessageData(b"half %d" % i)], producer_id=9,
                                 base_seq=i, txn=TxnType.PREPARED)
                txn.prepare(b, BatchView(b), 0, "pg", None)
            await asyncio.sleep(0.01)  # older than their 1 ms immunity
            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0)

            t = asyncio.get_running_loop().create_task(ticker())
            await asyncio.sleep(0)
            before = ticks
            await txn.check_round()
            during = ticks - before
            t.cancel()
            return during, txn.half_progress
        finally:
            await broker.stop()

    during, progress = asyncio.run(main())
    assert during >= n // _SLICE - 1, f"the loop ran {during} times during the round"
    assert progress == n  # every half message was judged (put back for a check)
