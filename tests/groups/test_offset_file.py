"""The broadcasting consumer's local offset file (CO7; docs/format.md, section 8): golden bytes,
reload, and a damaged file that is reported, not fatal."""

from __future__ import annotations

import asyncio
import logging
import os

from tidemq.client.message import MessageQueue
from tidemq.client.offset_store import LocalFileOffsetStore

GOLDEN = b'{"offsets": {"orders|broker-a|0": 42, "orders|broker-a|1": 7}}'


def test_golden_bytes_and_reload(tmp_path) -> None:
    async def go() -> dict[MessageQueue, int]:
        s = LocalFileOffsetStore(str(tmp_path), "member-1", "billing")
        s.update(MessageQueue("orders", "broker-a", 0), 42, False)
        s.update(MessageQueue("orders", "broker-a", 1), 7, False)
        s.update(MessageQueue("orders", "broker-a", 1), 5, True)  # never backwards
        await s.persist_all(set())
        again = LocalFileOffsetStore(str(tmp_path), "member-1", "billing")
        await again.load()
        return again.table

    table = asyncio.run(go())
    path = tmp_path / "member-1" / "billing" / "offsets.json"
    assert path.read_bytes() == GOLDEN
    assert table == {MessageQueue("orders", "broker-a", 0): 42,
                     MessageQueue("orders", "broker-a", 1): 7}
    assert [p for p in os.listdir(path.parent) if p != "offsets.json"] == []  # no temp left


def test_a_damaged_file_is_reported_and_the_member_starts_by_consume_from(tmp_path,
                                                                          caplog) -> None:
    path = tmp_path / "m" / "g" / "offsets.json"
    path.parent.mkdir(parents=True)
    path.write_bytes(GOLDEN[:20])  # torn

    async def go() -> dict[MessageQueue, int]:
        s = LocalFileOffsetStore(str(tmp_path), "m", "g")
        await s.load()
        return s.table

    with caplog.at_level(logging.WARNING):
        assert asyncio.run(go()) == {}
    assert any("unreadable" in r.getMessage() and str(path) in r.getMessage()
               for r in caplog.records)
