"""POP state across a promotion: the slave was started before any pop, so everything it knows
of the group's pops and acks came by replication of rmq_sys_POP_LOG; once promoted it serves
them as the old master would have -- acked messages never again, in-flight ones invisible until
their deadline (their old receipt handles still ack) and then back with attempt 2, the others
at once. Real processes on loopback, a real kill -9 of the master."""

from __future__ import annotations

import time

import tidemq
from support.cluster import info, start_cluster, wait_until

TOPIC, GROUP = "pop_promo", "pop_promo_g"
INVISIBLE = 6.0


def _receive_all(namesrv: str, n_max: int, invisible: float, idle: int = 2) -> list:
    out: list = []
    with tidemq.SimpleConsumer(namesrv, GROUP, await_duration=0.3, init_mode="earliest") as c:
        c.subscribe(TOPIC)
        quiet = 0
        while quiet < idle and len(out) < n_max:
            msgs = c.receive(min(32, n_max - len(out)), invisible_duration=invisible)
            quiet = 0 if msgs else quiet + 1
            out += msgs
    return out


def test_a_promoted_slave_serves_the_old_masters_pop_state(tmp_path):
    c = start_cluster(tmp_path)
    try:
        master, slave = c.broker("broker-a", 0), c.broker("broker-a", 1)
        with tidemq.Admin(c.namesrv) as admin:
            admin.create_topic(TOPIC, 2)
        wait_until(lambda: info(c, master).get("ha_in_sync_slaves") == 1, 10, what="in sync")
        with tidemq.Producer(c.namesrv) as p:
            for i in range(40):
                p.send(tidemq.Message(TOPIC, b"m%02d" % i))
        # 20 received: 10 acked, 10 left in flight (a consumer that dies)
        with tidemq.SimpleConsumer(c.namesrv, GROUP, init_mode="earliest") as sc:
            sc.subscribe(TOPIC)
            got: list = []
            while len(got) < 20:
                got += sc.receive(20 - len(got), invisible_duration=INVISIBLE)
            popped_at = time.monotonic()
            acked, kept = got[::2], got[1::2]
            assert all(e is None for e in sc.ack_all(acked))
        wait_until(lambda: info(c, slave)["commitlog_max_offset"] ==
                   info(c, master)["commitlog_max_offset"], 10, what="slave caught up")
        c.kill9(master)
        wait_until(lambda: not info(c, slave)["ha_connected"], 10, what="master gone")
        with tidemq.Admin(c.namesrv) as admin:
            admin.promote(slave.addr)
        body = lambda m: bytes(m.body)  # noqa: E731
        fresh = _receive_all(c.namesrv, 40, 60.0)
        assert time.monotonic() - popped_at < INVISIBLE, "promotion too slow for this test"
        # the 20 never received, once each; neither acked nor still-invisible ones
        assert sorted(map(body, fresh)) == sorted(
            {b"m%02d" % i for i in range(40)} - set(map(body, got)))
        assert all(m.delivery_attempt == 1 for m in fresh)
        with tidemq.SimpleConsumer(c.namesrv, GROUP) as sc:
            # handles the old master gave out still ack: the client finds the old address
            # dead and sends them to the group's master now, which knows them
            res = sc.ack_all(kept[:5] + acked[:1])
            assert res[:5] == [None] * 5
            assert isinstance(res[5], tidemq.StaleReceiptError)  # acked before the promotion
            # and so does an invisible-time change, one and many: they stay away 60 s more
            old = kept[5].broker_addr
            sc.change_invisible_duration(kept[5], 60.0)
            assert sc.change_invisible_all(kept[6:8], [60.0, 60.0]) == [None, None]
            assert {m.broker_addr for m in kept[5:8]} == {slave.addr} != {old}
        time.sleep(max(0.0, INVISIBLE + 0.3 - (time.monotonic() - popped_at)))
        back = _receive_all(c.namesrv, 40, 60.0)
        assert sorted(map(body, back)) == sorted(map(body, kept[8:]))
        assert all(m.delivery_attempt == 2 for m in back)
        with tidemq.SimpleConsumer(c.namesrv, GROUP) as sc:
            done = back + fresh + kept[5:8]  # the changed ones with their new handles
            assert sc.ack_all(done) == [None] * len(done)
        assert _receive_all(c.namesrv, 40, 60.0, idle=1) == []
    finally:
        c.down(10)
