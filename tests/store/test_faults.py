"""Fault tests: torn tails, bit flips, lost or garbled indexes, kill -9 under SYNC_FLUSH."""

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tidemq.protocol.record import BatchView

from .helpers import batch, open_store, read_all

ROOT = Path(__file__).resolve().parents[2]


def crash_image(store, dest: Path) -> Path:
    """Copy the data directory of an open store: what a crash at this instant leaves on disk
    (page cache included; no close, abort marker present, checkpoint as last saved)."""
    shutil.copytree(store.dir, dest, ignore=shutil.ignore_patterns("lock"))
    return dest


def test_kill_between_a_puts_copy_and_its_stamp_keeps_the_queue(tmp_path):
    """A put copies the producer's batch into the mapping, then stamps its store fields. The
    producer's batch passes both CRCs with phys and queue offset 0; a kill -9 between copy
    and stamp left exactly that at the tail, and recovery re-dispatched it at queue offset 0:
    the queue was cut back to one batch and new puts re-used acknowledged offsets (a rare
    failure of the kill -9 test below). The unstamped batch is a torn tail, never data."""
    with open_store(tmp_path / "live", segment_size=16384) as s:
        acked = [s.put(batch("t", [f"m{i}-{j}".encode() for j in range(2)])) for i in range(5)]
        s.flush()
        end = s.commitlog.write_pos
        d = crash_image(s, tmp_path / "crash")
    unstamped = batch("t", [b"never acknowledged"])  # as the producer encoded it
    assert BatchView(unstamped).queue_offset == 0
    with open(d / "commitlog" / f"{0:020d}", "r+b") as f:
        f.seek(end)
        f.write(unstamped)
    with open_store(d, segment_size=16384) as s:
        rep = s.recovery_report
        assert s.cqs.find("t", 0).max_offset == 10  # was 1: cut back by the unstamped batch
        assert rep.truncated and rep.truncated[0][1] == end, rep.summary()
        msgs, _ = read_all(s, "t")
        assert [m.queue_offset for m in msgs] == list(range(10))
        assert [m.body for m in msgs] == [f"m{i}-{j}".encode() for i in range(5) for j in range(2)]
        assert [r.queue_offset for r in acked] == [0, 2, 4, 6, 8]
        assert s.put(batch("t", [b"next"])).queue_offset == 10


def test_truncate_at_every_byte_of_the_last_batch(tmp_path):
    src = tmp_path / "live"
    s = open_store(src, segment_size=16384)
    bodies = [f"message-{i}".encode() for i in range(20)]
    for i in range(0, 20, 2):
        s.put(batch("t", bodies[i : i + 2], keys=f"k{i}"))
    s.flush()  # checkpoint: everything so far is durable and dispatched
    last = s.put(batch("t", [b"last-1", b"last-2", b"last-3"], keys="klast"))
    img = crash_image(s, tmp_path / "img")
    s.close()
    seg_path = img / "commitlog" / f"{0:020d}"
    for cut in range(last.size):
        d = tmp_path / f"cut{cut}"
        shutil.copytree(img, d)
        with open(d / "commitlog" / seg_path.name, "r+b") as f:
            f.truncate(last.phys_offset + cut)
        st = open_store(d, segment_size=16384)
        try:
            msgs, _ = read_all(st, "t")
            assert [m.body for m in msgs] == bodies, f"cut at {cut}"
            rep = st.recovery_report
            assert not rep.clean_shutdown
            assert rep.end_offset == last.phys_offset
            if cut:
                (f, pos, n) = rep.truncated[0]
                assert f.endswith(seg_path.name) and pos == last.phys_offset and n <= cut
            assert st.query_by_key("t", "klast") == []
            # the store keeps working after recovery, from the right offsets
            r = st.put(batch("t", [b"again"]))
            assert r.queue_offset == 20 and r.phys_offset == last.phys_offset
        finally:
            st.close()
        shutil.rmtree(d)
    # no cut at all: the whole last batch survives
    st = open_store(img, segment_size=16384)
    msgs, _ = read_all(st, "t")
    assert [m.body for m in msgs][-3:] == [b"last-1", b"last-2", b"last-3"]
    st.close()


@pytest.mark.parametrize("where", ["store_header", "producer_section", "framing", "last_batch"])
def test_bit_flip_is_detected_reported_and_contained(tmp_path, where):
    d = tmp_path / "s"
    puts = []
    with open_store(d, segment_size=16384) as s:
        for i in range(12):
            puts.append(s.put(batch("t", [f"m{i}-{j}".encode() for j in range(3)])))
    victim = puts[-1] if where == "last_batch" else puts[5]
    off = {
        "store_header": 30,
        "producer_section": victim.size - 2,
        "framing": 1,
        "last_batch": victim.size - 2,
    }[where]
    seg = d / "commitlog" / f"{0:020d}"
    with open(seg, "r+b") as f:
        f.seek(victim.phys_offset + off)
        byte = f.read(1)[0]
        f.seek(victim.phys_offset + off)
        f.write(bytes([byte ^ 0x10]))
    # Detected on read even after a clean shutdown (both CRCs are verified on every read) ...
    with open_store(d, segment_size=16384) as s:
        msgs, _ = read_all(s, "t")
        expected = [
            f"m{i}-{j}".encode() for i in range(12) for j in range(3) if puts[i] is not victim
        ]
        assert [m.body for m in msgs] == expected
        assert victim.phys_offset in s.quarantine
    # ... and by recovery after a crash: reported with file and position, the rest kept.
    (d / "abort").touch()
    (d / "checkpoint").unlink()
    with open_store(d, segment_size=16384) as s:
        rep = s.recovery_report
        assert rep.rebuilt_indexes
        if where == "last_batch":
            # nothing after it and not known durable: indistinguishable from a torn write
            assert rep.truncated and rep.truncated[0][1] == victim.phys_offset
        else:
            (q,) = rep.quarantined
            assert q.file.endswith(seg.name) and q.position == victim.phys_offset
            assert q.reason
        msgs, _ = read_all(s, "t")
        assert [m.body for m in msgs] == expected
        if where != "last_batch":
            # queue offsets of later messages did not move
            assert msgs[-1].queue_offset == 35


def test_reads_verify_the_crcs_of_what_an_earlier_process_wrote(tmp_path):
    """A batch this store appended was checked on its way in and is served from the same
    memory: reads do not re-verify it (the consumer's own CRC check catches a later flip);
    after a restart the same bytes come from the disk and are verified, the damage found."""
    d = tmp_path / "s"
    with open_store(d, segment_size=16384) as s:
        puts = [s.put(batch("t", [f"m{i}-{j}".encode() for j in range(3)])) for i in range(4)]
        victim = puts[2]
        seg = d / "commitlog" / f"{0:020d}"
        with open(seg, "r+b") as f:  # the mapping shares the page cache: the read sees it
            f.seek(victim.phys_offset + victim.size - 2)
            byte = f.read(1)[0]
            f.seek(victim.phys_offset + victim.size - 2)
            f.write(bytes([byte ^ 0x10]))
        res = s.get_messages("t", 0, 0, 1000)
        assert len(res.batches) == 4  # all four served, the damaged one too
        damaged = BatchView(res.batches[2].data)
        assert not damaged.batch_crc_ok()
        assert victim.phys_offset not in s.quarantine
    with open_store(d, segment_size=16384) as s:
        msgs, _ = read_all(s, "t")
        assert [m.body for m in msgs] == [
            f"m{i}-{j}".encode() for i in range(4) for j in range(3) if i != 2]
        assert victim.phys_offset in s.quarantine


@pytest.mark.parametrize(
    "damage", ["delete_cq", "garble_cq", "delete_index", "garble_index", "garble_checkpoint"]
)
def test_lost_or_garbled_indexes_are_rebuilt(tmp_path, damage):
    d = tmp_path / "s"
    with open_store(d) as s:
        for i in range(50):
            s.put(batch("t", [f"v{i}".encode()] * 2, queue_id=i % 2, keys=f"key{i}"))
    if damage == "delete_cq":
        shutil.rmtree(d / "cqlog")
    elif damage == "garble_cq":
        f = sorted((d / "cqlog").iterdir())[0]
        raw = bytearray(f.read_bytes())
        raw[40:60] = os.urandom(20)
        f.write_bytes(raw)
    elif damage == "delete_index":
        shutil.rmtree(d / "index")
    elif damage == "garble_index":
        f = sorted((d / "index").iterdir())[0]
        raw = bytearray(f.read_bytes())
        raw[0:40] = os.urandom(40)
        f.write_bytes(raw)
    elif damage == "garble_checkpoint":
        (d / "checkpoint").write_bytes(b"{not json")
    with open_store(d) as s:
        assert s.recovery_report.rebuilt_indexes, s.recovery_report.summary()
        for q in (0, 1):
            msgs, _ = read_all(s, "t", q)
            assert [m.body for m in msgs] == [
                f"v{i}".encode() for i in range(q, 50, 2) for _ in range(2)
            ]
        assert [m.body for m in s.query_by_key("t", "key33")] == [b"v33", b"v33"]


WRITER = r"""
import sys, os
sys.path.insert(0, os.path.join(sys.argv[2], "tests"))
from store.helpers import FlushMode, batch, open_store
s = open_store(sys.argv[1], segment_size=32768, flush_mode=FlushMode.SYNC)
n = int(sys.argv[3])
out = sys.stdout
while True:
    r = s.put(batch("t", [f"{n}-{j}".encode() * 10 for j in range(1 + n % 3)], keys=f"w{n}"))
    out.write(f"{r.queue_offset} {r.count} {n}\n")
    out.flush()
    n += 1
"""


def test_sigkill_during_sync_flush_loses_no_acknowledged_put(tmp_path):
    d = tmp_path / "s"
    d.mkdir()
    acked: dict[int, tuple[int, int]] = {}
    rng = random.Random(1234)
    n = 0
    for _ in range(20):
        p = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(d), str(ROOT), str(n)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        first = p.stdout.readline()  # the writer is up and has had one put acknowledged
        time.sleep(rng.random() * 0.3)  # then it dies at a random moment
        p.send_signal(signal.SIGKILL)
        out, err = p.communicate()
        lines = [ln for ln in (first + out).splitlines() if ln.count(" ") == 2]
        assert lines, err
        for ln in lines:
            qoff, count, k = map(int, ln.split())
            acked[k] = (qoff, count)
        n = max(acked) + 1
    with open_store(d, segment_size=32768) as s:
        msgs, _ = read_all(s, "t")
        by_offset = {m.queue_offset: m.body for m in msgs}
        for k, (qoff, count) in acked.items():
            for j in range(count):
                assert by_offset.get(qoff + j) == f"{k}-{j}".encode() * 10, (k, j)
        assert len(msgs) == len(by_offset) == max(by_offset) + 1  # no holes
        # every batch in the log passes its CRCs
        for m in msgs[:: max(1, len(msgs) // 50)]:
            BatchView(s.commitlog.read_batch(m.phys_offset).bytes_view).verify()
    print(f"{len(acked)} acknowledged puts over 20 kills, {len(msgs)} messages recovered")
