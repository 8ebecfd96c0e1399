"""The shared consume-queue index log (store/index_log.py): golden block bytes, a property test
against a plain model (appends, re-dispatch, truncation, flushes, reopen, deletion), a cut at
every byte of the last block, damage below the checkpoint, retention of old files, and the
older per-queue layout copied in by the store."""

from __future__ import annotations

import os
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidemq.protocol.record import INDEX_ENTRY, crc32c
from tidemq.store import index_log
from tidemq.store.consume_queue import ConsumeQueue
from tidemq.store.index_log import BLOCK_HEADER, BLOCK_MAGIC, UNIT, IndexLog

from .helpers import batch, open_store, read_all


def _idx(tags: list[int]) -> bytes:
    return b"".join(INDEX_ENTRY.pack(t, 0) for t in tags)


def _units(q, lo: int | None = None) -> list[tuple[int, int, int]]:
    out = []
    off = q.min_offset if lo is None else lo
    while off < q.max_offset:
        u = q.units(off, 7)
        assert len(u), (q, off)
        assert q.unit_bytes(off, 7) == u.tobytes()  # the same units, as stored bytes
        out += [(int(r["phys"]), int(r["size"]), int(r["tag"])) for r in u]
        off += len(u)
    return out


def test_golden_block_bytes(tmp_path):
    lg = IndexLog(tmp_path / "cqlog")
    lg.load()
    q = lg.get_or_create("T", 3)
    q.append_one(0, 100, 50, 7)
    lg.flush()
    raw = (tmp_path / "cqlog" / f"{0:020d}").read_bytes()
    entry = struct.pack("<IiQ", 0, 1, 0)
    unit = struct.pack("<QIQ", 100, 50, 7)
    body = entry + unit
    head = struct.pack("<IIIIq", BLOCK_MAGIC, crc32c(body), len(body), 1, 150)
    assert raw == head + body
    assert BLOCK_HEADER.size == 24 and raw[:4] == b"TQIX"
    rec = struct.pack("<IIH", 0, 3, 1) + b"T"
    assert (tmp_path / "cqlog" / "names").read_bytes() == struct.pack("<I", crc32c(rec)) + rec
    lg.close_all()


# -- property test against a model ----------------------------------------------------------

_ops = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(0, 3), st.integers(1, 4)),
        st.tuples(st.just("truncate"), st.integers(0, 60)),
        st.tuples(st.just("flush")),
        st.tuples(st.just("reopen")),
        st.tuples(st.just("destroy"), st.integers(0, 3)),
        st.tuples(st.just("start"), st.integers(0, 3), st.integers(1, 9)),
    ),
    max_size=40,
)


# block_queues=1: a flush writes a block per changed queue, taking the lock per block (as a
# flush of more than BLOCK_QUEUES changed queues does)
@pytest.mark.parametrize("block_queues", [index_log.BLOCK_QUEUES, 1])
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_ops)
def test_log_matches_a_model(tmp_path_factory, monkeypatch, block_queues, ops):
    monkeypatch.setattr(index_log, "BLOCK_QUEUES", block_queues)
    root = tmp_path_factory.mktemp("log") / "cqlog"
    lg = IndexLog(root, segment_bytes=256)  # tiny files: blocks roll often
    lg.load()
    model: dict[int, tuple[int, list[tuple[int, int, int]]]] = {}  # queue -> (start, units)
    phys = 0
    flushed_model = None

    def check() -> None:
        for qi in range(4):
            q = lg.find("t", qi)
            start, units = model.get(qi, (0, []))
            if q is None:
                assert not units and not start
                continue
            assert q.max_offset == start + len(units)
            assert _units(q, start) == units

    for op in ops:
        if op[0] == "append":
            _, qi, n = op
            start, units = model.get(qi, (0, []))
            q = lg.get_or_create("t", qi)
            tags = [phys + k for k in range(n)]
            size = 10 + n
            if n == 1:
                q.append_one(start + len(units), phys, size, tags[0])
            else:
                q.append_batch(start + len(units), phys, size, _idx(tags))
            model[qi] = (start, units + [(phys, size, t) for t in tags])
            phys += size
        elif op[0] == "truncate":
            cut_phys = op[1] * 5
            for qi in range(4):
                q = lg.find("t", qi)
                if q is not None:
                    q.truncate_dirty(cut_phys)
                start, units = model.get(qi, (0, []))
                model[qi] = (start, [u for u in units if u[0] < cut_phys])
            phys = max([u[0] + u[1] for _, us in model.values() for u in us] + [0])
        elif op[0] == "flush":
            lg.flush()
            flushed_model = {k: (s, list(u)) for k, (s, u) in model.items()}
        elif op[0] == "reopen":
            lg.close_all()
            lg = IndexLog(root, segment_bytes=256)
            lg.load()
            # close_all flushed: nothing was lost
            flushed_model = {k: (s, list(u)) for k, (s, u) in model.items()}
        elif op[0] == "destroy":
            lg.destroy_queue("t", op[1])
            model.pop(op[1], None)
        elif op[0] == "start":
            _, qi, at = op
            start, units = model.get(qi, (0, []))
            q = lg.get_or_create("t", qi)
            if not units and not start:
                q.start_at(at)
                model[qi] = (at, [])
        check()
    # a crash now (no close): what was flushed is back
    lg.flush()
    flushed_model = model
    again = IndexLog(root, segment_bytes=256)
    again.load()
    lg = again
    model = flushed_model
    check()
    lg.close_all()


def _run_ops(root, ops):
    """The model test's operations on one log, then a crash (flush, no close) and a reload;
    returns the reloaded log (each case below is a minimal failing example hypothesis found)."""
    lg = IndexLog(root, segment_bytes=256)
    lg.load()
    phys = 0
    for op in ops:
        if op[0] == "append":
            q = lg.get_or_create("t", op[1])
            q.append_one(q.max_offset, phys, 11, phys)
            phys += 11
        elif op[0] == "truncate":
            for q in lg.all():
                q.truncate_dirty(op[1])
            phys = max([q.max_phys_offset for q in lg.all()] + [0])
        elif op[0] == "flush":
            lg.flush()
        elif op[0] == "reopen":
            lg.close_all()
            lg = IndexLog(root, segment_bytes=256)
            lg.load()
        elif op[0] == "start":
            lg.get_or_create("t", op[1]).start_at(op[2])
    lg.flush()
    again = IndexLog(root, segment_bytes=256)
    again.load()
    assert again.load_problem is None, again.load_problem
    return lg, again


def test_a_cut_to_zero_then_a_later_start_is_replayed(tmp_path):
    # the cut to 0 was not logged: the start at 2 then looked like a jump over unit 0
    lg, again = _run_ops(tmp_path / "cqlog", [
        ("append", 0), ("flush",), ("truncate", 0), ("start", 0, 2)])
    q = again.find("t", 0)
    assert (q.min_offset, q.max_offset) == (2, 2) and not _units(q)
    lg.close_all()
    again.close_all()


def test_a_cut_to_zero_then_a_start_at_the_old_end_survives_reopen(tmp_path):
    # the start at 1 equals the old end: without the cut, unit 0 came back on reopen
    lg, again = _run_ops(tmp_path / "cqlog", [
        ("append", 0), ("flush",), ("truncate", 0), ("start", 0, 1), ("reopen",),
        ("append", 0)])
    q = again.find("t", 0)
    assert (q.min_offset, q.max_offset) == (1, 2)
    assert _units(q) == [(0, 11, 0)]
    lg.close_all()
    again.close_all()


def test_a_queue_cut_empty_before_its_first_block_is_named_later(tmp_path):
    # queue 1's units were all cut while pending: the block then did not name it, yet it was
    # marked named, so its later block referred to an id the names file does not hold
    lg, again = _run_ops(tmp_path / "cqlog", [
        ("append", 1), ("truncate", 0), ("append", 0), ("flush",), ("append", 1)])
    assert _units(again.find("t", 1)) == [(11, 11, 11)]
    assert _units(again.find("t", 0)) == [(0, 11, 0)]
    lg.close_all()
    again.close_all()


def test_other_queues_of_such_a_block_keep_their_units(tmp_path):
    lg, again = _run_ops(tmp_path / "cqlog", [
        ("append", 1), ("truncate", 0), ("append", 0), ("flush",), ("append", 0),
        ("append", 1)])
    assert _units(again.find("t", 0)) == [(0, 11, 0), (11, 11, 11)]
    assert _units(again.find("t", 1)) == [(22, 11, 22)]
    lg.close_all()
    again.close_all()


def test_a_block_that_does_not_apply_changes_no_queue(tmp_path):
    # a valid block naming an unknown id: a problem (the store rebuilds), and the queues stay
    # as the blocks before it left them (not half applied, no run pointing past the log end)
    root = tmp_path / "cqlog"
    lg = IndexLog(root)
    lg.load()
    lg.get_or_create("a", 0).append_one(0, 0, 10, 1)
    end = lg.flush()
    lg.close_all()
    entries = struct.pack("<IiQ", 0, 1, 1) + struct.pack("<IiQ", 7, 1, 0)
    body = entries + UNIT.pack(10, 10, 2) + UNIT.pack(20, 10, 3)
    head = struct.pack("<IIIIq", BLOCK_MAGIC, crc32c(body), len(body), 2, 30)
    with open(root / f"{0:020d}", "ab") as f:
        f.write(head + body)
    lg = IndexLog(root)
    lg.load(trusted_end=end)
    assert lg.load_problem and "unknown or deleted queue id 7" in lg.load_problem
    q = lg.find("a", 0)
    assert q.max_offset == 1 and _units(q) == [(0, 10, 1)]
    lg.close_all()


def test_a_start_logged_above_units_by_an_older_writer_replays_as_a_start(tmp_path):
    # the writer before the fix logged "cut to 0, start at 2" as a lone end entry at 2
    root = tmp_path / "cqlog"
    lg = IndexLog(root)
    lg.load()
    lg.get_or_create("a", 0).append_one(0, 0, 10, 1)
    lg.flush()
    lg.close_all()
    body = struct.pack("<IiQ", 0, 0, 2)
    head = struct.pack("<IIIIq", BLOCK_MAGIC, crc32c(body), len(body), 1, -1)
    with open(root / f"{0:020d}", "ab") as f:
        f.write(head + body)
    lg = IndexLog(root)
    lg.load()
    assert lg.load_problem is None
    q = lg.find("a", 0)
    assert (q.min_offset, q.max_offset) == (2, 2) and not _units(q)
    lg.close_all()


# -- torn tails and damage ---------------------------------------------------------------------


def test_cut_at_every_byte_of_the_last_block(tmp_path):
    root = tmp_path / "cqlog"
    lg = IndexLog(root)
    lg.load()
    a, b = lg.get_or_create("a", 0), lg.get_or_create("b", 1)
    a.append_batch(0, 0, 30, _idx([1, 2, 3]))
    b.append_one(0, 30, 10, 9)
    first_end = lg.flush()
    a.append_one(3, 40, 10, 4)
    b.append_batch(1, 50, 20, _idx([5, 6]))
    lg.get_or_create("c", 2).append_one(0, 70, 5, 0)
    end = lg.flush()
    lg.close_all()
    path = root / f"{0:020d}"
    full = path.read_bytes()
    assert len(full) == end
    for cut in range(first_end, end):
        path.write_bytes(full[:cut])
        lg = IndexLog(root)
        lg.load(trusted_end=first_end)
        assert lg.load_problem is None
        assert os.path.getsize(path) == first_end  # the torn block is cut off
        assert _units(lg.find("a", 0)) == [(0, 30, 1), (0, 30, 2), (0, 30, 3)]
        assert _units(lg.find("b", 1)) == [(30, 10, 9)]
        assert lg.find("c", 2) is None
        # and the log goes on from there
        lg.find("a", 0).append_one(3, 40, 10, 4)
        assert lg.flush() > first_end
        lg.close_all()
    path.write_bytes(full)
    lg = IndexLog(root)
    lg.load(trusted_end=end)
    assert _units(lg.find("b", 1)) == [(30, 10, 9), (50, 20, 5), (50, 20, 6)]
    lg.close_all()


def test_damage_below_the_checkpoint_is_a_problem(tmp_path):
    root = tmp_path / "cqlog"
    lg = IndexLog(root)
    lg.load()
    lg.get_or_create("a", 0).append_batch(0, 0, 30, _idx([1, 2, 3]))
    end = lg.flush()
    lg.close_all()
    path = root / f"{0:020d}"
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))
    lg = IndexLog(root)
    lg.load(trusted_end=end)
    assert lg.load_problem and "damaged block" in lg.load_problem
    assert lg.validate_all(100)


def test_truncation_and_deletion_survive_reopen(tmp_path):
    root = tmp_path / "cqlog"
    lg = IndexLog(root)
    lg.load()
    q = lg.get_or_create("a", 0)
    for i in range(10):
        q.append_one(i, i * 10, 10, i)
    lg.get_or_create("gone", 0).append_one(0, 100, 10, 0)
    lg.flush()
    q.truncate_dirty(50)  # flushed units cut: must be logged
    lg.delete_topic("gone")
    lg.close_all()
    lg = IndexLog(root)
    lg.load()
    assert lg.find("a", 0).max_offset == 5
    assert lg.find("gone", 0) is None
    q = lg.find("a", 0)
    q.append_one(5, 500, 10, 55)  # the CommitLog tail was rewritten
    lg.close_all()
    lg = IndexLog(root)
    lg.load()
    assert [u[0] for u in _units(lg.find("a", 0))] == [0, 10, 20, 30, 40, 500]
    lg.close_all()


def test_retention_deletes_old_files_and_keeps_queue_ends(tmp_path):
    root = tmp_path / "cqlog"
    lg = IndexLog(root, segment_bytes=200)
    lg.load()
    idle, busy = lg.get_or_create("idle", 0), lg.get_or_create("busy", 0)
    idle.append_one(0, 0, 10, 0)
    idle.append_one(1, 10, 10, 0)
    lg.flush()
    for i in range(40):
        busy.append_one(i, 20 + i * 10, 10, 0)
        lg.flush()
    files = len(lg.files())
    assert files > 3
    deleted = lg.delete_expired(200)
    assert deleted >= 1 and len(lg.files()) == files - deleted
    for q in lg.all():
        q.correct_min_offset(200)
    assert idle.min_offset == idle.max_offset == 2
    assert busy.get(busy.min_offset)[0] >= 200
    lg.close_all()
    lg = IndexLog(root, segment_bytes=200)
    lg.load()
    assert lg.find("idle", 0).max_offset == 2  # the end of an idle queue is remembered
    assert lg.find("busy", 0).max_offset == 40
    lg.close_all()


# -- in the store -------------------------------------------------------------------------------


def test_store_copies_the_older_layout(tmp_path):
    d = tmp_path / "s"
    with open_store(d) as s:
        for i in range(30):
            s.put(batch("t", [f"v{i}".encode()] * 2, queue_id=i % 3))
    # rebuild the older layout by hand from the log, then make it look like an old store
    lg = IndexLog(d / "cqlog")
    lg.load()
    for q in lg.all():
        old = ConsumeQueue(d / "consumequeue", q.topic, q.queue_id, units_per_file=8)
        units = _units(q)
        off = 0
        while off < len(units):  # one append per batch (its units share phys and size)
            phys, size, _ = units[off]
            n = 1
            while off + n < len(units) and units[off + n][0] == phys:
                n += 1
            old.append_batch(off, phys, size, _idx([u[2] for u in units[off : off + n]]))
            off += n
        old.close()
    lg.close_all()
    cp_path = d / "checkpoint"
    import msgspec

    cp = msgspec.json.decode(cp_path.read_bytes())
    cp.update(version=1, queues={f"t\u0000{q}": 20 for q in range(3)})
    cp.pop("index_log_end")
    cp_path.write_bytes(msgspec.json.encode(cp))
    import shutil

    shutil.rmtree(d / "cqlog")
    with open_store(d, cq_units_per_file=8) as s:
        assert not s.recovery_report.rebuilt_indexes, s.recovery_report.summary()
        assert not (d / "consumequeue").exists()
        for q in range(3):
            msgs, _ = read_all(s, "t", q)
            assert [m.body for m in msgs] == [
                f"v{i}".encode() for i in range(q, 30, 3) for _ in range(2)]
    with open_store(d) as s:
        assert len(read_all(s, "t", 2)[0]) == 20


def test_unit_struct_matches_consume_queue():
    from tidemq.store import consume_queue

    assert UNIT.format == consume_queue.UNIT.format
