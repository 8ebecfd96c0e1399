"""The sink's order of rows and of sends (``spark/sink.py``) without Spark: ``sortRows`` puts a
partition's rows in one order that depends only on the set of rows, and the default spread's
windows are sent in row order, rotating over the queues, against a real broker."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("pyspark")

from tests.spark.conftest import create_topic  # noqa: E402

import tidemq  # noqa: E402
from tidemq.spark import sink  # noqa: E402
from tidemq.spark.options import WriteOptions  # noqa: E402

pytestmark = pytest.mark.timeout(120)

_ROW = st.tuples(st.sampled_from(["a", "b", None]), st.binary(max_size=12))


def _batches(rows: list[tuple[str | None, bytes]], cuts: list[int]) -> list[pa.RecordBatch]:
    """``rows`` as Arrow batches cut at ``cuts`` (empty batches included, as Spark may send)."""
    out = []
    at = 0
    for c in [*sorted(cuts), len(rows)]:
        part = rows[at:c]
        out.append(pa.RecordBatch.from_arrays(
            [pa.array([t for t, _ in part], pa.string()), pa.array([b for _, b in part])],
            names=["tags", "body"]))
        at = max(at, c)
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(_ROW, max_size=40), st.randoms(), st.lists(st.integers(0, 40), max_size=4),
       st.lists(st.integers(0, 40), max_size=4))
def test_sorted_rows_depend_only_on_the_set_of_rows(rows, rnd, cuts_a, cuts_b):
    shuffled = list(rows)
    rnd.shuffle(shuffled)
    a = [r for x in sink._sorted(iter(_batches(rows, cuts_a))) for r in x.to_pylist()]
    b = [r for x in sink._sorted(iter(_batches(shuffled, cuts_b))) for r in x.to_pylist()]
    assert a == b
    assert sorted(((r["tags"], r["body"]) for r in a), key=repr) == sorted(rows, key=repr)


def test_default_spread_sends_its_windows_in_row_order_over_the_queues(dev):
    """Windows of batchRows rows go to the queues in turn; they are sent in that order (one
    request per queue in flight), not every window of queue 0 first, then queue 1's..."""
    create_topic(dev, "sk-rotate", 4)
    opts = WriteOptions.parse({"namesrv": dev.namesrv, "topic": "sk-rotate",
                               "batchRows": "100"})
    w = sink._PartitionWriter(opts, "spark-test-rotate-0", 0, 0)
    sent: list[tuple[int, int, int]] = []
    real = w.producer.send_columns_async

    def recording(cols, *, queue_id, sequence_id):  # the real send, recorded
        sent.append((queue_id, sequence_id, len(cols)))
        return real(cols, queue_id=queue_id, sequence_id=sequence_id)

    w.producer.send_columns_async = recording  # type: ignore[method-assign]
    try:
        bodies = [b"row-%04d" % i for i in range(800)]
        w.add(pa.RecordBatch.from_arrays([pa.array(bodies[:750])], names=["body"]))
        w.add(pa.RecordBatch.from_arrays([pa.array(bodies[750:])], names=["body"]))
        stats = w.finish()
    finally:
        w.close()
    assert sent == [(0, 0, 100), (1, 0, 100), (2, 0, 100), (3, 0, 100),
                    (0, 100, 100), (1, 100, 100), (2, 100, 100), (3, 100, 100)]
    assert (stats.rows, stats.duplicates, stats.batches) == (800, 0, 8)
    got: dict[int, list[tuple[int, bytes]]] = {}
    with tidemq.PullConsumer(dev.namesrv, "sk-rotate-check") as c:
        queues = c.fetch_queues("sk-rotate")
        c.assign(queues)
        for mq in queues:
            c.seek(mq, 0)
        for _ in range(60):
            for m in c.poll(1.0):
                got.setdefault(m.queue_id, []).append((m.queue_offset, m.body))
            if sum(map(len, got.values())) >= 800:
                break
    windows = np.arange(800).reshape(8, 100)
    for q in range(4):  # windows q and q + 4, in order, and nothing else
        assert [b for _, b in sorted(got[q])] == [bodies[i] for i in windows[q::4].ravel()]


def test_rows_alike_but_for_their_keys_or_properties_sort_the_same_in_any_order():
    """keys (array<string>) and properties (map) are not sortable Arrow types: rows that
    differ only there must still come out in one order, or a replay swaps their sequences."""
    rows = [{"body": b"same", "keys": k, "properties": p}
            for k in (["k1"], ["k2"], None) for p in ([("a", "1")], [("a", "2")], None)]
    schema = pa.schema([("body", pa.binary()), ("keys", pa.list_(pa.string())),
                        ("properties", pa.map_(pa.string(), pa.string()))])
    outs = set()
    for rot in range(len(rows)):
        shuffled = rows[rot:] + rows[:rot]
        rb = pa.RecordBatch.from_pylist(shuffled, schema=schema)
        outs.add(repr([x.to_pylist() for x in sink._sorted(iter([rb]))]))
    assert len(outs) == 1
