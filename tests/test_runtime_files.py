"""The runtime directory's files are written whole and locked one way."""

from __future__ import annotations

import fcntl

import pytest

from kv_budget.runtime_files import exclusive_lock, write_atomically


def test_a_file_is_replaced_whole_and_no_temporary_is_left(tmp_path):
    path = tmp_path / "ledger.json"
    path.write_text("old")
    write_atomically(path, "new")
    assert path.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["ledger.json"]


def test_the_lock_is_exclusive_while_held_and_free_after(tmp_path):
    lock_path = tmp_path / "device.lock"
    with exclusive_lock(lock_path), open(lock_path, "a") as other:
        with pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(lock_path, "a") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released with the block
