"""Under SYNC_MASTER the writes the broker makes itself wait for the slave as a client's send
does (RocketMQ: every put waits): here a consumer's send-back is answered only once the slave
holds the retry copy. Real processes on loopback; the slave is paused (SIGSTOP) meanwhile."""

from __future__ import annotations

import asyncio
import threading
import time

import tidemq
from support.cluster import info, start_cluster, wait_until
from tidemq.client.connection import ConnectionPool
from tidemq.protocol.codes import RequestCode
from tidemq.protocol.headers import ConsumerSendMsgBackRequestHeader

TOPIC = "bw"


def test_send_back_is_answered_once_the_slave_holds_the_copy(tmp_path):
    c = start_cluster(tmp_path, role="SYNC_MASTER")
    try:
        master, slave = c.broker("broker-a", 0), c.broker("broker-a", 1)
        with tidemq.Admin(c.namesrv) as admin:
            admin.create_topic(TOPIC, 1)
        wait_until(lambda: info(c, master).get("ha_in_sync_slaves") == 1, 10, what="in sync")
        with tidemq.Producer(c.namesrv) as p:
            assert p.send(tidemq.Message(TOPIC, b"retry me")).status.value == "SEND_OK"
        with tidemq.PullConsumer(c.namesrv, "g-bw", consume_from="first") as cons:
            cons.subscribe(TOPIC)
            msgs = wait_until(lambda: cons.poll(0.5), 10, what="message pulled")
        m = msgs[0]
        header = ConsumerSendMsgBackRequestHeader(
            consumer_group="g-bw", commit_log_offset=m.commit_log_offset, index=m._i,
            delay_level=0, origin_msg_id=m.msg_id, origin_topic=m.topic, max_reconsume_times=-1,
        )
        before = info(c, master)["ha_waited_sends"]
        resumed = [0.0]

        def pause_for(seconds: float) -> None:
            c.pause(slave)
            time.sleep(seconds)
            resumed[0] = time.monotonic()
            c.resume(slave)

        async def send_back() -> float:
            pool = ConnectionPool()
            try:
                th = threading.Thread(target=pause_for, args=(1.5,))
                th.start()
                await asyncio.sleep(0.2)  # the slave is asleep now
                await pool.request(master.addr, RequestCode.CONSUMER_SEND_MSG_BACK, header,
                                   timeout=10)
                answered = time.monotonic()
                await asyncio.to_thread(th.join)
                return answered
            finally:
                pool.close()

        answered = asyncio.run(send_back())
        # answered after the slave woke and stored the copy, not at the put
        assert answered >= resumed[0] > 0, (answered, resumed)
        assert info(c, master)["ha_waited_sends"] > before
    finally:
        c.down(10)
