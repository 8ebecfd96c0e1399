"""Epochs and the joining plan (broker/ha/epoch.py, master.plan_welcome) against a model.

The model: a log is a list, one entry per byte, naming the epoch that wrote it. One master per
epoch, so two logs hold the same bytes exactly where their lists agree. Failovers, copies and
writes are played on two brokers; ``consistent_offset`` from their epoch histories must be the
length of the lists' common prefix."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidemq.broker.ha.epoch import EpochFile, consistent_offset
from tidemq.broker.ha.master import plan_welcome
from tidemq.protocol.ha import HaAction, HaHello


def history(log: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for i, e in enumerate(log):
        if not out or out[-1][0] != e:
            out.append((e, i))
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


ops = st.lists(st.tuples(st.sampled_from(["write", "copy", "failover"]), st.integers(0, 6)),
               max_size=25)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_consistent_offset_is_the_common_prefix(script):
    # broker 0 starts as master of epoch 1; broker 1 follows it
    logs: list[list[int]] = [[], []]
    hist: list[list[tuple[int, int]]] = [[(1, 0)], [(1, 0)]]
    master, epoch = 0, 1
    for op, n in script:
        slave = 1 - master
        if op == "write":
            logs[master] += [epoch] * n
        elif op == "copy":  # the slave copies what it can continue (after truncation)
            m, s = logs[master], logs[slave]
            point = consistent_offset(hist[master], len(m), hist[slave], len(s))
            assert point == common_prefix(m, s)
            del s[point:]
            k = min(len(m), point + n)
            s += m[point:k]
            # the welcome hands over the master's history up to there, the first transfer
            # names its current epoch (MasterLink._apply, EpochFile.follow)
            hist[slave] = [h for h in hist[master] if h[1] <= point] or hist[master][:1]
            if hist[master][-1][0] > hist[slave][-1][0]:
                hist[slave].append(hist[master][-1])
        else:  # the slave becomes master of a new epoch from its end
            epoch += 1
            master = slave
            hist[master] = hist[master] + [(epoch, len(logs[master]))]
    slave = 1 - master
    point = consistent_offset(hist[master], len(logs[master]), hist[slave], len(logs[slave]))
    assert point == common_prefix(logs[master], logs[slave])


def test_old_master_rejoining_is_cut_back():
    # A wrote epoch 1 to 1000; B copied 800, was promoted (epoch 2 at 800) and wrote to 900
    assert consistent_offset([(1, 0), (2, 800)], 900, [(1, 0)], 1000) == 800
    # a slave that simply lags continues where it is
    assert consistent_offset([(1, 0), (2, 800)], 900, [(1, 0)], 500) == 500
    assert consistent_offset([(1, 0)], 900, [(1, 0)], 500) == 500
    # no epoch in common: nothing is known to match
    assert consistent_offset([(3, 0)], 900, [(1, 0)], 500) is None


def hello(**kw) -> HaHello:
    base = dict(broker_name="b", broker_id=1, segment_size=4096, min_offset=0, max_offset=0,
                epochs=[(1, 0)])
    base.update(kw)
    return HaHello(**base)  # type: ignore[arg-type]


def plan(h: HaHello, epochs=((1, 0), (2, 800)), mn=0, mx=900):
    return plan_welcome(h, broker_name="b", segment_size=4096, epochs=list(epochs),
                        master_min=mn, master_max=mx)


def test_plans():
    assert plan(hello(empty=True)) == (HaAction.RESET, 0, "")
    assert plan(hello(empty=True), mn=4096 * 3) == (HaAction.RESET, 4096 * 3, "")
    assert plan(hello(max_offset=500)) == (HaAction.APPEND, 500, "")
    assert plan(hello(max_offset=1000)) == (HaAction.TRUNCATE, 800, "")
    # the master no longer has what the slave needs
    assert plan(hello(max_offset=500), mn=4096) == (HaAction.RESET, 4096, "")
    assert "segment sizes differ" in plan(hello(segment_size=8192))[2]
    assert "belongs to" in plan(hello(broker_name="other"))[2]
    assert "no epoch history" in plan(hello(max_offset=500, epochs=[]))[2]
    assert "share nothing" in plan(hello(max_offset=500, epochs=[(7, 0)]))[2]


def test_epoch_file(tmp_path):
    f = EpochFile(str(tmp_path / "epoch")).load()
    assert f.entries == [] and f.last_epoch == 0
    f.append(1, 0)
    f.append(2, 4096)
    assert (tmp_path / "epoch").read_text() == "1 0\n2 4096\n"
    assert EpochFile(str(tmp_path / "epoch")).load().entries == [(1, 0), (2, 4096)]
    with pytest.raises(ValueError, match="cannot follow"):
        f.append(2, 5000)
    f.follow(2, 4096)  # known: nothing changes
    f.follow(3, 8192)
    assert f.entries[-1] == (3, 8192)
    (tmp_path / "bad").write_text("1 0\nnot a line\n")
    with pytest.raises(ValueError, match="line 2"):
        EpochFile(str(tmp_path / "bad")).load()
    (tmp_path / "bad").write_text("2 0\n1 10\n")
    with pytest.raises(ValueError, match="must grow"):
        EpochFile(str(tmp_path / "bad")).load()
