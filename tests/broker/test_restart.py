"""Durability across broker restarts: consumer offsets, topics and messages; SYNC_FLUSH sends."""

from __future__ import annotations

import json
import time

from .wire import RequestCode, ResponseCode, Wire, decode_pull, start_broker

R = ResponseCode


def _query(w: Wire, group: str, topic: str, qid: int) -> int | None:
    r = w.request(RequestCode.QUERY_CONSUMER_OFFSET,
                  {"consumer_group": group, "topic": topic, "queue_id": qid})
    return r.header.offset if r.code == R.SUCCESS else None


def test_offsets_topics_and_messages_survive_a_clean_restart(tmp_path):
    data = tmp_path / "data"
    srv = start_broker(tmp_path, "", data_dir=data)
    with Wire(srv.addr) as w:
        assert w.create_topic("orders", 3).code == R.SUCCESS
        w.send_messages("orders", [b"a", b"b", b"c"], queue_id=2)
        w.request(RequestCode.UPDATE_CONSUMER_OFFSET,
                  {"consumer_group": "g", "topic": "orders", "queue_id": 2, "commit_offset": 2})
    assert srv.stop() == 0
    srv = start_broker(tmp_path, "", data_dir=data)
    try:
        with Wire(srv.addr) as w:
            assert _query(w, "g", "orders", 2) == 2
            tc = w.request(RequestCode.GET_ALL_TOPIC_CONFIG).header.topics["orders"]
            assert tc.read_queue_nums == 3
            p = w.pull("orders", 2, queue_id=2)
            assert [m.body for m in decode_pull(p, 2)] == [b"c"]
    finally:
        assert srv.stop() == 0


def test_offsets_survive_kill_9_after_the_periodic_persist(tmp_path):
    data = tmp_path / "data"
    srv = start_broker(tmp_path, "", "-o", "offset_persist_interval_ms=300", data_dir=data)
    with Wire(srv.addr) as w:
        w.send_messages("t", [b"x"] * 10)
        for qid, off in ((0, 7),):
            w.request(RequestCode.UPDATE_CONSUMER_OFFSET,
                      {"consumer_group": "g", "topic": "t", "queue_id": qid, "commit_offset": off})
        w.pull("t", 7, group="g2", commit_offset=9)  # piggy-backed commit
    time.sleep(1.0)  # > the persist interval
    srv.kill9()
    saved = json.loads((data / "config" / "consumer_offsets.json").read_text())
    assert saved["offset_table"]["t@g"] == {"0": 7}
    assert not (data / "config" / "consumer_offsets.json.tmp").exists()
    srv = start_broker(tmp_path, "", data_dir=data)
    try:
        with Wire(srv.addr) as w:
            assert _query(w, "g", "t", 0) == 7
            assert _query(w, "g2", "t", 0) == 9
            assert "t" in w.request(RequestCode.GET_ALL_TOPIC_CONFIG).header.topics
    finally:
        assert srv.stop() == 0


def test_sync_flush_acknowledges_after_fsync(tmp_path):
    srv = start_broker(tmp_path, "", "--flush", "sync")
    try:
        with Wire(srv.addr) as w:
            r = w.send_messages("s", [b"durable"])
            assert r.code == R.SUCCESS and r.header.queue_offset == 0
            info = w.request(RequestCode.GET_BROKER_RUNTIME_INFO).header.table
            assert info["flush_mode"] == "sync"
            assert info["commitlog_flushed_offset"] >= info["commitlog_max_offset"]
            # Many sends in flight share fsyncs (group commit) and all succeed.
            ops = [w.send(RequestCode.SEND_MESSAGE, *_send_args("s", i)) for i in range(300)]
            t0 = time.perf_counter()
            codes = [w.recv(o, timeout=10).code for o in ops]
            took = time.perf_counter() - t0
            assert codes == [R.SUCCESS] * 300
            print(f"\n300 pipelined SYNC_FLUSH sends acknowledged in {took * 1000:.1f} ms")
            assert w.request(RequestCode.GET_MAX_OFFSET,
                             {"topic": "s", "queue_id": 0}).header.offset == 301
    finally:
        assert srv.stop() == 0


def test_sync_flush_timeout_answers_flush_disk_timeout_with_the_place(tmp_path):
    srv = start_broker(tmp_path, "", "--flush", "sync", "-o", "store.sync_flush_timeout_ms=0")
    try:
        with Wire(srv.addr) as w:
            rs = [w.send_messages("s", [f"m{i}".encode()]) for i in range(20)]
            assert {r.code for r in rs} <= {R.SUCCESS, R.FLUSH_DISK_TIMEOUT}
            late = [r for r in rs if r.code == R.FLUSH_DISK_TIMEOUT]
            assert late, "a 0 ms flush timeout never fired"
            # Stored all the same, with its place in the response (not an error: no retry).
            assert late[0].header.count == 1
            p = w.pull("s", 0)
            assert len(decode_pull(p, 0)) == 20
    finally:
        assert srv.stop() == 0


def _send_args(topic: str, i: int):
    from tidemq.protocol.headers import SendMessageRequestHeader

    from .wire import batch

    return (
        SendMessageRequestHeader(producer_group="p", topic=topic, queue_id=0),
        bytes(batch(topic, [f"m{i}".encode()])),
    )


def test_start_errors_are_reported_not_raised(tmp_path):
    import subprocess
    import sys

    from support.cluster import _env

    srv = start_broker(tmp_path, "", data_dir=tmp_path / "d")
    try:
        base = [sys.executable, "-m", "tidemq.cli.main", "broker"]
        port = srv.addr.rpartition(":")[2]
        r = subprocess.run([*base, "--port", port, "--data-dir", str(tmp_path / "e")],
                           capture_output=True, text=True, env=_env(), timeout=30)
        assert r.returncode == 1 and r.stdout == ""
        assert "address already in use" in r.stderr
        r = subprocess.run([*base, "--port", "0", "--data-dir", str(tmp_path / "d")],
                           capture_output=True, text=True, env=_env(), timeout=30)
        assert r.returncode == 1 and "in use by another tidemq process" in r.stderr
        r = subprocess.run([*base, "-o", "no_such_setting=1"],
                           capture_output=True, text=True, env=_env(), timeout=30)
        assert r.returncode == 2 and "unknown broker setting 'no_such_setting'" in r.stderr
        # The running broker was not disturbed (its topics file was not overwritten).
        with Wire(srv.addr) as w:
            assert w.send_messages("still", [b"x"]).code == R.SUCCESS
    finally:
        assert srv.stop() == 0
