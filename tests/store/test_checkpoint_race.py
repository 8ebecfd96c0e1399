"""Checkpoints from several threads at once (the housekeeper, flush() callers) are serialized."""

from __future__ import annotations

from .helpers import batch, open_store


def test_concurrent_checkpoints_never_garble_the_file(tmp_path):
    """flush() from several threads while the housekeeper checkpoints too: every checkpoint
    write succeeds and the file on disk is always a whole, loadable checkpoint."""
    import threading

    from tidemq.store.checkpoint import load_checkpoint

    store = open_store(tmp_path, segment_size=1 << 20, checkpoint_interval_ms=1)
    errors: list[BaseException] = []

    def flusher() -> None:
        try:
            for _ in range(100):
                store.flush()
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    try:
        threads = [threading.Thread(target=flusher) for _ in range(4)]
        for t in threads:
            t.start()
        for i in range(300):
            store.put(batch("t", [b"x%d" % i]))
        for t in threads:
            t.join()
        assert errors == []
        cp, problem = load_checkpoint(tmp_path / "checkpoint")
        assert problem is None and cp is not None
    finally:
        store.close()
    cp, problem = load_checkpoint(tmp_path / "checkpoint")
    assert problem is None and cp.dispatched == store.commitlog.write_pos
