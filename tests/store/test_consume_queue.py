"""ConsumeQueue (ref ST3, ST9): model-based state machine, golden bytes, faults, threads."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tidemq.protocol.errors import StoreClosedError, StoreError
from tidemq.protocol.record import INDEX_ENTRY
from tidemq.store.consume_queue import (
    UNIT,
    UNIT_DTYPE,
    UNIT_SIZE,
    ConsumeQueue,
    ConsumeQueueTable,
)

UPF = 7  # units per file: small, so batches cross file boundaries all the time


def index_of(tags: list[int]) -> bytes:
    """A batch's message index (tag_hash u64, rel_offset u32) for these tags."""
    return b"".join(INDEX_ENTRY.pack(t, 40 * i) for i, t in enumerate(tags))


def qdir(root: str, topic: str = "T", qid: int = 3) -> str:
    return os.path.join(root, topic, str(qid))


def fill(cq: ConsumeQueue, batches: list[tuple[int, int]], phys: int = 0) -> int:
    """Append batches given as (count, size); returns the CommitLog end."""
    for count, size in batches:
        cq.append_batch(cq.max_offset, phys, size, index_of(list(range(1, count + 1))))
        phys += size
    return phys


# -- state machine -------------------------------------------------------------------------


class ConsumeQueueMachine(RuleBasedStateMachine):
    """The queue against a plain list: ``units[i]`` is unit i; units below ``first`` (the
    first file's start) were deleted by retention and are no longer readable."""

    @initialize()
    def setup(self) -> None:
        self.tmp = tempfile.mkdtemp(prefix="cq-sm-")
        self.cq = ConsumeQueue(self.tmp, "T", 3, units_per_file=UPF)
        self.units: list[tuple[int, int, int]] = []
        self.batches: list[tuple[int, int, int, list[int]]] = []  # offset, phys, size, tags
        self.first = 0
        self.min = 0
        self.next_phys = 0  # the CommitLog's end
        self.min_phys = 0  # the CommitLog's min (retention only moves it forward)
        self.ts: dict[int, int] = {}
        self.last_ts = 1_000

    def teardown(self) -> None:
        if hasattr(self, "cq"):
            self.cq.close()
            shutil.rmtree(self.tmp, ignore_errors=True)

    # model helpers
    @property
    def max(self) -> int:
        return len(self.units)

    def model_max_phys(self) -> int:
        if self.max > self.first:
            phys, size, _ = self.units[-1]
            return phys + size
        return -1

    def model_correct_min(self) -> None:
        self.min = next(
            (i for i in range(self.first, self.max) if self.units[i][0] >= self.min_phys),
            self.max,
        )

    # rules
    @rule(
        tags=st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=50),
        gap=st.integers(0, 64),
        size=st.integers(1, 5000),
        dts=st.integers(0, 3),
    )
    def append(self, tags: list[int], gap: int, size: int, dts: int) -> None:
        phys = self.next_phys + gap
        self.cq.append_batch(self.max, phys, size, index_of(tags))
        self.batches.append((self.max, phys, size, tags))
        self.units += [(phys, size, t) for t in tags]
        self.next_phys = phys + size
        self.last_ts += dts
        self.ts[phys] = self.last_ts

    @precondition(lambda self: self.batches)
    @rule(data=st.data())
    def redispatch(self, data: st.DataObject) -> None:
        live = [b for b in self.batches if b[0] + len(b[3]) > self.first]
        if not live:
            return
        offset, phys, size, tags = data.draw(st.sampled_from(live))
        self.cq.append_batch(offset, phys, size, index_of(tags))  # idempotent: model unchanged

    @rule(extra=st.integers(1, 5))
    def gap_is_refused(self, extra: int) -> None:
        with pytest.raises(StoreError, match="gap"):
            self.cq.append_batch(self.max + extra, self.next_phys, 10, index_of([1]))

    @rule(data=st.data())
    def get(self, data: st.DataObject) -> None:
        offset = data.draw(st.integers(-2, self.max + 2))
        want = self.units[offset] if self.min <= offset < self.max else None
        assert self.cq.get(offset) == want

    @rule(data=st.data(), max_count=st.integers(0, 20))
    def units_view(self, data: st.DataObject, max_count: int) -> None:
        offset = data.draw(st.integers(max(self.min - 2, 0), self.max + 2))
        arr = self.cq.units(offset, max_count)
        assert arr.dtype == UNIT_DTYPE
        if offset < self.min or offset >= self.max:
            assert len(arr) == 0
            return
        file_end = (offset // UPF + 1) * UPF
        assert len(arr) == min(max_count, self.max - offset, file_end - offset)
        assert [tuple(int(x) for x in u) for u in arr] == self.units[offset : offset + len(arr)]

    @rule()
    def reopen(self) -> None:
        self.cq.close()
        self.cq = ConsumeQueue(self.tmp, "T", 3, units_per_file=UPF)
        self.min = self.first  # min_offset is not stored; the store corrects it after load

    @rule()
    def flush(self) -> None:
        self.cq.flush()

    @precondition(lambda self: self.batches)
    @rule(data=st.data())
    def truncate_dirty(self, data: st.DataObject) -> None:
        # The CommitLog's recovered end is a batch boundary: some batch's start, or its end.
        starts = [b[1] for b in self.batches if b[1] >= self.min_phys]  # never below retention
        cut_phys = data.draw(st.sampled_from([*starts, self.next_phys]))
        self.cq.truncate_dirty(cut_phys)
        cut = next((i for i, u in enumerate(self.units) if u[0] >= cut_phys), self.max)
        cut = max(cut, self.first)
        del self.units[cut:]
        self.batches = [b for b in self.batches if b[1] < cut_phys]
        self.min = min(self.min, cut)
        self.next_phys = cut_phys

    def draw_min_phys(self, data: st.DataObject) -> int:
        # Retention only moves forward; hitting a batch start exactly is the edge that matters.
        starts = [b[1] for b in self.batches if b[1] >= self.min_phys]
        exact = st.sampled_from(starts) if starts else st.nothing()
        return data.draw(exact | st.integers(self.min_phys, self.next_phys))

    @rule(data=st.data())
    def correct_min_offset(self, data: st.DataObject) -> None:
        self.min_phys = self.draw_min_phys(data)
        self.cq.correct_min_offset(self.min_phys)
        self.model_correct_min()

    @rule(data=st.data())
    def delete_expired_files(self, data: st.DataObject) -> None:
        self.min_phys = self.draw_min_phys(data)
        deleted = self.cq.delete_expired_files(self.min_phys)
        last_file = (self.max - 1) // UPF if self.max > self.first else self.first // UPF
        want = 0
        for f in range(self.first // UPF, last_file):
            if self.units[(f + 1) * UPF - 1][0] >= self.min_phys:
                break
            want += 1
        assert deleted == want
        self.first += want * UPF
        self.model_correct_min()

    @rule(data=st.data())
    def offset_for_timestamp(self, data: st.DataObject) -> None:
        target = data.draw(st.sampled_from(sorted(self.ts.values()) or [0]) | st.integers(0, 2000))
        got = self.cq.offset_for_timestamp(target, self.ts.__getitem__)
        want = next(
            (i for i in range(self.min, self.max) if self.ts[self.units[i][0]] >= target),
            self.max,
        )
        assert got == want

    # invariants
    @invariant()
    def bounds_match(self) -> None:
        if not hasattr(self, "cq"):
            return
        assert (self.cq.min_offset, self.cq.max_offset) == (self.min, self.max)
        assert self.cq.max_phys_offset == self.model_max_phys()

    @invariant()
    def files_on_disk(self) -> None:
        if not hasattr(self, "cq") or not os.path.isdir(qdir(self.tmp)):
            return
        names = sorted(os.listdir(qdir(self.tmp)))
        assert names[0] == f"{self.first * UNIT_SIZE:020d}"
        last = (self.max - 1) // UPF if self.max > self.first else self.first // UPF
        assert len(names) == last - self.first // UPF + 1

    @invariant()
    def valid(self) -> None:
        if hasattr(self, "cq"):
            assert self.cq.validate(self.next_phys) is None


# A test function, not ConsumeQueueMachine.TestCase: hypothesis digests the
# machine's source, and for a class inspect.getsource runs ast.parse, which
# CPython 3.11 can fail ('AST constructor recursion depth mismatch') while
# another thread (a client's I/O thread formatting a traceback) parses too.
# A lambda's source is found without ast.
def test_consume_queue_matches_the_model() -> None:
    run_state_machine_as_test(lambda: ConsumeQueueMachine(), settings=settings(
        max_examples=200, stateful_step_count=50, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))


# -- examples ------------------------------------------------------------------------------


def test_golden_unit_bytes(tmp_path):
    cq = ConsumeQueue(tmp_path, "T", 3, units_per_file=4)
    cq.append_batch(0, 0x0102030405060708, 0x11223344, index_of([0xA1A2A3A4A5A6A7A8]))
    cq.flush()
    with open(qdir(str(tmp_path)) + "/00000000000000000000", "rb") as f:
        raw = f.read()
    assert raw[:20].hex() == "0807060504030201" "44332211" "a8a7a6a5a4a3a2a1"
    assert raw[20:] == bytes(60)
    assert len(raw) == 4 * 20
    cq.close()


def test_batch_units_share_position_and_keep_their_tags(tmp_path):
    cq = ConsumeQueue(tmp_path, "T", 3, units_per_file=4)
    cq.append_batch(0, 100, 50, index_of([7, 8, 9, 10, 11, 12]))  # spans two files
    assert [cq.get(i) for i in range(6)] == [(100, 50, t) for t in (7, 8, 9, 10, 11, 12)]
    assert sorted(os.listdir(qdir(str(tmp_path)))) == [f"{0:020d}", f"{80:020d}"]
    assert (cq.max_offset, cq.max_phys_offset) == (6, 150)
    assert len(cq.units(0, 100)) == 4 and len(cq.units(4, 100)) == 2  # never crosses a file
    cq.close()


def test_units_view_is_read_only_and_survives_deletion(tmp_path):
    cq = ConsumeQueue(tmp_path, "T", 3, units_per_file=2)
    end = fill(cq, [(1, 10)] * 5)
    view = cq.units(0, 2)
    assert cq.delete_expired_files(end) == 2
    assert not view.flags.writeable
    assert [int(p) for p in view["phys"]] == [0, 10]  # still mapped after the unlink
    cq.close()


def test_append_order_and_argument_errors(tmp_path):
    cq = ConsumeQueue(tmp_path, "T", 3, units_per_file=4)
    cq.append_batch(0, 1000, 10, index_of([1]))
    with pytest.raises(StoreError, match="CommitLog order"):
        cq.append_batch(1, 500, 10, index_of([1]))
    with pytest.raises(ValueError):
        cq.append_batch(1, 2000, 10, b"\0" * 13)
    with pytest.raises(ValueError):
        cq.append_batch(1, 2000, 0, index_of([1]))
    with pytest.raises(ValueError):
        ConsumeQueue(tmp_path, "../evil", 0)
    cq.close()
    with pytest.raises(StoreClosedError):
        cq.append_batch(1, 2000, 10, index_of([1]))


def test_max_phys_is_minus_one_when_empty(tmp_path):
    cq = ConsumeQueue(tmp_path, "T", 3, units_per_file=4)
    assert (cq.min_offset, cq.max_offset, cq.max_phys_offset) == (0, 0, -1)
    fill(cq, [(3, 10)])
    cq.truncate_dirty(0)
    assert (cq.min_offset, cq.max_offset, cq.max_phys_offset) == (0, 0, -1)
    assert os.listdir(qdir(str(tmp_path))) == [f"{0:020d}"]  # the first file is kept
    cq.close()


def test_offset_for_timestamp_empty_and_bounds(tmp_path):
    cq = ConsumeQueue(tmp_path, "T", 3, units_per_file=4)
    assert cq.offset_for_timestamp(5, lambda p: 0) == 0
    fill(cq, [(2, 10), (3, 10)])
    ts = {0: 100, 10: 200}
    assert cq.offset_for_timestamp(50, ts.__getitem__) == 0
    assert cq.offset_for_timestamp(150, ts.__getitem__) == 2
    assert cq.offset_for_timestamp(201, ts.__getitem__) == 5
    cq.close()


def test_destroy_removes_directory(tmp_path):
    cq = ConsumeQueue(tmp_path, "T", 3, units_per_file=4)
    fill(cq, [(5, 10)])
    cq.destroy()
    assert not os.path.exists(os.path.join(tmp_path, "T"))


def test_table(tmp_path):
    table = ConsumeQueueTable(tmp_path, units_per_file=4)
    a = table.get_or_create("A", 0)
    assert table.get_or_create("A", 0) is a and table.find("A", 1) is None
    fill(a, [(3, 10)])
    fill(table.get_or_create("A", 1), [(1, 10)])
    fill(table.get_or_create("B", 0), [(1, 10)])
    table.flush_all()
    table.close_all()
    os.makedirs(os.path.join(tmp_path, "A", "not-a-queue"))
    table = ConsumeQueueTable(tmp_path, units_per_file=4)
    assert sorted(table.load()) == [("A", 0), ("A", 1), ("B", 0)]
    assert table.find("A", 0).max_offset == 3
    assert table.validate_all(30) == {}
    assert table.delete_topic("A") == 2
    assert not os.path.exists(os.path.join(tmp_path, "A"))
    assert [(q.topic, q.queue_id) for q in table.all()] == [("B", 0)]
    table.close_all()


def test_table_creates_each_queue_once_across_threads(tmp_path):
    table = ConsumeQueueTable(tmp_path, units_per_file=4)
    got: list[ConsumeQueue] = []
    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait()
        got.append(table.get_or_create("T", 0))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(q) for q in got}) == 1
    table.close_all()


def test_readers_see_only_whole_units_during_appends(tmp_path):
    cq = ConsumeQueue(tmp_path, "T", 3, units_per_file=16)
    stop = threading.Event()
    errors: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            mx = cq.max_offset
            if mx:
                unit = cq.get(mx - 1)
                if unit is None or unit[1] != 10 or unit[2] != unit[0] // 10 + 1:
                    errors.append(f"unit {mx - 1}: {unit}")
                arr = cq.units(max(mx - 8, 0), 8)
                if len(arr) == 0 or (arr["size"] == 0).any():
                    errors.append(f"units view at {mx - 8}: {arr}")

    threads = [threading.Thread(target=reader) for _ in range(2)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, so reads land inside appends
    try:
        for t in threads:
            t.start()
        for i in range(1500):
            cq.append_batch(i, i * 10, 10, index_of([i + 1]))
    finally:
        stop.set()
        for t in threads:
            t.join()
        sys.setswitchinterval(interval)
    assert errors == []
    cq.close()


# -- faults --------------------------------------------------------------------------------


def _make_queue(root: str) -> str:
    cq = ConsumeQueue(root, "T", 3, units_per_file=4)
    fill(cq, [(3, 100), (2, 50), (1, 70)])  # 6 units, two files, CommitLog end 220
    cq.close()
    return qdir(root)


def _reopen_problem(root: str) -> str | None:
    cq = ConsumeQueue(root, "T", 3, units_per_file=4)
    try:
        return cq.validate(220)
    finally:
        cq.close()


def test_sound_queue_validates(tmp_path):
    _make_queue(str(tmp_path))
    assert _reopen_problem(str(tmp_path)) is None


def test_truncated_file_is_reported(tmp_path):
    d = _make_queue(str(tmp_path))
    path = os.path.join(d, f"{80:020d}")
    os.truncate(path, 30)
    problem = _reopen_problem(str(tmp_path))
    assert problem is not None and path in problem and "30 bytes" in problem


@pytest.mark.parametrize(
    ("unit", "value", "expect"),
    [
        (4, (10, 50, 0), "below the previous"),  # phys goes back (across the file edge)
        (2, (50, 100, 0), "overlaps"),  # a unit of a batch moved inside that batch
        (1, (0, 99, 0), "differs from the previous unit"),  # batch split in two sizes
        (3, (60, 50, 0), "overlaps"),  # next batch starts inside the previous one
        (1, (0, 0, 0), "empty unit"),  # hole inside the written range
        (5, (170, 100, 0), "past the CommitLog end"),  # batch straddles the end
    ],
)
def test_garbled_unit_is_reported_with_file_and_byte(tmp_path, unit, value, expect):
    d = _make_queue(str(tmp_path))
    name = f"{(unit // 4) * 80:020d}"
    with open(os.path.join(d, name), "r+b") as f:
        f.seek((unit % 4) * UNIT_SIZE)
        f.write(UNIT.pack(*value))
    problem = _reopen_problem(str(tmp_path))
    assert problem is not None
    assert os.path.join(d, name) in problem
    assert f"at byte {(unit % 4) * UNIT_SIZE}" in problem and expect in problem


def test_bytes_after_the_end_are_reported(tmp_path):
    d = _make_queue(str(tmp_path))
    path = os.path.join(d, f"{80:020d}")
    with open(path, "r+b") as f:
        f.seek(3 * UNIT_SIZE + 5)
        f.write(b"\x01")
    problem = _reopen_problem(str(tmp_path))
    assert problem is not None and path in problem and "byte 65" in problem


def test_stray_and_misnamed_files_are_reported(tmp_path):
    d = _make_queue(str(tmp_path))
    with open(os.path.join(d, "junk"), "wb") as f:
        f.write(b"x")
    problem = _reopen_problem(str(tmp_path))
    assert problem is not None and "junk" in problem
    os.unlink(os.path.join(d, "junk"))
    os.rename(os.path.join(d, f"{80:020d}"), os.path.join(d, f"{81:020d}"))
    problem = _reopen_problem(str(tmp_path))
    assert problem is not None and f"{81:020d}" in problem


def test_table_rebuilds_a_bad_queue(tmp_path):
    d = _make_queue(str(tmp_path))
    os.truncate(os.path.join(d, f"{0:020d}"), 7)
    table = ConsumeQueueTable(tmp_path, units_per_file=4)
    table.load()
    bad = table.validate_all(220)
    assert list(bad) == [("T", 3)]
    table.destroy_queue("T", 3)
    assert not os.path.exists(d)
    fresh = table.get_or_create("T", 3)
    assert fresh.max_offset == 0
    fill(fresh, [(3, 100)])
    assert fresh.validate(100) is None
    table.close_all()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    flips=st.lists(st.tuples(st.integers(0, 2 * 80 - 1), st.integers(0, 255)), max_size=6),
    cut=st.none() | st.integers(0, 80),
)
def test_random_damage_never_crashes(flips, cut):
    root = tempfile.mkdtemp(prefix="cq-dmg-")
    try:
        d = _make_queue(root)
        files = sorted(os.listdir(d))
        for pos, byte in flips:
            with open(os.path.join(d, files[pos // 80]), "r+b") as f:
                f.seek(pos % 80)
                f.write(bytes([byte]))
        if cut is not None:
            os.truncate(os.path.join(d, files[-1]), cut)
        cq = ConsumeQueue(root, "T", 3, units_per_file=4)
        problem = cq.validate(220)
        assert problem is None or d in problem
        # Reads stay in bounds whatever the bytes say.
        for off in range(-1, cq.max_offset + 2):
            cq.get(off)
            cq.units(off, 3)
        cq.offset_for_timestamp(5, lambda p: p)
        cq.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_batch_bytes_match_unit_struct(tmp_path):
    # Batches of one take the struct path, larger ones numpy: both must equal UNIT.pack.
    tags = [int(x) for x in np.random.default_rng(1).integers(0, 2**63, 12)]
    cq = ConsumeQueue(tmp_path, "T", 0, units_per_file=5)
    cq.append_batch(0, 77, 9, index_of(tags))
    cq.append_batch(12, 86, 4, index_of([5]))
    cq.flush()
    d = qdir(str(tmp_path), "T", 0)
    raw = b"".join((Path(d) / n).read_bytes() for n in sorted(os.listdir(d)))
    want = b"".join(UNIT.pack(77, 9, t) for t in tags) + UNIT.pack(86, 4, 5)
    assert raw == want + bytes(len(raw) - len(want))
    cq.close()


def test_flush_thread_races_appends_and_deletions(tmp_path):
    cq = ConsumeQueue(tmp_path, "T", 3, units_per_file=8)
    stop = threading.Event()
    errors: list[BaseException] = []

    def flusher() -> None:
        while not stop.is_set():
            try:
                cq.flush()
            except BaseException as exc:  # any failure, reported to the main thread
                errors.append(exc)

    t = threading.Thread(target=flusher)
    t.start()
    try:
        for i in range(400):
            cq.append_batch(i, i * 10, 10, index_of([i]))
            if i % 50 == 49:
                cq.delete_expired_files(i * 10 - 100)
    finally:
        stop.set()
        t.join()
    assert errors == []
    assert cq.validate(4000) is None and cq.max_offset == 400
    cq.close()
