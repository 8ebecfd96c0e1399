"""Synchronous reads of one queue's offset range ``[start, end)``, decoded into columns.

What a batch job (the Spark data source, ``tidemq.spark``) needs from a queue is different from
what a consumer needs: a bounded range, read once, with no group state, and every field of every
message as a column. :class:`RangeReader` pulls the range without long polling (an empty answer
means the data is not there, not "wait"), keeps one pull in flight while the caller decodes the
previous one, and turns each pull response into a :class:`ColumnChunk`: numpy arrays and plain
lists built per stored batch (numpy gathers of the record headers, one vectorised hex encoding of
the message ids) instead of one ``MessageExt`` per message.

Data loss: when a part of the range is no longer stored (retention deleted it, the queue was
truncated) the reader raises :class:`DataLossError` if ``fail_on_data_loss``, else logs a warning
and goes on with what is still stored. ``ColumnChunk.lost`` counts the skipped offsets.

Threading: a ``RangeReader`` belongs to the thread that created it; the network work runs on
the process's shared ``tidemq-io`` loop (``tidemq.client.blocking``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tidemq.client import offsets
from tidemq.client.blocking import _run, _submit
from tidemq.client.connection import ConnectionPool, raise_for_error
from tidemq.client.errors import ClientError
from tidemq.client.message import MessageQueue
from tidemq.client.route import RouteCache
from tidemq.protocol.batch.layout import ARANGE_REC, IDX_DTYPE, REC_DTYPE
from tidemq.protocol.batch.tags import parse_tag_expression
from tidemq.protocol.codes import PullStatus, RequestCode, pull_status
from tidemq.protocol.corrupt import CorruptRecords
from tidemq.protocol.errors import CorruptBatchError
from tidemq.protocol.headers import (
    PullMessageRequestHeader,
    PullMessageResponseHeader,
    PullSysFlag,
)
from tidemq.protocol.record import (
    DEFAULT_MAX_RAW_SIZE,
    RECORD_HEADER_SIZE,
    BatchView,
    decode_properties,
    decode_utf8,
)

__all__ = ["RangeReader", "ColumnChunk", "DataLossError", "READER_GROUP"]

log = logging.getLogger(__name__)

#: The consumer group named in range pulls (the broker requires one; nothing is committed).
READER_GROUP = "TIDEMQ_RANGE_READER"
_HEX = np.frombuffer(b"0123456789ABCDEF", dtype=np.uint8)
_SHIFTS = np.arange(60, -4, -4, dtype=np.uint64)


class DataLossError(ClientError):
    """Offsets a reader was asked for are no longer stored (retention or truncation)."""

    code = "DATA_LOSS"


@dataclass
class ColumnChunk:
    """The messages of one pull as columns (row i of every column is one message).

    Message i's body is ``body_buffers[body_buffer[i]][body_starts[i]:][:body_lens[i]]``: the
    bodies stay where they arrived (no per-message copy; ``bodies()`` slices them out).
    ``tags``, ``keys`` and ``properties`` are None when no message of the chunk has one (the
    common case costs nothing); ``msg_ids`` is an ``(n, 32)`` uint8 array of ASCII hex digits.
    """

    topic: str
    queue_id: int
    queue_offsets: np.ndarray  # int64
    body_buffers: list[bytes]
    body_buffer: np.ndarray  # int32: index into body_buffers
    body_starts: np.ndarray  # int64
    body_lens: np.ndarray  # int64
    msg_ids: np.ndarray  # uint8 (n, 32)
    born_ts: np.ndarray  # int64, ms
    store_ts: np.ndarray  # int64, ms
    reconsume_times: np.ndarray  # int32
    tags: list[str | None] | None = None
    keys: list[list[str]] | None = None
    properties: list[dict[str, str]] | None = None
    lost: int = 0  # offsets of the range found deleted (fail_on_data_loss=False)
    #: messages of the range skipped because they do not decode (always skipped and logged,
    #: never an error: "tolerate on the way out")
    corrupt: int = 0
    #: first queue offset the pull's body held, corrupt batches included (None: nothing)
    covered_from: int | None = None

    def __len__(self) -> int:
        return len(self.queue_offsets)

    @property
    def nbytes(self) -> int:
        return int(self.body_lens.sum())

    def bodies(self) -> list[bytes]:
        """Every body as its own bytes object (a copy each: for tests and small reads)."""
        bufs = self.body_buffers
        return [bufs[b][s : s + n] for b, s, n in zip(self.body_buffer.tolist(),
                                                       self.body_starts.tolist(),
                                                       self.body_lens.tolist(), strict=True)]


@dataclass
class _Piece:
    """One stored batch's selected messages, before the pull's pieces are concatenated."""

    offsets: np.ndarray
    raw: bytes
    body_starts: np.ndarray
    body_lens: np.ndarray
    msg_ids: np.ndarray
    born_ts: np.ndarray
    store_ts: int
    reconsume: int
    tags: list[str | None] | None
    keys: list[list[str]] | None
    props: list[dict[str, str]] | None
    extra: dict[str, Any] = field(default_factory=dict)


def _hex_ids(producer_id: int, seqs: np.ndarray) -> np.ndarray:
    """(n, 32) ASCII hex of ``record.unique_id(producer_id, seq)`` for every seq."""
    n = len(seqs)
    out = np.empty((n, 32), dtype=np.uint8)
    out[:, :16] = np.frombuffer(f"{producer_id:016X}".encode(), dtype=np.uint8)
    digits = (seqs.astype(np.uint64)[:, None] >> _SHIFTS) & np.uint64(0xF)
    out[:, 16:] = _HEX[digits.astype(np.intp)]
    return out


def _decode_batch(view: BatchView, start: int, stop: int, tags: frozenset[str] | None,
                  max_raw: int, bad: list[tuple[int, str]]) -> _Piece | None:
    """Messages ``start..stop-1`` (batch indexes) of one stored batch, tag-filtered. A message
    whose tag, keys or properties are not UTF-8 is left out and appended to ``bad`` as
    (batch index, reason); what breaks the whole batch raises CorruptBatchError."""
    body = view.buf.obj
    if not view.compression and type(body) is bytes and len(body) == len(view.buf):
        # Uncompressed: the records stay inside the pull response (no copy at all).
        rawb, off = body, view.pos + view.records_start
    else:
        rawb, off = bytes(view.raw_records(max_raw)), 0
    rlen = off + view.records_size if off else len(rawb)
    count = view.count
    idx = np.frombuffer(view.index_view(), dtype=IDX_DTYPE, count=count)[start:stop]
    rel = idx["rel"].astype(np.int64) + off
    if len(rel) and (int(rel.max()) + RECORD_HEADER_SIZE > rlen or int(rel.min()) < off):
        raise CorruptBatchError("a message of a pulled batch starts outside its records section")
    hdr = np.frombuffer(rawb, dtype=np.uint8)[rel[:, None] + ARANGE_REC].view(
        REC_DTYPE).reshape(-1)
    tl = hdr["tl"].astype(np.int64)
    pl = hdr["pl"].astype(np.int64)
    bl = hdr["bl"].astype(np.int64)
    bstart = rel + RECORD_HEADER_SIZE + tl + pl
    if len(bstart) and int((bstart + bl).max()) > rlen:
        raise CorruptBatchError("record sizes of a pulled batch are inconsistent")
    sel = np.arange(start, stop, dtype=np.int64)
    n = len(sel)
    keep: np.ndarray | None = None  # messages kept, when some are not

    def drop(j: int, why: str) -> None:
        nonlocal keep
        if keep is None:
            keep = np.ones(n, dtype=bool)
        if keep[j]:
            keep[j] = False
            bad.append((start + j, why))

    tag_list: list[str | None] | None = None
    if bool(tl.any()):
        ts = (rel + RECORD_HEADER_SIZE).tolist()
        tag_list = []
        for j, (s, k) in enumerate(zip(ts, tl.tolist(), strict=True)):
            if not k:
                tag_list.append(None)
                continue
            try:
                tag_list.append(decode_utf8(rawb[s : s + k], f"tags of message {start + j}"))
            except CorruptBatchError as exc:
                tag_list.append(None)
                drop(j, exc.message)
        if tags is not None:
            wanted = np.fromiter((t in tags for t in tag_list), dtype=bool, count=n)
            keep = wanted if keep is None else keep & wanted
    elif tags is not None:
        return None
    props = None
    if bool(pl.any()):
        ps = (rel + RECORD_HEADER_SIZE + tl).tolist()
        props = []
        for j, (s, k) in enumerate(zip(ps, pl.tolist(), strict=True)):
            try:
                props.append(decode_properties(rawb[s : s + k]) if k else {})
            except CorruptBatchError as exc:
                props.append({})
                drop(j, f"message {start + j} {exc.message}")
    keys: list[list[str]] | None = None
    if view.keys_size:
        kmap = view.raw_keys()
        keys = []
        for j, i in enumerate(sel.tolist()):
            kraw = kmap.get(i)
            if kraw is None:
                keys.append([])
                continue
            try:
                keys.append([k for k in decode_utf8(kraw, f"keys of message {i}").split(" ")
                             if k])
            except CorruptBatchError as exc:
                keys.append([])
                drop(j, exc.message)
    if keep is not None and not keep.all():
        sel, rel, tl, pl, bl, bstart = (a[keep] for a in (sel, rel, tl, pl, bl, bstart))
        hdr = hdr[keep]
        kl = keep.tolist()
        if tag_list is not None:
            tag_list = [t for t, k in zip(tag_list, kl, strict=True) if k]
        if props is not None:
            props = [d for d, k in zip(props, kl, strict=True) if k]
        if keys is not None:
            keys = [x for x, k in zip(keys, kl, strict=True) if k]
    if not len(sel):
        return None
    return _Piece(
        offsets=sel + view.queue_offset, raw=rawb, body_starts=bstart, body_lens=bl,
        msg_ids=_hex_ids(view.producer_id, sel + view.base_seq),
        born_ts=hdr["born_ts"].astype(np.int64), store_ts=view.store_ts,
        reconsume=view.reconsume_times, tags=tag_list, keys=keys, props=props,
    )


def decode_columns(body: bytes, topic: str, queue_id: int, start: int, end: int,
                   tags: frozenset[str] | None = None, check_crc: bool = True,
                   max_uncompressed: int = DEFAULT_MAX_RAW_SIZE,
                   on_corrupt: Callable[[int, int, str], None] | None = None,
                   ) -> tuple[ColumnChunk, int]:
    """The messages with ``start <= queue_offset < end`` of a pull response body, and the queue
    offset right after the body's last batch.

    What cannot be decoded -- a batch failing its CRC or its decompression (over
    ``max_uncompressed`` bytes included), a message whose tag, keys or properties are not
    UTF-8 -- is reported to ``on_corrupt(queue_offset, count, reason)`` and left out (count -1:
    the body's framing broke there and its rest is dropped); without ``on_corrupt`` it raises
    CorruptBatchError. The chunk's ``corrupt`` counts the messages left out, and its
    ``covered_from`` is the first queue offset the body holds (corrupt batches included), so a
    reader can tell skipped-as-corrupt from no-longer-stored."""
    mv = memoryview(body)
    pos, total = 0, len(mv)
    after = start
    covered_from: int | None = None
    corrupt = 0
    pieces: list[_Piece] = []
    bad: list[tuple[int, str]] = []
    while pos < total:
        try:
            view = BatchView(mv, pos)
        except CorruptBatchError as exc:
            if on_corrupt is None:
                raise
            on_corrupt(after, -1, exc.message)
            corrupt += 1
            if covered_from is None:
                covered_from = start
            break
        pos += view.total_size
        qo = view.queue_offset
        after = max(after, qo + view.count)
        lo, hi = max(start - qo, 0), min(end - qo, view.count)
        if lo >= hi:
            continue
        if covered_from is None:
            covered_from = qo + lo
        try:
            if check_crc:
                view.verify()
            piece = _decode_batch(view, lo, hi, tags, max_uncompressed, bad)
        except CorruptBatchError as exc:
            if on_corrupt is None:
                raise
            on_corrupt(qo + lo, hi - lo, exc.message)
            corrupt += hi - lo
            bad.clear()
            continue
        if bad:
            if on_corrupt is None:
                raise CorruptBatchError(bad[0][1])
            for i, why in bad:
                on_corrupt(qo + i, 1, why)
            corrupt += len(bad)
            bad.clear()
        if piece is not None:
            pieces.append(piece)
    chunk = _concat(topic, queue_id, pieces)
    chunk.corrupt = corrupt
    chunk.covered_from = covered_from
    return chunk, after


def _concat(topic: str, queue_id: int, pieces: Sequence[_Piece]) -> ColumnChunk:
    if not pieces:
        z = np.zeros(0, dtype=np.int64)
        return ColumnChunk(topic, queue_id, z, [], np.zeros(0, dtype=np.int32), z, z,
                           np.zeros((0, 32), dtype=np.uint8), z, z, np.zeros(0, dtype=np.int32))
    counts = [len(p.offsets) for p in pieces]
    # Batches pulled together share one response buffer: keep each distinct buffer once.
    buffers: list[bytes] = []
    where: dict[int, int] = {}
    buf_index = []
    for p in pieces:
        i = where.get(id(p.raw))
        if i is None:
            i = where[id(p.raw)] = len(buffers)
            buffers.append(p.raw)
        buf_index.append(i)
    tags = keys = props = None
    if any(p.tags is not None for p in pieces):
        tags = [t for p, c in zip(pieces, counts, strict=True)
                for t in (p.tags if p.tags is not None else [None] * c)]
    if any(p.keys is not None for p in pieces):
        keys = [k for p, c in zip(pieces, counts, strict=True)
                for k in (p.keys if p.keys is not None else [[] for _ in range(c)])]
    if any(p.props is not None for p in pieces):
        props = [d for p, c in zip(pieces, counts, strict=True)
                 for d in (p.props if p.props is not None else [{} for _ in range(c)])]
    return ColumnChunk(
        topic=topic, queue_id=queue_id,
        queue_offsets=np.concatenate([p.offsets for p in pieces]),
        body_buffers=buffers,
        body_buffer=np.repeat(np.array(buf_index, dtype=np.int32), counts),
        body_starts=np.concatenate([p.body_starts for p in pieces]),
        body_lens=np.concatenate([p.body_lens for p in pieces]),
        msg_ids=np.concatenate([p.msg_ids for p in pieces]),
        born_ts=np.concatenate([p.born_ts for p in pieces]),
        store_ts=np.repeat(np.array([p.store_ts for p in pieces], dtype=np.int64), counts),
        reconsume_times=np.repeat(np.array([p.reconsume for p in pieces], dtype=np.int32),
                                  counts),
        tags=tags, keys=keys, properties=props,
    )


@dataclass
class _Pulled:
    status: PullStatus
    body: bytes
    next_begin: int
    min_offset: int
    max_offset: int


class RangeReader:
    """Reads offset ranges of queues, synchronously (see the module docstring).

    ``broker_addrs`` (broker name -> address) skips the name server lookup when given, which is
    how a Spark task reads with nothing but its partition description.
    """

    def __init__(self, namesrv: str | Sequence[str], *,
                 broker_addrs: dict[str, str] | None = None, request_timeout: float = 10.0,
                 max_messages_per_pull: int = 8192, check_crc: bool = True,
                 max_uncompressed_bytes: int = DEFAULT_MAX_RAW_SIZE) -> None:
        self.namesrv = namesrv
        self.max_uncompressed_bytes = max_uncompressed_bytes
        #: records skipped because they do not decode (see decode_columns)
        self.corrupt = CorruptRecords(log)
        self.broker_addrs = dict(broker_addrs or {})
        self.request_timeout = request_timeout
        self.max_per_pull = max_messages_per_pull
        self.check_crc = check_crc
        self._pool: ConnectionPool | None = None
        self._routes: RouteCache | None = None

    def close(self) -> None:
        pool, routes = self._pool, self._routes
        self._pool = self._routes = None

        async def go() -> None:
            if routes is not None:
                await routes.close()
            if pool is not None:
                pool.close()

        if pool is not None or routes is not None:
            _run(go())

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def _addr(self, mq: MessageQueue) -> str:
        addr = self.broker_addrs.get(mq.broker_name)
        if addr:
            return addr
        if self._routes is None:
            assert self._pool is not None
            self._routes = RouteCache(self._pool, self.namesrv, timeout=self.request_timeout)
        return await self._routes.addr_of(mq)

    async def _pull(self, mq: MessageQueue, offset: int, max_nums: int,
                    expression: str | None) -> _Pulled:
        if self._pool is None:
            self._pool = ConnectionPool()
        addr = await self._addr(mq)
        header = PullMessageRequestHeader(
            consumer_group=READER_GROUP, topic=mq.topic, queue_id=mq.queue_id,
            queue_offset=offset, max_msg_nums=max(1, max_nums),
            sys_flag=PullSysFlag.SUBSCRIPTION if expression else 0,
            suspend_timeout_millis=0, subscription=expression,
        )
        conn = await self._pool.get(addr)
        frame = await conn.request(RequestCode.PULL_MESSAGE, header,
                                   timeout=self.request_timeout)
        status = pull_status(frame.code)  # not-found statuses are answers, not errors
        if status is None:
            raise_for_error(frame)
            raise AssertionError("unreachable: raise_for_error raised")
        h = frame.header
        assert isinstance(h, PullMessageResponseHeader)
        body = frame.body if status is PullStatus.FOUND else b""
        return _Pulled(status, bytes(body), h.next_begin_offset, h.min_offset, h.max_offset)

    def read(self, mq: MessageQueue, start: int, end: int, *, tags: str | None = None,
             fail_on_data_loss: bool = True) -> Iterator[ColumnChunk]:
        """Column chunks of the messages with ``start <= queue_offset < end`` (in order)."""
        tag_set = parse_tag_expression(tags)
        expression = tags if tag_set is not None else None
        offset = start
        inflight: Future[_Pulled] | None = None
        try:
            while offset < end:
                if inflight is None:
                    inflight = _submit(self._pull(mq, offset, min(end - offset,
                                                                  self.max_per_pull), expression))
                pulled = inflight.result()
                inflight = None
                lost = 0
                if pulled.status is PullStatus.FOUND:
                    chunk, after = decode_columns(
                        pulled.body, mq.topic, mq.queue_id, offset, end, tag_set, self.check_crc,
                        self.max_uncompressed_bytes,
                        functools.partial(self._corrupt, mq))
                    nxt = max(after, pulled.next_begin)
                    # Skipped-as-corrupt is not lost: only a gap before the first batch the
                    # body holds is.
                    first = chunk.covered_from if chunk.covered_from is not None else nxt
                    if tag_set is None and first > offset:
                        lost = self._lost(mq, offset, min(first, end), fail_on_data_loss)
                    if nxt < end:  # prefetch while the caller works on this chunk
                        inflight = _submit(self._pull(mq, nxt, min(end - nxt, self.max_per_pull),
                                                      expression))
                    chunk.lost = lost
                    offset = nxt
                    if len(chunk) or lost:
                        yield chunk
                    continue
                if pulled.status is PullStatus.NO_MATCHED_MSG and pulled.next_begin > offset:
                    offset = pulled.next_begin
                    continue
                # NO_NEW_MSG / OFFSET_ILLEGAL: [offset, end) is not (or no longer) all stored.
                if offset < pulled.min_offset:
                    resume = min(pulled.min_offset, end)
                elif pulled.status is PullStatus.NO_MATCHED_MSG:
                    resume = offset + 1  # defensive: never spin on the same offset
                else:
                    resume = end  # the queue ends before ``end``: nothing more will come
                lost = self._lost(mq, offset, resume, fail_on_data_loss,
                                  pulled.min_offset, pulled.max_offset)
                offset = resume
                yield _concat(mq.topic, mq.queue_id, []) if not lost else self._empty(mq, lost)
        finally:
            if inflight is not None:
                inflight.cancel()
                try:
                    inflight.result()
                except BaseException:  # noqa: BLE001 - the prefetch is no longer wanted
                    pass

    def max_offset(self, mq: MessageQueue) -> int:
        """The queue's max offset now (where the next message will be stored)."""
        async def go() -> int:
            if self._pool is None:
                self._pool = ConnectionPool()
            addr = await self._addr(mq)
            return await offsets.max_offset(self._pool, addr, mq, timeout=self.request_timeout)

        return _run(go())

    def _corrupt(self, mq: MessageQueue, queue_offset: int, count: int, why: str) -> None:
        where = (f"offsets {queue_offset}..{queue_offset + count - 1}" if count > 0
                 else f"offset {queue_offset} to the end of the pull")
        self.corrupt.skipped("range reader",
                             f"topic {mq.topic} queue {mq.broker_name}:{mq.queue_id} {where}",
                             why, count)

    def _empty(self, mq: MessageQueue, lost: int) -> ColumnChunk:
        c = _concat(mq.topic, mq.queue_id, [])
        c.lost = lost
        return c

    @staticmethod
    def _lost(mq: MessageQueue, lo: int, hi: int, fail: bool, qmin: int | None = None,
              qmax: int | None = None) -> int:
        if hi <= lo:
            return 0
        held = f" (the queue holds [{qmin}, {qmax}))" if qmin is not None else ""
        text = (f"offsets [{lo}, {hi}) of {mq} are no longer stored{held}: retention deleted "
                "them or the queue was truncated")
        if fail:
            raise DataLossError(text + "; read from a later offset, or set failOnDataLoss=false "
                                "to skip what is gone")
        log.warning("%s; skipping them (failOnDataLoss=false)", text)
        return hi - lo

