"""Memory of a broker with 10 000 queues (issue target: RSS <= 300 MB)."""

from __future__ import annotations

import resource

import pytest

from tidemq.protocol.headers import SendMessageRequestHeader

from .wire import RequestCode, ResponseCode, Wire, batch, start

TOPICS = 10
QUEUES_PER_TOPIC = 1000
WINDOW = 256


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_rss_with_10000_queues(tmp_path):
    srv = start(
        ["broker", "--port", "0", "--data-dir", str(tmp_path / "data"), "--log-level", "warning",
         # Small consume-queue files: each is allocated in full on disk (see the report).
         "-o", "store.cq_units_per_file=1024", "-o", "store.segment_size=67108864",
         "-o", "store.index_slots=4096", "-o", "store.index_max_entries=16384"],
        str(tmp_path / "broker.log"),
    )
    try:
        idle = _rss_mb(srv.proc.pid)
        failures: list[str] = []
        ok = 0
        with Wire(srv.addr, timeout=60) as w:
            for t in range(TOPICS):
                assert w.create_topic(f"rss{t}", QUEUES_PER_TOPIC).code == ResponseCode.SUCCESS
            inflight: list[int] = []

            def settle(n: int) -> None:
                nonlocal ok
                while len(inflight) > n:
                    r = w.recv(inflight.pop(0))
                    if r.code == ResponseCode.SUCCESS:
                        ok += 1
                    else:
                        failures.append(r.header.message)

            for t in range(TOPICS):
                topic = f"rss{t}"
                for q in range(QUEUES_PER_TOPIC):
                    h = SendMessageRequestHeader(producer_group="p", topic=topic, queue_id=q)
                    body = bytes(batch(topic, [b"m" * 100], queue_id=q))
                    inflight.append(w.send(RequestCode.SEND_MESSAGE, h, body))
                    settle(WINDOW)
            settle(0)
            info = w.request(RequestCode.GET_BROKER_RUNTIME_INFO).header.table
        rss = _rss_mb(srv.proc.pid)
        print(f"\nbroker RSS: idle {idle:.0f} MB, with {info['queues']} queues holding one "
              f"message each {rss:.0f} MB")
        assert rss <= 300, f"RSS {rss:.0f} MB with {info['queues']} queues"
        if failures:
            limit = resource.getrlimit(resource.RLIMIT_NOFILE)
            assert all("Too many open files" in f for f in failures), failures[:3]
            pytest.xfail(
                f"only {ok} of {TOPICS * QUEUES_PER_TOPIC} queues could be created: the store "
                f"holds 2 descriptors per consume-queue file and RLIMIT_NOFILE is {limit} here "
                f"(RSS was {rss:.0f} MB at {info['queues']} queues)"
            )
        assert info["queues"] == TOPICS * QUEUES_PER_TOPIC
    finally:
        assert srv.stop(timeout=60) == 0
