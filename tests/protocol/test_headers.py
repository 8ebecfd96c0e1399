"""Header Structs: round trips, validation of peer input, and the code -> header tables."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tidemq.protocol.codes import RequestCode, ResponseCode, describe
from tidemq.protocol.errors import LocalProtocolError, RemoteProtocolError
from tidemq.protocol.frame import Frame, FrameDecoder, encode_frame
from tidemq.protocol.headers import (
    REQUEST_HEADER_TYPES,
    RESPONSE_HEADER_TYPES,
    BrokerData,
    EmptyHeader,
    ErrorResponseHeader,
    GetRouteInfoRequestHeader,
    HeartbeatRequestHeader,
    Perm,
    PullMessageRequestHeader,
    PullMessageResponseHeader,
    PullSysFlag,
    QueueData,
    RegisterBrokerRequestHeader,
    RegisterBrokerResponseHeader,
    SendMessageRequestHeader,
    SendMessageResponseHeader,
    TopicConfig,
    TopicRouteData,
    decode_header,
    encode_header,
    error_response,
    pull_sys_flag,
    request_header_type,
    response_header_type,
)

text = st.text(max_size=16)
u32 = st.integers(0, 2**32 - 1)
nonneg = st.integers(0, 2**63 - 1)
positive = st.integers(1, 2**63 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)

send_request = st.builds(
    SendMessageRequestHeader,
    producer_group=text, topic=text, queue_id=u32, born_timestamp=i64, flag=i64,
    properties=st.dictionaries(text, text, max_size=4), batch=st.booleans(),
    reconsume_times=nonneg,
)
send_response = st.builds(
    SendMessageResponseHeader,
    msg_id=text, queue_id=u32, queue_offset=nonneg, count=positive,
    transaction_id=st.none() | text,
)
pull_request = st.builds(
    PullMessageRequestHeader,
    consumer_group=text, topic=text, queue_id=u32, queue_offset=nonneg, max_msg_nums=positive,
    sys_flag=st.integers(0, 15), commit_offset=nonneg, suspend_timeout_millis=nonneg,
    subscription=st.none() | text, sub_version=i64,
    expression_type=st.sampled_from(["TAG", "SQL92"]),
)
pull_response = st.builds(
    PullMessageResponseHeader,
    next_begin_offset=nonneg, min_offset=nonneg, max_offset=nonneg,
    suggest_which_broker_id=nonneg,
)
topic_config = st.builds(
    TopicConfig,
    topic_name=text, read_queue_nums=u32, write_queue_nums=u32, perm=st.integers(0, 15),
    topic_sys_flag=st.integers(0, 255), order=st.booleans(),
)
register = st.builds(
    RegisterBrokerRequestHeader,
    cluster_name=text, broker_name=text, broker_id=nonneg, broker_addr=text,
    ha_server_addr=text, heartbeat_timeout_millis=positive, data_version=nonneg,
    topics=st.dictionaries(text, topic_config, max_size=3),
)
route = st.builds(
    TopicRouteData,
    queue_datas=st.lists(
        st.builds(QueueData, broker_name=text, read_queue_nums=u32, write_queue_nums=u32,
                  perm=st.integers(0, 15), topic_sys_flag=st.integers(0, 255)),
        max_size=3,
    ),
    broker_datas=st.lists(
        st.builds(BrokerData, cluster=text, broker_name=text,
                  broker_addrs=st.dictionaries(st.integers(0, 16), text, max_size=3)),
        max_size=3,
    ),
    order_topic_conf=st.none() | text,
)
any_header = st.one_of(
    send_request, send_response, pull_request, pull_response, register, route,
    st.builds(RegisterBrokerResponseHeader, ha_server_addr=text, master_addr=text),
    st.builds(GetRouteInfoRequestHeader, topic=text),
    st.builds(ErrorResponseHeader, message=text),
)


@given(any_header)
def test_header_round_trip(header):
    raw = encode_header(header)
    assert decode_header(raw, type(header)) == header


@given(any_header, st.integers(0, 0xFFFF), u32)
def test_header_round_trip_through_a_frame(header, code, opaque):
    wire = encode_frame(Frame.request(code, opaque, header, b"body"))
    (frame,) = FrameDecoder(header_types=lambda f, c, o: type(header)).feed(wire)
    assert frame.header == header and bytes(frame.body) == b"body"


def test_defaults_are_not_sent_and_unknown_fields_are_ignored():
    h = PullMessageRequestHeader(consumer_group="g", topic="t", queue_id=1, queue_offset=5)
    assert msgspec.msgpack.decode(encode_header(h)) == {
        "consumer_group": "g", "topic": "t", "queue_id": 1, "queue_offset": 5,
    }
    newer = msgspec.msgpack.encode({**msgspec.to_builtins(h), "field_from_v2": [1, 2]})
    assert decode_header(newer, PullMessageRequestHeader) == h


@pytest.mark.parametrize(
    ("raw", "htype"),
    [
        (b"", SendMessageRequestHeader),  # required fields missing
        (b"\xc1", SendMessageResponseHeader),  # not MessagePack
        (msgspec.msgpack.encode({"msg_id": "x", "queue_id": -1, "queue_offset": 0}),
         SendMessageResponseHeader),  # negative queue id
        (msgspec.msgpack.encode({"topic": 5}), GetRouteInfoRequestHeader),  # wrong type
        (msgspec.msgpack.encode([1, 2]), ErrorResponseHeader),  # not a map
        (msgspec.msgpack.encode({"next_begin_offset": 1, "min_offset": 0, "max_offset": 2**64 - 1,
                                 "suggest_which_broker_id": -3}), PullMessageResponseHeader),
    ],
)
def test_bad_header_input_is_a_remote_protocol_error(raw, htype):
    with pytest.raises(RemoteProtocolError, match=htype.__name__):
        decode_header(raw, htype)


def test_unencodable_header_is_a_local_protocol_error():
    with pytest.raises(LocalProtocolError, match="SendMessageRequestHeader"):
        encode_header(SendMessageRequestHeader(producer_group="g", topic="t",
                                               queue_id=object()))  # type: ignore[arg-type]


def test_pull_sys_flag_bits():
    assert pull_sys_flag() == 0
    assert pull_sys_flag(commit_offset=True) == 0x1
    assert pull_sys_flag(suspend=True) == 0x2
    assert pull_sys_flag(subscription=True) == 0x4
    assert pull_sys_flag(class_filter=True) == 0x8
    flag = pull_sys_flag(commit_offset=True, suspend=True, subscription=True)
    h = PullMessageRequestHeader(consumer_group="g", topic="t", queue_id=0, queue_offset=0,
                                 sys_flag=flag)
    assert (h.has_commit_offset, h.has_suspend, h.has_subscription, h.has_class_filter) == (
        True, True, True, False,
    )
    assert flag & ~PullSysFlag.COMMIT_OFFSET == 0x6
    assert Perm.READ_WRITE == 6


def test_header_tables():
    for code in (RequestCode.SEND_MESSAGE, RequestCode.SEND_BATCH):
        assert request_header_type(code) is SendMessageRequestHeader
        assert response_header_type(code, ResponseCode.SUCCESS) is SendMessageResponseHeader
        assert response_header_type(code, ResponseCode.FLUSH_DISK_TIMEOUT) is (
            SendMessageResponseHeader
        )
        assert response_header_type(code, ResponseCode.TOPIC_NOT_EXIST) is ErrorResponseHeader
    pull = RequestCode.PULL_MESSAGE
    for code in (ResponseCode.SUCCESS, ResponseCode.PULL_NOT_FOUND,
                 ResponseCode.PULL_RETRY_IMMEDIATELY, ResponseCode.PULL_OFFSET_MOVED):
        assert response_header_type(pull, code) is PullMessageResponseHeader
    assert response_header_type(pull, ResponseCode.SUBSCRIPTION_NOT_EXIST) is ErrorResponseHeader
    assert response_header_type(RequestCode.GET_ROUTEINFO_BY_TOPIC, 0) is TopicRouteData
    assert response_header_type(RequestCode.HEART_BEAT, 0) is EmptyHeader
    assert response_header_type(RequestCode.HEART_BEAT, ResponseCode.SYSTEM_BUSY) is (
        ErrorResponseHeader
    )
    assert request_header_type(RequestCode.HEART_BEAT) is HeartbeatRequestHeader
    # Every request has a response header, but the broker's one-way notices to clients.
    broker_to_client = {
        RequestCode.CHECK_TRANSACTION_STATE, RequestCode.NOTIFY_CONSUMER_IDS_CHANGED,
    }
    assert set(REQUEST_HEADER_TYPES) - broker_to_client == set(RESPONSE_HEADER_TYPES)


def test_error_response_frame():
    req = Frame.request(RequestCode.PULL_MESSAGE, 77)
    err = error_response(req, ResponseCode.SUBSCRIPTION_NOT_EXIST)
    assert err.is_response and err.opaque == 77 and err.code == 24
    assert err.header == ErrorResponseHeader(message=describe(24))
    assert error_response(req, 1, "boom").header.message == "boom"
    with pytest.raises(LocalProtocolError):
        error_response(req, ResponseCode.SUCCESS)


class _MultiQueuePullV1(msgspec.Struct, array_like=True, omit_defaults=True):
    """MultiQueuePull as a client without permits encodes and a broker without them decodes."""

    topic: str
    queue_id: int
    queue_offset: int
    max_msg_nums: int = 32
    sys_flag: int = 0
    commit_offset: int = 0
    subscription: str | None = None
    expression_type: str = "TAG"
    resolve: int = 0
    timestamp: int = 0


class _MultiQueuePullResultV1(msgspec.Struct, array_like=True, omit_defaults=True):
    code: int
    next_begin_offset: int = 0
    min_offset: int = 0
    max_offset: int = 0
    body_bytes: int = 0
    message: str = ""
    members: list[bytes] = []
    suggest_which_broker_id: int = 0
    start_offset: int = -1
    start_committed: bool = False


def test_standing_permits_travel_between_versions() -> None:
    """``keep`` (a pull's permits) and ``stands`` (a result's) are trailing fields with
    defaults (docs/protocol.md 4.0, "kept standing"): a peer without them decodes the new
    layout, and the new one decodes theirs as "no permits" / "does not stand"."""
    from tidemq.protocol.headers import MultiQueuePull, MultiQueuePullResult

    enc = msgspec.msgpack.encode
    new_pull = MultiQueuePull("t", 3, 17, keep=128, resolve=2)
    old = msgspec.msgpack.decode(enc(new_pull), type=_MultiQueuePullV1)  # an older broker
    assert (old.topic, old.queue_id, old.queue_offset, old.resolve) == ("t", 3, 17, 2)
    from_old = msgspec.msgpack.decode(enc(_MultiQueuePullV1("t", 3, 17)), type=MultiQueuePull)
    assert from_old.keep == 0  # an older client grants no permits

    new_res = MultiQueuePullResult(0, next_begin_offset=9, body_bytes=5, stands=True)
    old_res = msgspec.msgpack.decode(enc(new_res), type=_MultiQueuePullResultV1)
    assert (old_res.code, old_res.next_begin_offset, old_res.body_bytes) == (0, 9, 5)
    res = msgspec.msgpack.decode(enc(_MultiQueuePullResultV1(0, 9)), type=MultiQueuePullResult)
    assert res.stands is False  # an older broker's answer: the client pulls again
