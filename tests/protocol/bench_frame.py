"""Frame codec micro-benchmark (not a test): ``.venv/bin/python tests/protocol/bench_frame.py``.

Prints ns per frame for encoding and for decoding a stream cut into 64 KiB reads, with typed
headers (the broker's path) and with dict headers.
"""

from __future__ import annotations

import time

from tidemq.protocol.codes import RequestCode
from tidemq.protocol.frame import (
    Frame,
    FrameDecoder,
    encode_frame,
    encode_frame_parts,
)
from tidemq.protocol.headers import (
    PullMessageRequestHeader,
    SendMessageRequestHeader,
    request_header_type,
)

N = 100_000
CHUNK = 64 * 1024


def _best(fn, repeat: int = 9) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    send = Frame.request(
        RequestCode.SEND_MESSAGE,
        12345,
        SendMessageRequestHeader(
            producer_group="bench-producers", topic="bench", queue_id=3,
            born_timestamp=1_700_000_000_000, batch=True,
        ),
        bytes(200),
    )
    pull = Frame.request(
        RequestCode.PULL_MESSAGE,
        12346,
        PullMessageRequestHeader(
            consumer_group="bench-consumers", topic="bench", queue_id=3, queue_offset=123456,
            sys_flag=3, subscription="*",
        ),
    )
    big = Frame.request(RequestCode.SEND_BATCH, 1, send.header, memoryview(bytes(1 << 20)))

    def enc() -> None:
        for _ in range(N):
            encode_frame(send)

    def enc_parts() -> None:
        for _ in range(N):
            encode_frame_parts(send)

    def enc_big_parts() -> None:
        for _ in range(N // 100):
            encode_frame_parts(big)

    wire = b"".join(encode_frame(send if i % 2 else pull) for i in range(N))
    chunks = [wire[i : i + CHUNK] for i in range(0, len(wire), CHUNK)]

    def typed() -> None:
        dec = FrameDecoder(header_types=lambda flags, code, opaque: request_header_type(code))
        n = 0
        for c in chunks:
            n += len(dec.feed(c))
        assert n == N

    def generic() -> None:
        dec = FrameDecoder()
        n = 0
        for c in chunks:
            n += len(dec.feed(c))
        assert n == N

    print(f"frames: {N}, send {len(encode_frame(send))} B / pull {len(encode_frame(pull))} B")
    print(f"encode_frame (send, 200 B body)      {_best(enc) / N * 1e9:7.0f} ns/frame")
    print(f"encode_frame_parts (send, inline)     {_best(enc_parts) / N * 1e9:7.0f} ns/frame")
    print(f"encode_frame_parts (1 MiB body, view) {_best(enc_big_parts) / (N // 100) * 1e9:7.0f} "
          "ns/frame")
    print(f"decode, typed headers, 64 KiB reads   {_best(typed) / N * 1e9:7.0f} ns/frame")
    print(f"decode, dict headers, 64 KiB reads    {_best(generic) / N * 1e9:7.0f} ns/frame")


if __name__ == "__main__":
    main()
