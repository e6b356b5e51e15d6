"""Planner: the three-way split, the bound, policies, and the minimum over
workers. Property tests check the invariants over generated budgets."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_budget import ModelLocalKVSpec
from kv_budget.collect.model import Collection, DeclarerFailure, OwnedSpec
from kv_budget.plan.planner import (
    Decision,
    budget_worker,
    default_margin_bytes,
    headroom_from_free,
    headroom_outside_requested,
    headroom_override,
    live_margin_bytes,
    make_plan,
    shared_budget,
)
from kv_budget.report import infeasible_message, render_plan_table, summary_line
from kv_budget.settings import Policy
from kv_budget.units import GiB, MiB


def spec(name, positions, scope="request", rows="max_num_seqs", rows_fixed=None):
    return ModelLocalKVSpec(
        name=name, layers=1, kv_heads=1, head_dim=64, dtype=torch.float32,
        physical_capacity_positions=positions, capacity_source="test", scope=scope, rows=rows,
        rows_fixed=rows_fixed, rows_reason="test" if rows_fixed else None,
    )


def collection(*specs, failures=()):
    return Collection(tuple(OwnedSpec("m", s) for s in specs), tuple(failures))


ROW = 2 * 64 * 4  # bytes per position of spec(): K and V, head_dim 64, fp32


def test_split_charges_model_scope_once_and_subtracts_fixed_once():
    c = collection(
        spec("per_req", 10),
        spec("copy", 10, scope="invocation"),
        spec("pool", 10, scope="model", rows="fixed", rows_fixed=5),
        spec("session", 100, scope="session", rows="fixed", rows_fixed=2),
    )
    w = budget_worker(c, headroom_override(1_000_000), max_num_seqs=256)
    assert w.per_seq_bytes == 2 * 10 * ROW
    assert w.charged_bytes == 5 * 10 * ROW
    assert w.uncharged_fixed_bytes == 2 * 100 * ROW
    assert w.safe_max_num_seqs == (1_000_000 - 2 * 100 * ROW) // (2 * 10 * ROW)


def test_cap_lowers_to_safe_and_predicts_the_peak():
    w = budget_worker(collection(spec("kv", 100)), headroom_override(100 * ROW * 10 + 5))
    plan = make_plan([w], 256, "cap")
    assert plan.decision is Decision.CAPPED
    assert plan.effective_max_num_seqs == plan.safe_max_num_seqs == 10
    assert plan.predicted_peak_bytes == 10 * 100 * ROW
    assert plan.declarations[0].rows_at_peak == 10
    assert [c.value for c in plan.constraints] == [256, 10]


def test_warn_and_off_change_nothing_but_report_the_same_bound():
    w = budget_worker(collection(spec("kv", 100)), headroom_override(100 * ROW * 10))
    for policy in (Policy.WARN, Policy.OFF):
        plan = make_plan([w], 256, policy)
        assert plan.decision is Decision.WARNED
        assert plan.effective_max_num_seqs == 256
        assert plan.safe_max_num_seqs == 10


def test_fits_is_ok_under_every_policy_that_plans_max_num_seqs():
    w = budget_worker(collection(spec("kv", 1)), headroom_override(GiB))
    for policy in (Policy.CAP, Policy.WARN, Policy.OFF):  # reserve plans the pool: test_pool_reserve.py
        plan = make_plan([w], 256, policy)
        assert plan.decision is Decision.OK and plan.effective_max_num_seqs == 256


def test_not_one_sequence_is_infeasible_under_cap_only():
    w = budget_worker(collection(spec("kv", 100)), headroom_override(100 * ROW - 1))
    assert make_plan([w], 256, "cap").decision is Decision.INFEASIBLE
    assert make_plan([w], 256, "cap").effective_max_num_seqs == 0
    assert make_plan([w], 256, "warn").decision is Decision.WARNED
    message = infeasible_message(make_plan([w], 256, "cap"))
    assert f"{100 * ROW:,} B" in message and f"{100 * ROW - 1:,} B" in message and "m/kv" in message
    assert "To start:" in message and "--model-local-kv-policy warn" in message  # the fix, in the message


def test_a_default_margin_larger_than_what_is_free_starts_at_one_sequence_where_the_live_margin_leaves_room():
    """The default margin (1 GiB) is more than the device has free, so it
    leaves no sequence; the live margin leaves room for some: the engine
    starts at one and the live watch admits what the device holds. A
    margin the operator gave, a device below the live margin, other
    engines' reservations or an operator's share keep the refusal."""
    per_seq = 4096 * ROW  # 2 MiB
    free = 400 * MiB
    headroom = headroom_from_free(free, 3 * GiB, "test device")
    assert headroom.bytes == 0 and live_margin_bytes(headroom) == 64 * MiB  # an eighth of 400 MiB is under the floor
    assert live_margin_bytes(headroom_from_free(800 * MiB, 3 * GiB, "test device")) == 100 * MiB  # an eighth
    assert live_margin_bytes(headroom_from_free(4 * GiB, 3 * GiB, "test device")) == 128 * MiB  # of the margin
    worker = budget_worker(collection(spec("kv", 4096)), headroom)
    plan = make_plan([worker], 256, "cap")
    assert plan.decision is Decision.CAPPED and plan.effective_max_num_seqs == plan.safe_max_num_seqs == 1
    one = plan.constraints[-1]
    assert one.name == "one sequence until measured on rank 0" and one.value == 1
    assert f"live margin {64 * MiB:,} B leaves {free - 64 * MiB:,} B" in one.detail
    assert min(c.value for c in plan.constraints) == plan.effective_max_num_seqs
    given = headroom_from_free(free, 3 * GiB, "test device", GiB)
    assert make_plan([budget_worker(collection(spec("kv", 4096)), given)], 256, "cap").decision is Decision.INFEASIBLE
    scarce = headroom_from_free(64 * MiB + per_seq - 1, 3 * GiB, "test device")
    assert make_plan([budget_worker(collection(spec("kv", 4096)), scarce)], 256, "cap").decision is Decision.INFEASIBLE
    taken = shared_budget(worker, free - 64 * MiB - per_seq + 1, "engine 1")
    assert taken.safe_max_num_seqs == 0
    assert shared_budget(worker, free - 64 * MiB - per_seq, "engine 1").safe_max_num_seqs == 1
    assert shared_budget(worker, 0, "", share_bytes=per_seq).safe_max_num_seqs == 0


def test_fixed_alone_over_headroom_is_infeasible():
    w = budget_worker(collection(spec("s", 100, scope="session", rows="fixed", rows_fixed=1)), headroom_override(10))
    assert w.safe_max_num_seqs == 0
    assert make_plan([w], 4, "cap").decision is Decision.INFEASIBLE


def test_nothing_declared_is_unbounded():
    w = budget_worker(collection(), headroom_override(0))
    plan = make_plan([w], 256, "cap")
    assert plan.safe_max_num_seqs is None and plan.decision is Decision.OK
    assert [c.name for c in plan.constraints] == ["configured max_num_seqs"]


def test_minimum_over_workers_names_the_binding_rank():
    c = collection(spec("kv", 100))
    workers = [
        budget_worker(c, headroom_override(100 * ROW * 50), rank=0),
        budget_worker(c, headroom_override(100 * ROW * 20), rank=1),
    ]
    plan = make_plan(workers, 256, "cap")
    assert plan.effective_max_num_seqs == 20 and plan.binding_rank == 1
    assert plan.headroom_bytes == 100 * ROW * 20
    assert len(plan.constraints) == 3


def test_failures_from_every_worker_reach_the_plan_and_table():
    failed = collection(spec("kv", 1), failures=[DeclarerFailure("talker", "raised RuntimeError: boom")])
    workers = [budget_worker(failed, headroom_override(GiB), rank=r) for r in (0, 1)]
    plan = make_plan(workers, 8, "cap")
    assert [(f.rank, f.owner) for f in plan.failures] == [(0, "talker"), (1, "talker")]
    assert "FAILED declarer on rank 1: talker: raised RuntimeError: boom" in render_plan_table(plan)


def test_table_and_summary_carry_every_figure_in_bytes():
    c = collection(spec("kv", 100), spec("pool", 3, scope="model", rows="fixed", rows_fixed=2))
    plan = make_plan([budget_worker(c, headroom_override(100 * ROW * 10), max_num_seqs=256)], 256, "cap")
    table = render_plan_table(plan)
    for figure in (plan.per_seq_bytes, plan.headroom_bytes, plan.charged_bytes, plan.predicted_peak_bytes):
        assert f"{figure:,} B" in table
    assert "effective max_num_seqs = 10" in table
    assert "operator override" in table
    assert f"{plan.per_seq_bytes:,} B per sequence" in summary_line(plan)


def test_plan_json_round_trip():
    c = collection(spec("kv", 100))
    plan = make_plan([budget_worker(c, headroom_override(GiB))], 256, "cap")
    again = type(plan).model_validate_json(plan.model_dump_json())
    assert again == plan


def test_headroom_from_free_takes_the_default_margin():
    room = headroom_from_free(10 * GiB, 80 * GiB, "NVML device 0")
    assert room.margin_bytes == 4 * GiB == default_margin_bytes(80 * GiB)
    assert room.bytes == 6 * GiB
    assert "NVML device 0" in room.source and f"{4 * GiB:,} B" in room.source
    assert default_margin_bytes(4 * GiB) == GiB  # the floor
    assert headroom_from_free(100 * MiB, 4 * GiB, "x").bytes == 0  # never negative


def test_headroom_outside_requested_budget():
    room = headroom_outside_requested(100 * GiB, 0.9, margin_bytes=GiB)
    assert room.bytes == 10 * GiB - GiB
    with pytest.raises(ValueError):
        headroom_outside_requested(GiB, 1.5)


def test_bad_plan_inputs_raise():
    w = budget_worker(collection(), headroom_override(0))
    with pytest.raises(ValueError):
        make_plan([], 256, "cap")
    with pytest.raises(ValueError):
        make_plan([w], 0, "cap")
    with pytest.raises(ValueError):
        make_plan([w], 256, "sometimes")
    with pytest.raises(ValueError):
        headroom_override(-1)


positions = st.integers(min_value=1, max_value=4096)
per_seq_specs = st.lists(positions, min_size=1, max_size=4)
fixed_specs = st.lists(st.tuples(positions, st.integers(1, 8)), max_size=3)
headrooms = st.integers(min_value=0, max_value=64 * GiB)
configured = st.integers(min_value=1, max_value=1024)


def _worker(per_seq, fixed, room, rank=0):
    specs = [spec(f"p{i}", p) for i, p in enumerate(per_seq)]
    specs += [spec(f"f{i}", p, scope="session", rows="fixed", rows_fixed=n) for i, (p, n) in enumerate(fixed)]
    return budget_worker(collection(*specs), headroom_override(room), rank=rank)


@settings(max_examples=300, deadline=None)
@given(per_seq_specs, fixed_specs, headrooms, configured)
def test_cap_fits_and_one_more_would_not(per_seq, fixed, room, max_num_seqs):
    w = _worker(per_seq, fixed, room)
    plan = make_plan([w], max_num_seqs, "cap")
    effective = plan.effective_max_num_seqs
    assert effective >= 0 and plan.safe_max_num_seqs >= 0
    assert effective <= max_num_seqs
    if plan.decision is Decision.INFEASIBLE:
        assert w.uncharged_fixed_bytes + w.per_seq_bytes > room
        return
    assert w.uncharged_fixed_bytes + w.per_seq_bytes * effective <= room
    if plan.decision is Decision.CAPPED:
        assert w.uncharged_fixed_bytes + w.per_seq_bytes * (effective + 1) > room
    else:
        assert plan.decision is Decision.OK and effective == max_num_seqs


@settings(max_examples=200, deadline=None)
@given(per_seq_specs, fixed_specs, headrooms, st.integers(0, 8 * GiB))
def test_safe_is_monotonic_in_headroom(per_seq, fixed, room, extra):
    smaller = _worker(per_seq, fixed, room).safe_max_num_seqs
    larger = _worker(per_seq, fixed, room + extra).safe_max_num_seqs
    assert larger >= smaller


@settings(max_examples=200, deadline=None)
@given(per_seq_specs, fixed_specs, st.lists(headrooms, min_size=1, max_size=4), configured)
def test_plan_is_the_minimum_over_workers(per_seq, fixed, rooms, max_num_seqs):
    workers = [_worker(per_seq, fixed, room, rank=r) for r, room in enumerate(rooms)]
    plan = make_plan(workers, max_num_seqs, "cap")
    assert plan.safe_max_num_seqs == min(w.safe_max_num_seqs for w in workers)
    singles = [make_plan([w], max_num_seqs, "cap").effective_max_num_seqs for w in workers]
    assert plan.effective_max_num_seqs == min(singles)


def test_headroom_shared_by_workers_is_split_evenly():
    room = headroom_from_free(10 * GiB + 1, 24 * GiB, "psutil", margin_bytes=GiB, sharers=2)
    assert room.bytes == (9 * GiB + 1) // 2
    assert "split between 2 workers" in room.source
    with pytest.raises(ValueError):
        headroom_from_free(GiB, GiB, "x", sharers=0)
