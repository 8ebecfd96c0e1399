"""`tidemq cluster up|status|down` as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys

from support.cluster import ELECTION_OPTIONS, TEST_OPTIONS, LocalCluster, needs_etcd, wait_until


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


@needs_etcd
def test_cluster_up_with_election_shows_etcd_state(tmp_path):
    d = str(tmp_path / "e")
    opts = [x for o in TEST_OPTIONS + ELECTION_OPTIONS for x in ("-o", o)]
    try:
        line = tidemq("cluster", "up", "--dir", d, "--groups", "1", "--namesrvs", "1",
                      "--election", "--role", "SYNC_MASTER", *opts).strip()
        assert " etcd=127.0.0.1:" in line and "namesrv=" in line
        status = lambda: json.loads(tidemq("cluster", "status", "--dir", d, "--json"))  # noqa: E731
        rows = wait_until(lambda: (r := status()) and all(x.get("in_sync") for x in r) and r,
                          20, what="both brokers in the in-sync set in etcd")
        master, slave = rows
        assert master["leader"] is True and master["group_epoch"] == 1
        assert 0 < master["leader_lease_ttl_s"] <= 3 and master["etcd_lease_ok"] is True
        assert slave["leader"] is False and slave["broker_role"] == "SLAVE"
        table = tidemq("cluster", "status", "--dir", d)
        assert "etcd DefaultCluster/broker-a: epoch 1, SYNC_MASTER" in table, table
        assert "lease" in table and "in sync:" in table
        # a manual promotion is refused: etcd elects the master
        out = subprocess.run([sys.executable, "-m", "tidemq.cli.main", "cluster", "promote",
                              "--dir", d, "--broker-name", "broker-a"], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode != 0 and "elects its master on etcd" in out.stderr
    finally:
        stopped = tidemq("cluster", "down", "--dir", d)
    assert "stopped 4 processes" in stopped and "etcd-0" in stopped
    assert not any(p.alive() for p in LocalCluster.load(d).procs)
