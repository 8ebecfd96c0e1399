"""docs/quickstart.md works as written: its shell and Python blocks run against a real
`tidemq dev` (only the name-server address is swapped for the test cluster's), and print what
the page says they print."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "quickstart.md"
BIN = Path(sys.executable).parent


def _blocks(lang: str) -> dict[str, str]:
    """Fenced blocks of ``lang``, keyed by the heading they stand under."""
    out: dict[str, str] = {}
    heading = ""
    text = DOC.read_text()
    for m in re.finditer(rf"^## ([^\n]+)$|^```{lang}\n(.*?)^```", text, re.M | re.S):
        if m.group(1):
            heading = m.group(1)
        else:
            out[heading] = out.get(heading, "") + m.group(2)
    return out


def _env(dev) -> dict[str, str]:
    return {**os.environ, "TIDEMQ_NAMESRV": dev.namesrv,
            "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}


def test_shell_walkthrough(dev) -> None:
    script = _blocks("sh")["2. From the shell"]
    script = script.replace("T=.venv/bin/tidemq", f"T={BIN / 'tidemq'}")
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True,
                       text=True, env=_env(dev), timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    # consume prints the five sent messages, tags filter aside (all were sent with tag "paid")
    for i in range(5):
        assert f"order {i} paid" in out
    assert "orders" in out  # topic list / describe


@pytest.mark.parametrize("section", ["3. From Python (blocking API, any thread)",
                                     "4. From asyncio"])
def test_python_blocks(dev, section: str) -> None:
    code = _blocks("python")[section].replace("127.0.0.1:9876", dev.namesrv)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=_env(dev), timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), "the example printed nothing"
    if section.startswith("3."):
        assert "SEND_OK" in r.stdout and "b'order 42 paid'" in r.stdout
    else:
        assert int(r.stdout.split()[-1]) >= 1
