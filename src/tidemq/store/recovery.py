"""Recovery (ref ST6): walk the CommitLog from a trusted point, check every batch, find the end.

The CommitLog is the only source of truth. ``scan`` walks batches from ``start`` (a batch
boundary: the checkpoint's ``dispatched`` offset, or the CommitLog's first offset when indexes are
rebuilt), verifies each batch's framing and both CRC32Cs, hands every good batch to ``dispatch``
and returns where valid data ends. How a bad batch is treated depends on where it lies:

- followed by valid data (found by the batch's own size when its framing is intact, else by
  searching for the next batch magic whose CRCs check, else at the next segment): damage in the
  middle of the log, e.g. a bit flip. The batch is quarantined and reported (file, position,
  reason), never served, and the scan resumes after it. Nothing after it is lost.
- CRC-valid but undecodable by the dispatch (its topic is not UTF-8): quarantined the same
  way, so a restart never fails because of what a batch holds. (Keys that are not UTF-8 are
  only left out of the key index: see ``MessageStore._decodable_key_hashes``.)
- with nothing valid after it: a torn tail (a write cut short by a crash). The log ends there;
  the caller truncates from that position and reports file, position and bytes dropped. When the
  batch lay below ``durable_end`` (it had been fsynced, so the damage came later) the report
  says so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tidemq.protocol.errors import CorruptBatchError
from tidemq.protocol.record import BATCH_MAGIC, FILLER_MAGIC, TOTAL_SIZE_MAGIC, BatchView
from tidemq.store.commit_log import CommitLog
from tidemq.store.segment import Segment

log = logging.getLogger(__name__)

_MAGIC_BYTES = BATCH_MAGIC.to_bytes(2, "little")


@dataclass
class Quarantined:
    file: str
    position: int  # byte position within the file
    phys_offset: int
    size: int
    reason: str


@dataclass
class RecoveryReport:
    clean_shutdown: bool = True
    scanned_from: int = 0
    end_offset: int = 0
    batches_dispatched: int = 0
    rebuilt_indexes: bool = False
    truncated: list[tuple[str, int, int]] = field(default_factory=list)  # file, position, bytes
    quarantined: list[Quarantined] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        parts = [
            "clean shutdown" if self.clean_shutdown else "recovered after a crash",
            f"scanned from {self.scanned_from} to {self.end_offset}",
            f"{self.batches_dispatched} batches re-dispatched",
        ]
        if self.rebuilt_indexes:
            parts.append("indexes rebuilt from the CommitLog")
        parts += [f"truncated {n} bytes of {f} at position {p}" for f, p, n in self.truncated]
        parts += [
            f"quarantined {q.file} position {q.position}: {q.reason}" for q in self.quarantined
        ]
        parts += self.problems
        return "; ".join(parts) + f" ({self.seconds:.3f} s)"


Dispatch = Callable[[BatchView, int], None]


def _valid_at(mv: memoryview, rel: int, phys: int) -> BatchView | None:
    """The batch at ``rel`` if both CRCs check and the store stamped it at ``phys``.

    Why the stamp: ``put`` copies the producer's batch into the mapping, then stamps its store
    fields (phys and queue offset, timestamp) and reseals the header CRC. The producer's
    batch is itself CRC-valid (store fields zero, header sealed by the encoder), so a kill -9
    between the copy and the stamp left a batch that passed both CRCs with queue offset 0;
    recovery then re-dispatched it at offset 0, cutting its queue back to nothing, and new puts
    re-used acknowledged offsets. A batch whose stored phys offset is not where it lies was
    never stamped (or is not where the store wrote it): never valid data."""
    try:
        v = BatchView(mv, rel)
        v.verify()
    except CorruptBatchError:
        return None
    return v if v.phys_offset == phys else None


def _resync(seg: Segment, mv: memoryview, rel: int) -> int | None:
    """Relative position of the next valid batch after ``rel`` in ``seg``, if any."""
    mm = seg.mm
    at = rel + 1
    while True:
        hit = mm.find(_MAGIC_BYTES, at + 4)
        if hit < 0:
            return None
        cand = hit - 4
        if _valid_at(mv, cand, seg.start + cand) is not None:
            return cand
        at = cand + 1


def scan(
    cl: CommitLog, start: int, durable_end: int, dispatch: Dispatch, report: RecoveryReport
) -> int:
    """Walk from ``start``; dispatch good batches; quarantine or stop at bad ones. Returns end."""
    pos = start
    while True:
        try:
            seg = cl.segment_for(pos)
        except Exception:
            break
        mv = memoryview(seg.mm)
        rel = pos - seg.start
        total, magic = TOTAL_SIZE_MAGIC.unpack_from(seg.mm, rel)
        if magic == FILLER_MAGIC and total == seg.size - rel:
            if seg is cl.segments[-1]:
                pos = seg.end
                break
            pos = seg.end
            continue
        if total == 0 and magic == 0 and (pos >= durable_end or not _nonzero(seg, rel)):
            break  # the end of written data
        v = _valid_at(mv, rel, pos) if magic == BATCH_MAGIC else None
        if v is not None:
            try:
                dispatch(v, pos)
            except CorruptBatchError as exc:
                # CRC-valid but undecodable (a topic that is not UTF-8: stored by a bug or an
                # older version): never a reason not to start. Quarantined like a damaged
                # batch, never served; everything after it is kept.
                reason = f"undecodable batch: {exc.message}"
                report.quarantined.append(
                    Quarantined(str(seg.path), rel, pos, v.total_size, reason))
                log.error("corrupt batch in %s at position %d (%s); quarantined", seg.path, rel,
                          reason)
                pos += v.total_size
                continue
            report.batches_dispatched += 1
            pos += v.total_size
            continue
        reason = _describe(mv, rel, pos)
        # Is valid data further on? Then this is damage in the middle of the log, not a torn
        # tail: quarantine it and keep everything after it.
        nxt = None
        if magic == BATCH_MAGIC and 0 < total <= seg.size - rel:
            after = rel + total
            if (after == seg.size or _valid_at(mv, after, seg.start + after) is not None
                    or _is_filler(seg, after)):
                nxt = after
        if nxt is None:
            nxt = _resync(seg, mv, rel)
        if nxt is None and seg is not cl.segments[-1] and _has_data(cl, seg.end):
            nxt = seg.size  # the rest of this segment is lost; the next one has data
        if nxt is None:
            if pos < durable_end:
                reason += " (in data that had been fsynced: damaged afterwards)"
            log.error(
                "CommitLog ends in a damaged batch in %s at position %d (%s)", seg.path, rel, reason
            )
            break  # the tail is torn: the caller truncates and reports it
        report.quarantined.append(Quarantined(str(seg.path), rel, pos, nxt - rel, reason))
        log.error("corrupt batch in %s at position %d (%s); quarantined", seg.path, rel, reason)
        pos = seg.start + nxt
    report.end_offset = pos
    return pos


def _has_data(cl: CommitLog, pos: int) -> bool:
    try:
        seg = cl.segment_for(pos)
    except Exception:
        return False
    return _valid_at(memoryview(seg.mm), pos - seg.start, pos) is not None


def _is_filler(seg: Segment, rel: int) -> bool:
    if rel + 6 > seg.size:
        return False
    total: int
    magic: int
    total, magic = TOTAL_SIZE_MAGIC.unpack_from(seg.mm, rel)
    return magic == FILLER_MAGIC and total == seg.size - rel


def _nonzero(seg: Segment, rel: int) -> bool:
    return bool(np.frombuffer(seg.mm, dtype=np.uint8, offset=rel).any())


def _describe(mv: memoryview, rel: int, phys: int) -> str:
    try:
        v = BatchView(mv, rel)
    except CorruptBatchError as exc:
        return exc.message
    if not v.batch_crc_ok():
        return "batch CRC32C mismatch"
    if not v.store_crc_ok():
        return "store header CRC32C mismatch"
    if v.phys_offset != phys:
        return (f"batch not stamped by the store (its header says phys offset {v.phys_offset}, "
                "a write cut short between copy and stamp)")
    return "unknown damage"
