"""docs/configuration.md lists exactly the settings the code has: every BrokerConfig,
StoreConfig and NamesrvConfig field, and nothing that no longer exists."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from tidemq.broker.config import BrokerConfig
from tidemq.namesrv.server import NamesrvConfig
from tidemq.store.config import StoreConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def _documented() -> set[str]:
    names = set()
    for line in DOC.read_text().splitlines():
        m = re.match(r"\|\s*`([a-z_.]+)`\s*\|", line)
        if m and not m.group(1).startswith("--"):
            names.add(m.group(1))
    return names


def test_every_setting_is_documented_and_every_documented_setting_exists() -> None:
    code = {f.name for f in dataclasses.fields(BrokerConfig)}
    code |= {f"store.{f.name}" for f in dataclasses.fields(StoreConfig)}
    code |= {f"namesrv.{f.name}" for f in dataclasses.fields(NamesrvConfig)}
    documented = _documented()
    assert sorted(code - documented) == [], "settings missing from docs/configuration.md"
    assert sorted(documented - code) == [], "docs/configuration.md lists settings the code lacks"


def test_documented_plain_defaults_match_the_code() -> None:
    """Defaults written as plain numbers or words in the table equal the dataclass defaults."""
    broker = BrokerConfig()
    store = StoreConfig(data_dir="")
    namesrv = NamesrvConfig()
    checked = 0
    for line in DOC.read_text().splitlines():
        m = re.match(r"\|\s*`([a-z_.]+)`\s*\|\s*`([^`]*)`", line)
        if not m:
            continue
        name, shown = m.groups()
        if name.startswith("store."):
            obj, attr = store, name[6:]
        elif name.startswith("namesrv."):
            obj, attr = namesrv, name[8:]
        else:
            obj, attr = broker, name
        if not hasattr(obj, attr):
            continue
        value = getattr(obj, attr)
        if isinstance(value, bool):
            assert shown == str(value).lower(), name
        elif isinstance(value, (int, float)):
            assert float(shown) == float(value), name
        else:
            continue
        checked += 1
    assert checked >= 40
