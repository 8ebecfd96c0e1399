"""Consumer groups on the broker: who is in which group (RocketMQ's ConsumerManager; ref BR5).

A push consumer sends HEART_BEAT every 30 s with its client id and, per group, its message model,
consume-from and subscriptions. The broker keeps, per group, the member clients with the
connection each heartbeat came on and when it last arrived. A member leaves:

- cleanly, with UNREGISTER_CLIENT;
- when its connection closes (the client process died or was killed);
- when it stays silent for ``client_channel_expired_ms`` (120 s; a hung client whose TCP
  connection is still open), found by a scan every ``client_scan_interval_ms`` (10 s).

Whenever a group's member set changes the broker sends NOTIFY_CONSUMER_IDS_CHANGED (one-way) to
every remaining member over its own connection, so they rebalance at once instead of waiting
for their 20 s timer (RocketMQ's ``notifyConsumerIdsChangedEnable``). GET_CONSUMER_LIST_BY_GROUP
answers the member ids, which every member sorts the same way before allocating queues.

A heartbeat whose subscription does not parse (an SQL92 expression that does not compile, an
unknown expression type) is refused whole with SUBSCRIPTION_PARSE_FAILED and the reason, as
RocketMQ's heartbeat does, so the consumer learns it at start rather than at its first pull.

The first heartbeat of a clustering group creates its retry topic ``%RETRY%<group>``
(RocketMQ does this in its heartbeat handler too), so the retry topic has a route before the
first message is sent back.

SimpleConsumers heartbeat with ``consume_type="POP"`` (server-side dispatch,
``pop_processor.py``): they are listed as members, but get no retry topic and no
NOTIFY_CONSUMER_IDS_CHANGED (nothing to rebalance). One group name has one consumption mode:
a heartbeat of POP members into a group consumed by pulls (or of push/lite pull members into a
POP group) is refused whole with CONSUME_MODE_CONFLICT (``PopProcessor.check_mode``).

Threads: the broker's event loop only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tidemq.broker.connection import decode_request
from tidemq.broker.errors import RequestRejected, check_group
from tidemq.broker.sql_select import check_subscription
from tidemq.protocol.codes import DLQ_PREFIX, RETRY_PREFIX, RequestCode, ResponseCode
from tidemq.protocol.headers import (
    ConsumerData,
    ConsumerGroupRequestHeader,
    ConsumerListResponseHeader,
    EmptyHeader,
    GroupInfoResponseHeader,
    HeartbeatRequestHeader,
    SubscriptionData,
    UnregisterClientRequestHeader,
)

if TYPE_CHECKING:
    from tidemq.broker.broker import Broker
    from tidemq.broker.connection import BrokerConnection
    from tidemq.protocol.frame import Frame

__all__ = ["ConsumerManager", "ConsumerGroupInfo", "RETRY_PREFIX", "DLQ_PREFIX", "retry_topic"]

log = logging.getLogger(__name__)

_EMPTY = EmptyHeader()


def retry_topic(group: str) -> str:
    return RETRY_PREFIX + group


def pop_mode(consume_type: str) -> str:
    """The consumption mode (``pop_processor.POP`` or ``PULL``) of a heartbeat's consume type."""
    return "POP" if consume_type == "POP" else "PULL"


class _Member:
    __slots__ = ("client_id", "conn", "last_seen")

    def __init__(self, client_id: str, conn: BrokerConnection, now: float) -> None:
        self.client_id = client_id
        self.conn = conn
        self.last_seen = now


class ConsumerGroupInfo:
    """One group's members and what they last said about the group."""

    def __init__(self, group: str) -> None:
        self.group = group
        self.members: dict[str, _Member] = {}
        self.message_model = "CLUSTERING"
        self.consume_from = "last"
        self.consume_type = "PUSH"
        self.subscriptions: dict[str, SubscriptionData] = {}

    def ids(self) -> list[str]:
        return sorted(self.members)


class ConsumerManager:
    """Groups, members and their connections; the handlers of the membership requests."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.config = broker.config
        self.groups: dict[str, ConsumerGroupInfo] = {}
        self.notifications = 0  # NOTIFY_CONSUMER_IDS_CHANGED frames sent (runtime info)

    def handlers(self) -> dict[int, Callable[..., None]]:
        return {
            RequestCode.HEART_BEAT: self.heart_beat,
            RequestCode.UNREGISTER_CLIENT: self.unregister_client,
            RequestCode.GET_CONSUMER_LIST_BY_GROUP: self.get_consumer_list,
            RequestCode.GET_CONSUMER_CONNECTION_LIST: self.get_group_info,
        }

    # -- requests ----------------------------------------------------------------------------
    def heart_beat(self, conn: BrokerConnection, frame: Frame) -> None:
        h: HeartbeatRequestHeader = decode_request(frame, HeartbeatRequestHeader)
        if not h.client_id:
            raise RequestRejected(ResponseCode.INVALID_ARGUMENT, "heartbeat without client_id")
        now = time.monotonic()
        pop = self.broker.pop
        for cd in h.consumers:
            self._check_group(cd.group)
            for sd in cd.subscriptions:
                check_subscription(sd.expression_type, sd.expression, sd.topic)
            if pop is not None:
                pop.check_mode(cd.group, pop_mode(cd.consume_type), client_id=h.client_id)
                pop.types.check_heartbeat(h.client_id, cd)  # one type; exclusive
        for cd in h.consumers:
            self.register(conn, h.client_id, cd, now)
        if not frame.is_oneway:
            conn.respond(frame.opaque, ResponseCode.SUCCESS, _EMPTY)

    def unregister_client(self, conn: BrokerConnection, frame: Frame) -> None:
        h: UnregisterClientRequestHeader = decode_request(frame, UnregisterClientRequestHeader)
        if h.consumer_group:
            self.unregister(h.consumer_group, h.client_id, "unregistered")
        if not frame.is_oneway:
            conn.respond(frame.opaque, ResponseCode.SUCCESS, _EMPTY)

    def get_consumer_list(self, conn: BrokerConnection, frame: Frame) -> None:
        h: ConsumerGroupRequestHeader = decode_request(frame, ConsumerGroupRequestHeader)
        info = self.groups.get(h.consumer_group)
        ids = info.ids() if info is not None else []
        conn.respond(frame.opaque, ResponseCode.SUCCESS, ConsumerListResponseHeader(ids))

    def get_group_info(self, conn: BrokerConnection, frame: Frame) -> None:
        h: ConsumerGroupRequestHeader = decode_request(frame, ConsumerGroupRequestHeader)
        info = self.groups.get(h.consumer_group)
        sg = self.broker.subscription_groups.get(h.consumer_group)
        if info is None:
            header = GroupInfoResponseHeader(config=sg)
        else:
            header = GroupInfoResponseHeader(
                consumer_ids=info.ids(), message_model=info.message_model,
                consume_from=info.consume_from,
                subscriptions=list(info.subscriptions.values()), config=sg,
                consume_type=info.consume_type,
            )
        conn.respond(frame.opaque, ResponseCode.SUCCESS, header)

    @staticmethod
    def _check_group(group: str) -> None:
        check_group(group, "consumers[].group")

    def is_member(self, group: str, conn: BrokerConnection) -> bool:
        """True when ``conn`` carries a live member of consumer group ``group``."""
        info = self.groups.get(group)
        return info is not None and any(m.conn is conn for m in info.members.values())

    # -- membership --------------------------------------------------------------------------
    def register(
        self, conn: BrokerConnection, client_id: str, cd: ConsumerData, now: float
    ) -> bool:
        """Add or refresh a member; True (and the group is notified) when it is new."""
        group = cd.group
        info = self.groups.get(group)
        if info is None:
            info = self.groups[group] = ConsumerGroupInfo(group)
            self.broker.subscription_groups.ensure(group)
        info.message_model = cd.message_model
        info.consume_from = cd.consume_from
        info.consume_type = cd.consume_type
        info.subscriptions = {s.topic: s for s in cd.subscriptions}
        m = info.members.get(client_id)
        if m is not None and m.conn is conn:
            m.last_seen = now
            return False
        info.members[client_id] = _Member(client_id, conn, now)
        pops = cd.consume_type == "POP"
        if pops and self.broker.pop is not None:
            self.broker.pop.types.joined(group, client_id, cd)
        if cd.message_model == "CLUSTERING" and not pops:
            self.broker.ensure_retry_topic(group)
        log.info("consumer %s joined group %s (%d members)", client_id, group, len(info.members))
        if not pops:  # POP members do not rebalance
            self._notify(info)
        return True

    def unregister(self, group: str, client_id: str, why: str) -> None:
        info = self.groups.get(group)
        if info is None or info.members.pop(client_id, None) is None:
            return
        log.info("consumer %s left group %s (%s)", client_id, group, why)
        self.broker.queue_locks.release_client(group, client_id)
        if self.broker.pop is not None:
            self.broker.pop.types.left(group, client_id)  # its deliveries revive now
        if info.members:
            self._notify(info)
        else:
            del self.groups[group]

    def connection_closed(self, conn: BrokerConnection) -> None:
        for info in list(self.groups.values()):
            for cid, m in list(info.members.items()):
                if m.conn is conn:
                    self.unregister(info.group, cid, "connection closed")

    def scan_expired(self, now: float | None = None) -> int:
        """Drop members silent for longer than the expiry; the number dropped."""
        now = time.monotonic() if now is None else now
        limit = self.config.client_channel_expired_ms / 1000
        dropped = 0
        for info in list(self.groups.values()):
            for cid, m in list(info.members.items()):
                if now - m.last_seen > limit:
                    dropped += 1
                    self.unregister(info.group, cid, f"silent for more than {limit:g} s")
                    m.conn.close()
        return dropped

    def _notify(self, info: ConsumerGroupInfo) -> None:
        header = ConsumerGroupRequestHeader(consumer_group=info.group)
        for m in info.members.values():
            m.conn.send_oneway_request(RequestCode.NOTIFY_CONSUMER_IDS_CHANGED, header)
            self.notifications += 1

    def group_of(self, group: str) -> ConsumerGroupInfo | None:
        return self.groups.get(group)
