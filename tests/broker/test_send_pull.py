"""Send and pull against a real broker process: every pull status, tags, batches, long polling."""

from __future__ import annotations

import time

import pytest

from tidemq.protocol.codes import PullStatus, pull_status
from tidemq.protocol.record import unique_id

from .wire import RequestCode, ResponseCode, Wire, decode_pull, start_broker


def test_single_send_returns_its_place_and_pull_finds_it(wire, topic):
    r = wire.send_messages(topic, [b"hello"], queue_id=3, tags="A", producer_id=0xAB, base_seq=5)
    assert r.code == ResponseCode.SUCCESS
    assert (r.header.queue_id, r.header.queue_offset, r.header.count) == (3, 0, 1)
    assert r.header.msg_id == unique_id(0xAB, 5)
    p = wire.pull(topic, 0, queue_id=3)
    assert pull_status(p.code) is PullStatus.FOUND
    assert (p.header.next_begin_offset, p.header.min_offset, p.header.max_offset) == (1, 0, 1)
    [m] = decode_pull(p, 0)
    assert (m.body, m.tags, m.queue_offset, m.msg_id) == (b"hello", "A", 0, unique_id(0xAB, 5))
    assert m.store_ts > 0


def test_send_answers_the_message_id_of_its_first_message_at_the_u64_extremes(wire, topic):
    """The send path formats the id itself (SendProcessor.handle): it must be record.unique_id
    for every producer id and sequence a batch can carry, zeros and all-ones digits included."""
    for pid, seq in ((1, 0), (0x7FFF_FFFF_FFFF_FFFF, 2**64 - 1), (0x1234, 0xABCDEF)):
        r = wire.send_messages(topic, [b"x"], producer_id=pid, base_seq=seq)
        assert r.code == ResponseCode.SUCCESS
        assert r.header.msg_id == unique_id(pid, seq)


def test_batch_keeps_one_offset_per_message_and_is_served_whole(wire, topic):
    wire.send_messages(topic, [b"m0"])
    r = wire.send_messages(topic, [b"m1", b"m2", b"m3", b"m4"], producer_id=9, base_seq=100)
    assert r.code == ResponseCode.SUCCESS
    assert (r.header.queue_offset, r.header.count) == (1, 4)
    assert r.header.msg_id == unique_id(9, 100)
    # Pull from the middle of the batch: the body holds the whole batch (starting at offset 1);
    # the client skips to the requested offset.
    p = wire.pull(topic, 3)
    assert p.code == ResponseCode.SUCCESS
    assert p.header.next_begin_offset == 5
    msgs = decode_pull(p, 3)
    assert [(m.queue_offset, m.body) for m in msgs] == [(3, b"m3"), (4, b"m4")]
    assert msgs[0].msg_id == unique_id(9, 102)
    # max_msg_nums bounds the batches, not the messages of a batch: one batch is never split.
    p = wire.pull(topic, 0, max_msgs=1)
    assert p.code == ResponseCode.SUCCESS and p.header.next_begin_offset == 1
    assert [m.body for m in decode_pull(p, 0)] == [b"m0"]


def test_no_new_msg_at_max_offset_without_suspend(wire, topic):
    wire.send_messages(topic, [b"a", b"b"])
    p = wire.pull(topic, 2)
    assert pull_status(p.code) is PullStatus.NO_NEW_MSG
    assert (p.header.next_begin_offset, p.header.max_offset) == (2, 2)
    assert p.body == b""


def test_no_new_msg_on_an_empty_queue_at_offset_zero(wire, topic):
    assert wire.create_topic(topic, 4).code == ResponseCode.SUCCESS
    p = wire.pull(topic, 0, queue_id=2)
    assert pull_status(p.code) is PullStatus.NO_NEW_MSG
    assert p.header.next_begin_offset == 0


def test_held_pull_answers_no_new_msg_at_its_suspend_timeout(wire, topic):
    wire.send_messages(topic, [b"a"])
    t0 = time.monotonic()
    p = wire.pull(topic, 1, suspend_ms=400)
    took = time.monotonic() - t0
    assert pull_status(p.code) is PullStatus.NO_NEW_MSG
    assert p.header.next_begin_offset == 1
    assert 0.35 <= took < 2.0, took


def test_no_matched_msg_with_a_tag_filter(wire, topic):
    wire.send_messages(topic, [b"a", b"b", b"c"], tags=["X", "Y", "X"])
    p = wire.pull(topic, 0, subscription="Z || W")
    assert pull_status(p.code) is PullStatus.NO_MATCHED_MSG
    assert p.header.next_begin_offset == 3  # skipped past what cannot match
    p = wire.pull(topic, 0, subscription="Y")
    assert p.code == ResponseCode.SUCCESS
    # The broker filters whole batches by tag hash; the client re-checks each tag.
    assert [m.body for m in decode_pull(p, 0, tags={"Y"})] == [b"b"]
    p = wire.pull(topic, 0, subscription="*")
    assert [m.body for m in decode_pull(p, 0)] == [b"a", b"b", b"c"]


def test_a_batch_without_the_tag_is_skipped(wire, topic):
    wire.send_messages(topic, [b"x1", b"x2"], tags="X")
    wire.send_messages(topic, [b"y1"], tags="Y")
    p = wire.pull(topic, 0, subscription="Y")
    assert p.code == ResponseCode.SUCCESS
    assert [(m.queue_offset, m.body) for m in decode_pull(p, 0)] == [(2, b"y1")]


def test_offset_illegal_past_the_end_is_corrected(wire, topic):
    wire.send_messages(topic, [b"a", b"b", b"c"])
    p = wire.pull(topic, 50)
    assert pull_status(p.code) is PullStatus.OFFSET_ILLEGAL
    # RocketMQ's correction: past the end with min offset 0 -> restart from min (0).
    assert (p.header.next_begin_offset, p.header.min_offset, p.header.max_offset) == (0, 0, 3)


def test_offset_illegal_on_an_empty_queue_with_a_nonzero_offset(wire, topic):
    assert wire.create_topic(topic, 2).code == ResponseCode.SUCCESS
    p = wire.pull(topic, 7, queue_id=1)
    assert pull_status(p.code) is PullStatus.OFFSET_ILLEGAL
    assert p.header.next_begin_offset == 0


def test_status_table_is_rocketmqs():
    from tidemq.broker.pull_processor import response_code_for
    from tidemq.store.message_store import GetStatus as S

    R = ResponseCode
    assert response_code_for(S.FOUND, 5) == R.SUCCESS
    assert response_code_for(S.NO_MATCHED_MESSAGE, 5) == R.PULL_RETRY_IMMEDIATELY
    assert response_code_for(S.MESSAGE_WAS_REMOVING, 5) == R.PULL_RETRY_IMMEDIATELY
    assert response_code_for(S.OFFSET_FOUND_NULL, 5) == R.PULL_NOT_FOUND
    assert response_code_for(S.OFFSET_OVERFLOW_ONE, 5) == R.PULL_NOT_FOUND
    assert response_code_for(S.OFFSET_OVERFLOW_BADLY, 5) == R.PULL_OFFSET_MOVED
    assert response_code_for(S.OFFSET_TOO_SMALL, 5) == R.PULL_OFFSET_MOVED
    for s in (S.NO_MESSAGE_IN_QUEUE, S.NO_MATCHED_LOGIC_QUEUE):
        assert response_code_for(s, 0) == R.PULL_NOT_FOUND
        assert response_code_for(s, 3) == R.PULL_OFFSET_MOVED


def test_tag_expressions():
    from tidemq.protocol.batch.tags import tag_hashes
    from tidemq.protocol.record import tag_hash

    assert tag_hashes(None) is None
    assert tag_hashes(" * ") is None
    assert tag_hashes("") is None
    assert tag_hashes("A || B") == {tag_hash("A"), tag_hash("B")}
    assert tag_hashes("A||") == {tag_hash("A")}
    assert tag_hashes("A || *") == {tag_hash("A"), tag_hash("*")}
    with pytest.raises(ValueError):
        tag_hashes("||")


def test_a_star_among_tags_is_a_tag_not_everything(wire, topic):
    """RocketMQ's FilterAPI reading: "A || *" is the tags {A, *}. The broker used to serve
    everything for it while the client kept only A and *, so B-tagged messages were fetched
    and silently dropped."""
    wire.send_messages(topic, [b"a"], tags="A")
    wire.send_messages(topic, [b"b"], tags="B")
    wire.send_messages(topic, [b"star"], tags="*")
    p = wire.pull(topic, 0, subscription="A || *")
    assert p.code == ResponseCode.SUCCESS
    assert [(m.queue_offset, m.body) for m in decode_pull(p, 0)] == [(0, b"a"), (2, b"star")]


# -- long polling ----------------------------------------------------------------------------------


def test_long_poll_wakes_within_milliseconds_of_a_send(broker, wire, topic):
    wire.send_messages(topic, [b"first"])
    latencies = []
    for i in range(5):
        held = wire.pull_header(topic, 1 + i, suspend_ms=5000)
        opaque = wire.send(RequestCode.PULL_MESSAGE, held)
        time.sleep(0.1)  # the pull is held now
        with Wire(broker.addr) as producer:
            t0 = time.perf_counter()
            producer.send_messages(topic, [f"m{i}".encode()], oneway=True)
            p = wire.recv(opaque, timeout=10)
            latencies.append((time.perf_counter() - t0) * 1000)
        assert p.code == ResponseCode.SUCCESS
        assert [m.body for m in decode_pull(p, 1 + i)] == [f"m{i}".encode()]
    print(f"\nlong-poll wake latency (ms): {[round(x, 2) for x in latencies]}")
    # The periodic check runs every 5 s; a wake well under 100 ms can only be the arrival hook.
    assert max(latencies) < 100, latencies


def test_woken_pull_rechecks_the_tag_filter(broker, wire, topic):
    wire.send_messages(topic, [b"a"], tags="A")
    opaque = wire.send(
        RequestCode.PULL_MESSAGE, wire.pull_header(topic, 1, suspend_ms=5000, subscription="B")
    )
    time.sleep(0.1)
    with Wire(broker.addr) as producer:
        producer.send_messages(topic, [b"not-for-you"], tags="A")
        with pytest.raises(TimeoutError):
            wire.recv(opaque, timeout=0.4)  # an A message does not wake a B subscriber
        t0 = time.perf_counter()
        producer.send_messages(topic, [b"for-you"], tags="B")
        p = wire.recv(opaque, timeout=10)
        took = time.perf_counter() - t0
    assert p.code == ResponseCode.SUCCESS
    assert [m.body for m in decode_pull(p, 1, tags={"B"})] == [b"for-you"]
    assert took < 0.5


def test_many_held_pulls_on_one_queue_all_wake(broker, topic):
    wire_conns = [Wire(broker.addr) for _ in range(5)]
    try:
        wire_conns[0].create_topic(topic, 1)
        ops = [w.send(RequestCode.PULL_MESSAGE, w.pull_header(topic, 0, suspend_ms=5000))
               for w in wire_conns]
        time.sleep(0.1)
        with Wire(broker.addr) as producer:
            producer.send_messages(topic, [b"x"])
        for w, o in zip(wire_conns, ops, strict=True):
            p = w.recv(o, timeout=3)
            assert p.code == ResponseCode.SUCCESS
    finally:
        for w in wire_conns:
            w.close()


def test_closing_a_connection_with_a_held_pull_is_harmless(broker, wire, topic):
    with Wire(broker.addr) as w:
        w.send(RequestCode.PULL_MESSAGE, w.pull_header(topic, 0, suspend_ms=5000))
        time.sleep(0.05)
    time.sleep(0.05)
    assert wire.send_messages(topic, [b"after"]).code == ResponseCode.SUCCESS
    assert wire.pull(topic, 0).code == ResponseCode.SUCCESS


def test_short_polling_when_long_polling_is_off(tmp_path):
    """Long polling off: no wake on arrival; held pulls are answered by the 1 s check."""
    srv = start_broker(tmp_path, "", "--no-long-polling", "-o", "short_polling_time_ms=600")
    try:
        with Wire(srv.addr) as w, Wire(srv.addr) as producer:
            w.create_topic("sp", 1)
            t0 = time.monotonic()
            p = w.pull("sp", 0, suspend_ms=10_000)  # the broker holds it 0.6 s, not 10 s
            assert pull_status(p.code) is PullStatus.NO_NEW_MSG
            assert 0.5 <= time.monotonic() - t0 < 2.5
            opaque = w.send(RequestCode.PULL_MESSAGE, w.pull_header("sp", 0, suspend_ms=10_000))
            producer.send_messages("sp", [b"x"])
            p = w.recv(opaque, timeout=5)
            assert p.code == ResponseCode.SUCCESS
            info = w.request(RequestCode.GET_BROKER_RUNTIME_INFO).header.table
            # Not woken by the arrival: found by the check (or at its short deadline).
            assert info["held_woken_by_arrival"] == 0
            assert info["held_woken_by_check"] + info["held_timed_out"] == 2
    finally:
        assert srv.stop() == 0


def test_periodic_check_answers_held_pulls_when_a_wake_was_missed(tmp_path):
    """The fallback check (RocketMQ's checkHoldRequest) finds messages the arrival hook did not
    announce: a filtered pull is re-run, so it gets NO_MATCHED_MSG at the next check."""
    srv = start_broker(tmp_path, "", "-o", "long_polling_check_ms=300")
    try:
        with Wire(srv.addr) as w, Wire(srv.addr) as producer:
            w.create_topic("pc", 1)
            opaque = w.send(
                RequestCode.PULL_MESSAGE,
                w.pull_header("pc", 0, suspend_ms=10_000, subscription="B"),
            )
            time.sleep(0.05)
            producer.send_messages("pc", [b"a"], tags="A")  # arrival: no match, stays held
            t0 = time.monotonic()
            p = w.recv(opaque, timeout=5)
            took = time.monotonic() - t0
            assert pull_status(p.code) is PullStatus.NO_MATCHED_MSG
            assert p.header.next_begin_offset == 1
            assert took < 2.0
    finally:
        assert srv.stop() == 0
