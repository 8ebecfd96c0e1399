"""`tidemq bench request` (bench/request_bench.py) against its own `tidemq dev`: every request
is answered SUCCESS, and the result reports the broker's CPU and the round trip."""

from __future__ import annotations

import os
import threading
import time

from tidemq.bench.request_bench import _cpu_ns_since, _threads_ns, bench_request


def test_bench_request_measures_one_message_sends_one_at_a_time_and_pipelined() -> None:
    one = bench_request(count=300, rounds=1, floor=False)
    assert one["errors"] == 0
    assert one["broker_cpu_us_per_request"] > 0
    assert 0 < one["rtt_p50_us"] <= one["rtt_p99_us"]
    assert "floor_cpu_us_per_request" not in one


def test_bench_request_pipelined_window_on_one_connection() -> None:
    many = bench_request(count=500, inflight=16, size=100, rounds=2, floor=False)
    assert many["errors"] == 0 and many["inflight"] == 16
    assert many["requests_per_s"] > 0 and "rtt_p50_us" not in many


def test_the_floor_is_measured_in_the_same_run_and_costs_less_than_the_broker() -> None:
    """The floor server answers every frame with the broker's own answer bytes (a SUCCESS the
    reader accepts: no errors), costs CPU of its own (its process, measured), and less per
    request than the broker, which stores the message; the progress counts both phases."""
    ticks: list[int] = []
    r = bench_request(count=2000, rounds=2, progress=ticks.append)
    assert r["errors"] == 0
    assert ticks == [1, 2, 3, 4]
    assert 0 < r["floor_cpu_us_per_request"] < r["broker_cpu_us_per_request"]
    assert r["broker_cpu_us_above_floor"] == round(
        r["broker_cpu_us_per_request"] - r["floor_cpu_us_per_request"], 2)
    assert 0 < r["floor_rtt_p50_us"] <= r["floor_rtt_p99_us"]


def test_the_cpu_of_a_round_counts_per_thread_so_an_ended_thread_does_not_make_it_negative(
) -> None:
    """A thread that ends during a round takes its run time out of the process's threads: a
    sum over the threads before and after went negative (-230 us per request, seen in a
    `make test` run). Per thread, the round's CPU is never negative."""
    burnt = threading.Event()
    release = threading.Event()

    def burn() -> None:
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.05:  # 50 ms of CPU, more than the rest below
            pass
        burnt.set()
        release.wait(10)

    th = threading.Thread(target=burn)
    th.start()
    assert burnt.wait(10)
    before = _threads_ns(os.getpid())
    release.set()
    th.join()
    assert 0 <= _cpu_ns_since(os.getpid(), before) < 50_000_000
