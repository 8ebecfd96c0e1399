"""Test-side helpers: a minimal blocking frame client and server subprocesses.

Deliberately independent of ``tidemq.client``: these tests pin the broker's side of the wire
contract (docs/protocol.md) with nothing but ``tidemq.protocol`` and a socket.
"""

from __future__ import annotations

import itertools
import select
import socket
import time
from pathlib import Path

from support.cluster import Server, start, start_broker, start_namesrv
from tidemq.protocol.codes import RequestCode, ResponseCode
from tidemq.protocol.frame import Frame, FrameDecoder, encode_frame
from tidemq.protocol.headers import (
    PullMessageRequestHeader,
    SendMessageRequestHeader,
    TopicConfig,
    pull_sys_flag,
    response_header_type,
)
from tidemq.protocol.record import BatchView, MessageData, StoredMessage, encode_batch

SRC = str(Path(__file__).resolve().parents[2] / "src")


# -- the frame client -----------------------------------------------------------------------------



def _readable(sock: socket.socket, timeout: float) -> bool:
    """poll, not select: the test process may hold descriptors past FD_SETSIZE (1024)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLHUP)
    return bool(poller.poll(max(0.0, timeout) * 1000))

class Wire:
    """One connection; ``request`` sends a frame and returns its response (headers typed)."""

    def __init__(self, addr: str, timeout: float = 10.0) -> None:
        host, _, port = addr.rpartition(":")
        self.addr = addr
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._pending: dict[int, int] = {}
        self.decoder = FrameDecoder(header_types=self._resolve)
        self._ready: list[Frame] = []
        self._opaque = itertools.count(1)

    def _resolve(self, flags: int, code: int, opaque: int):
        return response_header_type(self._pending.get(opaque, 0), code)

    def __enter__(self) -> Wire:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def send(self, code: int, header=None, body=b"", *, oneway: bool = False) -> int:
        opaque = next(self._opaque)
        if not oneway:
            self._pending[opaque] = code
        self.sock.sendall(encode_frame(Frame.request(code, opaque, header, body, oneway=oneway)))
        return opaque

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self, opaque: int | None = None, timeout: float | None = None) -> Frame:
        """The next response (or the one for ``opaque``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            for i, f in enumerate(self._ready):
                if opaque is None or f.opaque == opaque:
                    del self._ready[i]
                    self._pending.pop(f.opaque, None)
                    return f
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("no response in time")
                if not _readable(self.sock, left):
                    raise TimeoutError("no response in time")
            data = self.sock.recv(1 << 20)
            if not data:
                raise ConnectionError("the server closed the connection")
            self._ready.extend(self.decoder.feed(data))

    def request(self, code: int, header=None, body=b"", timeout: float | None = None) -> Frame:
        return self.recv(self.send(code, header, body), timeout)

    def is_closed_by_peer(self, timeout: float = 5.0) -> bool:
        """True when the server closes the connection within ``timeout`` (data is discarded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if _readable(self.sock, deadline - time.monotonic()):
                try:
                    if not self.sock.recv(1 << 16):
                        return True
                except ConnectionError:
                    return True
        return False

    # -- conveniences -----------------------------------------------------------------------------
    def create_topic(self, topic: str, queues: int = 8, **kw) -> Frame:
        tc = TopicConfig(topic_name=topic, read_queue_nums=queues, write_queue_nums=queues, **kw)
        return self.request(RequestCode.UPDATE_AND_CREATE_TOPIC, tc)

    def send_messages(
        self,
        topic: str,
        bodies: list[bytes],
        *,
        queue_id: int = 0,
        tags=None,
        keys=None,
        producer_id: int = 7,
        base_seq: int = 0,
        oneway: bool = False,
        header_topic: str | None = None,
        header_queue_id: int | None = None,
    ) -> Frame | int:
        body = batch(topic, bodies, queue_id=queue_id, tags=tags, keys=keys,
                     producer_id=producer_id, base_seq=base_seq)
        code = RequestCode.SEND_BATCH if len(bodies) > 1 else RequestCode.SEND_MESSAGE
        header = SendMessageRequestHeader(
            producer_group="pg",
            topic=header_topic if header_topic is not None else topic,
            queue_id=header_queue_id if header_queue_id is not None else queue_id,
            batch=len(bodies) > 1,
        )
        if oneway:
            return self.send(code, header, bytes(body), oneway=True)
        return self.request(code, header, bytes(body))

    def pull_header(
        self,
        topic: str,
        offset: int,
        *,
        queue_id: int = 0,
        group: str = "cg",
        max_msgs: int = 32,
        suspend_ms: int | None = None,
        subscription: str | None = None,
        commit_offset: int | None = None,
    ) -> PullMessageRequestHeader:
        return PullMessageRequestHeader(
            consumer_group=group,
            topic=topic,
            queue_id=queue_id,
            queue_offset=offset,
            max_msg_nums=max_msgs,
            sys_flag=pull_sys_flag(
                suspend=suspend_ms is not None,
                commit_offset=commit_offset is not None,
                subscription=subscription is not None,
            ),
            commit_offset=commit_offset or 0,
            suspend_timeout_millis=suspend_ms or 0,
            subscription=subscription,
        )

    def pull(self, topic: str, offset: int, timeout: float | None = 10.0, **kw) -> Frame:
        return self.request(RequestCode.PULL_MESSAGE, self.pull_header(topic, offset, **kw),
                            timeout=timeout)


def batch(topic, bodies, *, queue_id=0, tags=None, keys=None, producer_id=7, base_seq=0):
    msgs = [
        MessageData(
            b,
            tags=(tags[i] if isinstance(tags, list) else tags),
            keys=(keys[i] if isinstance(keys, list) else keys),
        )
        for i, b in enumerate(bodies)
    ]
    return encode_batch(topic, msgs, queue_id=queue_id, producer_id=producer_id,
                        base_seq=base_seq)


def decode_pull(frame: Frame, requested_offset: int, tags: set[str] | None = None):
    """Messages of a FOUND pull body, as the client must read them (docs/protocol.md)."""
    out: list[StoredMessage] = []
    body = frame.body
    pos = 0
    while pos < len(body):
        v = BatchView(body, pos)
        v.verify()
        start = max(0, requested_offset - v.queue_offset)
        for m in v.messages(start):
            if tags is None or m.tags in tags:
                out.append(m)
        pos += v.total_size
    return out


def error_message(frame: Frame) -> str:
    return getattr(frame.header, "message", "")


def wait_until(pred, timeout: float = 10.0, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            return value
        time.sleep(interval)


__all__ = [
    "Wire", "Server", "batch", "decode_pull", "error_message", "start", "start_namesrv",
    "start_broker", "wait_until", "RequestCode", "ResponseCode",
]
