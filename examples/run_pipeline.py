"""`make run`: the whole orders pipeline on one machine, for a bounded time, then a summary.

1. starts ``tidemq dev`` (name server + broker) on ``<data-dir>/pipeline`` (wiped first, so each
   run starts from nothing) on free ports;
2. creates topics ``orders`` (4 queues) and ``order-stats`` (2 queues);
3. starts the Spark job (order_stats_job.py: windowed revenue and counts per region with a
   watermark, written back to tidemq exactly once), the printer (print_stats.py) and the
   producer of order events (order_events.py) for ``--seconds``;
4. sends one far-future ``flush`` event so the watermark closes the last windows, waits for
   the job to drain, prints a summary (events in, results out, duplicates, revenue in vs out,
   the group's lag from ``tidemq group lag``, the query's last progress) and stops everything.

Exit status 0 when the results match the input (every paid cent counted once), else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

from order_events import ProducedStats, produce, send_watermark_flush  # noqa: E402
from print_stats import ReceivedStats, consume  # noqa: E402

import tidemq  # noqa: E402
from tidemq.bench.dev_process import DevProcess  # noqa: E402

TIDEMQ = [sys.executable, "-m", "tidemq.cli.main"]


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def start_dev(data_dir: Path) -> DevProcess:
    """`tidemq dev` on free ports; its log goes to DATA_DIR/../dev.log."""
    try:
        return DevProcess(str(data_dir), log_path=str(data_dir.parent / "dev.log")).start(60)
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None


def stop_spark(spark: object) -> None:
    """Stop the session and wait for its JVM to exit (it otherwise outlives this script by a
    moment, and `make run` promises to leave nothing running)."""
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    jvm = getattr(gateway, "proc", None)
    spark.stop()  # type: ignore[attr-defined]
    if gateway is not None:
        gateway.shutdown()
        SparkContext._gateway = SparkContext._jvm = None
    if jvm is not None:
        if jvm.stdin is not None:
            jvm.stdin.close()  # the JVM exits when its parent's pipe closes
        try:
            jvm.wait(15)
        except subprocess.TimeoutExpired:
            jvm.kill()
            jvm.wait()


def summary(produced: ProducedStats, received: ReceivedStats, lag_text: str,
            progress: dict | None, recent: list[dict], seconds: float) -> bool:
    rev_in = sum(produced.revenue_cents.values())
    rev_out = sum(received.revenue_cents.values())
    ok = (rev_in == rev_out and received.duplicates == 0
          and received.counts == produced.events)
    print()
    print("=" * 72)
    print(f" orders pipeline summary ({seconds:.0f} s)")
    print("=" * 72)
    ev = produced.events
    print(f" events in      {produced.total:>8}  (created {ev['created']}, paid {ev['paid']}, "
          f"shipped {ev['shipped']})")
    print(f" results out    {received.messages:>8}  window x region rows on topic order-stats")
    print(f" duplicates     {received.duplicates:>8}")
    print(f" revenue in     {rev_in / 100:>14,.2f}   (sum of paid amounts sent)")
    print(f" revenue out    {rev_out / 100:>14,.2f}   (sum over result windows)")
    for region in sorted(produced.revenue_cents):
        a, b = produced.revenue_cents[region], received.revenue_cents[region]
        mark = "ok" if a == b else "MISMATCH"
        print(f"   {region:<10} {a / 100:>12,.2f} -> {b / 100:>12,.2f}  {mark}")
    c = received.counts
    print(f" counts out     created {c['created']}, paid {c['paid']}, shipped {c['shipped']}")
    print(" lag (tidemq group lag --group orders-pipeline):")
    for line in lag_text.strip().splitlines():
        print("   " + line)
    busy = [p for p in recent if p.get("numInputRows")]
    if busy:
        rates = [p.get("processedRowsPerSecond", 0) for p in busy]
        print(f" micro-batches  {len(busy):>8}  with data, {sum(p['numInputRows'] for p in busy)} "
              f"rows read, up to {max(rates):,.0f} rows/s processed")
    if progress:
        src = (progress.get("sources") or [{}])[0]
        print(" query progress (lastProgress):")
        print(f"   batchId {progress.get('batchId')}, numInputRows {progress.get('numInputRows')}, "
              f"processedRowsPerSecond {progress.get('processedRowsPerSecond', 0):.0f}")
        print(f"   watermark {progress.get('eventTime', {}).get('watermark')}, "
              f"durationMs {progress.get('durationMs', {}).get('triggerExecution')}")
        print(f"   source endOffset {json.dumps(src.get('endOffset'))}")
        print(f"   sink numOutputRows {progress.get('sink', {}).get('numOutputRows')}")
    print("-" * 72)
    print(" RESULT: " + ("OK - every event counted exactly once" if ok
                         else "FAILED - results do not match the input"))
    print("=" * 72, flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default="./data")
    ap.add_argument("--seconds", type=float, default=50, help="how long to produce events")
    ap.add_argument("--rate", type=int, default=400, help="order events per second")
    ap.add_argument("--quiet", action="store_true", help="do not print each result row")
    a = ap.parse_args()
    t_start = time.monotonic()
    data_dir = Path(a.data_dir) / "pipeline"
    shutil.rmtree(data_dir, ignore_errors=True)
    data_dir.mkdir(parents=True)

    say(f"starting tidemq dev on {data_dir}")
    dev = start_dev(data_dir / "broker")
    namesrv = dev.namesrv
    spark = query = None
    stop_printer = threading.Event()
    printer: threading.Thread | None = None
    received = ReceivedStats()
    produced = ProducedStats()
    ok = False
    try:
        with tidemq.Admin(namesrv) as admin:
            admin.create_topic("orders", 4)
            admin.create_topic("order-stats", 2)
        say(f"tidemq dev ready: namesrv {namesrv}; topics orders (4 queues), order-stats (2)")

        say("starting Spark (local[2]) and the streaming job")
        from order_stats_job import start_job
        from pyspark.sql import SparkSession

        from tidemq.spark import register

        spark = (SparkSession.builder.master("local[2]").appName("orders-pipeline")
                 .config("spark.ui.enabled", "false")
                 .config("spark.ui.showConsoleProgress", "false")
                 .config("spark.sql.shuffle.partitions", "2")
                 .config("spark.driver.bindAddress", "127.0.0.1")
                 .config("spark.sql.session.timeZone", "UTC")
                 .getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
        register(spark)
        query = start_job(spark, namesrv, str(data_dir / "checkpoint"))

        printer = threading.Thread(target=consume, name="printer",
                                   args=(namesrv, stop_printer, received, a.quiet), daemon=True)
        printer.start()
        say(f"producing ~{a.rate} order events/s for {a.seconds:.0f} s "
            "(result windows print as the watermark closes them)")
        produced = produce(namesrv, a.seconds, a.rate)
        say(f"producer done: {produced.total} events; sending the watermark flush event")
        send_watermark_flush(namesrv)

        want = sum(produced.revenue_cents.values())
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline:
            if query.exception() is not None:
                raise query.exception()  # type: ignore[misc]
            if sum(received.revenue_cents.values()) >= want and received.counts == produced.events:
                break
            time.sleep(0.5)
        time.sleep(2.5)  # one more trigger: the source commits the last batch's offsets
        lag = subprocess.run([*TIDEMQ, "group", "lag", "--namesrv", namesrv, "--group",
                              "orders-pipeline"], capture_output=True, text=True, timeout=30)
        stop_printer.set()
        printer.join(10)
        ok = summary(produced, received, lag.stdout or lag.stderr, query.lastProgress,
                     query.recentProgress, time.monotonic() - t_start)
    finally:
        stop_printer.set()
        if query is not None:
            say("stopping the query")
            query.stop()
        if spark is not None:
            stop_spark(spark)
        if printer is not None:
            printer.join(10)
        say("stopping tidemq dev")
        dev.stop(15)
        say(f"done in {time.monotonic() - t_start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
