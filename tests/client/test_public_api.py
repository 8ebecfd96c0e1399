"""The public names of `tidemq` and `tidemq.aio` are exactly their __all__, and all resolve."""

from __future__ import annotations

import subprocess
import sys

import tidemq
from tidemq import aio


def test_blocking_facade_names_resolve_and_are_the_blocking_classes():
    for name in tidemq.__all__:
        assert getattr(tidemq, name) is not None, name
    assert tidemq.Producer.__module__ == "tidemq.client.blocking"
    assert tidemq.Message is aio.Message and tidemq.MessageExt is aio.MessageExt
    assert set(tidemq.__all__) <= set(dir(tidemq))


def test_aio_all_is_its_public_names():
    public = {n for n in vars(aio) if not n.startswith("_") and n != "annotations"}
    assert set(aio.__all__) == public


def test_importing_the_store_does_not_load_the_client():
    code = ("import sys, tidemq.store.message_store; "
            "print(any(m.startswith('tidemq.client') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
