"""Hypothesis strategies for the fuzz suite: request frames whose headers are valid MessagePack
with wrong, missing or extreme fields, and batches with valid CRCs and hostile content."""

from __future__ import annotations

import msgspec
from hypothesis import strategies as st
from tests.broker.forge import Rec, forge

from tidemq.protocol.codes import RequestCode
from tidemq.protocol.frame import (
    FLAG_ONEWAY,
    FLAG_RESPONSE,
    FRAME_MAGIC,
    FRAME_PREFIX,
    FRAME_VERSION,
)
from tidemq.protocol.headers import REQUEST_HEADER_TYPES

__all__ = ["header_bytes", "batches", "Sent", "BROKER_CODES", "NAMESRV_CODES"]

NAMESRV_CODES = [RequestCode.REGISTER_BROKER, RequestCode.UNREGISTER_BROKER,
                 RequestCode.GET_ROUTEINFO_BY_TOPIC, RequestCode.GET_BROKER_CLUSTER_INFO,
                 RequestCode.GET_ALL_TOPIC_LIST_FROM_NAMESERVER]
BROKER_CODES = [c for c in RequestCode if c not in NAMESRV_CODES]

# -- values --------------------------------------------------------------------------------------

I64 = st.integers(-(2**63), 2**63 - 1)
ANY_INT = st.integers(-(2**63), 2**64 - 1)
hostile = st.recursive(
    st.none() | st.booleans() | ANY_INT | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
    max_leaves=8,
)
extreme_ints = st.sampled_from([0, 1, 7, 99, 2**31, 2**32 - 1, 2**63 - 1, 2**64 - 1, -1,
                                -(2**63)])
TOPICS = ["fz-ok", "fz-ro", "fz-wo", "%RETRY%fz-g", "%DLQ%fz-g", "SCHEDULE_TOPIC_XXXX",
          "rmq_sys_wheel_timer", "RMQ_SYS_TRANS_HALF_TOPIC", "RMQ_SYS_TRANS_OP_HALF_TOPIC",
          "TRANS_CHECK_MAX_TIME_TOPIC", "%NP%fz", "fz-new", "a b", "", "x" * 128, "é"]
GROUPS = ["fz-g", "TOOLS_CONSUMER", "a b", "", "g" * 121, "%RETRY%x", "fz-txn", "é"]
topics = st.sampled_from(TOPICS) | st.text(max_size=10)
groups = st.sampled_from(GROUPS) | st.text(max_size=10)
small_or_extreme = st.integers(0, 64) | extreme_ints
expressions = st.sampled_from(["*", "TagA || TagB", "||", "", "a > 1", " * ", "TagA||*"])
hexid = st.binary(min_size=16, max_size=16).map(lambda b: b.hex().upper())

subscription = st.fixed_dictionaries({}, optional={
    "topic": topics, "expression": expressions | hostile,
    "expression_type": st.sampled_from(["TAG", "SQL92", "", "x"]), "sub_version": ANY_INT})
consumer_data = st.fixed_dictionaries({"group": groups}, optional={
    "consume_type": st.sampled_from(["PUSH", "PULL", "x"]),
    "message_model": st.sampled_from(["CLUSTERING", "BROADCASTING", "x"]),
    "consume_from": st.sampled_from(["last", "first", "timestamp", "x"]),
    "subscriptions": st.lists(subscription | hostile, max_size=3)})
queue_ref = st.fixed_dictionaries({"topic": topics, "broker_name": st.sampled_from(
    ["broker-a", "fz-broker", ""]), "queue_id": small_or_extreme})
topic_config = st.fixed_dictionaries({"topic_name": topics}, optional={
    "read_queue_nums": small_or_extreme, "write_queue_nums": small_or_extreme,
    "perm": st.sampled_from([0, 2, 4, 6, 0xFF, -1]), "order": st.booleans(),
    "topic_sys_flag": ANY_INT})

BY_NAME = {
    "topic": topics, "topic_name": topics,
    "consumer_group": groups, "producer_group": groups, "group": groups, "group_name": groups,
    "queue_id": small_or_extreme, "queue_offset": small_or_extreme,
    "commit_offset": small_or_extreme, "commit_log_offset": small_or_extreme,
    "tran_state_table_offset": small_or_extreme, "index": small_or_extreme,
    "max_msg_nums": small_or_extreme, "max_num": small_or_extreme,
    "sys_flag": st.integers(0, 255) | extreme_ints,
    "suspend_timeout_millis": st.sampled_from([0, 50, 2**31]),
    "subscription": expressions | st.none(), "expression": expressions,
    "expression_type": st.sampled_from(["TAG", "SQL92", "", "x"]),
    "msg_id": hexid | st.sampled_from(["F" * 32, "nothex", ""]),
    "transaction_id": hexid, "origin_msg_id": hexid, "origin_topic": topics,
    "key": st.sampled_from(["k1", "", "x" * 1000]) | st.text(max_size=8),
    "client_id": st.sampled_from(["c1", "c2", ""]) | st.text(max_size=8),
    "consumers": st.lists(consumer_data | hostile, max_size=3),
    "producer_groups": st.lists(groups, max_size=3),
    "queues": st.lists(queue_ref | hostile, max_size=3),
    "read_queue_nums": small_or_extreme, "write_queue_nums": small_or_extreme,
    "retry_queue_nums": small_or_extreme, "retry_max_times": small_or_extreme,
    "perm": st.sampled_from([0, 2, 4, 6, 0xFF, -1]),
    "delay_level": st.sampled_from([-2, -1, 0, 1, 18, 31, 99, 2**31]),
    "commit_or_rollback": st.sampled_from([0, 1, 2, 3, 9, -1]),
    "max_reconsume_times": st.sampled_from([-1, 0, 1, 16, 2**31]),
    "producer_name": st.sampled_from(["p1", "", "x" * 300]) | st.text(max_size=8),
    "timestamp": I64, "begin_timestamp": I64, "end_timestamp": I64,
    "topics": st.dictionaries(topics, topic_config | hostile, max_size=3),
    "broker_addr": st.sampled_from(["127.0.0.1:1", "", "garbage", ":::", "[::1]:9"]),
    "ha_server_addr": st.sampled_from(["", "x"]),
    "cluster_name": st.sampled_from(["fz-cluster", ""]) | st.text(max_size=8),
    "broker_name": st.sampled_from(["fz-broker", "fz-broker-2", ""]) | st.text(max_size=8),
    "broker_id": small_or_extreme, "heartbeat_timeout_millis": small_or_extreme,
    "data_version": small_or_extreme,
}
_MISSING = object()


def _field(name: str) -> st.SearchStrategy:
    plausible = BY_NAME.get(name, hostile)
    return st.one_of(plausible, plausible, plausible, hostile, st.just(_MISSING))


@st.composite
def header_bytes(draw, code: int) -> bytes:
    """A MessagePack header for ``code``: usually a map of its fields (each plausible, hostile
    or missing, plus unknown keys), sometimes any other MessagePack value, or nothing."""
    kind = draw(st.integers(0, 19))
    if kind == 0:
        return b""
    if kind == 1:
        return msgspec.msgpack.encode(draw(hostile))
    t = REQUEST_HEADER_TYPES.get(code)
    names = [f.name for f in msgspec.structs.fields(t)] if t is not None else []
    d = {n: draw(_field(n)) for n in names}
    d = {k: v for k, v in d.items() if v is not _MISSING}
    d.update(draw(st.dictionaries(st.text(max_size=6), hostile, max_size=2)))
    return msgspec.msgpack.encode(d)


class Sent:
    """One generated frame: its bytes and whether the peer may answer it."""

    def __init__(self, code: int, flags: int, opaque: int, header: bytes, body: bytes) -> None:
        self.code, self.flags, self.opaque = code, flags, opaque
        self.header, self.body = header, body
        self.data = FRAME_PREFIX.pack(14 + len(header) + len(body), FRAME_MAGIC, FRAME_VERSION,
                                      flags, 0, code, opaque, len(header)) + header + body

    @property
    def answered(self) -> bool:
        return not self.flags & (FLAG_ONEWAY | FLAG_RESPONSE)

    def __repr__(self) -> str:
        try:
            name = RequestCode(self.code).name
        except ValueError:
            name = str(self.code)
        head = msgspec.msgpack.decode(self.header) if self.header else None
        return (f"Sent({name}, flags={self.flags}, header={head!r}, body={len(self.body)} "
                f"bytes {bytes(self.body[:40])!r})")


# -- batches -------------------------------------------------------------------------------------

text = st.text(alphabet=st.characters(blacklist_categories=("Cs",),
                                      blacklist_characters="\x01\x02 "), max_size=10)
bad_bytes = st.binary(max_size=8) | st.sampled_from(
    [b"\xff", b"\xc3", b"ok\xe2\x82", b"\xed\xa0\x80", b"\xc0\xaf", b"\x80"])


@st.composite
def batches(draw, topic: str) -> bytes:
    """A batch with valid CRCs: clean, or with lies (non-UTF-8 fields, sizes that do not add
    up, compression that does not match raw_size, extreme counts and attributes)."""
    n = draw(st.integers(1, 3) | st.integers(17, 60))
    recs = []
    for _ in range(n):
        recs.append(Rec(body=draw(st.binary(max_size=16)),
                        tag=draw(st.just(b"") | text.map(str.encode)),
                        props=draw(st.just(b"") | text.map(lambda s: f"K\x01{s}\x02".encode())),
                        keys=draw(st.none() | text.filter(bool).map(str.encode))))
    kw: dict = {"compression": draw(st.sampled_from([0, 0, 0, 1, 2, 3]))}
    for _ in range(draw(st.integers(0, 2))):
        lie = draw(st.sampled_from(["tag", "props", "keys", "big_props", "size", "extra",
                                    "rels", "raw_size", "count", "attributes", "delay",
                                    "deliver_at", "records"]))
        r = recs[draw(st.integers(0, n - 1))]
        if lie in ("tag", "props", "keys"):
            setattr(r, lie, draw(bad_bytes))
        elif lie == "big_props":
            r.props = b"p" * draw(st.sampled_from([32_768, 32_769, 70_000]))
        elif lie == "size":
            r.size_fix = draw(st.sampled_from([-30, -1, 1, 2**20]))
        elif lie == "extra":
            r.extra = b"\0" * draw(st.integers(1, 5))
        elif lie == "rels":
            kw["rels"] = draw(st.lists(extreme_ints.filter(lambda x: 0 <= x < 2**32),
                                       min_size=n, max_size=n))
        elif lie == "raw_size":
            kw["raw_size"] = draw(st.integers(0, 2**32 - 1))
        elif lie == "count":
            kw["count"] = draw(st.sampled_from([0, n + 1, 2**32 - 1]))
        elif lie == "attributes":
            kw["attributes"] = draw(st.integers(0, 0xFFFF))
        elif lie == "delay":
            kw["delay_level"] = draw(st.integers(0, 31))
        elif lie == "deliver_at":
            kw["deliver_at"] = draw(I64)
        elif lie == "records":
            kw["records"] = draw(st.binary(max_size=64))
    return forge(topic, recs, **kw)
