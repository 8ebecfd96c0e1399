"""Hypothesis state machine: the MessageStore against a list-per-queue model.

Rules: put batches (random topics, queues, sizes, tags), read at random offsets with and without
tag filters, roll segments (tiny segments), reopen cleanly, crash (copy of the files while open)
and recover, tear the tail of the log (the last batch is lost, nothing else).
"""

import itertools
import shutil
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tidemq.protocol.record import tag_hash

from .helpers import batch, open_store

TOPICS = ["a", "b"]
# pwrite_min_bytes=300: batches take both write paths (through the mapping and pwritev)
OPTS = dict(
    segment_size=4096, cq_units_per_file=7, index_slots=8, index_max_entries=16,
    pwrite_min_bytes=300,
)
_ids = itertools.count()


class StoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="tidemq-sm-"))
        self.dir = self.root / "s"
        self.store = open_store(self.dir, **OPTS)
        self.model: dict[tuple[str, int], list[tuple[bytes, str | None]]] = {}
        self.last_put = None  # (key, count) of the most recent put, for tear_tail

    def teardown(self):
        self.store.close()
        shutil.rmtree(self.root, ignore_errors=True)

    @rule(
        topic=st.sampled_from(TOPICS),
        qid=st.integers(0, 2),
        sizes=st.lists(st.integers(0, 400), min_size=1, max_size=6),
        tags=st.lists(st.sampled_from([None, "x", "y"]), min_size=6, max_size=6),
    )
    def put(self, topic, qid, sizes, tags):
        n = next(_ids)
        bodies = [f"{n}:{i}:".encode() + b"p" * s for i, s in enumerate(sizes)]
        tg = tags[: len(bodies)]
        r = self.store.put(
            batch(topic, bodies, queue_id=qid, tags=tg, producer_id=7, base_seq=n * 10)
        )
        q = self.model.setdefault((topic, qid), [])
        assert r.queue_offset == len(q)
        q.extend(zip(bodies, tg, strict=True))
        self.last_put = ((topic, qid), len(bodies))

    @rule(topic=st.sampled_from(TOPICS), qid=st.integers(0, 2), data=st.data())
    def read(self, topic, qid, data):
        q = self.model.get((topic, qid), [])
        off = data.draw(st.integers(0, len(q) + 2))
        res = self.store.get_messages(topic, qid, off, data.draw(st.integers(1, 10)))
        if off >= len(q):
            assert not res.batches
            return
        got = res.messages()
        assert got, res.status
        assert [m.body for m in got] == [b for b, _ in q[off : off + len(got)]]
        assert [m.queue_offset for m in got] == list(range(off, off + len(got)))
        assert res.next_begin_offset == off + len(got)

    @rule(topic=st.sampled_from(TOPICS), qid=st.integers(0, 2), tag=st.sampled_from(["x", "y"]))
    def read_filtered(self, topic, qid, tag):
        q = self.model.get((topic, qid), [])
        res = self.store.get_messages(topic, qid, 0, 1000, frozenset({tag_hash(tag)}))
        got = [m for m in res.messages() if m.tags == tag]  # the client re-checks the tag
        want = [b for b, t in q if t == tag]
        # one read returns at most max_read_bytes; the model is small enough for one call
        assert [m.body for m in got] == want

    @rule()
    def reopen(self):
        self.store.close()
        self.store = open_store(self.dir, **OPTS)
        assert self.store.recovery_report.clean_shutdown

    @rule(flush_first=st.booleans())
    def crash_and_recover(self, flush_first):
        if flush_first:
            self.store.flush()
        img = self.root / f"crash{next(_ids)}"
        shutil.copytree(self.dir, img, ignore=shutil.ignore_patterns("lock"))
        self.store.close()
        shutil.rmtree(self.dir)
        img.rename(self.dir)
        self.store = open_store(self.dir, **OPTS)
        assert not self.store.recovery_report.clean_shutdown

    @precondition(lambda self: self.last_put is not None)
    @rule(cut=st.integers(1, 50))
    def tear_tail(self, cut):
        """Crash with the last batch half written: exactly that batch is lost."""
        s = self.store
        end = s.commitlog.write_pos
        key, count = self.last_put
        last = s.get_messages(key[0], key[1], len(self.model[key]) - count, 1).batches[0]
        size = len(last.data)
        phys = end - size
        img = self.root / f"torn{next(_ids)}"
        shutil.copytree(self.dir, img, ignore=shutil.ignore_patterns("lock"))
        s.close()
        seg_start = phys - phys % OPTS["segment_size"]
        with open(img / "commitlog" / f"{seg_start:020d}", "r+b") as f:
            at = phys + min(cut, size - 1) - seg_start
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ 0xFF]))  # garbage in the unflushed tail
        # the checkpoint must not claim the torn batch was durable
        import msgspec

        cp = msgspec.json.decode((img / "checkpoint").read_bytes())
        cp["commitlog_flushed"] = min(cp["commitlog_flushed"], phys)
        cp["dispatched"] = min(cp["dispatched"], phys)
        (img / "checkpoint").write_bytes(msgspec.json.encode(cp))
        shutil.rmtree(self.dir)
        img.rename(self.dir)
        self.store = open_store(self.dir, **OPTS)
        rep = self.store.recovery_report
        assert rep.end_offset == phys, rep.summary()
        del self.model[key][-count:]
        self.last_put = None

    @invariant()
    def offsets_match(self):
        for (topic, qid), q in self.model.items():
            assert self.store.max_offset(topic, qid) == len(q)


# A test function, not StoreMachine.TestCase: hypothesis digests the
# machine's source, and for a class inspect.getsource runs ast.parse, which
# CPython 3.11 can fail ('AST constructor recursion depth mismatch') while
# another thread (a client's I/O thread formatting a traceback) parses too.
# A lambda's source is found without ast.
def test_store_matches_the_model() -> None:
    run_state_machine_as_test(lambda: StoreMachine(), settings=settings(
        max_examples=25, stateful_step_count=30, deadline=None))
