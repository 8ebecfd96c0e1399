"""How `tidemq bench …` prints a result: one JSON object with ``--json``, else aligned
``key  value`` lines."""

from __future__ import annotations

import json
from typing import Any

import click

__all__ = ["emit_result"]


def emit_result(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(result))
    else:
        width = max(len(k) for k in result)
        for k, v in result.items():
            click.echo(f"{k:<{width}}  {v}")
