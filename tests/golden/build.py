"""Build the golden objects from their inputs (``cases.py``) with the code of today.

This is the only file of ``tests/golden`` that calls the encoders: when the owner of a layout
moves, only the imports here change, never the ``.bin`` files.
"""

from __future__ import annotations

import os
import tempfile

from tests.golden import cases

from tidemq.client.message import Message
from tidemq.protocol.batch.fast import encode_messages
from tidemq.protocol.frame import Frame, encode_frame
from tidemq.protocol.record import (
    CRC_FIELD,
    STORE_CRC_FROM,
    STORE_CRC_OFFSET,
    STORE_FIELDS_OFFSET,
    STORE_TAIL,
    BatchView,
    MessageData,
    crc32c,
    encode_batch,
    pack_host,
)
from tidemq.store.consume_queue import ConsumeQueue
from tidemq.store.index_file import IndexService


def wire_batch(case: cases.BatchCase) -> bytes:
    """The batch as a producer sends it (store fields zero), by the reference encoder."""
    data = [
        MessageData(m.body, m.tags, m.keys, m.properties, 0, cases.BORN_TS)
        for m in case.messages
    ]
    return bytes(encode_batch(
        case.topic, data, producer_id=cases.PRODUCER_ID, born_host=cases.BORN_HOST,
        born_port=cases.BORN_PORT, **case.kw,
    ))


def client_batch(case: cases.BatchCase) -> bytes:
    """The same batch by the client's fast encoder."""
    kw = dict(case.kw)
    msgs = [
        Message(case.topic, m.body, tags=m.tags, keys=m.keys, properties=m.properties,
                delay_level=kw.get("delay_level", 0), deliver_at=kw.get("deliver_at", 0))
        for m in case.messages
    ]
    return bytes(encode_messages(
        case.topic, msgs, queue_id=kw.get("queue_id", 0), producer_id=cases.PRODUCER_ID,
        base_seq=kw.get("base_seq", 0), born_ts=cases.BORN_TS,
        born_host=pack_host(cases.BORN_HOST), born_port=cases.BORN_PORT,
        compression=kw.get("compression", 0), compress_min=kw.get("compress_min", 0),
    ))


def stored_batch(wire: bytes, case: cases.BatchCase) -> bytes:
    """``wire`` as the store writes it to the CommitLog: the store fields stamped in place
    and the store header CRC sealed (what store/message_store.py's put does)."""
    buf = bytearray(wire)
    v = BatchView(buf)
    STORE_TAIL.pack_into(
        buf, STORE_FIELDS_OFFSET, case.phys_offset, case.queue_offset, cases.STORE_TS,
        v.prepared_offset, v.queue_id, v.reconsume_times, v.topic_len, cases.STORE_PORT,
        pack_host(cases.STORE_HOST),
    )
    CRC_FIELD.pack_into(
        buf, STORE_CRC_OFFSET, crc32c(memoryview(buf)[STORE_CRC_FROM : v.producer_start])
    )
    return bytes(buf)


def frame_bytes(kind: str, code: int, opaque: int, header: object, body: bytes) -> bytes:
    if kind == "response":
        f = Frame.request(code, opaque).response(code, header, body)
    else:
        f = Frame.request(code, opaque, header, body, oneway=kind == "oneway")
    return encode_frame(f)


def consume_queue_bytes() -> bytes:
    """The first consume-queue file after appending ``cases.CQ_UNITS``."""
    with tempfile.TemporaryDirectory() as root:
        cq = ConsumeQueue(root, "Golden", 0, units_per_file=cases.CQ_UNITS_PER_FILE)
        for qoff, phys, size, tag in cases.CQ_UNITS:
            cq.append_one(qoff, phys, size, tag)
        cq.flush()
        d = os.path.join(root, "Golden", "0")
        (name,) = os.listdir(d)
        with open(os.path.join(d, name), "rb") as f:
            data = f.read()
        cq.close()
        return name.encode() + b"\n" + data


def index_file_bytes() -> bytes:
    """The index file after ``cases.INDEX_PUTS``: its name, a newline, its bytes."""
    with tempfile.TemporaryDirectory() as root:
        svc = IndexService(root, slots=cases.INDEX_SLOTS, max_entries=cases.INDEX_MAX_ENTRIES)
        for key, phys, ts in cases.INDEX_PUTS:
            svc.put(key, phys, ts)
        svc.flush()
        (name,) = os.listdir(root)
        with open(os.path.join(root, name), "rb") as f:
            data = f.read()
        svc.close()
        return name.encode() + b"\n" + data
