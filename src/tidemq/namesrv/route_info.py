"""The name server's tables (RocketMQ's RouteInfoManager; ref NS1).

::

    topic_queue_table   topic       -> {broker name -> QueueData (queue counts, perm)}
    broker_addr_table   broker name -> BrokerData (cluster, {broker id -> "host:port"})
    cluster_addr_table  cluster     -> {broker names}
    broker_live_table   broker addr -> BrokerLive (last registration, timeout, data version)

A registration (REGISTER_BROKER) carries every topic config of the broker, so it *replaces* the
broker's part of topic_queue_table: topics the broker no longer has disappear from the routes
(RocketMQ only adds on registration and deletes through a separate admin call). A broker
leaves the tables when it unregisters, when its connection to the name server closes
(:meth:`RouteInfoManager.on_connection_closed`, RocketMQ's BrokerHousekeepingService), or when
it has not registered for its heartbeat timeout (:meth:`scan_not_active_brokers`, run every
10 s).

Broker groups (docs/cluster.md): ``broker_addrs`` lists the master (id 0) and the slaves of a
group; a group keeps its queues in the routes while any of its brokers lives (consumers read from
a slave when the master is gone; while the group has no master, a slave's registration carries
its topics). The answer to a registration names the group's master and its replication address
(a slave follows it). A master whose epoch is lower than that of the live master of its group
is refused (RegistrationRefused): it was replaced by a promotion.

Routes are answered from these tables only; the name servers do not talk to each other (every
broker registers with each of them).

Route changes are numbered: every change of a topic's queue data (a topic added, changed or
removed on a broker) and of a group's addresses (a broker joining or leaving a group, a new
master) takes the next ``version`` and enters a bounded history (``CHANGE_HISTORY``), so a
client asks "what changed since version v" (GET_ROUTES_CHANGED, :meth:`changes_since`) and
refreshes only those routes instead of every route it holds (a client of 12,500 topics did
12,500 route requests every 30 s). ``instance`` names this history (a restarted name server,
or another one, starts another: the answer is then "everything").

Threads: the name server's event loop only.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tidemq.protocol.headers import (
    MASTER_ID,
    BrokerData,
    ClusterInfo,
    QueueData,
    RegisterBrokerRequestHeader,
    TopicRouteData,
)

__all__ = ["RouteInfoManager", "BrokerLive", "RegistrationRefused", "RouteChanges",
           "CHANGE_HISTORY", "CHANGES_MAX"]

log = logging.getLogger(__name__)

CHANGE_HISTORY = 200_000  # route changes remembered (older: a client refreshes every route)
CHANGES_MAX = 10_000  # changes one answer names at most (more: "refresh every route")
_TOPIC, _GROUP = 0, 1


@dataclass
class RouteChanges:
    """The answer of :meth:`RouteInfoManager.changes_since`."""

    instance: str
    version: int
    full: bool
    topics: list[str]
    brokers: list[str]


@dataclass
class BrokerLive:
    """When a broker last registered, over which connection, and how long it may stay silent."""

    cluster_name: str
    broker_name: str
    broker_id: int
    last_update: float  # monotonic seconds
    timeout_s: float
    data_version: int
    conn: object = None  # the connection it registered over (dropped when that closes)
    ha_server_addr: str = ""  # a master's replication address (its slaves connect there)
    epoch: int = 0  # a master's epoch


class RegistrationRefused(Exception):
    """A registration the name server does not take (the message says why)."""


class RouteInfoManager:
    """The name server's four tables (its event loop only; no locks, unlike RocketMQ's)."""

    def __init__(
        self, *, expire_override_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.topic_queue_table: dict[str, dict[str, QueueData]] = {}
        self.broker_addr_table: dict[str, BrokerData] = {}
        self.cluster_addr_table: dict[str, set[str]] = {}
        self.broker_live_table: dict[str, BrokerLive] = {}
        self.expire_override_s = expire_override_s
        self._clock = clock
        #: the history of route changes: (version, _TOPIC or _GROUP, topic or broker name)
        self.instance = secrets.token_hex(8)
        self.version = 0
        self._changes: deque[tuple[int, int, str]] = deque(maxlen=CHANGE_HISTORY)

    # -- change history ----------------------------------------------------------------------------
    def _changed(self, kind: int, name: str) -> None:
        self.version += 1
        self._changes.append((self.version, kind, name))

    def changes_since(self, instance: str, since: int) -> RouteChanges:
        """The topics and groups whose routes changed after version ``since`` of history
        ``instance``; ``full`` when that is not known (another history, a version older than
        the history kept or newer than this one, more than ``CHANGES_MAX`` changes). Costs
        the number of changes since, not the number of topics."""
        v = self.version
        ch = self._changes
        oldest = ch[0][0] if ch else v + 1  # the oldest version still in the history
        if instance != self.instance or since > v or since + 1 < oldest or v - since > CHANGES_MAX:
            return RouteChanges(self.instance, v, True, [], [])
        topics: dict[str, None] = {}
        groups: dict[str, None] = {}
        for i in range(len(ch) - 1, -1, -1):  # newest first, back to ``since``
            version, kind, name = ch[i]
            if version <= since:
                break
            (topics if kind == _TOPIC else groups)[name] = None
        return RouteChanges(self.instance, v, False, sorted(topics), sorted(groups))

    # -- registration ----------------------------------------------------------------------------
    def register_broker(
        self, h: RegisterBrokerRequestHeader, conn: object = None
    ) -> tuple[str, str]:
        """Take a registration; returns the group's master (client address, replication
        address), for a slave to follow. RegistrationRefused when another live master of the
        group has a higher epoch (this one was replaced by a promotion: it must not serve)."""
        addr = h.broker_addr
        bd = self.broker_addr_table.get(h.broker_name)
        if h.broker_id == MASTER_ID and bd is not None and bd.cluster == h.cluster_name:
            cur = bd.broker_addrs.get(MASTER_ID)
            live = self.broker_live_table.get(cur) if cur else None
            if cur != addr and live is not None and live.epoch > h.epoch:
                raise RegistrationRefused(
                    f"broker {h.broker_name} already has master {cur} at epoch {live.epoch}; "
                    f"this broker ({addr}, epoch {h.epoch}) was replaced by a promotion and must "
                    "not serve as master: restart it as a slave (--role SLAVE --broker-id N); "
                    "it cuts whatever the new master lacks"
                )
        self.cluster_addr_table.setdefault(h.cluster_name, set()).add(h.broker_name)
        before = dict(bd.broker_addrs) if bd is not None and bd.cluster == h.cluster_name else None
        if bd is None or bd.cluster != h.cluster_name:
            bd = BrokerData(cluster=h.cluster_name, broker_name=h.broker_name, broker_addrs={})
            self.broker_addr_table[h.broker_name] = bd
        # An address registered under another id (a restarted broker changing role) moves.
        for bid, a in list(bd.broker_addrs.items()):
            if a == addr and bid != h.broker_id:
                del bd.broker_addrs[bid]
        old_addr = bd.broker_addrs.get(h.broker_id)
        if old_addr is not None and old_addr != addr:
            # The same broker came back on another port: forget the old address at once.
            self.broker_live_table.pop(old_addr, None)
        bd.broker_addrs[h.broker_id] = addr
        if bd.broker_addrs != before:
            self._changed(_GROUP, h.broker_name)
        timeout = self.expire_override_s or h.heartbeat_timeout_millis / 1000
        live = self.broker_live_table.get(addr)
        first = live is None
        if live is None:
            live = self.broker_live_table[addr] = BrokerLive(
                h.cluster_name, h.broker_name, h.broker_id, self._clock(), timeout,
                h.data_version, conn,
            )
        live.last_update = self._clock()
        live.timeout_s = timeout
        live.conn = conn
        live.broker_id = h.broker_id
        live.ha_server_addr = h.ha_server_addr
        live.epoch = h.epoch
        if h.topics_omitted:
            pass  # a heartbeat for a topic set already held (has_topics_of checked it)
        elif h.broker_id == MASTER_ID or MASTER_ID not in bd.broker_addrs:
            # A full registration carries the whole topic set; replacing is exact.
            # A slave's topics (copied from its master) count while the group has no master,
            # so its queues stay readable when the name server restarts meanwhile.
            self._replace_topics(h)
        if not h.topics_omitted:
            live.data_version = h.data_version
        if first:
            log.info(
                "broker %s id %d (%s, cluster %s) registered with %d topics",
                h.broker_name, h.broker_id, addr, h.cluster_name, len(h.topics),
            )
        master = bd.broker_addrs.get(MASTER_ID, "")
        mlive = self.broker_live_table.get(master) if master else None
        return master, (mlive.ha_server_addr if mlive is not None else "")

    def has_topics_of(self, h: RegisterBrokerRequestHeader) -> bool:
        """Whether a registration without topics may stand for the topic set this name server
        holds for the broker (same address, same data version)."""
        live = self.broker_live_table.get(h.broker_addr)
        return live is not None and live.data_version == h.data_version

    def _replace_topics(self, h: RegisterBrokerRequestHeader) -> None:
        name = h.broker_name
        for topic, tc in h.topics.items():
            qd = QueueData(
                broker_name=name,
                read_queue_nums=tc.read_queue_nums,
                write_queue_nums=tc.write_queue_nums,
                perm=tc.perm,
                topic_sys_flag=tc.topic_sys_flag,
            )
            queues = self.topic_queue_table.setdefault(topic, {})
            if queues.get(name) != qd:
                queues[name] = qd
                self._changed(_TOPIC, topic)
        for topic in [t for t, q in self.topic_queue_table.items() if name in q]:
            if topic not in h.topics:
                self._remove_topic_of(topic, name)

    def _remove_topic_of(self, topic: str, broker_name: str) -> None:
        queues = self.topic_queue_table.get(topic)
        if queues is None or queues.pop(broker_name, None) is None:
            return
        self._changed(_TOPIC, topic)
        if not queues:
            del self.topic_queue_table[topic]

    def unregister_broker(
        self, cluster_name: str, broker_name: str, broker_id: int, broker_addr: str
    ) -> bool:
        live = self.broker_live_table.pop(broker_addr, None)
        bd = self.broker_addr_table.get(broker_name)
        removed_name = False
        if bd is not None:
            if bd.broker_addrs.get(broker_id) == broker_addr:
                del bd.broker_addrs[broker_id]
                self._changed(_GROUP, broker_name)
            if not bd.broker_addrs:
                del self.broker_addr_table[broker_name]
                removed_name = True
        if removed_name:
            names = self.cluster_addr_table.get(cluster_name)
            if names is not None:
                names.discard(broker_name)
                if not names:
                    del self.cluster_addr_table[cluster_name]
        if removed_name:
            # Nobody of the group is left: its queues leave the routes. While a slave lives
            # they stay (RocketMQ): consumers read them there; producers skip a group whose
            # route has no master.
            for topic in [t for t, q in self.topic_queue_table.items() if broker_name in q]:
                self._remove_topic_of(topic, broker_name)
        if live is not None:
            log.info("broker %s (%s) removed", broker_name, broker_addr)
        return live is not None

    def _remove_live(self, addr: str, why: str) -> None:
        live = self.broker_live_table.get(addr)
        if live is None:
            return
        log.warning("broker %s (%s) %s; removing it from the routes", live.broker_name, addr, why)
        self.unregister_broker(live.cluster_name, live.broker_name, live.broker_id, addr)

    def on_connection_closed(self, conn: object) -> None:
        for addr, live in list(self.broker_live_table.items()):
            if live.conn is conn:
                self._remove_live(addr, "closed its connection")

    def scan_not_active_brokers(self) -> int:
        """Remove brokers whose last registration is older than their timeout."""
        now = self._clock()
        expired = [
            (a, now - live.last_update)
            for a, live in self.broker_live_table.items()
            if now - live.last_update > live.timeout_s
        ]
        for addr, age in expired:
            self._remove_live(addr, f"has not registered for {age:.1f} s")
        return len(expired)

    # -- queries ---------------------------------------------------------------------------------
    def get_route(self, topic: str) -> TopicRouteData | None:
        queues = self.topic_queue_table.get(topic)
        if not queues:
            return None
        names = sorted(queues)
        brokers = [self.broker_addr_table[n] for n in names if n in self.broker_addr_table]
        if not brokers:
            return None
        return TopicRouteData(
            queue_datas=[queues[n] for n in names],
            broker_datas=brokers,
        )

    def topic_list(self) -> list[str]:
        return sorted(self.topic_queue_table)

    def cluster_info(self) -> ClusterInfo:
        return ClusterInfo(
            broker_addr_table=dict(self.broker_addr_table),
            cluster_addr_table={c: sorted(n) for c, n in self.cluster_addr_table.items()},
        )
