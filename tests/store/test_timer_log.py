"""TimerLog, the durable time index (store/timer_log.py), against a trivially correct model: a
dict of pending entries. A hypothesis state machine adds, cancels, pops due entries, marks them
done, checkpoints (deleting finished buckets), syncs from another thread and reopens the
directory (a restart): the index must hand out exactly the model's due entries, earliest
first, never one that is not due, never one twice, and lose nothing across a reopen. Plus the
layout pinned by golden bytes, and torn-tail / bad-CRC handling."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tidemq.store.timer_log import ADD, DONE, ENTRY_SIZE, TimerLog, encode_entry

BUCKET_MS = 10


class TimerLogModel(RuleBasedStateMachine):
    """Model: ``pending`` phys -> (deliver_at, size) for every ADD not cancelled or done;
    ``handed`` the popped ones awaiting done() (not handed out again until a reopen)."""

    @initialize()
    def setup(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="timerlog-model-")
        self.log = TimerLog(self.dir, BUCKET_MS)
        self.pending: dict[int, tuple[int, int]] = {}
        self.handed: dict[int, tuple[int, int]] = {}
        self.next_phys = 1000
        self.now = 0

    def teardown(self) -> None:
        if hasattr(self, "log"):
            self.log.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    @rule(ahead=st.integers(-25, 60), size=st.integers(1, 5000))
    def add(self, ahead: int, size: int) -> None:
        at = max(0, self.now + ahead)  # past-due adds happen too (a late re-index)
        phys = self.next_phys
        self.next_phys += size
        self.log.add(at, phys, size)
        self.pending[phys] = (at, size)

    @rule(step=st.integers(0, 25))
    def advance(self, step: int) -> None:
        self.now += step

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def cancel(self, data) -> None:  # noqa: ANN001
        waiting = sorted(set(self.pending) - set(self.handed))
        if not waiting:
            return
        phys = data.draw(st.sampled_from(waiting))
        at, size = self.pending.pop(phys)
        assert self.log.is_pending(at, phys)
        self.log.cancel(at, phys, size)
        assert not self.log.is_pending(at, phys)

    @rule(limit=st.integers(1, 8))
    def pop_due(self, limit: int) -> None:
        got = self.log.pop_due(self.now, limit)
        waiting = {p: v for p, v in self.pending.items() if p not in self.handed}
        due = sorted(v[0] for v in waiting.values() if v[0] <= self.now)
        assert len(got) <= limit
        if due:
            assert got, f"entries due at {due} at {self.now}, none handed out"
        for at, phys, size in got:
            assert phys in waiting, f"{phys} handed out but not pending (or handed before)"
            assert waiting[phys] == (at, size)
            assert at <= self.now, f"entry due at {at} handed out early at {self.now}"
            self.handed[phys] = (at, size)
        dues = [g[0] for g in got]
        assert dues == sorted(dues)
        # earliest first: nothing left waiting is due before the last one handed out
        if got:
            left = [v[0] for p, v in waiting.items() if p not in self.handed]
            assert all(d >= dues[-1] for d in left if d <= self.now)

    @precondition(lambda self: self.handed)
    @rule(data=st.data())
    def done(self, data) -> None:  # noqa: ANN001
        phys = data.draw(st.sampled_from(sorted(self.handed)))
        at, size = self.handed.pop(phys)
        del self.pending[phys]
        self.log.done(at, phys, size)

    @precondition(lambda self: self.handed)
    @rule(data=st.data())
    def release(self, data) -> None:  # noqa: ANN001
        """A failed delivery gives its entries back."""
        phys = data.draw(st.lists(st.sampled_from(sorted(self.handed)), min_size=1,
                                  unique=True))
        self.log.release([(self.handed[p][0], p, self.handed[p][1]) for p in phys])
        for p in phys:
            del self.handed[p]

    @rule()
    def checkpoint(self) -> None:
        finished, self.log.pending_deletes = self.log.pending_deletes, []
        t = threading.Thread(target=self.log.save_checkpoint, args=(self.now,))
        t.start()  # from another thread, as the broker does
        t.join()
        self.log.delete_finished(finished)

    @rule()
    def reopen(self) -> None:
        """A restart: entries handed out but never done are pending again."""
        self.log.close()
        self.log = TimerLog(self.dir, BUCKET_MS)
        self.handed.clear()

    @invariant()
    def next_due_is_the_models_earliest(self) -> None:
        if not hasattr(self, "log"):
            return
        waiting = [v[0] for p, v in self.pending.items() if p not in self.handed]
        assert self.log.next_due() == (min(waiting) if waiting else None)


# A test function, not TimerLogModel.TestCase: hypothesis digests the
# machine's source, and for a class inspect.getsource runs ast.parse, which
# CPython 3.11 can fail ('AST constructor recursion depth mismatch') while
# another thread (a client's I/O thread formatting a traceback) parses too.
# A lambda's source is found without ast.
def test_timer_log_matches_the_model() -> None:
    run_state_machine_as_test(lambda: TimerLogModel(), settings=settings(
        max_examples=60, stateful_step_count=50, deadline=None))


def test_entry_golden_bytes() -> None:
    raw = encode_entry(1_700_000_000_123, 4096, 321, ADD)
    assert len(raw) == ENTRY_SIZE
    assert raw.hex() == (
        "7b68e5cf8b010000"  # deliver_at i64 = 1_700_000_000_123
        "0010000000000000"  # phys u64 = 4096
        "41010000"  # size u32 = 321
        "0100"  # kind u16 = ADD
        "0000"  # reserved
        "d23056f6"  # crc32c of bytes [0, 24)
        "00000000"  # pad
    )


def test_torn_tail_is_cut_and_bad_crc_is_skipped_and_reported(tmp_path) -> None:
    log = TimerLog(tmp_path, BUCKET_MS)
    for i in range(4):
        log.add(100 + i, 1000 + i, 10)
    log.done(100, 1000, 10)
    log.close()
    (path,) = [p for p in tmp_path.iterdir() if p.suffix == ".tl"]
    raw = bytearray(path.read_bytes())
    raw[2 * ENTRY_SIZE + 3] ^= 0x10  # flip a bit in the entry of phys 1002
    raw += encode_entry(105, 9999, 1, DONE)[:13]  # a torn append
    path.write_bytes(bytes(raw))
    log = TimerLog(tmp_path, BUCKET_MS)
    assert os.path.getsize(path) % ENTRY_SIZE == 0
    assert any("torn tail" in p for p in log.problems)
    assert any(f"entry at byte {2 * ENTRY_SIZE} fails its CRC" in p for p in log.problems)
    assert [g[1] for g in log.pop_due(1_000, 10)] == [1001, 1003]
    log.close()


def test_the_owner_thread_never_writes_or_fsyncs(tmp_path, monkeypatch) -> None:
    """add / done / pop_due / next_due, with buckets filling up, rolling over and the open-file
    LRU evicting, never call write() or fsync() on the calling thread; sync() (the checkpoint
    thread) does all of it."""
    calls: list[tuple[str, int]] = []
    real_write, real_fsync = os.write, os.fsync

    def write(fd, data):  # noqa: ANN001, ANN202
        calls.append(("write", threading.get_ident()))
        return real_write(fd, data)

    def fsync(fd):  # noqa: ANN001, ANN202
        calls.append(("fsync", threading.get_ident()))
        return real_fsync(fd)

    log = TimerLog(tmp_path, BUCKET_MS)
    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "fsync", fsync)
    owner = threading.get_ident()
    for i in range(2000):  # 200 buckets: more than the 32 open files
        log.add(i // 10 * BUCKET_MS + i % 10, 10_000 + i, 1)
        if i % 100 == 99:
            for d, p, s in log.pop_due(i // 10 * BUCKET_MS, 1000):
                log.done(d, p, s)
            t = threading.Thread(target=log.sync)
            t.start()
            t.join()
    assert not [c for c in calls if c[1] == owner], "the owner thread wrote or fsynced"
    assert any(c[0] == "write" for c in calls) and any(c[0] == "fsync" for c in calls)
    monkeypatch.undo()
    expected = log.next_due()
    assert expected is not None
    log.close()
    again = TimerLog(tmp_path, BUCKET_MS)
    assert again.next_due() == expected  # what was pending is pending after a reopen
    again.close()


def test_an_add_between_released_entries_is_not_served_after_them(tmp_path) -> None:
    """Found by the model above: every bucket exhausted (entries handed out), two of them
    released (buckets 0 and 10), then an add due at 10: it must come before the released entry
    due at 11 (the loaded bucket was set back to the first released entry's, 0, so the add
    went only to its file and waited behind the heap)."""
    log = TimerLog(tmp_path, BUCKET_MS)
    log.next_due()
    log.add(0, 1000, 1)
    log.add(0, 1001, 1)
    log.add(11, 1002, 1)
    log.next_due()
    log.cancel(0, 1001, 1)
    log.next_due()
    assert log.pop_due(13, 2) == [(0, 1000, 1), (11, 1002, 1)]
    log.next_due()
    log.release([(0, 1000, 1), (11, 1002, 1)])
    log.next_due()
    assert log.pop_due(13, 1) == [(0, 1000, 1)]
    log.next_due()
    log.add(10, 1003, 1)
    assert log.next_due() == 10
    assert log.pop_due(13, 5) == [(10, 1003, 1), (11, 1002, 1)]
    log.close()


def test_unchanged_until_an_entry_is_appended_or_indexed(tmp_path) -> None:
    """The owner skips an idle checkpoint by ``unchanged()`` (issue 17): false before the first
    checkpoint, true after it, false again after an add, a mark or a re-index."""
    log = TimerLog(tmp_path, BUCKET_MS)
    try:
        assert not log.unchanged()
        log.save_checkpoint(1)
        assert log.unchanged()
        log.add(100, 1, 10)
        assert not log.unchanged()
        log.save_checkpoint(2)
        assert log.unchanged()
        log.done(100, 1, 10)
        assert not log.unchanged()
        log.save_checkpoint(3)
        log.indexed += 1
        assert not log.unchanged()
    finally:
        log.close()
