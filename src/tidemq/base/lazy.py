"""Names a package loads on first use (PEP 562): one module ``__getattr__`` for every package
that keeps its imports light (``tidemq``: the broker and the store do not pay for the client;
``tidemq.spark``: a Spark writer task does not pay for the read side)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(namespace: dict[str, Any], where: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``name`` from the module ``where[name]`` on first
    use and keeps it in ``namespace`` (the package's ``globals()``), so later uses are plain
    lookups; any other name is an AttributeError, as for a module without it."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
