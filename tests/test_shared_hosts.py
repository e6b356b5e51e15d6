"""Shared hosts: kv-budget's runtime directory against other users, hostile
files and crashes (``kv_budget/runtime_files.py``, ``kv_budget/ledger.py``,
``kv_budget/watch/status.py``).

Another user is played by uid/gid 65534 (``nobody``/``nogroup``): the tests
that need one chown files, which only root may do, and are skipped with that
reason elsewhere. Other engines are real processes (a sleeping Python); dead
ones are processes that have exited.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_budget import ModelLocalKVSpec
from kv_budget.collect.model import Collection, OwnedSpec
from kv_budget.ledger import MAX_ENTRIES, MAX_RESERVED_BYTES, LedgerError, ledger_path, open_ledger, process_start
from kv_budget.plan.planner import budget_worker, headroom_override, shared_budget
from kv_budget.runtime_files import (
    MAX_FILE_BYTES,
    UnsafeRuntimeDirError,
    UnsafeRuntimeFileError,
    checked_dir,
    read_text,
    write_atomically,
)
from kv_budget.watch.status import read_status

DEVICE = "host:test"
NOBODY = 65534
AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="playing another user needs chown, which only root may do")
FIX = "choose another with --model-local-kv-ledger-dir"


@pytest.fixture(scope="module")
def live_process():
    """Another engine that runs: (pid, start time)."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    yield process.pid, process_start(process.pid)
    process.kill()
    process.wait()


@pytest.fixture(scope="module")
def dead_pid():
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def entry(pid: int, start: float, reserved, device: str = DEVICE, **more) -> dict:
    return {"device": device, "pid": pid, "process_start": start, "engine": f"pid {pid}: model m",
            "reserved_bytes": reserved, "recorded_at": 1.0, **more}


def private(tmp_path: Path) -> Path:
    directory = tmp_path / "ledger"
    directory.mkdir(mode=0o700)
    return directory


def others(directory: Path, shared: bool = False) -> list:
    with open_ledger(directory, [DEVICE], shared) as ledger:
        return ledger.others(DEVICE)


# --- the directory ---

def test_a_missing_private_directory_is_created_for_this_user_alone(tmp_path):
    directory = tmp_path / "a" / "kv-budget"
    others(directory)
    info = os.lstat(directory)
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()


@pytest.mark.parametrize("mode, problem", [(0o777, "is writable by group or others"),
                                           (0o720, "is writable by group or others")])
def test_a_private_directory_others_can_write_is_refused_naming_owner_mode_and_fix(tmp_path, mode, problem):
    directory = private(tmp_path)
    directory.chmod(mode)
    with pytest.raises(LedgerError) as refused:
        others(directory)
    message = str(refused.value)
    assert f"private runtime directory {directory} (owner " in message
    assert f"mode {stat.filemode(stat.S_IFDIR | mode)}) {problem}; {FIX}" in message


def test_a_directory_planted_as_a_link_is_refused(tmp_path):
    target = private(tmp_path)
    link = tmp_path / "kv-budget-link"
    link.symlink_to(target)
    with pytest.raises(LedgerError, match=f"{link} .*is a symbolic link; {FIX}"):
        others(link)


@AS_ROOT
def test_a_directory_another_user_created_first_is_refused(tmp_path):
    directory = private(tmp_path)
    os.chown(directory, NOBODY, NOBODY)
    with pytest.raises(LedgerError, match=r"owner (nobody )?\(?uid 65534.*is owned by another user"):
        others(directory)


# --- the files in it ---

def test_a_link_planted_at_the_lock_or_the_ledger_is_refused_and_its_target_untouched(tmp_path):
    directory = private(tmp_path)
    target = tmp_path / "victim"
    target.write_text("precious")
    lock = ledger_path(directory, DEVICE).with_suffix(".lock")
    lock.symlink_to(target)
    with pytest.raises(LedgerError, match=f"cannot lock the kv-budget ledger {lock} .a symbolic link, not followed"):
        others(directory)
    lock.unlink()
    ledger_path(directory, DEVICE).symlink_to(target)
    with pytest.raises(LedgerError, match="host_test.json cannot be used .a symbolic link, not followed"):
        others(directory)
    assert target.read_text() == "precious"


def test_a_link_planted_at_the_temporary_is_replaced_not_followed(tmp_path):
    directory = private(tmp_path)
    target = tmp_path / "victim"
    target.write_text("precious")
    path = directory / "status.json"
    path.with_name(f".{path.name}.{os.getpid()}.tmp").symlink_to(target)
    write_atomically(path, "new")
    assert path.read_text() == "new" and target.read_text() == "precious"
    assert not stat.S_ISLNK(os.lstat(path).st_mode) and sorted(p.name for p in directory.iterdir()) == ["status.json"]


def test_a_fifo_where_the_ledger_should_be_is_refused_without_waiting(tmp_path):
    directory = private(tmp_path)
    os.mkfifo(ledger_path(directory, DEVICE))
    with pytest.raises(LedgerError, match="is not a regular file"):
        others(directory)


@AS_ROOT
def test_a_file_of_another_user_in_a_private_directory_is_refused(tmp_path, live_process):
    directory = private(tmp_path)
    path = ledger_path(directory, DEVICE)
    path.write_text(json.dumps([entry(*live_process, 1000)]))
    os.chown(path, NOBODY, NOBODY)
    with pytest.raises(LedgerError, match="is owned by another user"):
        others(directory)


def test_status_files_are_read_and_written_the_same_way(tmp_path):
    target = tmp_path / "victim.json"
    target.write_text("{}")
    link = tmp_path / "engine-0-abc.json"
    link.symlink_to(target)
    with pytest.raises(UnsafeRuntimeFileError, match="a symbolic link, not followed"):
        read_status(link)
    group_writable = tmp_path / "status"
    group_writable.mkdir(mode=0o700)
    group_writable.chmod(0o770)
    with pytest.raises(UnsafeRuntimeDirError, match="is writable by group or others; set \\$KV_BUDGET_STATUS_DIR"):
        checked_dir(group_writable, "set $KV_BUDGET_STATUS_DIR to a directory of this user's alone")


def test_a_file_larger_than_kv_budget_writes_is_not_read_whole(tmp_path):
    path = tmp_path / "big"
    path.write_bytes(b" " * (MAX_FILE_BYTES + 1))
    with pytest.raises(UnsafeRuntimeFileError, match=f"larger than {MAX_FILE_BYTES:,} B"):
        read_text(path)


# --- a shared ledger, opt-in ---

def shared_dir(tmp_path: Path, mode: int = 0o2770) -> Path:
    directory = tmp_path / "shared"
    directory.mkdir()
    os.chown(directory, -1, os.getegid())
    directory.chmod(mode)
    return directory


@AS_ROOT
def test_a_shared_directory_plans_across_users_and_holds_them_to_taking_bytes_off(tmp_path, live_process):
    """Another user's engine (its file, written for the group) is seen; its
    entries, like anyone's, only take bytes off."""
    directory = shared_dir(tmp_path)
    path = ledger_path(directory, DEVICE)
    path.write_text(json.dumps([entry(*live_process, 3 * 131_072)]))
    os.chown(path, NOBODY, os.getegid())
    path.chmod(0o660)
    (seen,) = others(directory, shared=True)
    assert seen.reserved_bytes == 3 * 131_072
    with open_ledger(directory, [DEVICE], shared=True) as ledger:
        ledger.record(DEVICE, "me", 1000)
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o660  # the next user of the group can rewrite it
    with pytest.raises(LedgerError, match="is not a directory"):
        others(path, shared=True)


@AS_ROOT
@pytest.mark.parametrize("mode, gid, problem", [
    (0o0770, None, "is not set-group-ID"),
    (0o2777, None, "is writable by users outside its group"),
    (0o2770, NOBODY, "belongs to a group this process is not in"),
])
def test_a_shared_directory_that_is_not_what_the_docs_say_is_refused(tmp_path, mode, gid, problem):
    directory = shared_dir(tmp_path, mode)
    if gid is not None:
        os.chown(directory, -1, gid)
        directory.chmod(mode)  # chown clears the set-group-ID bit
    if gid is not None and gid in os.getgroups():
        pytest.skip("this process is in nogroup")
    with pytest.raises(LedgerError, match=f"shared runtime directory .*{problem}"):
        others(directory, shared=True)


def test_a_missing_shared_directory_is_not_created_and_the_refusal_says_how_to_make_it(tmp_path):
    with pytest.raises(LedgerError, match="cannot be used .No such file or directory.; create it for the group: "
                                          "install -d -m 2770 -g GROUP DIR"):
        others(tmp_path / "absent", shared=True)
    assert not (tmp_path / "absent").exists()


# --- hostile and broken entries ---

@pytest.mark.parametrize("hostile, reason", [
    ({"reserved_bytes": -10**9}, "reserved_bytes=-1000000000"),
    ({"reserved_bytes": MAX_RESERVED_BYTES + 1}, "reserved_bytes="),
    ({"reserved_bytes": 1.5}, "reserved_bytes=1.5"),
    ({"reserved_bytes": "1000"}, "reserved_bytes='1000'"),
    ({"reserved_bytes": True}, "reserved_bytes=True"),
    ({"device": "GPU-other"}, "for another device ('GPU-other')"),
    ({"pid": -1}, "pid=-1"),
    ({"process_start": float("nan")}, "process_start=nan"),
    ({"surplus": 1}, "not an entry of the ledger's fields"),
])
def test_an_entry_no_engine_writes_is_dropped_with_one_warning(tmp_path, live_process, caplog, hostile, reason):
    directory = private(tmp_path)
    pid, start = live_process
    bad = {**entry(pid, start, 0), **hostile}
    ledger_path(directory, DEVICE).write_text(json.dumps([bad, bad, entry(pid, start, 4096)]))
    with caplog.at_level(logging.WARNING, logger="vllm.kv_budget"):
        seen = others(directory)
    assert [e.reserved_bytes for e in seen] == [4096]
    (warning,) = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert f"the device ledger {ledger_path(directory, DEVICE)}: 2 entries dropped (first: " in warning
    assert reason in warning and warning.endswith("they reserve nothing")


def test_duplicate_and_recycled_pids_keep_one_entry_per_live_process(tmp_path, live_process, caplog):
    directory = private(tmp_path)
    pid, start = live_process
    entries = [entry(pid, start, 100), {**entry(pid, start, 200), "recorded_at": 5.0}, entry(pid, start - 60, 300)]
    ledger_path(directory, DEVICE).write_text(json.dumps(entries))
    with caplog.at_level(logging.WARNING, logger="vllm.kv_budget"):
        seen = others(directory)
    assert [(e.pid, e.reserved_bytes) for e in seen] == [(pid, 200)]  # the latest; the recycled pid's is dead
    assert "1 entry dropped (first: a second entry of pid" in caplog.text


def test_a_corrupt_file_of_dead_processes_is_set_aside_and_blocks_nothing(tmp_path, dead_pid, caplog):
    directory = private(tmp_path)
    path = ledger_path(directory, DEVICE)
    path.write_text(json.dumps([entry(dead_pid, 1.0, 10**9)])[:-7])  # truncated mid-write
    with caplog.at_level(logging.WARNING, logger="vllm.kv_budget"):
        assert others(directory) == []
    (aside,) = directory.glob("host_test.json.corrupt-*")
    assert "names no running process: moved to host_test.json.corrupt-" in caplog.text and not path.exists()
    assert aside.read_text().startswith('[{"device"')


def test_a_file_of_dead_processes_that_is_not_utf8_is_set_aside_too(tmp_path, dead_pid, caplog):
    directory = private(tmp_path)
    ledger_path(directory, DEVICE).write_bytes(b"\xff" + json.dumps([entry(dead_pid, 1.0, 10**9)]).encode())
    with caplog.at_level(logging.WARNING, logger="vllm.kv_budget"):
        assert others(directory) == []
    assert "could not be read (not UTF-8) and names no running process" in caplog.text


def test_a_corrupt_file_naming_a_live_process_is_refused_in_one_line(tmp_path, live_process):
    directory = private(tmp_path)
    pid, start = live_process
    ledger_path(directory, DEVICE).write_text(json.dumps([entry(pid, start, 10**9)])[:-3])
    with pytest.raises(LedgerError, match=f"cannot be read .not JSON: .*names running process.es. {pid}; "
                                          "stop them, or remove the file"):
        others(directory)


@pytest.mark.parametrize("count, why", [(MAX_ENTRIES + 1, f"{MAX_ENTRIES + 1:,} entries, over"),
                                        (40_000, "larger than")])
def test_too_many_entries_of_dead_processes_are_set_aside(tmp_path, dead_pid, caplog, count, why):
    directory = private(tmp_path)
    ledger_path(directory, DEVICE).write_text(json.dumps([entry(dead_pid, 1.0, 1)] * count))
    with caplog.at_level(logging.WARNING, logger="vllm.kv_budget"):
        assert others(directory) == []
    assert why in caplog.text and list(directory.glob("host_test.json.corrupt-*"))


def test_a_writer_killed_mid_write_leaves_nothing_that_stops_the_next(tmp_path, dead_pid):
    """What a SIGKILL mid-write leaves is the temporary (the rename never
    came): removed under the lock. The engine test kills a real process
    holding the lock (tests/test_engine_ledger.py)."""
    directory = private(tmp_path)
    path = ledger_path(directory, DEVICE)
    path.write_text(json.dumps([entry(dead_pid, 1.0, 10**9)]))
    temporary = path.with_name(f".{path.name}.{dead_pid}.tmp")
    temporary.write_text('[{"device": "host:test", "pid": ')
    assert others(directory) == [] and not temporary.exists()


# --- the trust model, and the readers fuzzed ---

def _worker():
    spec = ModelLocalKVSpec(name="kv", layers=2, kv_heads=2, head_dim=64, dtype=torch.float32,
                            physical_capacity_positions=64, capacity_source="t", scope="request",
                            rows="max_num_seqs")  # 131,072 B per row
    return budget_worker(Collection((OwnedSpec("m", spec),), ()), headroom_override(10 * 131_072, "own sample"),
                         max_num_seqs=256)


VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63), st.floats(allow_nan=True),
                   st.text(max_size=8))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=st.lists(st.dictionaries(st.sampled_from(["device", "pid", "process_start", "engine",
                                                       "reserved_bytes", "recorded_at"]), VALUES), max_size=6),
       reserved=st.lists(VALUES, max_size=4))
def test_whoever_writes_the_ledger_never_makes_an_engine_plan_beyond_its_own_sample(
        tmp_path_factory, live_process, items, reserved):
    """Any entries, hostile fields and real live pids alike: the engine
    either refuses in one line or sees reservations in [0, 1 PiB], and its
    plan is never larger than its own device sample allows."""
    directory = tmp_path_factory.mktemp("fuzz-ledger", numbered=True)
    pid, start = live_process
    raw = [*items, *(entry(pid, start, value) for value in reserved)]
    ledger_path(directory, DEVICE).write_text(json.dumps(raw, allow_nan=True))
    try:
        seen = others(directory)
    except LedgerError:
        return
    assert all(type(e.reserved_bytes) is int and 0 <= e.reserved_bytes <= MAX_RESERVED_BYTES for e in seen)
    worker = _worker()
    planned = shared_budget(worker, sum(e.reserved_bytes for e in seen), "others")
    assert planned.safe_max_num_seqs <= worker.safe_max_num_seqs


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=st.binary(max_size=512))
def test_the_ledger_reader_refuses_or_reads_any_bytes_and_raises_nothing_else(tmp_path_factory, content):
    directory = tmp_path_factory.mktemp("fuzz-bytes", numbered=True)
    ledger_path(directory, DEVICE).write_bytes(content)
    try:
        assert isinstance(others(directory), list)
    except LedgerError:
        pass
