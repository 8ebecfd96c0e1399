"""The cluster tests' launcher: the product's own LocalCluster (``tidemq cluster up`` runs it
too) with test-sized settings -- small segments, so replication crosses segment ends, and fast
replication heartbeats, so a lost link is noticed in seconds. With ``election=True`` an etcd of
its own (one member, 127.0.0.1, its own data dir) and short leases."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tidemq.bench.local_cluster import LocalCluster, Proc, find_etcd
from tidemq.client.blocking import Admin

__all__ = ["TEST_OPTIONS", "ELECTION_OPTIONS", "LocalCluster", "Proc", "start_cluster",
           "wait_until", "info", "same_commitlog", "needs_etcd"]

TEST_OPTIONS = (
    "store.segment_size=1048576",
    "store.index_slots=4096",
    "store.index_max_entries=16384",
    "store.cq_units_per_file=4096",
    "store.flush_interval_ms=100",
    "ha_heartbeat_interval_ms=500",
    "ha_housekeeping_interval_ms=4000",
    "ha_sync_metadata_interval_ms=1000",
    "ha_max_catchup_ms=3000",
    "offset_persist_interval_ms=500",
    # the machine's disk is shared with other test runs: retention must not delete segments
    # (or refuse writes) because of disk space the tests do not use
    "store.disk_max_used_ratio=0.97",
    "store.disk_clean_forcibly_ratio=0.98",
    "store.disk_refuse_writes_ratio=0.99",
)


#: election tests: a dead master is replaced about 3 s after its death
ELECTION_OPTIONS = (
    "election_lease_ttl_ms=3000",
    "election_poll_interval_ms=250",
    "etcd_timeout_ms=1500",
)

#: `make setup` installs Debian's etcd-server; only a machine where it cannot (no apt) skips
needs_etcd = pytest.mark.skipif(
    find_etcd() is None,
    reason="etcd is not installed and `make setup` could not install it (Debian package "
           "etcd-server; or set TIDEMQ_ETCD to an etcd binary)",
)


def start_cluster(root: Path, *, groups: int = 1, slaves: int = 1, namesrvs: int = 1,
                  role: str = "ASYNC_MASTER", options: tuple[str, ...] = (),
                  election: bool = False) -> LocalCluster:
    opts = TEST_OPTIONS + (ELECTION_OPTIONS if election else ()) + tuple(options)
    c = LocalCluster(root, log_level="info", broker_options=opts, etcd_in_memory=True)
    return c.up(namesrvs=namesrvs, groups=groups, slaves=slaves, role=role, election=election)


def wait_until(pred, timeout: float, step: float = 0.05, what: str = "condition") -> Any:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout} s")
        time.sleep(step)


def info(c: LocalCluster, p: Proc) -> dict[str, Any]:
    """Runtime info of one broker (GET_BROKER_RUNTIME_INFO)."""
    with Admin(c.namesrv_addrs or p.addr) as admin:
        return admin.runtime_info(p.addr)


def same_commitlog(a: Proc, b: Proc) -> bool:
    """Every segment both brokers hold is byte-identical (the shorter log's last segment up to
    its end, the rest of both zeros)."""
    da, db = Path(a.data_dir) / "commitlog", Path(b.data_dir) / "commitlog"
    names = sorted(set(p.name for p in da.iterdir()) & set(p.name for p in db.iterdir()))
    assert names, "no common segment"
    return all((da / n).read_bytes() == (db / n).read_bytes() for n in names)
