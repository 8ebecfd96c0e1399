"""A tiny frame-speaking server for testing client layers without a broker (never as proof
that the client works with the real broker: tests/client/test_integration.py does that)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from tidemq.protocol.frame import Frame, FrameDecoder, encode_frame
from tidemq.protocol.headers import request_header_type

Handler = Callable[[Frame], Awaitable[Frame | bytes | None]]


class FakeServer:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.server: asyncio.Server | None = None
        self.requests: list[Frame] = []

    @property
    def address(self) -> str:
        assert self.server is not None
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    async def start(self) -> FakeServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        dec = FrameDecoder(header_types=lambda f, c, o: request_header_type(c))
        try:
            while data := await reader.read(65536):
                for frame in dec.feed(data):
                    self.requests.append(frame)
                    asyncio.ensure_future(self._answer(frame, writer))
        except ConnectionError:
            pass

    async def _answer(self, frame: Frame, writer: asyncio.StreamWriter) -> None:
        out = await self.handler(frame)
        if out is None:
            return
        writer.write(out if isinstance(out, bytes) else encode_frame(out))
