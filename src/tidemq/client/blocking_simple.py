"""Blocking SimpleConsumer: ``tidemq.SimpleConsumer``, the facade of
``tidemq.aio.SimpleConsumer`` (``client/simple_consumer.py``) on the shared I/O thread.

Acks from many threads (or ``ack_async``) are grouped into one ACK_MESSAGE frame per flush;
``ack`` waits for its answer, ``ack_async`` returns a ``concurrent.futures.Future``.
Any thread.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable, Sequence
from typing import Any

from tidemq.client.blocking import _Facade, _make, _open, _run, _submit
from tidemq.client.simple_consumer import ReceivedMessage
from tidemq.client.simple_consumer import SimpleConsumer as AioSimpleConsumer

__all__ = ["SimpleConsumer"]


class SimpleConsumer(_Facade):
    """Blocking SimpleConsumer; options as ``tidemq.aio.SimpleConsumer``. Any thread."""

    def __init__(self, namesrv: str | Sequence[str], group: str, **options: Any) -> None:
        self._aio: AioSimpleConsumer = _run(
            _make(lambda: AioSimpleConsumer(namesrv, group, **options)))

    def subscribe(self, topic: str, expression: str = "*", *, sql: str | None = None) -> None:
        async def go() -> None:
            self._aio.subscribe(topic, expression, sql=sql)

        _run(go())

    def unsubscribe(self, topic: str) -> None:
        async def go() -> None:
            self._aio.unsubscribe(topic)

        _run(go())

    def receive(self, max_messages: int = 16, invisible_duration: float = 30.0
                ) -> list[ReceivedMessage]:
        _open.add(self)
        return _run(self._aio.receive(max_messages, invisible_duration))

    def ack(self, msg: ReceivedMessage) -> None:
        """Ack ``msg``; StaleReceiptError when its handle is stale."""
        _run(self._aio.ack(msg))

    def ack_async(self, msg: ReceivedMessage) -> concurrent.futures.Future[None]:
        """Queue the ack of ``msg`` (grouped with others into one frame); a future of it."""
        return _submit(self._aio.ack(msg))

    def ack_all(self, msgs: Iterable[ReceivedMessage]) -> list[BaseException | None]:
        """Ack many in one frame per broker; per message None or its error."""
        return _run(self._aio.ack_all(list(msgs)))

    def change_invisible_duration(self, msg: ReceivedMessage, duration: float) -> None:
        _run(self._aio.change_invisible_duration(msg, duration))

    def change_invisible_all(self, msgs: Sequence[ReceivedMessage],
                             durations: Sequence[float]) -> list[BaseException | None]:
        """:meth:`change_invisible_duration` of many, one frame per broker; per message None
        or its error."""
        return _run(self._aio.change_invisible_all(list(msgs), list(durations)))

    def stats(self) -> dict[str, int]:
        async def go() -> dict[str, int]:
            return self._aio.stats()

        return _run(go())
