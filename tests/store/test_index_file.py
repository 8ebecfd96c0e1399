"""IndexService / IndexFile (ref ST4): model-based state machine, golden bytes, faults."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading

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

from tidemq.store.index_file import (
    ENTRY_SIZE,
    HEADER,
    HEADER_SIZE,
    SLOT,
    IndexFile,
    IndexService,
    key_hash,
)

SLOTS = 4  # tiny, so chains of different keys share slots
MAX_ENTRIES = 10  # tiny, so files roll often
KEYS = [f"key-{i}" for i in range(8)]
assert len({key_hash(k) for k in KEYS}) == len(KEYS)  # the model assumes no hash collision
assert len({key_hash(k) % SLOTS for k in KEYS}) > 1
I32_MAX = 2**31 - 1
T0 = 1_700_000_000_000


def _same_files(a: IndexService, b: IndexService) -> None:
    """``a`` and ``b`` (flushed) hold the same index files, byte for byte."""
    assert len(a.files) == len(b.files)
    for x, y in zip(a.files, b.files, strict=True):
        with open(x, "rb") as f1, open(y, "rb") as f2:
            assert f1.read() == f2.read()


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.lists(st.integers(0, 9), min_size=1, max_size=4),
                          st.integers(-1, 3), st.integers(-2, 3)), min_size=1, max_size=30))
def test_put_hashes_writes_what_put_hash_writes_for_each(tmp_path_factory, batches):
    """A small batch's few hashes in one call (the store's per-batch path: a keyed message's
    key and its id block) leave the same bytes as one put_hash per hash: rolls when a file is
    full (also in the middle of a batch's hashes), a repeated hash chained to itself, a
    batch below the last indexed phys skipped, a clock going back clamped."""
    a, b = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("few")
    one = IndexService(a, slots=4, max_entries=7)
    few = IndexService(b, slots=4, max_entries=7)
    ts, phys = 1_700_000_000_000, 1000
    for hashes, step, dts in batches:
        phys += step * 100  # step -1: below the last one indexed, skipped by both
        ts += dts
        for h in hashes:
            one.put_hash(h, phys, ts)
        few.put_hashes(hashes, phys, ts)
    one.flush()
    few.flush()
    _same_files(one, few)
    assert one.query("", 0, 2**62, 100) == few.query("", 0, 2**62, 100)
    one.close()
    few.close()


class ModelFile:
    def __init__(self, begin_ts: int) -> None:
        self.begin_ts = begin_ts
        self.entries: list[tuple[str, int, int]] = []  # key, phys, ts (oldest first)


class IndexMachine(RuleBasedStateMachine):
    """The service against a list of model files of (key, phys, ts) entries."""

    @initialize()
    def setup(self) -> None:
        self.tmp = tempfile.mkdtemp(prefix="ix-sm-")
        self.ix = IndexService(self.tmp, slots=SLOTS, max_entries=MAX_ENTRIES)
        self.files: list[ModelFile] = []
        self.phys = 0
        self.ts = T0
        self.min_phys = 0

    def teardown(self) -> None:
        if hasattr(self, "ix"):
            self.ix.close()
            shutil.rmtree(self.tmp, ignore_errors=True)

    def model_end_phys(self) -> int:
        return self.files[-1].entries[-1][1] if self.files else -1

    def model_put(self, keys: list[str], phys: int, ts: int) -> None:
        if phys < self.model_end_phys():
            return
        for k in keys:
            if not k:
                continue
            f = self.files[-1] if self.files else None
            if f is None or len(f.entries) == MAX_ENTRIES or ts - f.begin_ts > I32_MAX:
                f = ModelFile(ts)
                self.files.append(f)
            f.entries.append((k, phys, ts))

    def advance(self, dphys: int, dts: int) -> tuple[int, int]:
        self.phys += dphys
        self.ts += dts
        return self.phys, self.ts

    @rule(
        key=st.sampled_from(KEYS),
        dphys=st.just(0) | st.integers(0, 300),  # 0: another key of the same batch
        dts=st.integers(0, 20) | st.just(I32_MAX + 1),
    )
    def put(self, key: str, dphys: int, dts: int) -> None:
        phys, ts = self.advance(dphys, dts)
        self.ix.put(key, phys, ts)
        self.model_put([key], phys, ts)

    @rule(
        keys=st.lists(st.sampled_from([*KEYS, ""]), max_size=25),
        dphys=st.integers(1, 300),
        dts=st.integers(0, 20),
    )
    def put_many(self, keys: list[str], dphys: int, dts: int) -> None:
        phys, ts = self.advance(dphys, dts)
        self.ix.put_many(keys, phys, ts)
        self.model_put(keys, phys, ts)

    @precondition(lambda self: self.phys > 0)
    @rule(data=st.data(), key=st.sampled_from(KEYS))
    def redispatch_old(self, data: st.DataObject, key: str) -> None:
        # Re-dispatch of a batch below the indexed end is ignored (already indexed).
        end = self.model_end_phys()
        if end <= 0:
            return
        phys = data.draw(st.integers(0, end - 1))
        self.ix.put(key, phys, self.ts)
        self.model_put([key], phys, self.ts)

    @rule(
        key=st.sampled_from(KEYS),
        data=st.data(),
        max_num=st.integers(1, 70),
    )
    def query(self, key: str, data: st.DataObject, max_num: int) -> None:
        stamps = sorted({e[2] for f in self.files for e in f.entries}) or [T0]
        near = st.sampled_from(stamps).flatmap(lambda t: st.integers(t - 1, t + 1))
        begin = data.draw(near | st.just(0))
        end = data.draw(near | st.just(2**62) | st.integers(begin - 3, begin + 30))
        want: list[int] = []
        for f in reversed(self.files):
            for k, phys, ts in reversed(f.entries):
                if k == key and begin <= ts <= end and phys not in want:
                    want.append(phys)
        assert self.ix.query(key, begin, end, max_num) == want[:max_num]

    @rule()
    def reopen(self) -> None:
        self.ix.close()
        self.ix = IndexService(self.tmp, slots=SLOTS, max_entries=MAX_ENTRIES)
        assert self.ix.load_errors == []

    @rule()
    def flush(self) -> None:
        self.ix.flush()

    @precondition(lambda self: self.files)
    @rule(data=st.data())
    def truncate_dirty(self, data: st.DataObject) -> None:
        # The CommitLog's recovered end: never below what retention already removed.
        starts = sorted({e[1] for f in self.files for e in f.entries if e[1] >= self.min_phys})
        cut = data.draw(
            (st.sampled_from(starts) if starts else st.nothing())
            | st.integers(self.min_phys, self.phys + 1)
        )
        self.ix.truncate_dirty(cut)
        for f in self.files:
            f.entries = [e for e in f.entries if e[1] < cut]
        self.files = [f for f in self.files if f.entries]
        self.phys = max(cut, self.model_end_phys(), 0)  # the CommitLog now ends at `cut`

    @rule(data=st.data())
    def delete_expired(self, data: st.DataObject) -> None:
        ends = [f.entries[-1][1] for f in self.files if f.entries[-1][1] >= self.min_phys]
        self.min_phys = data.draw(
            (st.sampled_from(ends).flatmap(lambda p: st.sampled_from([p, p + 1])) if ends
             else st.nothing())
            | st.integers(self.min_phys, self.phys + 1)
        )
        want = 0
        for f in self.files[:-1]:
            if f.entries[-1][1] >= self.min_phys:
                break
            want += 1
        assert self.ix.delete_expired(self.min_phys) == want
        del self.files[:want]

    @invariant()
    def same_end(self) -> None:
        if hasattr(self, "ix"):
            assert self.ix.max_phys_offset == self.model_end_phys()
            assert len(self.ix.files) == len(self.files)


# A test function, not IndexMachine.TestCase: hypothesis digests the
# machine's source, and for a class inspect.getsource runs ast.parse, which
# CPython 3.11 can fail ('AST constructor recursion depth mismatch') while
# another thread (a client's I/O thread formatting a traceback) parses too.
# A lambda's source is found without ast.
def test_index_file_matches_the_model() -> None:
    run_state_machine_as_test(lambda: IndexMachine(), settings=settings(
        max_examples=150, stateful_step_count=50, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))


# -- examples ------------------------------------------------------------------------------


def test_golden_header_and_entry(tmp_path):
    ix = IndexService(tmp_path, slots=4, max_entries=2)
    ix.put("hello", 0x0102030405060708, 1_700_000_000_000)
    ix.put("hello", 0x0102030405060709, 1_700_000_000_250)
    ix.flush()
    [path] = ix.files
    assert os.path.basename(path) == "20231114221320000"  # UTC yyyyMMddHHmmssSSS
    with open(path, "rb") as f:
        raw = f.read()
    assert len(raw) == 40 + 4 * 4 + 2 * 20
    assert key_hash("hello") == 0x9A71BB4C  # crc32c; slot 0x...4c % 4 == 0
    assert raw[:40].hex() == (
        "0068e5cf8b010000"  # begin_ts 1_700_000_000_000
        "fa68e5cf8b010000"  # end_ts   1_700_000_000_250
        "0807060504030201"  # begin_phys
        "0907060504030201"  # end_phys
        "01000000"  # hash_slot_count
        "02000000"  # index_count
    )
    assert raw[40:56].hex() == "02000000" + "00" * 12  # slot 0 -> entry 2
    assert raw[56:96].hex() == (
        "4cbb719a" "0807060504030201" "00000000" "00000000"  # entry 1: diff 0, prev none
        "4cbb719a" "0907060504030201" "fa000000" "01000000"  # entry 2: diff 250 ms, prev 1
    )
    ix.close()


def test_rolls_when_time_diff_would_overflow(tmp_path):
    ix = IndexService(tmp_path, slots=4, max_entries=100)
    ix.put("a", 10, T0)
    ix.put("a", 20, T0 + I32_MAX)  # still fits
    ix.put("a", 30, T0 + I32_MAX + 1)  # would not
    assert len(ix.files) == 2
    assert ix.query("a", T0, T0 + 2 * I32_MAX) == [30, 20, 10]
    assert ix.query("a", T0 + 1, T0 + I32_MAX) == [20]
    ix.close()


def test_file_names_are_unique_and_ordered(tmp_path):
    ix = IndexService(tmp_path, slots=4, max_entries=1)
    for i in range(5):
        ix.put("k", i, T0)  # same store time: names must still differ
    names = [os.path.basename(p) for p in ix.files]
    assert names == sorted(names) and len(set(names)) == 5
    ix.close()


def test_names_keep_creation_order_when_the_clock_goes_back(tmp_path):
    ix = IndexService(tmp_path, slots=4, max_entries=1)
    ix.put("k", 1, T0)
    ix.put("k", 2, T0 - 60_000)  # new file, store time a minute earlier
    names = [os.path.basename(p) for p in ix.files]
    assert names == ["20231114221320000", "20231114221320001"]
    ix.close()
    ix = IndexService(tmp_path, slots=4, max_entries=1)
    assert ix.max_phys_offset == 2 and ix.load_errors == []
    ix.close()


def test_truncate_rewrites_the_header(tmp_path):
    ix = IndexService(tmp_path, slots=4, max_entries=10)
    for i in range(6):
        ix.put(KEYS[i], 100 * i, T0 + 10 * i)
    ix.truncate_dirty(300)
    [path] = ix.files
    ix.close()
    with open(path, "rb") as f:
        header = HEADER.unpack(f.read(HEADER_SIZE))
    slots_used = len({key_hash(k) % 4 for k in KEYS[:3]})
    assert header == (T0, T0 + 20, 0, 200, slots_used, 3)


def test_query_dedupes_and_limits(tmp_path):
    ix = IndexService(tmp_path, slots=2, max_entries=50)
    ix.put_many(["k", "k", "other", "k"], 100, T0)
    ix.put_many(["k"], 200, T0 + 1)
    assert ix.query("k", 0, 2**62) == [200, 100]
    assert ix.query("k", 0, 2**62, max_num=1) == [200]
    assert ix.query("k", T0 + 2, 2**62) == [] and ix.query("k", 5, 4) == []
    assert ix.query("absent", 0, 2**62) == []
    ix.close()


def test_clock_going_back_is_clamped_to_begin(tmp_path):
    ix = IndexService(tmp_path, slots=4, max_entries=10)
    ix.put("a", 10, T0)
    ix.put("a", 20, T0 - 500)  # recorded at begin_ts
    assert ix.query("a", T0, T0) == [20, 10]
    ix.close()
    ix = IndexService(tmp_path, slots=4, max_entries=10)
    assert ix.load_errors == []
    ix.close()


def test_empty_file_is_dropped_on_load(tmp_path):
    f = IndexFile.create(os.path.join(tmp_path, "20231114221320000"), 4, 10)
    f.mf.close()
    ix = IndexService(tmp_path, slots=4, max_entries=10)
    assert ix.files == [] and ix.load_errors == [] and ix.max_phys_offset == -1
    ix.close()


# -- faults --------------------------------------------------------------------------------


def _five_files(root: str) -> list[str]:
    ix = IndexService(root, slots=4, max_entries=10)
    for i in range(25):
        ix.put_many([KEYS[i % 5], "common"], 100 * i, T0 + i)
    paths = ix.files
    assert len(paths) == 5
    ix.close()
    return paths


def _reload(root: str) -> IndexService:
    ix = IndexService(root, slots=4, max_entries=10)
    # whatever was dropped, the service works
    ix.query("common", 0, 2**62)
    ix.put("common", 10**9, T0 + 10**6)
    assert ix.query("common", T0 + 10**6, T0 + 10**6) == [10**9]
    return ix


def test_truncated_file_is_dropped_with_newer_ones(tmp_path):
    paths = _five_files(str(tmp_path))
    os.truncate(paths[2], 100)
    ix = _reload(str(tmp_path))
    assert paths[2] in ix.load_errors[0] and "100 bytes" in ix.load_errors[0]
    assert any(paths[4] in e and "newer" in e for e in ix.load_errors)
    assert not os.path.exists(paths[2]) and not os.path.exists(paths[3])
    assert ix.files[:2] == paths[:2]
    assert ix.max_phys_offset == 10**9  # _reload's put went into file 1 (ended at 900)
    ix.close()


def test_max_phys_falls_back_to_last_good_file(tmp_path):
    paths = _five_files(str(tmp_path))
    with open(paths[3], "r+b") as f:
        f.seek(36)
        f.write((10**6).to_bytes(4, "little"))  # index_count beyond max_entries
    ix = IndexService(tmp_path, slots=4, max_entries=10)
    assert len(ix.load_errors) == 2
    assert paths[3] in ix.load_errors[0] and "byte 36" in ix.load_errors[0]
    assert ix.max_phys_offset == 1400  # file 2 ends with the batch at 100 * 14
    ix.close()


@pytest.mark.parametrize(
    ("pos", "value", "expect"),
    [
        (32, (9).to_bytes(4, "little"), "byte 32"),  # hash_slot_count > slots
        (16, (10**12).to_bytes(8, "little"), "byte 16"),  # begin_phys > end_phys
        (8, (0).to_bytes(8, "little"), "byte 0"),  # end_ts before begin_ts
        (HEADER_SIZE + 16 + 2 * 20 + 16, (7).to_bytes(4, "little"), "entry 3 at byte 96"),  # prev
        (HEADER_SIZE + 16 + 4 * 20 + 4, (1).to_bytes(8, "little"), "entry 5 at byte 136"),  # phys
    ],
)
def test_garbled_newest_file_is_reported_with_position(tmp_path, pos, value, expect):
    paths = _five_files(str(tmp_path))
    with open(paths[-1], "r+b") as f:
        f.seek(pos)
        f.write(value)
    ix = _reload(str(tmp_path))
    assert len(ix.load_errors) == 1, ix.load_errors
    assert paths[-1] in ix.load_errors[0] and expect in ix.load_errors[0], ix.load_errors
    assert ix.files[:4] == paths[:4]
    ix.close()


def test_slot_pointing_past_the_entries_is_reported(tmp_path):
    paths = _five_files(str(tmp_path))
    slot = key_hash("common") % 4  # in use, so only the head's target is wrong
    with open(paths[-1], "r+b") as f:
        f.seek(HEADER_SIZE + 4 * slot)
        f.write((11).to_bytes(4, "little"))
    ix = _reload(str(tmp_path))
    assert len(ix.load_errors) == 1
    assert f"slot {slot} at byte {HEADER_SIZE + 4 * slot}" in ix.load_errors[0]
    assert "entry 11" in ix.load_errors[0]
    ix.close()


@pytest.mark.timeout(20)
def test_looping_chain_in_an_old_file_terminates(tmp_path):
    paths = _five_files(str(tmp_path))
    # Entry 4 of the first file points back at itself; only the newest file is deep-checked.
    with open(paths[0], "r+b") as f:
        f.seek(HEADER_SIZE + 16 + 3 * ENTRY_SIZE + 16)
        f.write((4).to_bytes(4, "little"))
    ix = IndexService(tmp_path, slots=4, max_entries=10)
    assert ix.load_errors == []
    assert 100 in ix.query("common", 0, 2**62, 1000)  # entry 4 is "common" at phys 100
    ix.close()


def test_unparseable_name_is_reported(tmp_path):
    paths = _five_files(str(tmp_path))
    bad = os.path.join(tmp_path, "20231399999999999")  # 17 digits, no date; sorts last
    shutil.copy(paths[-1], bad)
    ix = _reload(str(tmp_path))
    assert len(ix.load_errors) == 1 and bad in ix.load_errors[0]
    ix.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    flips=st.lists(
        st.tuples(st.integers(0, 5 * 256 - 1), st.integers(0, 255)), min_size=1, max_size=8
    ),
    cut=st.none() | st.tuples(st.integers(0, 4), st.integers(0, 255)),
)
def test_random_damage_never_crashes(flips, cut):
    root = tempfile.mkdtemp(prefix="ix-dmg-")
    try:
        paths = _five_files(root)
        size = os.path.getsize(paths[0])
        assert size == HEADER.size + 4 * SLOT.size + 10 * ENTRY_SIZE == 256
        for pos, byte in flips:
            with open(paths[pos // size], "r+b") as f:
                f.seek(pos % size)
                f.write(bytes([byte]))
        if cut is not None:
            os.truncate(paths[cut[0]], cut[1])
        ix = _reload(root)
        for e in ix.load_errors:
            assert any(p in e for p in paths)
        for k in [*KEYS, "common"]:
            ix.query(k, 0, 2**62, 1000)
        ix.truncate_dirty(1200)
        ix.delete_expired(500)
        ix.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_queries_during_puts_see_a_consistent_prefix(tmp_path):
    ix = IndexService(tmp_path, slots=3, max_entries=64)
    stop = threading.Event()
    errors: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            got = ix.query("hot", 0, 2**62, 10_000)
            # every hit is a real batch of "hot" (multiples of 7), newest first, no repeats
            if got != sorted(set(got), reverse=True) or any(p % 7 for p in got):
                errors.append(str(got))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    threads = [threading.Thread(target=reader) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        for i in range(1, 600):
            ix.put_many(["hot", f"cold-{i % 5}"] if i % 7 == 0 else [f"cold-{i % 5}"], i, T0 + i)
    finally:
        stop.set()
        for t in threads:
            t.join()
        sys.setswitchinterval(interval)
    assert errors == []
    assert ix.query("hot", 0, 2**62, 10_000) == list(range(595, 0, -7))
    ix.close()


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 3)), min_size=1,
                max_size=30),
       st.integers(1, 5))
def test_put_hash_run_writes_what_put_hash_writes(tmp_path_factory, entries, frames):
    """A frame's id-index entries in one call (issue 17) leave the same bytes as one
    put_hash per entry: rolls when a file is full, an entry below the last indexed phys
    skipped, the header written once."""
    a, b = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("run")
    one = IndexService(a, slots=4, max_entries=7)
    run = IndexService(b, slots=4, max_entries=7)
    ts, phys = 1_700_000_000_000, 1000
    hs, physs = [], []
    for h, step in entries:
        phys += step * 100
        hs.append(h)
        physs.append(phys)
    cut = len(hs) // frames or 1
    for i in range(0, len(hs), cut):
        one_h, one_p = hs[i : i + cut], physs[i : i + cut]
        first = one_p[0] - 50  # below the last indexed phys from the second frame on: skipped
        one.put_hash(7, first, ts)
        run.put_hash_run([7], [first], ts)
        for h, p in zip(one_h, one_p, strict=True):
            one.put_hash(h, p, ts)
        run.put_hash_run(one_h, one_p, ts)
        ts += 3
    one.flush()
    run.flush()
    _same_files(one, run)
    one.close()
    run.close()
