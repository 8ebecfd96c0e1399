"""base/atomic_file.py: the one write-tmp, fsync, rename, fsync-dir of the project."""

from __future__ import annotations

import os

import pytest

from tidemq.base.atomic_file import read_file, write_atomic


@pytest.mark.parametrize("unique_tmp", [False, True])
def test_replaces_the_file_and_leaves_no_temporary(tmp_path, unique_tmp):
    path = tmp_path / "sub" / "state.json"
    write_atomic(path, b"one", unique_tmp=unique_tmp)
    write_atomic(str(path), b"two", unique_tmp=unique_tmp)
    assert read_file(path) == b"two"
    assert os.listdir(path.parent) == ["state.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "state.json"
    write_atomic(path, b"old")
    with pytest.raises(TypeError):
        write_atomic(path, "not bytes")  # type: ignore[arg-type]
    assert read_file(path) == b"old"
    assert os.listdir(tmp_path) == ["state.json"]
    assert read_file(tmp_path / "missing") is None
