"""The producer's router: which queue (and so which broker) a batch goes to (ref PR2).

Round robin over the topic's writable queues; ``queue_id=`` (an index into the sorted writable
queues, equal to the queue id on a single broker, or a MessageQueue), ``selector=``
(``selector(queues, message, arg) -> MessageQueue``, RocketMQ's MessageQueueSelector) or
``hash_key=`` (CRC32C of the key modulo the queue count) pin the queue for ordered sends.

A broker that failed, or answered slowly, is avoided for a while (RocketMQ's MQFaultStrategy,
``latency_fault.py``) unless every broker is avoided. A topic no broker has yet gets a route
over every master broker (RocketMQ's TBW102 default route): a broker with auto-create on creates
the topic on the first send.

Threading: one event loop (the producer's).
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable
from typing import Any

from tidemq.client.errors import ClientError, MessageRejectedError, NoRouteError
from tidemq.client.latency_fault import LatencyFaultTable
from tidemq.client.message import Message, MessageQueue
from tidemq.client.route import RouteCache, TopicRoute
from tidemq.protocol.codes import RequestCode
from tidemq.protocol.errors import BrokerError
from tidemq.protocol.headers import ClusterInfo, QueueData, TopicRouteData
from tidemq.protocol.names import topic_name_problem
from tidemq.protocol.record import crc32c

__all__ = ["Selector", "SendRouter"]

Selector = Callable[[list[MessageQueue], Message, Any], MessageQueue]


class SendRouter:
    """Routes of the producer's topics and the queue choice for each batch."""

    def __init__(self, routes: RouteCache, *, latency_fault: bool, auto_create_route: bool,
                 default_topic_queues: int) -> None:
        self.routes = routes
        self.latency_fault = latency_fault
        self.auto_create_route = auto_create_route
        self.default_topic_queues = default_topic_queues
        self.faults = LatencyFaultTable()
        self._rr = itertools.count(secrets.randbelow(1 << 16))

    def cached(self, topic: str) -> TopicRoute | None:
        return self.routes.cached(topic)

    async def route(self, topic: str) -> TopicRoute:
        """The topic's route; for a topic no broker has yet, a route over every master broker
        (RocketMQ's TBW102 default route): a broker with auto-create on creates the topic on
        the first send, one with it off answers TOPIC_NOT_EXIST."""
        try:
            return await self.routes.get(topic)
        except NoRouteError as exc:
            problem = topic_name_problem(topic)
            if problem:  # no broker would create it (the rule of protocol/names.py)
                raise MessageRejectedError(problem) from None
            if not self.auto_create_route:
                raise
            try:
                frame = await self.routes.namesrv_request(RequestCode.GET_BROKER_CLUSTER_INFO)
            except (ClientError, BrokerError):
                raise exc from None
            info = frame.header
            if not isinstance(info, ClusterInfo) or not info.broker_addr_table:
                raise
            data = TopicRouteData(
                queue_datas=[
                    QueueData(broker_name=name, read_queue_nums=self.default_topic_queues,
                              write_queue_nums=self.default_topic_queues)
                    for name in sorted(info.broker_addr_table)
                ],
                broker_datas=list(info.broker_addr_table.values()),
            )
            route = TopicRoute(topic, data)
            if not route.write_queues:
                raise
            # Not cached: the next send asks the name server again and finds the real route
            # once the broker has created the topic and re-registered.
            return route

    def record(self, broker: str, latency_ms: float) -> None:
        """How long ``broker`` took to answer (or a failure's penalty)."""
        if self.latency_fault:
            self.faults.update(broker, latency_ms)

    def spread_chooser(self) -> Callable[[list[MessageQueue]], MessageQueue]:
        """The queue choice of :meth:`select` for unpinned batches (no queue id, selector,
        hash key nor broker to avoid), for many batches chosen at once (a flush of spread
        traffic, client/multi_sender.py): each broker's availability is asked once per
        chooser, not once per candidate queue of every batch (a route of 8 queues on the one
        avoided broker asked it 8 times per batch, to end on the round-robin queue anyway)."""
        rr = self._rr
        if not self.faults.avoiding:
            return lambda queues: queues[next(rr) % len(queues)]
        available = self.faults.available
        known: dict[str, bool] = {}

        def choose(queues: list[MessageQueue]) -> MessageQueue:
            n = len(queues)
            start = next(rr)
            for k in range(n):
                mq = queues[(start + k) % n]
                ok = known.get(mq.broker_name)
                if ok is None:
                    ok = known[mq.broker_name] = available(mq.broker_name)
                if ok:
                    return mq
            return queues[start % n]  # every broker of the route avoided: round robin

        return choose

    def select(
        self,
        route: TopicRoute,
        msg: Message,
        queue_id: int | MessageQueue | None,
        selector: Selector | None,
        arg: Any,
        hash_key: str | bytes | None,
        avoid: str | None,
    ) -> tuple[MessageQueue, bool]:
        """(queue, pinned): pinned queues are never moved by a retry."""
        queues = route.write_queues
        if (
            queue_id is None and selector is None and hash_key is None and avoid is None
            and queues and not self.faults.avoiding
        ):
            # The common choice: plain round robin (no broker to avoid).
            return queues[next(self._rr) % len(queues)], False
        if not queues:
            self.routes.refresh_soon(route.topic)  # its groups may have a master again soon
            raise NoRouteError(
                f"topic {route.topic!r} has no writable queue (check its perm and write queue "
                "count, and that its brokers are registered)"
            )
        if queue_id is not None:
            if isinstance(queue_id, MessageQueue):
                if queue_id not in queues:
                    if queue_id.broker_name in route.group_addrs:
                        self.routes.refresh_soon(route.topic)  # an election may name one
                        raise NoRouteError(
                            f"queue {queue_id} belongs to broker group "
                            f"{queue_id.broker_name!r}, which has no master now (only slaves, "
                            "which take no writes); a send pinned to it is not moved to another "
                            "queue -- retry once a master is back (`tidemq cluster promote`)"
                        )
                    raise MessageRejectedError(f"queue {queue_id} is not a writable queue of "
                                               f"topic {route.topic!r}")
                return queue_id, True
            if not 0 <= queue_id < len(queues):
                raise MessageRejectedError(
                    f"queue_id {queue_id} is out of range: topic {route.topic!r} has "
                    f"{len(queues)} writable queues (0..{len(queues) - 1})"
                )
            return queues[queue_id], True
        if selector is not None:
            mq = selector(list(queues), msg, arg)
            if mq not in queues:
                raise MessageRejectedError(
                    f"the selector returned {mq!r}, which is not one of the queues it was given"
                )
            return mq, True
        if hash_key is not None:
            kb = hash_key.encode() if isinstance(hash_key, str) else hash_key
            return queues[crc32c(kb) % len(queues)], True
        n = len(queues)
        start = next(self._rr)
        if self.latency_fault or avoid is not None:
            for k in range(n):
                mq = queues[(start + k) % n]
                if mq.broker_name != avoid and (
                    not self.latency_fault or self.faults.available(mq.broker_name)
                ):
                    return mq, False
            if avoid is not None:
                for k in range(n):  # every other broker is avoided: any other broker at all
                    mq = queues[(start + k) % n]
                    if mq.broker_name != avoid:
                        return mq, False
        return queues[start % n], False
