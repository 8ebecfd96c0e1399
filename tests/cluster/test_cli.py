"""`tidemq cluster up|status|down` as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys

from support.cluster import TEST_OPTIONS, LocalCluster, wait_until


def tidemq(*args: str, timeout: float = 90) -> str:
    out = subprocess.run([sys.executable, "-m", "tidemq.cli.main", *args], capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_cluster_up_status_down(tmp_path):
    d = str(tmp_path / "c")
    opts = [x for o in TEST_OPTIONS for x in ("-o", o)]
    try:
        line = tidemq("cluster", "up", "--dir", d, "--groups", "1", "--namesrvs", "1",
                      "--role", "SYNC_MASTER", *opts).strip()
        assert line.startswith("tidemq cluster ready namesrv=127.0.0.1:")
        assert "broker-a/0=" in line and "broker-a/1=" in line
        with_slave = lambda: json.loads(tidemq("cluster", "status", "--dir", d, "--json"))  # noqa: E731
        rows = wait_until(lambda: (r := with_slave()) and r[0].get("ha_in_sync_slaves") == 1
                          and r, 15, what="slave in sync")
        assert [(r["broker_name"], r["broker_id"], r["broker_role"]) for r in rows] == [
            ("broker-a", 0, "SYNC_MASTER"), ("broker-a", 1, "SLAVE")]
        assert all(r["pid"] > 0 and r["epoch"] == 1 for r in rows)
        assert rows[0]["ha_slave_links"][0]["in_sync"] is True
        table = tidemq("cluster", "status", "--dir", d)
        assert "LAG_BYTES" in table and "SYNC_MASTER" in table and "SLAVE" in table
        tidemq("send", "--namesrv", line.split("namesrv=")[1].split()[0], "--topic", "cli",
               "--body", "x", "--count", "3")
        out = subprocess.run([sys.executable, "-m", "tidemq.cli.main", "cluster", "up",
                              "--dir", d], capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and "already running" in out.stderr
    finally:
        stopped = tidemq("cluster", "down", "--dir", d)
    assert "stopped 3 processes" in stopped
    assert not any(p.alive() for p in LocalCluster.load(d).procs)
