"""Chunked messages (PR5) in column reads: the Spark source's reassembly (CO9).

A range read (``range_reader.RangeReader``, one Spark task's ``[start, end)``) yields
:class:`~tidemq.client.range_reader.ColumnChunk`\\ s; :class:`ColumnAssembler` replaces the rows
of a chunked message by one row -- the whole body, the user's properties (``__CHUNK_*``
removed), every other column from its last chunk -- as ``chunking.ChunkAssembler`` does for
consumers.

Ranges are aligned to whole messages by the rule "a chunked message belongs to the range that
holds its first chunk":

- a range whose end falls inside a chunked message reads on past its end until the message is
  complete (:meth:`ColumnAssembler.feed` with ``tail=True`` keeps only the completions of
  messages already started), so the message is emitted once, whole, by that range;
- a range meets the other chunks of that message at its start without their first chunk and
  skips them (``skipped_tails``: they were emitted by the previous range).

So a chunked message never straddles two micro-batches or two partitions, whatever offsets the
planner chose, and a replay of the same ranges emits the same rows. Expiry is judged by the
*store* time of the first chunk: a message is dropped (``expired``) only when the rest of it is
not stored and more than ``expire_ms`` (60 s) passed since its first chunk was stored -- a
replay of stored history never waits and never expires a message that is complete in the
queue.

Threads: one per assembler (the task's).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tidemq.client.chunking import CHUNK_ID, CHUNK_SIZE, CHUNK_TOTAL, CHUNK_UUID
from tidemq.client.range_reader import ColumnChunk

__all__ = ["ColumnAssembler"]

log = logging.getLogger(__name__)

_CHUNK_PROPS = (CHUNK_UUID, CHUNK_ID, CHUNK_TOTAL, CHUNK_SIZE)


@dataclass
class _Part:
    total: int
    size: int
    first_offset: int
    first_store_ts: int
    parts: list[bytes | None] = field(default_factory=list)


class ColumnAssembler:
    """Reassembles the chunked messages of one range read (see the module doc)."""

    def __init__(self, *, expire_ms: int = 60_000) -> None:
        self.expire_ms = expire_ms
        self._partial: dict[str, _Part] = {}
        self.assembled = 0
        self.expired = 0
        self.skipped_tails = 0

    @property
    def pending(self) -> bool:
        """True while a chunked message started in the range is incomplete."""
        return bool(self._partial)

    def expire(self, now_ms: int) -> int:
        """Drop the incomplete messages whose first chunk was stored more than ``expire_ms``
        before ``now_ms``; how many were dropped."""
        gone = [u for u, p in self._partial.items() if now_ms - p.first_store_ts > self.expire_ms]
        for u in gone:
            p = self._partial.pop(u)
            got = sum(1 for x in p.parts if x is not None)
            log.warning("chunked message %s dropped: %d of %d chunks stored, the first at "
                        "offset %d more than %g s ago", u, got, p.total, p.first_offset,
                        self.expire_ms / 1000)
        self.expired += len(gone)
        return len(gone)

    def feed(self, chunk: ColumnChunk, *, tail: bool = False) -> ColumnChunk:
        """``chunk`` with chunk rows replaced by the messages they complete. ``tail``: rows
        read past the range's end, of which only completions of started messages are kept."""
        props = chunk.properties
        n = len(chunk)
        if props is None or (not tail and not any(CHUNK_UUID in p for p in props)):
            if tail and n:
                return _take(chunk, np.zeros(n, dtype=bool), chunk.body_buffers, None)
            return chunk
        keep = np.zeros(n, dtype=bool) if tail else np.ones(n, dtype=bool)
        bufs = list(chunk.body_buffers)
        new_props = list(props)
        body_buffer = chunk.body_buffer.copy()
        starts = chunk.body_starts.copy()
        lens = chunk.body_lens.copy()
        offsets = chunk.queue_offsets.tolist()
        for i, p in enumerate(props):
            uuid = p.get(CHUNK_UUID)
            if uuid is None:
                continue
            keep[i] = False
            try:
                cid, total, size = int(p[CHUNK_ID]), int(p[CHUNK_TOTAL]), int(p[CHUNK_SIZE])
            except (KeyError, ValueError):
                keep[i] = not tail  # malformed: delivered as is, as consumers do
                continue
            part = self._partial.get(uuid)
            if part is None:
                if cid != 0 or tail:
                    if not tail:
                        self.skipped_tails += 1  # emitted whole by the range of its first chunk
                    continue
                part = self._partial[uuid] = _Part(total, size, offsets[i],
                                                   int(chunk.store_ts[i]), [None] * total)
            if not 0 <= cid < part.total or total != part.total:
                continue
            b = int(body_buffer[i])
            s = int(starts[i])
            part.parts[cid] = bufs[b][s : s + int(lens[i])]
            if any(x is None for x in part.parts):
                continue
            del self._partial[uuid]
            body = b"".join(part.parts)  # type: ignore[arg-type]
            if len(body) != part.size:
                log.error("chunked message %s reassembled to %d bytes, expected %d; dropped",
                          uuid, len(body), part.size)
                continue
            bufs.append(body)
            body_buffer[i] = len(bufs) - 1
            starts[i] = 0
            lens[i] = len(body)
            new_props[i] = {k: v for k, v in p.items() if k not in _CHUNK_PROPS}
            keep[i] = True
            self.assembled += 1
        out = _take(chunk, keep, bufs, new_props, body_buffer, starts, lens)
        return out


def _take(chunk: ColumnChunk, keep: np.ndarray, bufs: list[bytes],
          props: list[dict[str, str]] | None, body_buffer: np.ndarray | None = None,
          starts: np.ndarray | None = None, lens: np.ndarray | None = None) -> ColumnChunk:
    """The rows of ``chunk`` where ``keep``, with the body columns given."""
    idx = np.flatnonzero(keep)
    sel = idx.tolist()

    def rows(xs: list[Any] | None) -> list[Any] | None:
        return None if xs is None else [xs[i] for i in sel]

    return ColumnChunk(
        topic=chunk.topic, queue_id=chunk.queue_id,
        queue_offsets=chunk.queue_offsets[idx],
        body_buffers=bufs,
        body_buffer=(chunk.body_buffer if body_buffer is None else body_buffer)[idx],
        body_starts=(chunk.body_starts if starts is None else starts)[idx],
        body_lens=(chunk.body_lens if lens is None else lens)[idx],
        msg_ids=chunk.msg_ids[idx], born_ts=chunk.born_ts[idx], store_ts=chunk.store_ts[idx],
        reconsume_times=chunk.reconsume_times[idx],
        tags=rows(chunk.tags), keys=rows(chunk.keys),
        properties=rows(props if props is not None else chunk.properties),
        lost=chunk.lost, corrupt=chunk.corrupt, covered_from=chunk.covered_from,
    )
