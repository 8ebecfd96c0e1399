"""Reading for an SQL92 subscription (ref BR10): whole batches, plus who in them is selected.

RocketMQ evaluates a consumer's SQL92 expression on the broker for every message it reads
(``ExpressionMessageFilter.isMatchedByCommitLog``). Here the store keeps serving whole stored
batches, zero-copy; :func:`read_selected` evaluates the filter per message of each batch read
(tag and properties only, ``members.filter_fields``), drops the batches where nothing is
selected, and returns, for each batch kept, the bitmap of its selected messages -- the pull
answer carries them in ``PullMessageResponseHeader.members`` and the client hands out only
those. Nothing is re-encoded.

A read goes on past batches that select nothing until it has ``max_messages`` selected
messages, or examined ``scan_limit`` messages, or holds ``max_read_bytes`` of batches, or
reached the queue's end, so a selective filter does not cost the consumer one round trip per
handful of messages. When nothing was selected the status is NO_MATCHED_MESSAGE (the client
moves to next_begin_offset and pulls again at once, as RocketMQ's PULL_RETRY_IMMEDIATELY).

A record that does not decode selects nothing (the store's verify already checked the CRCs;
the client's decoder reports any damage if the batch is served for another member).

Threads: the broker's event loop (like the pull processor that calls it).
"""

from __future__ import annotations

from typing import Any, Protocol

from tidemq.broker.errors import RequestRejected
from tidemq.protocol.codes import ResponseCode
from tidemq.protocol.errors import CorruptBatchError
from tidemq.protocol.members import bitmap, filter_fields
from tidemq.protocol.record import BatchView
from tidemq.protocol.sql_filter import SqlFilter, SqlFilterError, compile_sql
from tidemq.store.pull_outcome import GetResult, GetStatus

__all__ = ["read_selected", "sql_filter_for", "check_subscription", "SCAN_LIMIT"]

#: messages one pull may examine at most (RocketMQ's maxFilterMessageCount is 16 000 queue
#: units; a Python broker answers sooner so one consumer's scan cannot hold the loop long)
SCAN_LIMIT = 4096
_SCAN_STEP = 256  # messages per store read once the first read selected too few


class _Source(Protocol):
    def get_messages(
        self, topic: str, queue_id: int, offset: int, max_messages: int = 32,
        tag_hashes: frozenset[int] | None = None,
    ) -> GetResult: ...


def read_selected(
    src: _Source,
    topic: str,
    queue_id: int,
    offset: int,
    max_messages: int,
    flt: SqlFilter,
    *,
    max_read_bytes: int = 4 << 20,
    scan_limit: int = SCAN_LIMIT,
) -> tuple[GetResult, list[bytes], int]:
    """(result, bitmaps, examined): ``result.batches`` are the batches holding a selected
    message (``count`` = messages selected), ``bitmaps[j]`` those of batch ``j``."""
    matches = flt.matches
    kept: list[Any] = []
    bitmaps: list[bytes] = []
    selected = examined = nbytes = 0
    r = first = src.get_messages(topic, queue_id, offset, max_messages)
    end = offset
    full = False
    while True:
        if r.status is not GetStatus.FOUND:
            end = max(end, r.next_begin_offset)
            break
        for b in r.batches:
            examined += b.count
            end = b.queue_offset + b.count  # right after this batch
            try:
                view = BatchView(b.data)
                picked = [i for i, tag, props in filter_fields(view, b.first_index)
                          if props is not None and matches(props, tag)]
            except CorruptBatchError:
                picked = []
            if picked:
                b.count = len(picked)
                kept.append(b)
                bitmaps.append(bitmap(picked))
                selected += len(picked)
                nbytes += len(b.data)
            if selected >= max_messages or nbytes >= max_read_bytes:
                full = True  # the batches after this one are left for the next pull
                break
        if full:
            break
        end = max(end, r.next_begin_offset)  # past units skipped as removed or corrupt
        if examined >= scan_limit or end >= r.max_offset:
            break
        # Read on in steps sized by the selectivity seen so far (what is read past the answer
        # is verified and dropped: not too much), at least max_messages, at most _SCAN_STEP.
        need = max_messages - selected
        step = need * examined // selected + need // 4 if selected else _SCAN_STEP
        step = max(max_messages, min(step, _SCAN_STEP, scan_limit - examined))
        r = src.get_messages(topic, queue_id, end, step)
    if examined == 0:
        return first, [], 0  # the store's own answer: empty queue, offset moved, ...
    status = GetStatus.FOUND if kept else GetStatus.NO_MATCHED_MESSAGE
    return GetResult(status, end, r.min_offset, r.max_offset, kept), bitmaps, examined


def sql_filter_for(expression: str | None) -> SqlFilter:
    """The compiled filter of a pull's or heartbeat's SQL92 expression (cached by
    ``compile_sql``); SUBSCRIPTION_PARSE_FAILED with the reason when it does not compile."""
    try:
        return compile_sql(expression or "")
    except SqlFilterError as exc:
        raise RequestRejected(ResponseCode.SUBSCRIPTION_PARSE_FAILED, exc.message) from None


def check_subscription(expression_type: str, expression: str | None, topic: str) -> None:
    """Refuse a subscription the broker cannot filter by (a heartbeat's, at the door)."""
    kind = (expression_type or "TAG").upper()
    if kind == "TAG":
        return
    if kind != "SQL92":
        raise RequestRejected(
            ResponseCode.SUBSCRIPTION_PARSE_FAILED,
            f"subscription to {topic!r}: expression type {expression_type!r} is not supported; "
            "use TAG or SQL92",
        )
    try:
        compile_sql(expression or "")
    except SqlFilterError as exc:
        raise RequestRejected(
            ResponseCode.SUBSCRIPTION_PARSE_FAILED, f"subscription to {topic!r}: {exc.message}"
        ) from None
