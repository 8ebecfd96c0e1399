"""Write the golden files (``python -m tests.golden.make_golden``): only for a deliberate
format change -- see ``cases.py``."""

from __future__ import annotations

from tests.golden import build, cases


def main() -> None:
    for case in cases.BATCHES:
        wire = build.wire_batch(case)
        with open(cases.path(f"batch_{case.name}.bin"), "wb") as f:
            f.write(wire)
        with open(cases.path(f"stored_{case.name}.bin"), "wb") as f:
            f.write(build.stored_batch(wire, case))
    for name, kind, code, opaque, header, body in cases.FRAMES:
        with open(cases.path(f"{name}.bin"), "wb") as f:
            f.write(build.frame_bytes(kind, code, opaque, header, body))
    with open(cases.path("consume_queue.bin"), "wb") as f:
        f.write(build.consume_queue_bytes())
    with open(cases.path("index_file.bin"), "wb") as f:
        f.write(build.index_file_bytes())


if __name__ == "__main__":
    main()
