"""Golden bytes: today's encoders build, and today's decoders read, the files written before the
batch format got its single owner -- the format on the wire and on disk has not changed.

See ``cases.py`` for the inputs and for when the files may be re-generated.
"""

from __future__ import annotations

import os
import shutil

import pytest
from tests.golden import build, cases

from tidemq.client.codec import decode_pull_body
from tidemq.protocol.frame import FrameDecoder
from tidemq.protocol.record import BatchView, Compression, pack_host, stored_span, tag_hash
from tidemq.store.consume_queue import ConsumeQueue
from tidemq.store.index_file import IndexService

BATCH_IDS = [c.name for c in cases.BATCHES]


def _golden(name: str) -> bytes:
    with open(cases.path(name), "rb") as f:
        return f.read()


def _same_batch(built: bytes, golden: bytes) -> None:
    """Equal bytes; for a compressed batch, the compressed section may come out of another
    version of the compression library differently, so there the headers, index and keys must
    be equal and the records must decompress to the same bytes."""
    if built == golden:
        return
    a, b = BatchView(built), BatchView(golden)
    assert a.compression != Compression.NONE, "an uncompressed batch differs from its golden file"
    assert a.compression == b.compression
    assert bytes(a.raw_records()) == bytes(b.raw_records())
    assert built[12 : a.producer_start + 4] == golden[12 : b.producer_start + 4]


@pytest.mark.parametrize("case", cases.BATCHES, ids=BATCH_IDS)
def test_reference_encoder_builds_the_golden_batch(case: cases.BatchCase) -> None:
    _same_batch(build.wire_batch(case), _golden(f"batch_{case.name}.bin"))


@pytest.mark.parametrize(
    "case", [c for c in cases.BATCHES if c.client], ids=[c.name for c in cases.BATCHES if c.client]
)
def test_client_encoder_builds_the_golden_batch(case: cases.BatchCase) -> None:
    _same_batch(build.client_batch(case), _golden(f"batch_{case.name}.bin"))


@pytest.mark.parametrize("case", cases.BATCHES, ids=BATCH_IDS)
def test_store_stamp_builds_the_golden_stored_batch(case: cases.BatchCase) -> None:
    wire = _golden(f"batch_{case.name}.bin")
    assert build.stored_batch(wire, case) == _golden(f"stored_{case.name}.bin")


@pytest.mark.parametrize("case", cases.BATCHES, ids=BATCH_IDS)
def test_golden_batch_decodes(case: cases.BatchCase) -> None:
    stored = _golden(f"stored_{case.name}.bin")
    v = BatchView(stored)
    v.verify()
    kw = case.kw
    assert v.topic == case.topic
    assert v.count == len(case.messages)
    assert (v.phys_offset, v.queue_offset, v.store_ts) == (
        case.phys_offset, case.queue_offset, cases.STORE_TS)
    assert v.queue_id == kw.get("queue_id", 0)
    assert v.txn == kw.get("txn", 0)
    assert v.prepared_offset == kw.get("prepared_offset", -1)
    assert v.reconsume_times == kw.get("reconsume_times", 0)
    assert v.delay_level == kw.get("delay_level", 0)
    assert v.deliver_at == kw.get("deliver_at", 0)
    assert v.compression == kw.get("compression", 0)
    assert v.store_host_raw == pack_host(cases.STORE_HOST) and v.store_port == cases.STORE_PORT
    assert v.born_host_raw == pack_host(cases.BORN_HOST) and v.born_port == cases.BORN_PORT
    assert stored_span(stored, 0, len(stored)) == (case.queue_offset, len(case.messages))
    got = list(v.messages())
    for i, (m, want) in enumerate(zip(got, case.messages, strict=True)):
        assert m.body == want.body
        assert m.tags == want.tags
        assert m.keys == want.keys
        assert m.properties == (want.properties or {})
        assert m.born_ts == cases.BORN_TS
        assert m.queue_offset == case.queue_offset + i
        assert v.tag_hash_at(i) == tag_hash(want.tags)
        assert m.msg_id == f"{cases.PRODUCER_ID:016X}{kw.get('base_seq', 0) + i:016X}"
    # The client's decoder reads the same messages from a pull body of this batch.
    exts, end = decode_pull_body(stored, from_offset=case.queue_offset, topic=case.topic)
    assert end == case.queue_offset + len(case.messages)
    for i, (e, want) in enumerate(zip(exts, case.messages, strict=True)):
        assert (e.body, e.tags, e.queue_offset) == (want.body, want.tags, case.queue_offset + i)
        assert e.keys == (want.keys.split() if want.keys else [])
        assert e.properties == (want.properties or {})
        assert e.msg_id == got[i].msg_id


@pytest.mark.parametrize("frame", cases.FRAMES, ids=[f[0] for f in cases.FRAMES])
def test_frame_golden(frame: tuple) -> None:  # type: ignore[type-arg]
    name, kind, code, opaque, header, body = frame
    golden = _golden(f"{name}.bin")
    assert build.frame_bytes(kind, code, opaque, header, body) == golden
    (f,) = FrameDecoder().feed(golden)
    assert (f.code, f.opaque, f.is_response, f.is_oneway) == (
        code, opaque, kind == "response", kind == "oneway")
    assert f.header == header
    assert bytes(f.body) == body


def test_consume_queue_golden(tmp_path: object) -> None:
    golden = _golden("consume_queue.bin")
    assert build.consume_queue_bytes() == golden
    name, data = golden.split(b"\n", 1)
    d = os.path.join(str(tmp_path), "Golden", "0")
    os.makedirs(d)
    with open(os.path.join(d, name.decode()), "wb") as f:
        f.write(data)
    cq = ConsumeQueue(str(tmp_path), "Golden", 0, units_per_file=cases.CQ_UNITS_PER_FILE)
    try:
        assert cq.max_offset == len(cases.CQ_UNITS)
        for qoff, phys, size, tag in cases.CQ_UNITS:
            assert cq.get(qoff) == (phys, size, tag)
    finally:
        cq.close()


def test_index_file_golden(tmp_path: object) -> None:
    golden = _golden("index_file.bin")
    assert build.index_file_bytes() == golden
    name, data = golden.split(b"\n", 1)
    root = str(tmp_path)
    with open(os.path.join(root, name.decode()), "wb") as f:
        f.write(data)
    svc = IndexService(root, slots=cases.INDEX_SLOTS, max_entries=cases.INDEX_MAX_ENTRIES)
    try:
        assert svc.load_errors == []
        lo, hi = cases.STORE_TS - 1, cases.STORE_TS + 100
        assert sorted(svc.query("order-1", lo, hi)) == [0, 217]
        assert svc.query("order-2", lo, hi) == [120]
    finally:
        svc.close()
    shutil.rmtree(root, ignore_errors=True)
