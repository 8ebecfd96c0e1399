"""A consumer group's switches, enforced where messages leave the broker (ref BR11).

RocketMQ's PullMessageProcessor checks the group's SubscriptionGroupConfig on every pull:

- ``consume_enable=false``: every pull of the group is refused, NO_PERMISSION ("subscription
  group no permission"), until it is enabled again (`tidemq group update --consume-enable`);
- ``consume_broadcast_enable=false``: pulls of a group whose members registered as
  BROADCASTING (their heartbeats say so) are refused, NO_PERMISSION.

And the topic's ``order`` flag (an ordered topic, RocketMQ 5's FIFO topic): a push consumer
group in clustering mode may pull a queue of an ordered topic only while one of its members on
that connection holds the queue's lock (LOCK_BATCH_MQ, which orderly push consumers take before
they pull), so an ordered topic is never consumed concurrently and out of order; anything else
is refused, NO_PERMISSION, telling to consume it with an orderly listener. Lite pull consumers
(one poller per queue, in order), broadcasting members and the admin tools are not concerned.

A group the broker has no config for (auto-create off and never created) is not checked here:
the heartbeat creates configs, and an admin tool reading a dead-letter queue has none.

Threads: the broker's event loop only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tidemq.broker.errors import RequestRejected
from tidemq.protocol.codes import ResponseCode

if TYPE_CHECKING:
    from tidemq.broker.broker import Broker
    from tidemq.broker.connection import BrokerConnection
    from tidemq.protocol.headers import TopicConfig

__all__ = ["check_consume_allowed", "check_ordered_topic"]


def check_consume_allowed(broker: Broker, group: str) -> None:
    """NO_PERMISSION, with the reason and the fix, when ``group`` may not consume now."""
    sg = broker.subscription_groups.get(group)
    if sg is None:
        return
    name = broker.config.broker_name
    if not sg.consume_enable:
        raise RequestRejected(
            ResponseCode.NO_PERMISSION,
            f"subscription group {group!r} may not consume on broker {name} (consume_enable is "
            "false); enable it with `tidemq group update --group "
            f"{group} --consume-enable`",
        )
    if not sg.consume_broadcast_enable:
        info = broker.consumers.groups.get(group)
        if info is not None and info.message_model == "BROADCASTING":
            raise RequestRejected(
                ResponseCode.NO_PERMISSION,
                f"subscription group {group!r} may not consume by broadcasting on broker {name} "
                "(consume_broadcast_enable is false); consume in clustering mode or enable it "
                f"with `tidemq group update --group {group} --broadcast-enable`",
            )


def check_ordered_topic(broker: Broker, conn: BrokerConnection, group: str, tc: TopicConfig,
                        queue_id: int) -> None:
    """NO_PERMISSION when a clustering push group pulls a queue of an ordered topic without
    holding its lock from this connection."""
    if not tc.order:
        return
    info = broker.consumers.groups.get(group)
    if info is None or info.consume_type != "PUSH" or info.message_model != "CLUSTERING":
        return
    key = (tc.topic_name, broker.config.broker_name, queue_id)
    holder = broker.queue_locks.holder(group, key)
    if holder is not None and any(m.client_id == holder and m.conn is conn
                                  for m in info.members.values()):
        return
    raise RequestRejected(
        ResponseCode.NO_PERMISSION,
        f"topic {tc.topic_name!r} is ordered (order=true): group {group!r} must consume it with "
        "an orderly listener (PushConsumer(orderly=True)), which locks each queue before "
        f"pulling it; queue {queue_id} is not locked by this consumer",
    )
