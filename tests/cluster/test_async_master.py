"""ASYNC_MASTER: acknowledged at once, so a master lost before its slave copied can lose
messages -- never more than the replication lag it reported, only the newest ones, and the
old master says exactly how much when it rejoins (it cuts that divergent tail). Real
processes on loopback."""

from __future__ import annotations

import tidemq
from support.cluster import info, same_commitlog, start_cluster, wait_until
from tidemq.client.message import SendStatus

TOPIC = "am"


def test_async_master_loss_is_bounded_by_the_lag_and_reported(tmp_path):
    c = start_cluster(tmp_path)
    try:
        master, slave = c.broker("broker-a", 0), c.broker("broker-a", 1)
        with tidemq.Admin(c.namesrv) as admin:
            admin.create_topic(TOPIC, 2)
        wait_until(lambda: info(c, master).get("ha_in_sync_slaves") == 1, 10, what="in sync")
        with tidemq.Producer(c.namesrv) as p:
            kept = [p.send(tidemq.Message(TOPIC, b"kept %d" % i)) for i in range(300)]
            wait_until(lambda: info(c, master)["ha_max_lag_bytes"] == 0, 10, what="caught up")
            c.pause(slave)  # the slave stops copying: more than the sockets' buffers hold ...
            pad = b"." * 10_000
            late = [p.send_batch([tidemq.Message(TOPIC, b"late %d" % i + pad)
                                  for i in range(k, k + 10)])
                    for k in range(0, 3000, 10)]
            late_ids = [f"{r.msg_id[:16]}{r.base_seq + i:016X}" for r in late
                        for i in range(r.count)]
        # ... and the master says how far behind it is
        lag = wait_until(lambda: info(c, master)["ha_max_lag_bytes"], 5, what="lag reported")
        assert {r.status for r in kept + late} == {SendStatus.SEND_OK}  # ASYNC: at once
        m = info(c, master)
        assert m["ha_max_lag_ms"] > 0 and m["ha_in_sync_slaves"] in (0, 1)
        c.kill9(master)
        c.resume(slave)
        wait_until(lambda: not info(c, slave)["ha_connected"], 10, what="master gone")
        with tidemq.Admin(c.namesrv) as admin:
            promoted = admin.promote(slave.addr)
        assert promoted.epoch == 2

        seen: set[str] = set()
        with tidemq.PullConsumer(c.namesrv, "g-check", consume_from="first") as cons:
            cons.subscribe(TOPIC)
            want = {r.msg_id for r in kept}
            wait_until(lambda: seen.update(x.msg_id for x in cons.poll(0.5)) or want <= seen,
                       20, what="kept messages readable")
            for _ in range(4):
                seen.update(x.msg_id for x in cons.poll(0.3))
        lost = [m for m in late_ids if m not in seen]
        assert {r.msg_id for r in kept} <= seen  # nothing older than the lag is lost
        assert lost, "the paused slave should have missed the newest messages"

        # the old master rejoins as a slave: it cuts (and counts) the tail only it had
        master.args[master.args.index("--role") + 1] = "SLAVE"
        master.args[master.args.index("--broker-id") + 1] = "2"
        c.restart(master)
        wait_until(lambda: info(c, master).get("ha_connected"), 15, what="old master rejoined")
        cut = info(c, master)["ha_truncated_bytes"]
        assert 0 < cut <= lag, (cut, lag)
        # every lost message was in the cut tail: at least its bytes were cut
        assert cut >= len(lost) * len(pad)
        wait_until(lambda: info(c, master)["commitlog_max_offset"] ==
                   info(c, slave)["commitlog_max_offset"], 10, what="rejoined caught up")
        assert same_commitlog(master, slave)
        print(f"\nASYNC_MASTER loss: {len(lost)} of {len(late_ids)} late messages lost, "
              f"{cut} bytes cut on rejoin, lag reported before the kill {lag} bytes, "
              f"{promoted.unreplicated_bytes} bytes known unreplicated at promotion")
    finally:
        c.down(10)
