"""POP state across a real kill -9 of the broker (rmq_sys_POP_LOG, broker/pop_log.py): after the
restart no acked message is delivered again, the unacked in-flight ones stay invisible until
their deadline and come back with attempt + 1, the never-popped ones are delivered, none is
lost; a seek holds across a restart too."""

from __future__ import annotations

import time

import pytest

from tidemq.protocol.pop import AckMessageRequestHeader, PopMessageRequestHeader, SeekRequestHeader
from tidemq.protocol.receipt import decode_receipt

from .test_pop import handles
from .wire import RequestCode, ResponseCode, Wire, error_message, start_broker

TOPIC = "pop_restart"
GROUP = "pop_restart_g"


def _pop(w, max_n, inv_ms):
    r = w.request(RequestCode.POP_MESSAGE, PopMessageRequestHeader(
        consumer_group=GROUP, topic=TOPIC, max_msg_nums=max_n, invisible_ms=inv_ms,
        init_mode="EARLIEST"))
    assert r.code in (ResponseCode.SUCCESS, ResponseCode.PULL_NOT_FOUND), error_message(r)
    return handles(r, TOPIC) if r.code == ResponseCode.SUCCESS else []


def test_kill9_keeps_acks_and_in_flight_deliveries(tmp_path):
    data = tmp_path / "data"
    fast = ("-o", "offset_persist_interval_ms=200")  # POP snapshots every 0.2 s
    srv = start_broker(tmp_path, "", *fast, data_dir=data)
    try:
        with Wire(srv.addr) as w:
            w.create_topic(TOPIC, 2)
            for q in (0, 1):
                w.send_messages(TOPIC, [b"q%d-%d" % (q, i) for i in range(50)], queue_id=q)
            early_at = time.monotonic()
            early = _pop(w, 30, 8000)  # 30 of the 100, half acked, then a snapshot
            r = w.request(RequestCode.ACK_MESSAGE,
                          AckMessageRequestHeader(consumer_group=GROUP, handles=early[::2]))
            assert r.header.results == [0] * 15
            deadline = time.monotonic() + 5
            while not list(data.rglob("pop_windows.snapshot")) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert list(data.rglob("pop_windows.snapshot")), "no POP snapshot written"
            time.sleep(0.5)  # a snapshot holding the early acks is written
            late = _pop(w, 30, 8000)  # records after the snapshot: replayed from the log
            popped = early + late
            assert len(popped) == 60
            acked = early[::2] + late[::3] + late[1::3]  # 35 acked: 15 before, 20 after
            kept = [h for h in popped if h not in set(acked)]  # 25 in flight
            r = w.request(RequestCode.ACK_MESSAGE, AckMessageRequestHeader(
                consumer_group=GROUP, handles=late[::3] + late[1::3]))
            assert r.header.results == [0] * 20
            popped_at = time.monotonic()
        srv.kill9()  # right away: before any offset persist
        srv = start_broker(tmp_path, "", *fast, data_dir=data)
        key = lambda h: (decode_receipt(h).queue_id, decode_receipt(h).offset)  # noqa: E731
        with Wire(srv.addr) as w:
            fresh = _pop(w, 200, 60_000)
            # the 40 never popped, at once; neither acked nor still-invisible ones
            assert len(fresh) == 40, [key(h) for h in fresh]
            assert not {key(h) for h in fresh} & {key(h) for h in popped}
            assert all(decode_receipt(h).attempt == 1 for h in fresh)
            assert time.monotonic() - early_at < 8.0, "restart too slow for this test"
            time.sleep(max(0.0, 8.1 - (time.monotonic() - popped_at)))
            back = _pop(w, 200, 60_000)
            assert sorted(map(key, back)) == sorted(map(key, kept))
            assert all(decode_receipt(h).attempt == 2 for h in back)
            # a stale handle of before the crash is still stale
            r = w.request(RequestCode.ACK_MESSAGE, AckMessageRequestHeader(
                consumer_group=GROUP, handles=kept[:1] + acked[:1] + back + fresh))
            assert r.header.results == [ResponseCode.NO_MESSAGE] * 2 + [0] * 65
            assert _pop(w, 200, 60_000) == []
    finally:
        if srv.alive():
            srv.stop()


def _seek(w, qid, offset):
    r = w.request(RequestCode.SEEK_SUBSCRIPTION, SeekRequestHeader(
        consumer_group=GROUP, topic=TOPIC, queue_id=qid, offset=offset))
    assert r.code == ResponseCode.SUCCESS, error_message(r)
    assert r.header.offsets == {qid: offset}


@pytest.mark.parametrize("crash", [True, False], ids=["kill9", "clean-stop"])
def test_a_seek_survives_a_restart_before_the_next_snapshot(tmp_path, crash):
    """A seek is a POP_LOG record: a restart right after it (no snapshot, no offset persist
    since) serves from the seek's offset -- back over acked messages on queue 0, forward
    past in-flight ones on queue 1 -- not from the state before it."""
    data = tmp_path / "data"
    slow = ("-o", "offset_persist_interval_ms=600000")  # neither a snapshot nor an offset file
    srv = start_broker(tmp_path, "", *slow, data_dir=data)
    key = lambda h: (decode_receipt(h).queue_id, decode_receipt(h).offset)  # noqa: E731
    try:
        with Wire(srv.addr) as w:
            w.create_topic(TOPIC, 2)
            for q in (0, 1):
                w.send_messages(TOPIC, [b"q%d-%d" % (q, i) for i in range(20)], queue_id=q)
            popped = _pop(w, 40, 60_000)
            assert len(popped) == 40
            r = w.request(RequestCode.ACK_MESSAGE, AckMessageRequestHeader(
                consumer_group=GROUP, handles=[h for h in popped if key(h)[0] == 0]))
            assert r.header.results == [0] * 20
            _seek(w, 0, 5)  # back: 5..19 again, though acked
            _seek(w, 1, 15)  # forward: 15..19 at once, though 0..19 are in flight
        if crash:
            srv.kill9()
        else:
            srv.stop()
        srv = start_broker(tmp_path, "", *slow, data_dir=data)
        with Wire(srv.addr) as w:
            got = sorted(map(key, _pop(w, 200, 60_000)))
            assert got == [(0, i) for i in range(5, 20)] + [(1, i) for i in range(15, 20)]
    finally:
        if srv.alive():
            srv.stop()
