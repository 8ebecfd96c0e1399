"""Durable POP state: pop and ack records through the CommitLog (docs/pop-dispatch.md).

Every change of a pop window (``pop_window.py``) -- the deliveries a pop handed out, the acks of
an ACK_MESSAGE frame, a new invisible time -- is appended as one single-message batch to the
system topic ``rmq_sys_POP_LOG`` (queue 0) before the answer leaves, through the ordinary
store: flushed with the flush mode, recovered by the store's recovery, replicated as any topic.
The body is one MessagePack array (msgspec)::

    [group, topic, queue id, [[offset, attempt, pop time ms, invisible ms], ...],   # deliveries
                             [[offset, pop time ms], ...]]                            # acks
    [group, topic, queue id, [], [], offset]                 # a seek (or an offset reset)

A seek record replaces the queue's window by an empty one starting at ``offset``, as the seek
did (``SubscriptionTypes.move``): records after it apply to the new window.

On start the broker replays the topic in order into fresh windows whose ``start`` is the
group's committed offset (every offset below it is acked), else the first offset the log names
for that queue. So after a kill -9: an acked message is never delivered again (its ack record
was written before the ack was answered -- a machine crash can lose at most the records of one
flush interval, whose acks then count as not given), an in-flight one stays invisible until its
deadline and comes back with attempt + 1, and nothing is lost (a window's ``start`` moves only
over acked offsets).

Snapshots bound the replay: every ``interval`` the windows are copied with the log's end
offset and, once the CommitLog is flushed past what that copy covers, written atomically to
``<config>/pop_windows.snapshot``; a start loads the snapshot and replays only the records
after it (``PopSnapshots``).

Threads: the broker's event loop only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from tidemq.base.atomic_file import write_atomic
from tidemq.protocol.errors import TidemqError
from tidemq.protocol.record import BatchView, MessageData, encode_batch
from tidemq.store.message_store import GetStatus

if TYPE_CHECKING:
    from tidemq.broker.pop_window import Popped, PopWindow
    from tidemq.store.message_store import MessageStore

__all__ = ["POP_LOG_TOPIC", "PopLog", "PopSnapshots"]

log = logging.getLogger(__name__)

POP_LOG_TOPIC = "rmq_sys_POP_LOG"

_Record = tuple[str, str, int, list[tuple[int, int, int, int]], list[tuple[int, int]]]
_Seek = tuple[str, str, int, list[Any], list[Any], int]
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Record)
_seek_decoder = msgspec.msgpack.Decoder(_Seek)


class PopLog:
    """Append and replay ``rmq_sys_POP_LOG`` (event loop only)."""

    def __init__(self, store: MessageStore) -> None:
        self.store = store
        self.appended = 0
        self.replayed = 0
        self.skipped = 0
        self.replayed_to = 0  # the log offset the last replay reached

    def append(self, group: str, topic: str, qid: int, pops: list[Popped],
               acks: list[tuple[int, int]]) -> None:
        if not pops and not acks:
            return
        body = _encoder.encode((group, topic, qid,
                                [(p.offset, p.attempt, p.pop_time, p.invisible_ms)
                                 for p in pops], acks))
        self.store.put(encode_batch(POP_LOG_TOPIC, [MessageData(body)]), queue_id=0)
        self.appended += 1

    def seek(self, group: str, topic: str, qid: int, offset: int) -> None:
        """The group's window of the queue starts over at ``offset`` (before the answer)."""
        body = _encoder.encode((group, topic, qid, [], [], offset))
        self.store.put(encode_batch(POP_LOG_TOPIC, [MessageData(body)]), queue_id=0)
        self.appended += 1

    def replay(self, window_for: Callable[..., Any], start: int = 0,
               seek: Callable[[str, str, int, int], None] | None = None) -> int:
        """Apply every record from log offset ``start`` on, in order;
        ``window_for(group, topic, qid, first_offset)`` gives the window to apply it to,
        ``seek(group, topic, qid, offset)`` replaces it (a seek record).
        Returns the records applied."""
        store = self.store
        off = max(start, store.min_offset(POP_LOG_TOPIC, 0))
        end = store.max_offset(POP_LOG_TOPIC, 0)
        n = 0
        while off < end:
            r = store.get_messages(POP_LOG_TOPIC, 0, off, 256)
            if r.status is not GetStatus.FOUND:
                if r.next_begin_offset > off:
                    off = r.next_begin_offset
                    continue
                break
            for rb in r.batches:
                off = rb.queue_offset + rb.count
                try:
                    for m in BatchView(rb.data).messages(rb.first_index):
                        try:
                            group, topic, qid, pops, acks = _decoder.decode(m.body)
                        except msgspec.ValidationError:  # not pops and acks: a seek?
                            g, t, q, _p, _a, to = _seek_decoder.decode(m.body)
                            if seek is not None:
                                seek(g, t, q, to)
                            n += 1
                            continue
                        first = pops[0][0] if pops else (acks[0][0] if acks else 0)
                        w: PopWindow = window_for(group, topic, qid, first)
                        for o, attempt, pop_time, inv in pops:
                            w.restore(o, attempt, pop_time, inv)
                        for o, pop_time in acks:
                            w.ack(o, pop_time)
                        n += 1
                except (TidemqError, msgspec.DecodeError, ValueError) as exc:
                    self.skipped += 1
                    log.warning("%s record at offset %d skipped: %s", POP_LOG_TOPIC,
                                rb.queue_offset, exc)
        self.replayed += n
        self.replayed_to = max(off, start)
        return n


_snap_encoder = msgspec.msgpack.Encoder()
_snap_decoder = msgspec.msgpack.Decoder()


class PopSnapshots:
    """Snapshots of the pop windows (see the module doc). Event loop only."""

    def __init__(self, path: str, store: MessageStore) -> None:
        self.path = path
        self.store = store
        self._pending: tuple[int, bytes] | None = None  # (phys offset it needs flushed, bytes)
        self._written_offset = -1  # offset covered by the snapshot last written
        self.written = 0

    def take(self, windows: dict[Any, Any], log_offset: int) -> tuple[int, bytes]:
        """The windows now, with the log offset replay continues from (every record below
        ``log_offset`` is in them)."""
        data = _snap_encoder.encode({
            "log": log_offset,
            "windows": [[g, t, q, w.to_state()] for (g, t, q), w in windows.items()],
        })
        return self.store.max_phys_offset, data

    def load(self) -> tuple[int, list[Any]] | None:
        """(log offset, [[group, topic, queue, state], ...]) of the last snapshot, or None."""
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        try:
            d = _snap_decoder.decode(raw)
            return int(d["log"]), list(d["windows"])
        except (msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
            log.warning("POP snapshot %s does not decode (%s): replaying the whole log",
                        self.path, exc)
            return None

    async def run(self, windows_of: Callable[[], tuple[Any, int]], interval_s: float) -> None:
        """Every ``interval_s``: write the previous copy if the CommitLog is durable past what
        it covers, then take a new one (a copy never claims more than the log holds).
        ``windows_of()``: (the windows, the log offset they cover)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                pending = self._pending
                if pending is not None and self.store.flushed_phys_offset >= pending[0]:
                    self._pending = None
                    # Nothing logged since the snapshot on disk (it covers this offset, the
                    # replay from it gives the same windows): an idle broker writes nothing.
                    if pending[0] != self._written_offset:
                        self._written_offset = -1
                        await asyncio.to_thread(write_atomic, self.path, pending[1])
                        self._written_offset = pending[0]
                        self.written += 1
                if self._pending is None:
                    self._pending = self.take(*windows_of())
            except OSError as exc:
                log.error("writing the POP snapshot %s failed: %s", self.path, exc)
