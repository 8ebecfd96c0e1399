"""The Prometheus endpoint of a real broker (``tidemq dev --metrics-port 0``): counters follow
sends and pulls, the lag gauge is the backlog a group has left, and bad requests get an HTTP error
without hurting the broker."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from urllib.parse import urlparse

import pytest
from prometheus_client.parser import text_string_to_metric_families

import tidemq

from .wire import start


@pytest.fixture(scope="module")
def dev(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("metrics")
    srv = start(["dev", "--data-dir", str(tmp / "data"), "--namesrv-port", "0",
                 "--broker-port", "0", "--metrics-port", "0", "--log-level", "warning",
                 "-o", "store.segment_size=67108864"], str(tmp / "dev.log"))
    yield srv
    if srv.alive():
        assert srv.stop() == 0, srv.log()


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = resp.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_counters_and_lag_follow_traffic(dev) -> None:
    url = dev.addrs["metrics"]
    ns = dev.addrs["namesrv"]
    with tidemq.Admin(ns) as admin:
        admin.create_topic("mtr", 2)
    with tidemq.Producer(ns) as p:
        for i in range(10):
            p.send(tidemq.Message("mtr", b"x" * 100, keys=f"k{i}"), queue_id=0)
        p.send_batch([tidemq.Message("mtr", b"y" * 50) for _ in range(5)], queue_id=1)
    m = scrape(url)
    assert m[("tidemq_up", (("broker", "broker-a"),))] == 1
    assert m[("tidemq_put_messages_total", (("topic", "mtr"),))] == 15
    assert m[("tidemq_put_batches_total", (("topic", "mtr"),))] == 11
    assert m[("tidemq_put_latency_seconds_count", ())] >= 11
    assert m[("tidemq_commitlog_offset_bytes", (("kind", "max"),))] > 1500

    with tidemq.PullConsumer(ns, "mgroup", consume_from="first") as c:
        c.assign([tidemq.MessageQueue("mtr", "broker-a", 0)])
        got = []
        while len(got) < 10:
            got += c.poll(timeout=2.0)
        c.commit()
    m = scrape(url)
    assert m[("tidemq_got_messages_total", (("group", "mgroup"), ("topic", "mtr")))] == 10
    lag = {k[1]: v for k, v in m.items() if k[0] == "tidemq_consumer_lag_messages"}
    assert lag[(("group", "mgroup"), ("queue", "0"), ("topic", "mtr"))] == 0
    # The group never read queue 1: its whole backlog counts as lag.
    assert lag[(("group", "mgroup"), ("queue", "1"), ("topic", "mtr"))] == 5


def test_bad_requests_get_http_errors_and_the_broker_keeps_serving(dev) -> None:
    url = dev.addrs["metrics"]
    base = url.rsplit("/", 1)[0]
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(base + "/nope", timeout=5)
    assert err.value.code == 404
    u = urlparse(url)
    for junk in (b"\x00\xff garbage\r\n\r\n", b"GET\r\n\r\n", b"x" * 70000):
        with socket.create_connection((u.hostname, u.port), timeout=5) as s:
            s.sendall(junk)
            s.shutdown(socket.SHUT_WR)
            reply = s.recv(4096)
            assert reply == b"" or reply.startswith(b"HTTP/1.1 400")
    assert dev.alive()
    assert ("tidemq_up", (("broker", "broker-a"),)) in scrape(url)
