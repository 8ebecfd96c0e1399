import os
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

os.environ.setdefault("PYTHONHASHSEED", "0")


@pytest.fixture
def data_dir(tmp_path):
    d = tmp_path / "store"
    d.mkdir()
    return d
