"""Chunking of messages above the broker's size limit (Pulsar's chunked messages; ref PR5,
CO9).

Producer side (:func:`split`): a message whose body does not fit one batch under
``max_message_size`` is sent as ``total`` single-message batches, in order, to one queue. Each
chunk carries the message's tags and keys, and these properties:

=====================  =========================================================================
``__CHUNK_UUID``       ``"<producer name>-<sequence id of chunk 0>"`` (Pulsar's uuid); unnamed
                       producers use their producer id in hex
``__CHUNK_ID``         0 .. total-1
``__CHUNK_TOTAL``      number of chunks
``__CHUNK_SIZE``       bytes of the whole body
=====================  =========================================================================

plus, on every chunk, the message's own user properties (so a filter or a reader of any chunk
sees them).

Consumer side (:class:`ChunkAssembler`, one per queue): chunks are held until the last one
arrives, then one message is emitted whose body is the concatenation, whose queue offset is
that of the *last* chunk (committing after it covers every chunk) and whose properties are the
user's (the ``__CHUNK_*`` ones removed). Incomplete messages expire ``expire_s`` (60 s) after
their first chunk arrived, and at most ``max_pending`` (100) are held -- the oldest goes first;
both are counted in ``expired`` and logged. While an incomplete message is held, the lowest
offset of its chunks is the queue's *low water*: the consumer never commits past it, so a
restart re-reads the chunks it had not assembled.

Threads: the consumer's event loop (one assembler per queue, no locking).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from tidemq.client.message import Message, MessageExt, SendResult
from tidemq.protocol.batch.layout import (
    ATTR_COMPRESSION_MASK,
    H_ATTRIBUTES,
    H_IDX0_REL,
    H_KEYS_SIZE,
    H_REC0_PROPS_LEN,
)

__all__ = [
    "ChunkAssembler",
    "split",
    "send_chunks",
    "CHUNK_UUID",
    "CHUNK_ID",
    "CHUNK_TOTAL",
    "CHUNK_SIZE",
    "chunk_body_size",
    "may_be_chunk",
    "may_hold_chunks",
    "first_chunk_offset",
]

log = logging.getLogger(__name__)

CHUNK_UUID = "__CHUNK_UUID"
CHUNK_ID = "__CHUNK_ID"
CHUNK_TOTAL = "__CHUNK_TOTAL"
CHUNK_SIZE = "__CHUNK_SIZE"
_CHUNK_PROPS = (CHUNK_UUID, CHUNK_ID, CHUNK_TOTAL, CHUNK_SIZE)

#: Room left in each chunk's batch for headers, topic, tags, keys and properties.
CHUNK_HEADROOM = 64 * 1024


def chunk_body_size(max_message_size: int) -> int:
    """Body bytes per chunk for a broker limit of ``max_message_size``."""
    return max(1024, max_message_size - CHUNK_HEADROOM)


def split(msg: Message, uuid: str, chunk_size: int) -> list[Message]:
    """The chunk messages of ``msg`` (body cut into ``chunk_size`` pieces)."""
    body = msg.body
    size = len(body)
    total = max(1, -(-size // chunk_size))
    base = dict(msg.properties or {})
    mv = memoryview(body)
    out = []
    for i in range(total):
        props = dict(base)
        props[CHUNK_UUID] = uuid
        props[CHUNK_ID] = str(i)
        props[CHUNK_TOTAL] = str(total)
        props[CHUNK_SIZE] = str(size)
        out.append(Message(msg.topic, bytes(mv[i * chunk_size : (i + 1) * chunk_size]),
                           tags=msg.tags, keys=msg.keys, properties=props,
                           delay_level=msg.delay_level, deliver_at=msg.deliver_at))
    return out


class _Partial:
    __slots__ = ("parts", "total", "size", "first_offset", "started", "last")

    def __init__(self, total: int, size: int, first_offset: int, now: float) -> None:
        self.parts: list[bytes | None] = [None] * total
        self.total = total
        self.size = size
        self.first_offset = first_offset
        self.started = now
        self.last: MessageExt | None = None


class ChunkAssembler:
    """Reassembles chunked messages of one queue (see the module doc)."""

    def __init__(self, *, expire_s: float = 60.0, max_pending: int = 100,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.expire_s = expire_s
        self.max_pending = max_pending
        self.clock = clock
        self._partial: dict[str, _Partial] = {}
        self.expired = 0
        self.assembled = 0

    def feed(self, msgs: list[MessageExt]) -> list[MessageExt]:
        """``msgs`` with chunks replaced by the whole messages they complete (in the order of
        their last chunks). Plain messages pass untouched; the check costs one dict lookup
        per message only for messages that have properties."""
        now = self.clock()
        if self._partial:
            self._expire(now)
        out: list[MessageExt] | None = None
        for k, m in enumerate(msgs):
            props = m.properties if may_be_chunk(m) else None
            uuid = props.get(CHUNK_UUID) if props else None
            if uuid is None:
                if out is not None:
                    out.append(m)
                continue
            if out is None:
                out = msgs[:k]
            whole = self._add(uuid, props, m, now)  # type: ignore[arg-type]
            if whole is not None:
                out.append(whole)
        return msgs if out is None else out

    def low_water(self) -> int | None:
        """Lowest queue offset of a held chunk (commit no further), or None."""
        if not self._partial:
            return None
        return min(p.first_offset for p in self._partial.values())

    def _add(self, uuid: str, props: dict[str, str], m: MessageExt, now: float
             ) -> MessageExt | None:
        try:
            cid, total, size = int(props[CHUNK_ID]), int(props[CHUNK_TOTAL]), int(
                props[CHUNK_SIZE])
        except (KeyError, ValueError):
            log.warning("message at %s:%d has a malformed chunk header %s; delivered as is",
                        m.message_queue, m.queue_offset, {k: props.get(k) for k in _CHUNK_PROPS})
            return m
        p = self._partial.get(uuid)
        if p is None:
            if cid != 0:
                # Its first chunks expired or were before our start offset: never completable.
                log.warning("chunk %d/%d of %s at %s:%d without its first chunk; dropped", cid,
                            total, uuid, m.message_queue, m.queue_offset)
                return None
            if len(self._partial) >= self.max_pending:
                oldest = min(self._partial, key=lambda u: self._partial[u].started)
                self._drop(oldest, "too many incomplete chunked messages")
            p = self._partial[uuid] = _Partial(total, size, m.queue_offset, now)
        if not 0 <= cid < p.total or p.total != total:
            log.warning("chunk %d/%d of %s does not fit; dropped", cid, total, uuid)
            return None
        p.parts[cid] = m.body
        p.last = m
        if any(part is None for part in p.parts):
            return None
        del self._partial[uuid]
        body = b"".join(p.parts)  # type: ignore[arg-type]
        if len(body) != p.size:
            log.error("chunked message %s reassembled to %d bytes, expected %d; dropped", uuid,
                      len(body), p.size)
            return None
        self.assembled += 1
        return _Assembled(body, m.queue_offset, m.tags, m._b, m._i, p.first_offset)

    def _expire(self, now: float) -> None:
        for uuid in [u for u, p in self._partial.items() if now - p.started > self.expire_s]:
            self._drop(uuid, f"incomplete after {self.expire_s:g} s")

    def _drop(self, uuid: str, why: str) -> None:
        p = self._partial.pop(uuid)
        self.expired += 1
        got = sum(1 for x in p.parts if x is not None)
        log.warning("chunked message %s dropped (%s): %d of %d chunks, first at offset %d",
                    uuid, why, got, p.total, p.first_offset)


def first_chunk_offset(m: MessageExt) -> int | None:
    """Queue offset of the first chunk of a reassembled message; None for any other."""
    return m.first_offset if type(m) is _Assembled else None


async def send_chunks(msg: Message, uuid: str, chunk_size: int, base_seq: int,
                      send_one: Callable[[Message, int], Awaitable[SendResult]]) -> SendResult:
    """The producer's chunker: ``msg`` as single-message batches, in order, chunk ``i`` with
    sequence ``base_seq + i`` (``send_one(chunk, seq)`` sends one to the chosen queue); the
    result of the last chunk (count 1: the consumer sees one message)."""
    result: SendResult | None = None
    for i, part in enumerate(split(msg, uuid, chunk_size)):
        result = await send_one(part, base_seq + i)
    assert result is not None
    return result


def may_be_chunk(m: MessageExt) -> bool:
    """Cheap pre-check: chunks travel as batches of one message that have properties."""
    return m._b.count == 1 and m._b.record(m._i)[4] > 0


def may_hold_chunks(msgs: list[MessageExt]) -> bool:
    """Whether any of ``msgs`` (as a pull decodes them) is a chunk: looked at once per batch
    (messages of one batch are adjacent and share its metadata), since only a batch of one
    message can be a chunk."""
    prev = None
    for m in msgs:
        b = m._b
        if b is prev:
            continue
        prev = b
        if b.count != 1:
            continue
        h = b.h
        if (len(h) > H_REC0_PROPS_LEN and not h[H_KEYS_SIZE] and not h[H_IDX0_REL]
                and not h[H_ATTRIBUTES] & ATTR_COMPRESSION_MASK):
            # the record header the decoder read with the batch's (batch.layout.heads_struct:
            # valid for one uncompressed message without keys), not read again: at 10,000
            # queues every message of a pull is such a batch (issue 17)
            props_len = h[H_REC0_PROPS_LEN]
        else:
            props_len = b.record(m._i)[4]
        if props_len > 0 and CHUNK_UUID in m.properties:
            return True
    return False


class _Assembled(MessageExt, array_like=True, gc=False):
    """A reassembled chunked message: the user's properties, without the chunk bookkeeping;
    its queue offset is its last chunk's, ``first_offset`` its first chunk's."""

    first_offset: int = -1

    @property
    def properties(self) -> dict[str, str]:
        props: dict[str, str] = MessageExt.properties.fget(self)  # type: ignore[attr-defined]
        for k in _CHUNK_PROPS:
            props.pop(k, None)
        return props
