"""One traced `bench e2e` run: a fresh `tidemq dev` (trace_dev.py) and the traced bench
(trace_bench.py), both with the tidemq on PYTHONPATH (or installed), at `nice -n 10`.

    python bench/e2e_trace/run.py OUT_DIR TAG [SECONDS]   # writes OUT_DIR/TAG.{broker,client}.pkl
    python bench/e2e_trace/stages.py OUT_DIR/TAG [OUT_DIR/TAG2 ...]

E2E_CENSUS=1: both processes on asyncio's own loop with every callback timed (wall and thread
CPU; the long ones kept); E2E_GCONLY=1 in trace_dev: only collections are recorded."""
import os
import shutil
import subprocess
import sys
import tempfile

here = os.path.dirname(os.path.abspath(__file__))
out_dir, tag = sys.argv[1], sys.argv[2]
secs = sys.argv[3] if len(sys.argv) > 3 else "10"
os.makedirs(out_dir, exist_ok=True)
data = tempfile.mkdtemp(prefix="e2e-trace-", dir=out_dir)
env = {**os.environ, "PYTHONUNBUFFERED": "1",
       "E2E_TRACE_OUT": os.path.join(out_dir, f"{tag}.broker.pkl")}
dev = subprocess.Popen(["nice", "-n", "10", sys.executable, os.path.join(here, "trace_dev.py"), "dev",
                        "--data-dir", data, "--namesrv-port", "0", "--broker-port", "0",
                        "--log-level", "warning"],
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
try:
    line = ""
    while True:
        line = dev.stdout.readline()
        if line.startswith("tidemq dev ready") or not line:
            break
    f = dict(p.split("=", 1) for p in line.split()[3:])
    env["E2E_BROKER_PORT"] = f["broker"].rsplit(":", 1)[1]
    r = subprocess.run(["nice", "-n", "10", sys.executable, os.path.join(here, "trace_bench.py"),
                        f["namesrv"], os.path.join(out_dir, f"{tag}.client.pkl"), secs],
                       capture_output=True, text=True, env=env)
    print(r.stdout.strip(), r.stderr[-2000:])
finally:
    dev.terminate()
    dev.wait()
    shutil.rmtree(data, ignore_errors=True)
