"""`tidemq bench request` (bench/request_bench.py) against its own `tidemq dev`: every request
is answered SUCCESS, and the result reports the broker's CPU and the round trip."""

from __future__ import annotations

from tidemq.bench.request_bench import bench_request


def test_bench_request_measures_one_message_sends_one_at_a_time_and_pipelined() -> None:
    one = bench_request(count=300, rounds=1)
    assert one["errors"] == 0
    assert one["broker_cpu_us_per_request"] > 0
    assert 0 < one["rtt_p50_us"] <= one["rtt_p99_us"]


def test_bench_request_pipelined_window_on_one_connection() -> None:
    many = bench_request(count=500, inflight=16, size=100, rounds=2)
    assert many["errors"] == 0 and many["inflight"] == 16
    assert many["requests_per_s"] > 0 and "rtt_p50_us" not in many
