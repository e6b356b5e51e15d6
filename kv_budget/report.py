"""Plans as operators read them: a table for logs, one-line messages.

Modelled on vLLM's startup memory lines: every figure carries its unit in
exact bytes and MiB and says where it came from, so it can be checked by
hand. Each constraint on ``max_num_seqs`` is on a line of its own and the
effective value is shown as their minimum.
"""

from __future__ import annotations

from .planner import Charge, Decision, Plan
from .protocol import RowDriver
from .units import format_bytes

__all__ = ["render_plan_table", "infeasible_message", "summary_line"]


def _owner_label(owner: str) -> str:
    return owner or "<root>"


def render_plan_table(plan: Plan) -> str:
    """Multi-line table: declarations, figures, constraints, decision."""
    lines = [
        f"model-local KV plan: policy={plan.policy.value} decision={plan.decision.value} "
        f"(figures from rank {plan.binding_rank} of {len(plan.workers)} worker(s))"
    ]
    if plan.declarations:
        lines.append("  declarations (owner / name: geometry x positions = bytes per row; rows -> bytes):")
    else:
        lines.append("  declarations: none (the model declares no model-local KV)")
    for d in plan.declarations:
        rows = (
            f"fixed {d.rows_fixed} ({d.rows_reason})"
            if d.rows is RowDriver.FIXED
            else f"max_num_seqs = {d.rows_at_peak}"
        )
        lines.append(
            f"    {_owner_label(d.owner)} / {d.name}: 2 x {d.layers} layers x {d.kv_heads} kv heads "
            f"x {d.head_dim} head_dim x {d.physical_capacity_positions} positions "
            f"({d.capacity_source}) x {d.dtype_bytes} B {d.dtype} = {format_bytes(d.bytes_per_row)} per row; "
            f"scope {d.scope.value}, rows {rows} -> {format_bytes(d.peak_bytes)} [{d.charge.value}]"
        )
        for o in d.overrides:
            lines.append(f"      overridden by the operator: {o.field} declared {o.declared} -> applied {o.applied}")
    for f in plan.failures:
        lines.append(f"    FAILED declarer on rank {f.rank}: {_owner_label(f.owner)}: {f.error}")
    lines += [
        f"  already charged (scope model, resident when sampled; not subtracted again): "
        f"{format_bytes(plan.charged_bytes)}",
        f"  uncharged fixed (subtracted once): {format_bytes(plan.uncharged_fixed_bytes)}",
        f"  per sequence (sum of bytes per row of max_num_seqs declarations): {format_bytes(plan.per_seq_bytes)}",
        f"  headroom: {format_bytes(plan.headroom_bytes)} from {plan.headroom_source}",
        f"  needed at configured max_num_seqs={plan.configured_max_num_seqs}: "
        f"{format_bytes(plan.required_bytes_at_configured)}",
        "  constraints on max_num_seqs:",
    ]
    for c in plan.constraints:
        lines.append(f"    {c.name}: {c.value}  [{c.detail}]")
    lines.append(
        f"  -> effective max_num_seqs = {plan.effective_max_num_seqs} ({_effect(plan)}); "
        f"predicted model-local KV at peak {format_bytes(plan.predicted_peak_bytes)}"
    )
    return "\n".join(lines)


def _effect(plan: Plan) -> str:
    if plan.decision is Decision.OK:
        return "configured value fits"
    if plan.decision is Decision.CAPPED:
        return f"capped from {plan.configured_max_num_seqs}, the minimum of the constraints"
    if plan.decision is Decision.WARNED:
        return f"does NOT fit; policy {plan.policy.value} leaves it unchanged"
    return "not even one sequence fits"


def summary_line(plan: Plan) -> str:
    """One line for a log or an error: the decision and its numbers."""
    safe = "unbounded" if plan.safe_max_num_seqs is None else str(plan.safe_max_num_seqs)
    return (
        f"model-local KV: {plan.decision.value}: max_num_seqs {plan.configured_max_num_seqs} -> "
        f"{plan.effective_max_num_seqs} (safe {safe}); needs {plan.required_bytes_at_configured:,} B "
        f"at {plan.configured_max_num_seqs} sequences (fixed {plan.uncharged_fixed_bytes:,} B + "
        f"{plan.per_seq_bytes:,} B per sequence), headroom {plan.headroom_bytes:,} B on rank {plan.binding_rank}"
    )


def infeasible_message(plan: Plan) -> str:
    """Why the engine refuses to start: the declarations that need memory,
    and the bytes needed for one sequence against the bytes available."""
    needed = plan.uncharged_fixed_bytes + plan.per_seq_bytes
    names = ", ".join(
        f"{_owner_label(d.owner)}/{d.name} ({d.charge.value}, {d.bytes_per_row:,} B per row)"
        for d in plan.declarations
        if d.charge is not Charge.CHARGED
    )
    return (
        f"model-local KV does not fit even one sequence on rank {plan.binding_rank}: needs "
        f"{needed:,} B ({plan.uncharged_fixed_bytes:,} B fixed + {plan.per_seq_bytes:,} B per sequence) "
        f"but {plan.headroom_bytes:,} B are available ({plan.headroom_source}). Declarations: {names}"
    )
