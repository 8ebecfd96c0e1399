"""PULL_MESSAGE (RocketMQ's PullMessageProcessor; ref BR2; the
status table is in docs/protocol.md, "Pull").

A pull names (group, topic, queue id, queue offset, max messages, sys flags, commit offset,
suspend timeout, subscription). The processor

1. checks the request (group present and allowed to consume -- ``consume_switches.py`` --,
   topic exists and is readable, queue id below the topic's read queue count, a subscription
   that parses) -- any failure is an error response;
2. stores the piggy-backed commit offset (PullSysFlag.COMMIT_OFFSET), only on the first
   execution, never when a held pull is re-executed (RocketMQ's ``brokerAllowSuspend``), and
   never on a slave (there only explicit commits count);
3. reads from the store (``MessageStore.get_messages`` filters whole batches by tag hash) and
   maps its GetStatus to a response code exactly as RocketMQ does::

       FOUND                                   -> SUCCESS                 (PullStatus.FOUND)
       NO_MATCHED_MESSAGE, MESSAGE_WAS_REMOVING -> PULL_RETRY_IMMEDIATELY  (NO_MATCHED_MSG)
       OFFSET_FOUND_NULL, OFFSET_OVERFLOW_ONE  -> PULL_NOT_FOUND          (NO_NEW_MSG)
       NO_MESSAGE_IN_QUEUE, NO_MATCHED_LOGIC_QUEUE
                         offset == 0           -> PULL_NOT_FOUND
                         offset != 0           -> PULL_OFFSET_MOVED       (OFFSET_ILLEGAL)
       OFFSET_OVERFLOW_BADLY, OFFSET_TOO_SMALL -> PULL_OFFSET_MOVED

   with the store's corrected next_begin_offset (a master always corrects: below the queue it
   is min_offset, past the end max_offset -- or min_offset when that is 0 -- and 0 for an empty
   queue), min_offset and max_offset in every response;
4. holds the pull (long_polling) when it would answer PULL_NOT_FOUND and carries SUSPEND;
5. answers FOUND with the stored batches, unmodified, as the body: the first batch may start
   before the requested offset and the last may run past max_msg_nums; the client skips and
   re-filters by tag string (the broker filters by tag hash only).
6. suggests the broker to pull from next (``suggest_which_broker_id``, as RocketMQ): with
   ``slave_read_enable``, a consumer left more than ``access_message_in_memory_max_ratio`` % of
   memory behind the CommitLog's end is sent to the group's ``which_broker_when_consume_slowly``
   (a slave), any other to the master (docs/cluster.md).

A write-only topic cannot be pulled, with one exception: a dead-letter topic ``%DLQ%<group>``
may be read by the admin tools' group ``TOOLS_CONSUMER`` (`tidemq dlq list|resend`).

Subscriptions: ``"*"``, empty or absent = every message; ``"TagA || TagB"`` = messages whose tag
is one of these (by tag hash; ``protocol/batch/tags.py`` is the one parser, shared with the
client: ``"A || *"`` is the tags {A, *}, not everything); expression type ``SQL92``: messages
the expression selects (``protocol/sql_filter.py``), evaluated per message as the batches are
read (``broker/sql_select.py``), the answer naming them in ``members``. An expression that does
not compile is SUBSCRIPTION_PARSE_FAILED, with the reason.
Without a consumer registry (heartbeats), the broker takes the subscription from the request
whether or not PullSysFlag.SUBSCRIPTION is set.

Threads: the broker's event loop only.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from tidemq.broker.connection import decode_request
from tidemq.broker.consume_switches import check_consume_allowed, check_ordered_topic
from tidemq.broker.errors import RequestRejected, check_group
from tidemq.broker.long_polling import HeldPull
from tidemq.broker.pop_processor import PULL
from tidemq.broker.sql_select import read_selected, sql_filter_for
from tidemq.protocol.batch.fields import phys_offset_at
from tidemq.protocol.batch.tags import tag_hashes
from tidemq.protocol.codes import DLQ_PREFIX, TOOLS_CONSUMER_GROUP, ResponseCode
from tidemq.protocol.headers import (
    MASTER_ID,
    Perm,
    PullMessageRequestHeader,
    PullMessageResponseHeader,
    PullSysFlag,
)
from tidemq.store.message_store import GetStatus
from tidemq.store.pull_outcome import GetResult

if TYPE_CHECKING:
    from tidemq.broker.broker import Broker
    from tidemq.broker.connection import BrokerConnection
    from tidemq.protocol.frame import Frame

__all__ = ["PullProcessor", "response_code_for"]



def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not Linux
        return 8 << 30

_R = ResponseCode
_S = GetStatus
_FIXED_CODES: dict[GetStatus, ResponseCode] = {
    _S.FOUND: _R.SUCCESS,
    _S.MESSAGE_WAS_REMOVING: _R.PULL_RETRY_IMMEDIATELY,
    _S.NO_MATCHED_MESSAGE: _R.PULL_RETRY_IMMEDIATELY,
    _S.OFFSET_FOUND_NULL: _R.PULL_NOT_FOUND,
    _S.OFFSET_OVERFLOW_ONE: _R.PULL_NOT_FOUND,
    _S.OFFSET_OVERFLOW_BADLY: _R.PULL_OFFSET_MOVED,
    _S.OFFSET_TOO_SMALL: _R.PULL_OFFSET_MOVED,
}
_SUCCESS = int(_R.SUCCESS)
_EMPTY_QUEUE = frozenset({_S.NO_MESSAGE_IN_QUEUE, _S.NO_MATCHED_LOGIC_QUEUE})


def response_code_for(status: GetStatus, requested_offset: int) -> ResponseCode:
    """RocketMQ's GetMessageStatus -> ResponseCode table (docs/protocol.md, "Pull")."""
    code = _FIXED_CODES.get(status)
    if code is not None:
        return code
    if status in _EMPTY_QUEUE:
        return _R.PULL_OFFSET_MOVED if requested_offset != 0 else _R.PULL_NOT_FOUND
    raise AssertionError(f"unmapped store status {status}")


class PullProcessor:
    """Handles PULL_MESSAGE and re-runs held pulls (event loop only)."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.store = broker.store
        self.topics = broker.topics
        self.offsets = broker.offsets
        self.stats = broker.stats
        self.config = broker.config
        self.hold = broker.hold
        self._subscriptions: dict[str, frozenset[int] | None] = {}
        cfg = self.config
        #: a consumer further behind than this reads from a slave when slave reads are on
        self.slow_backlog = int(_memory_bytes() * cfg.access_message_in_memory_max_ratio / 100)

    def _tag_hashes(self, h: PullMessageRequestHeader) -> frozenset[int] | None:
        """The tag filter of a pull (None: none); an SQL92 subscription is compiled here to
        refuse a bad one at the door, and filtered by ``process``."""
        kind = h.expression_type.upper()
        if kind == "SQL92":
            sql_filter_for(h.subscription)
            return None
        if kind != "TAG":
            raise RequestRejected(
                ResponseCode.SUBSCRIPTION_PARSE_FAILED,
                f"expression type {h.expression_type!r} is not supported by this broker; "
                "use TAG ('*' or 'TagA || TagB') or SQL92",
            )
        expr = h.subscription
        if expr is None:
            return None
        cache = self._subscriptions
        if expr in cache:
            return cache[expr]
        try:
            hashes = tag_hashes(expr)
        except ValueError as exc:
            raise RequestRejected(ResponseCode.SUBSCRIPTION_PARSE_FAILED, str(exc)) from None
        if len(cache) > 4096:
            cache.clear()
        cache[expr] = hashes
        return hashes

    def handle(self, conn: BrokerConnection, frame: Frame) -> None:
        h: PullMessageRequestHeader = decode_request(frame, PullMessageRequestHeader)
        if frame.is_oneway:
            raise RequestRejected(
                ResponseCode.INVALID_ARGUMENT, "a pull cannot be one-way: it exists to answer"
            )
        tags = self.admit(h, conn)
        self.process(conn, frame.opaque, h, tags, allow_suspend=True)

    def admit(self, h: PullMessageRequestHeader, conn: BrokerConnection
              ) -> frozenset[int] | None:
        """The door of one pull that came on ``conn``: RequestRejected, or its tag filter --
        after storing a piggy-backed commit offset."""
        self.admit_group(h.consumer_group)
        return self.admit_queue(h, conn)

    def admit_group(self, group: str) -> None:
        """The part of the door that depends on the group only (a PULL_MULTI_QUEUE checks it
        once for all its queues): RequestRejected."""
        check_group(group)
        check_consume_allowed(self.broker, group)
        if self.broker.pop is not None:
            self.broker.pop.check_mode(group, PULL)

    def admit_queue(self, h: PullMessageRequestHeader, conn: BrokerConnection
                    ) -> frozenset[int] | None:
        """The rest of the door, per queue, once ``admit_group`` passed: RequestRejected, or
        the tag filter -- after storing a piggy-backed commit offset."""
        group = h.consumer_group
        tc = self.topics.get(h.topic)
        broker_name = self.config.broker_name
        if tc is None:
            raise RequestRejected(
                ResponseCode.TOPIC_NOT_EXIST,
                f"topic {h.topic!r} does not exist on broker {broker_name}; create it or "
                "refresh the route from the name server",
            )
        if not tc.perm & Perm.READ and not (
            group == TOOLS_CONSUMER_GROUP and h.topic.startswith(DLQ_PREFIX)
        ):
            raise RequestRejected(
                ResponseCode.NO_PERMISSION,
                f"topic {h.topic!r} is not readable on broker {broker_name} (perm {tc.perm:#x})",
            )
        if h.queue_id >= tc.read_queue_nums:
            raise RequestRejected(
                ResponseCode.INVALID_ARGUMENT,
                f"queue id {h.queue_id} is out of range: topic {h.topic!r} has "
                f"{tc.read_queue_nums} read queues (0..{tc.read_queue_nums - 1}) on broker "
                f"{broker_name}",
            )
        check_ordered_topic(self.broker, conn, group, tc, h.queue_id)
        tags = self._tag_hashes(h)
        if h.sys_flag & PullSysFlag.COMMIT_OFFSET and not self.broker.ha.is_slave:
            # A slave stores offsets only when a consumer commits them explicitly (RocketMQ:
            # a pull's commit offset counts on the master only).
            self.offsets.commit(group, h.topic, h.queue_id, h.commit_offset)
        return tags

    def process(
        self,
        conn: BrokerConnection,
        opaque: int,
        h: PullMessageRequestHeader,
        tags: frozenset[int] | None,
        *,
        allow_suspend: bool,
    ) -> None:
        """Read and answer (or hold) one validated pull."""
        code, r, bodies, members, _n, suggest = self.read(h, tags)
        if bodies is not None:
            header = PullMessageResponseHeader(
                next_begin_offset=r.next_begin_offset,
                min_offset=r.min_offset,
                max_offset=r.max_offset,
                members=members,
                suggest_which_broker_id=suggest,
            )
            conn.respond(opaque, ResponseCode.SUCCESS, header, bodies)
            return
        suspend = allow_suspend and h.sys_flag & PullSysFlag.SUSPEND
        if code == ResponseCode.PULL_NOT_FOUND and suspend:
            cfg = self.config
            if len(conn.held) >= cfg.max_held_pulls_per_connection:
                raise RequestRejected(
                    ResponseCode.SYSTEM_BUSY,
                    f"this connection already has {len(conn.held)} pulls held by long polling "
                    f"(max_held_pulls_per_connection); pull again after the hint",
                )
            if cfg.long_polling_enable:
                timeout_ms = min(h.suspend_timeout_millis, cfg.max_suspend_ms)
            else:
                timeout_ms = cfg.short_polling_time_ms
            self.hold.suspend(
                HeldPull(conn, opaque, h, tags, timeout_ms / 1000.0, self.hold.loop.time())
            )
            return
        conn.respond(
            opaque,
            code,
            PullMessageResponseHeader(
                next_begin_offset=r.next_begin_offset,
                min_offset=r.min_offset,
                max_offset=r.max_offset,
            ),
        )

    def read(self, h: PullMessageRequestHeader, tags: frozenset[int] | None
             ) -> tuple[int, GetResult, list[memoryview] | None, list[bytes], int, int]:
        """Read one validated pull: (response code, the store's result, the found batches --
        None unless SUCCESS --, the SQL92 members, their bytes, the suggested broker id).
        ``process`` answers it as a PULL_MESSAGE, a PULL_MULTI_QUEUE as one of its queues."""
        np = self.broker.non_persistent
        src = np if np.owns(h.topic) else self.store
        members: list[bytes] = []
        if h.expression_type == "SQL92" or h.expression_type.upper() == "SQL92":
            r, members, _examined = read_selected(
                src, h.topic, h.queue_id, h.queue_offset, h.max_msg_nums,
                sql_filter_for(h.subscription), max_read_bytes=self.store.config.max_read_bytes,
            )
        else:
            r = src.get_messages(h.topic, h.queue_id, h.queue_offset, h.max_msg_nums, tags)
        if r.status is not _S.FOUND:
            return response_code_for(r.status, h.queue_offset), r, None, members, 0, MASTER_ID
        bodies = []
        n = count = 0
        for b in r.batches:
            bodies.append(b.data)
            n += len(b.data)
            count += b.count
        self.stats.record_get(h.consumer_group, h.topic, count, n)
        suggest = MASTER_ID
        if self.config.slave_read_enable and src is self.store:
            suggest = self._suggest(h.consumer_group, bodies[-1])
        return _SUCCESS, r, bodies, members, n, suggest

    def _suggest(self, group: str, last: memoryview) -> int:
        """RocketMQ's suggestWhichBrokerId: a consumer more than
        ``access_message_in_memory_max_ratio`` % of memory behind the CommitLog's end reads
        from the group's ``which_broker_when_consume_slowly`` (a slave, 1 by default); one
        that caught up goes back to the master."""
        behind = self.store.max_phys_offset - (phys_offset_at(last) + len(last))
        if behind > self.slow_backlog:
            sg = self.broker.subscription_groups.get(group)
            return sg.which_broker_when_consume_slowly if sg is not None else 1
        return MASTER_ID

    def execute_held(self, held: HeldPull) -> None:
        """Re-execute a held pull (woken or timed out): answer whatever is there now -- or,
        while its client is not reading (``write_paused``), once it reads again, so that pulls
        woken together cannot queue more than the high-water mark of responses."""
        conn = held.conn
        if conn.write_paused:
            conn.when_writable(lambda: self.execute_held(held))
            return
        try:
            self.process(held.conn, held.opaque, held.header, held.tag_hashes, allow_suspend=False)
        except Exception as exc:  # answer, never leave the client waiting
            self.broker.answer_failure(held.conn, held.opaque, "PULL_MESSAGE", exc)
