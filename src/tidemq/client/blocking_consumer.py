"""Blocking Pulsar-style consumer: ``tidemq.Consumer``, the facade of ``tidemq.aio.Consumer``
(``client/subscription_consumer.py``) on the shared I/O thread. Any thread."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any

from tidemq.client.blocking import _Facade, _make, _open, _run, _submit
from tidemq.client.simple_consumer import ReceivedMessage
from tidemq.client.subscription_consumer import Consumer as AioConsumer

__all__ = ["Consumer"]


class Consumer(_Facade):
    """Blocking Consumer; arguments as ``tidemq.aio.Consumer``. Any thread."""

    def __init__(self, namesrv: str | Sequence[str], topic: str | Sequence[str],
                 subscription: str, **options: Any) -> None:
        self._aio: AioConsumer = _run(
            _make(lambda: AioConsumer(namesrv, topic, subscription, **options)))

    def receive(self, timeout: float | None = None) -> ReceivedMessage | None:
        """The next message; None when none came within ``timeout`` seconds."""
        _open.add(self)
        return _run(self._aio.receive(timeout))

    def batch_receive(self, max_messages: int = 100, timeout: float | None = None
                      ) -> list[ReceivedMessage]:
        _open.add(self)
        return _run(self._aio.batch_receive(max_messages, timeout))

    def acknowledge(self, msg: ReceivedMessage) -> None:
        _run(self._aio.acknowledge(msg))

    def acknowledge_async(self, msg: ReceivedMessage) -> concurrent.futures.Future[None]:
        """Queue the ack (grouped with others into one frame); a future of its answer."""
        return _submit(self._aio.acknowledge(msg))

    def acknowledge_cumulative(self, msg: ReceivedMessage) -> int:
        return _run(self._aio.acknowledge_cumulative(msg))

    def negative_acknowledge(self, msg: ReceivedMessage) -> None:
        async def go() -> None:
            self._aio.negative_acknowledge(msg)

        _run(go())

    def seek(self, message: ReceivedMessage | None = None, *,
             timestamp: float | None = None) -> dict[str, dict[int, int]]:
        return _run(self._aio.seek(message, timestamp=timestamp))

    def pause(self) -> None:
        """Stop popping until :meth:`resume` (see ``tidemq.aio.Consumer.pause``)."""
        async def go() -> None:
            self._aio.pause()

        _run(go())

    def resume(self) -> None:
        async def go() -> None:
            self._aio.resume()

        _run(go())

    def stats(self) -> dict[str, Any]:
        async def go() -> dict[str, Any]:
            return self._aio.stats()

        return _run(go())
