"""A consumer group's switches, enforced where messages leave the broker (SPEC BR11).

RocketMQ's PullMessageProcessor checks the group's SubscriptionGroupConfig on every pull:

- ``consume_enable=false``: every pull of the group is refused, NO_PERMISSION ("subscription
  group no permission"), until it is enabled again (`tidemq group update --consume-enable`);
- ``consume_broadcast_enable=false``: pulls of a group whose members registered as
  BROADCASTING (their heartbeats say so) are refused, NO_PERMISSION.

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

__all__ = ["check_consume_allowed"]


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
