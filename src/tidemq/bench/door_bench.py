"""`tidemq bench door`: what the broker's door (``protocol.batch_rules.validate_batch``) costs
on the send path, measured inside one broker process.

A broker runs in this process on a temporary directory (ASYNC_FLUSH, no name server) and
``SendProcessor.handle`` -- the whole send path: header decode, checks, the store's put into
the mapped CommitLog and its consume-queue and key-index dispatch -- is called directly with
SEND_BATCH frames of BATCH messages of SIZE bytes, answers discarded; each body is joined from
the 64 KiB pieces a socket delivers, as the connection's FrameDecoder does (so it is as fresh in
the CPU's caches as a received one, and that copy is counted as the broker's work).
Within each round the door is on and replaced by a no-op in alternation, a few sends each, so
the machine's other load falls on both alike; the broker's event-loop thread CPU time is
summed per mode and the least disturbed round of each is kept. Two workloads: identical
messages (what ``bench produce`` sends) and varied ones (a tag of 8, a key and 2 properties per
message, ``bench produce --varied``).

A benchmark of the broker's own CPU: unlike ``bench produce`` it has no client or network in
the measure, so it still reads on a busy machine where end-to-end throughput swings by tens of
percent between runs. Runs its own event loop; call from a thread without one.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from typing import TYPE_CHECKING, Any, cast

import msgspec

from tidemq.broker import send_processor
from tidemq.broker.broker import Broker
from tidemq.broker.config import BrokerConfig
from tidemq.protocol.codes import RequestCode
from tidemq.protocol.frame import Frame
from tidemq.protocol.headers import SendMessageRequestHeader
from tidemq.protocol.record import MessageData, encode_batch

__all__ = ["bench_door"]


if TYPE_CHECKING:
    from tidemq.broker.connection import BrokerConnection


class _Sink:
    """The connection a handled send answers: answers are dropped."""

    peer = "bench"
    closed = False
    oneway_opaque = None

    def respond(self, *args: Any, **kwargs: Any) -> None:
        pass

    def respond_error(self, opaque: int, code: int, message: str) -> None:
        raise RuntimeError(f"the broker refused a benchmark batch: {code} {message}")


def _frame(topic: str, size: int, batch: int, varied: bool, seq: int
           ) -> tuple[msgspec.Raw, list[bytes]]:
    """A SEND_BATCH's header and its body cut in the 64 KiB pieces a socket delivers."""
    body = os.urandom(size)
    if varied:
        msgs = [MessageData(body, tags=f"Tag{i % 8}", keys=f"order-{seq + i}",
                            properties={"region": "eu-west-1", "attempt": str(i % 3)})
                for i in range(batch)]
    else:
        msgs = [MessageData(body) for _ in range(batch)]
    data = bytes(encode_batch(topic, msgs, producer_id=7, base_seq=seq))
    header = msgspec.msgpack.encode(SendMessageRequestHeader(
        producer_group="bench", topic=topic, queue_id=0, batch=True))
    return msgspec.Raw(header), [data[i : i + 65536] for i in range(0, len(data), 65536)]


def _no_door(v: Any, limits: Any) -> None:
    pass


_BLOCK = 5  # sends timed together
_SEND_BATCH = int(RequestCode.SEND_BATCH)


async def _run(size: int, batch: int, sends: int, rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tidemq-door-") as d:
        broker = Broker(BrokerConfig(data_dir=d, listen_port=0, listen_host="127.0.0.1",
                                     metrics_port=-1))
        await broker.start()
        try:
            handle = broker.send_processor.handle
            conn = cast("BrokerConnection", _Sink())  # answers dropped; duck-typed
            out: dict[str, Any] = {"workload": "door", "size": size, "batch": batch,
                                   "sends_per_round": sends, "rounds": rounds}
            names = vars(send_processor)  # the door is swapped in the module it is called from
            door = names["validate_batch"]
            for varied in (False, True):
                name = "varied" if varied else "identical"
                frames = [_frame(f"door-{name}", size, batch, varied, i * batch)
                          for i in range(16)]
                best = {"on": float("inf"), "off": float("inf")}
                for r in range(rounds):
                    # On and off alternate every few sends (in both orders across rounds):
                    # a burst of the machine's other load hits both alike.
                    took = {"on": 0.0, "off": 0.0}
                    for block in range(2 * sends // _BLOCK):
                        mode = ("on", "off")[(block + r) % 2]
                        names["validate_batch"] = door if mode == "on" else _no_door
                        try:
                            t0 = time.thread_time()
                            for i in range(_BLOCK):
                                header, pieces = frames[(block * _BLOCK + i) % len(frames)]
                                # what the connection's FrameDecoder does with a big frame:
                                # the pieces joined, the body a view of the result
                                body = memoryview(b"".join(pieces))
                                handle(conn, Frame(_SEND_BATCH, 1, 0, header, body))
                            took[mode] += time.thread_time() - t0
                        finally:
                            names["validate_batch"] = door
                        await asyncio.sleep(0)  # let the loop run the store's callbacks
                    for m in best:
                        best[m] = min(best[m], took[m])
                per_msg = {m: best[m] / (sends * batch) * 1e6 for m in best}
                out[f"{name}_us_per_msg_door_on"] = round(per_msg["on"], 3)
                out[f"{name}_us_per_msg_door_off"] = round(per_msg["off"], 3)
                out[f"{name}_door_share_pct"] = round(
                    (per_msg["on"] - per_msg["off"]) / per_msg["on"] * 100, 2)
            return out
        finally:
            await broker.stop()


def bench_door(*, size: int = 1024, batch: int = 1000, sends: int = 100,
               rounds: int = 5) -> dict[str, Any]:
    """Broker CPU per message of the send path with the door and without it."""
    return asyncio.run(_run(size, batch, sends, rounds))
