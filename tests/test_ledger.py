"""The device ledger: reservations of live engines are seen, those of
processes that are gone are dropped, the lock is exclusive, and an unusable
directory is a clear error. Other engines are real processes here."""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys

import psutil
import pytest
import torch

from kv_budget import ModelLocalKVSpec
from kv_budget.collect.model import Collection, OwnedSpec
from kv_budget.ledger import LedgerError, open_ledger, process_start
from kv_budget.plan.planner import budget_worker, headroom_override, shared_budget

HOST = "host:test"


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def _entry(pid: int, start: float, reserved: int, engine: str = "other") -> dict:
    return {"device": HOST, "pid": pid, "process_start": start, "engine": engine,
            "reserved_bytes": reserved, "recorded_at": 0.0}


def _write(directory, entries) -> None:
    (directory / "host_test.json").write_text(json.dumps(entries))


def test_a_recorded_reservation_is_seen_by_the_next_engine_and_replaced_on_replanning(tmp_path):
    other = _sleeper()
    try:
        start = process_start(other.pid)
        _write(tmp_path, [_entry(other.pid, start, 1000, "pid other: model m")])
        with open_ledger(tmp_path, [HOST]) as ledger:
            (seen,) = ledger.others(HOST)
            assert (seen.pid, seen.reserved_bytes, seen.engine) == (other.pid, 1000, "pid other: model m")
            ledger.record(HOST, "me", 500)
        with open_ledger(tmp_path, [HOST]) as ledger:  # this process plans again: its old entry is not "other"
            assert [o.pid for o in ledger.others(HOST)] == [other.pid]
            ledger.record(HOST, "me", 700)
        stored = json.loads((tmp_path / "host_test.json").read_text())
        assert sorted((e["engine"], e["reserved_bytes"]) for e in stored) == [("me", 700), ("pid other: model m", 1000)]
    finally:
        other.kill()
        other.wait()


def test_reservations_of_processes_that_are_gone_or_recycled_are_dropped(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone_pid = int(gone.stdout)
    alive = _sleeper()
    try:
        start = process_start(alive.pid)
        _write(tmp_path, [
            _entry(gone_pid, 1.0, 111),
            _entry(alive.pid, start - 50.0, 222),  # same pid, another process: a recycled pid
            _entry(alive.pid, start, 333),
        ])
        with open_ledger(tmp_path, [HOST]) as ledger:
            assert [o.reserved_bytes for o in ledger.others(HOST)] == [333]
        alive.kill()
        alive.wait()
        with open_ledger(tmp_path, [HOST]) as ledger:
            assert ledger.others(HOST) == []
    finally:
        if alive.poll() is None:
            alive.kill()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's start time is read from /proc")
def test_a_live_engine_keeps_its_reservation_when_the_wall_clock_moves(tmp_path, monkeypatch):
    """The kernel derives the boot time psutil adds to a process's start
    from the wall clock: an NTP step moves it, not the process's identity."""
    other = _sleeper()
    try:
        _write(tmp_path, [_entry(other.pid, process_start(other.pid), 1000)])
        booted = psutil.boot_time()
        monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: booted + 1.0)  # the clock stepped one second
        monkeypatch.setattr(psutil, "boot_time", lambda: booted + 1.0)
        with open_ledger(tmp_path, [HOST]) as ledger:
            assert [o.reserved_bytes for o in ledger.others(HOST)] == [1000]
    finally:
        other.kill()
        other.wait()


def test_the_ledger_is_locked_while_an_engine_plans(tmp_path):
    with open_ledger(tmp_path, ["b", HOST, "a"]):
        for name in ("a", "b", "host_test"):
            with open(tmp_path / f"{name}.lock", "a") as lock, pytest.raises(BlockingIOError):
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(tmp_path / "a.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released once the plan is done


def test_an_unusable_directory_or_file_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(LedgerError, match="is not a directory; choose another with --model-local-kv-ledger-dir"), \
            open_ledger(blocker, [HOST]):
        pass
    (tmp_path / "host_test.json").mkdir()  # a directory where the ledger file should be
    with pytest.raises(LedgerError, match=r"host_test.json cannot be used .*is a directory, not a file\); remove it"), \
            open_ledger(tmp_path, [HOST]):
        pass


def _worker(headroom: int):
    spec = ModelLocalKVSpec(name="kv", layers=2, kv_heads=2, head_dim=64, dtype=torch.float32,
                            physical_capacity_positions=64, capacity_source="t", scope="request",
                            rows="max_num_seqs")  # 2 x 2 x 2 x 64 x 64 x 4 = 131,072 B per row
    fixed = ModelLocalKVSpec(name="pool", layers=1, kv_heads=1, head_dim=64, dtype=torch.float32,
                             physical_capacity_positions=64, capacity_source="t", scope="session",
                             rows="fixed", rows_fixed=1, rows_reason="one")  # 2 x 1 x 1 x 64 x 64 x 4 = 32,768 B
    collection = Collection((OwnedSpec("m", spec), OwnedSpec("m", fixed)), ())
    return budget_worker(collection, headroom_override(headroom, "operator"), max_num_seqs=256)


ROW = 131_072
FIXED = 32_768


def test_shared_budget_takes_other_engines_off_and_caps_at_the_share():
    worker = _worker(10 * ROW + FIXED)
    assert worker.safe_max_num_seqs == 10
    after = shared_budget(worker, 3 * ROW, "pid 1: model x: 393,216 B")
    assert after.safe_max_num_seqs == 7
    assert after.headroom.reserved_by_others_bytes == 3 * ROW
    assert "minus 393,216 B reserved by other engines on this device (pid 1: model x: 393,216 B)" in after.headroom.source
    capped = shared_budget(worker, 0, "", share_bytes=4 * ROW + FIXED)
    assert capped.safe_max_num_seqs == 4 and "share 557,056 B" in capped.headroom.source
    starved = shared_budget(worker, 11 * ROW, "x")
    assert starved.safe_max_num_seqs == 0 and starved.headroom.bytes == 0
