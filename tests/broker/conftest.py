from __future__ import annotations

import itertools
import re

import pytest

from .wire import Wire, start_broker

_names = itertools.count()


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    """One broker (no name server, auto-create on) shared by a test module."""
    tmp = tmp_path_factory.mktemp("broker")
    srv = start_broker(tmp, "", "-o", "long_polling_check_ms=5000")
    yield srv
    if srv.alive():
        assert srv.stop() == 0, srv.log()


@pytest.fixture
def wire(broker):
    with Wire(broker.addr) as w:
        yield w


@pytest.fixture
def topic(request):
    """A fresh topic name per test."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", f"t{next(_names)}_{request.node.name[:40]}")
