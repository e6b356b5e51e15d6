"""Plans as operators read them: a table for logs, one-line messages.

Modelled on vLLM's startup memory lines: every figure carries its unit in
exact bytes and MiB and says where it came from, so it can be checked by
hand. Each constraint on ``max_num_seqs`` is on a line of its own and the
effective value is shown as their minimum.
"""

from __future__ import annotations

import json
from pathlib import Path

from kv_budget.declare.spec import RowDriver
from kv_budget.deployment import StageSplit
from kv_budget.log import logger
from kv_budget.plan.deploy import DeployPlan, DeviceAccount, StageOnDevice, StagePlan
from kv_budget.plan.deploy_file import GRAPH_RESERVE_BYTES
from kv_budget.plan.planner import Charge, Decision, DeclarationLine, FailureLine, Plan, WorkerBudget
from kv_budget.plan.reserve import ReservePlan
from kv_budget.settings import ModelLocalKVSettings
from kv_budget.stage import Stage, stage_file_name
from kv_budget.units import GiB, format_bytes


__all__ = ["render_plan_table", "render_split", "infeasible_message", "summary_line", "render_deploy_table",
           "deploy_infeasible_message", "render_reserve_table", "reserve_infeasible_message", "render_choices",
           "report_file", "write_report"]


def _owner_label(owner: str) -> str:
    return owner or "<root>"


def render_plan_table(plan: Plan) -> str:
    """Multi-line table: declarations, figures, constraints, decision."""
    lines = [
        f"model-local KV plan: policy={plan.policy.value} decision={plan.decision.value} "
        f"(figures from rank {plan.binding_rank} of {len(plan.workers)} worker(s))"
    ]
    lines += _declaration_lines(plan.declarations, plan.failures)
    lines += [
        f"  already charged (scope model, resident when sampled; not subtracted again): "
        f"{format_bytes(plan.charged_bytes)}",
        f"  uncharged fixed (subtracted once): {format_bytes(plan.uncharged_fixed_bytes)}",
        f"  per sequence (sum of bytes per row of max_num_seqs declarations): {format_bytes(plan.per_seq_bytes)}",
        f"  headroom: {format_bytes(plan.headroom_bytes)} from {plan.headroom_source}",
        *_ledger_lines(plan),
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


def render_split(split: StageSplit, effective_max_num_seqs: int) -> str:
    """A vLLM-Omni stage's part of its devices: what the other stages'
    parts are and where each figure came from, the share the split gave
    it, and which bound it plans against."""
    if split.final:
        state = "final: every stage on its devices has planned"
    else:
        state = ("provisional until " + ", ".join(s.label() for s in split.waiting_for) + " plan(s); "
                 "the final split is applied before the first request, lowering only")
    lines = [f"model-local KV deployment split ({split.split_rule}), {state}:"]
    for device in split.devices:
        if device.headroom_bytes is not None:
            where = f"operator's headroom outside the pools {format_bytes(device.headroom_bytes)}"
        else:
            where = f"capacity {format_bytes(device.capacity_bytes)} [{device.capacity_source}]"
        lines.append(f"  device {device.device}: {where}")
        for part in device.set_aside:
            lines.append(f"    set aside for {part.stage}: {part.what} {format_bytes(part.bytes)} [{part.source}]")
        left = format_bytes(device.left_for_per_seq_bytes)
        lines.append(f"    left for the declaring stages' per-sequence KV: {left}")
        share = "none (nothing per sequence)" if device.share_bytes is None else format_bytes(device.share_bytes)
        lines.append(f"    this stage's share: {share}; with its fixed part {format_bytes(device.split_bytes)} "
                     f"[{device.split_source}]")
        if device.measured_room_bytes is not None:
            lines.append(f"    its own headroom less the others' parts: {format_bytes(device.measured_room_bytes)} "
                         f"[{device.measured_source}]")
        lines.append(f"    -> plans against {format_bytes(device.room_bytes)} ({device.binding})")
    lines.append(f"  -> max_num_seqs under this split: {effective_max_num_seqs}")
    return "\n".join(lines)


def _declaration_lines(declarations: list[DeclarationLine], failures: list[FailureLine]) -> list[str]:
    """One line per declaration (geometry, rows, bytes, charge) and per failed declarer."""
    lines = []
    if declarations:
        lines.append("  declarations (owner / name: geometry x positions = bytes per row; rows -> bytes):")
    else:
        lines.append("  declarations: none (the model declares no model-local KV)")
    for d in declarations:
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
        if d.supplied_by:
            lines.append(f"      supplied by the operator ({d.supplied_by}), not declared by the model")
        for o in d.overrides:
            lines.append(f"      overridden by the operator: {o.field} declared {o.declared} -> applied {o.applied}")
    for f in failures:
        lines.append(f"    FAILED declarer on rank {f.rank}: {_owner_label(f.owner)}: {f.error}")
    return lines


def render_reserve_table(plan: ReservePlan, binding: WorkerBudget) -> str:
    """Under ``reserve``: the declarations, what was taken out of the paged
    pool, and what it cost in blocks and in ``max_model_len`` concurrency."""
    lines = [
        f"model-local KV plan: policy=reserve decision={'reserved' if plan.feasible else 'infeasible'} "
        f"(figures from rank {plan.binding_rank} of {len(plan.reservations)} worker(s))",
        *_declaration_lines(binding.declarations, binding.failures),
        f"  already charged (scope model, resident when profiled; not reserved again): "
        f"{format_bytes(binding.charged_bytes)}",
        f"  uncharged fixed: {format_bytes(binding.uncharged_fixed_bytes)}; per sequence: "
        f"{format_bytes(binding.per_seq_bytes)}; max_num_seqs kept at {plan.max_num_seqs} (configured)",
        f"  reserved out of the paged pool: {binding.uncharged_fixed_bytes:,} B + {binding.per_seq_bytes:,} B x "
        f"{plan.max_num_seqs} = {format_bytes(plan.reserved_bytes)}",
        f"  paged pool: {format_bytes(plan.kv_pool_bytes_before)} before ({plan.pool_source}) "
        f"-> {format_bytes(plan.kv_pool_bytes_after)} after",
        f"  blocks: {plan.num_blocks_before:,} -> {plan.num_blocks_after:,} (a block is "
        f"{plan.binding.block_bytes:,} B across the KV layers; the reservation costs "
        f"{plan.num_blocks_before - plan.num_blocks_after:,} blocks)",
        *_unified_block_lines(plan),
        f"  -> max_num_seqs = {plan.max_num_seqs} (kept); the pool holds "
        f"{plan.max_concurrency_at_max_model_len:.2f} sequences of max_model_len={plan.max_model_len:,} at once "
        f"({plan.num_blocks_after:,} blocks / {plan.blocks_per_sequence:,} per sequence)",
    ]
    return "\n".join(lines)


def _unified_block_lines(plan: ReservePlan) -> list[str]:
    """The workers left more blocks than the binding one: vLLM gives every
    worker the smallest count, so what they reserved less stays out of
    their pool all the same (pipeline parallel: the ranks without the
    caches)."""
    return [
        f"  rank {r.rank}: reserves {format_bytes(r.reserved_bytes)}, keeps {plan.num_blocks_after:,} blocks as "
        f"every worker does (vLLM gives each the smallest count): "
        f"{(r.num_blocks_after - plan.num_blocks_after) * r.block_bytes:,} B of its pool stay unallocated"
        for r in plan.reservations if r.num_blocks_after > plan.num_blocks_after
    ]


def render_choices(cap: Plan | None, reserve: ReservePlan) -> str:
    """``cap`` and ``reserve`` at the same settings, one line each, so an
    operator can pick before starting: concurrency, or pool blocks."""
    before = reserve.num_blocks_before / reserve.blocks_per_sequence
    lines = [f"choices at max_num_seqs={reserve.max_num_seqs} (pick one with --model-local-kv-policy):"]
    if cap is None:
        lines.append("  cap:     give --headroom-bytes or --device-memory to see what cap would do")
    elif cap.decision is Decision.INFEASIBLE:
        lines.append(f"  cap:     refuses to start: not one sequence fits the headroom of {cap.headroom_bytes:,} B")
    else:
        lines.append(
            f"  cap:     max_num_seqs {cap.configured_max_num_seqs} -> {cap.effective_max_num_seqs}; "
            f"{cap.predicted_peak_bytes:,} B of model-local KV outside the pool, in the headroom; the pool keeps "
            f"its {reserve.num_blocks_before:,} blocks ({before:.2f} sequences of max_model_len at once)"
        )
    if reserve.feasible:
        lines.append(
            f"  reserve: max_num_seqs stays {reserve.max_num_seqs}; {reserve.reserved_bytes:,} B come out of the "
            f"pool: {reserve.num_blocks_before:,} -> {reserve.num_blocks_after:,} blocks ({before:.2f} -> "
            f"{reserve.max_concurrency_at_max_model_len:.2f} sequences of max_model_len={reserve.max_model_len:,} "
            "at once)"
        )
    else:
        lines.append(f"  reserve: refuses to start: {reserve_infeasible_message(reserve)}")
    return "\n".join(lines)


def reserve_infeasible_message(plan: ReservePlan) -> str:
    """Why a ``reserve`` engine refuses to start: the reservation and the
    pool it leaves, against what one ``max_model_len`` sequence needs."""
    short = [r for r in plan.reservations if r.pool_bytes_after < r.needed_bytes]
    worst = min(short, key=lambda r: r.pool_bytes_after - r.needed_bytes)
    return (
        f"policy reserve: on rank {worst.rank}, reserving {worst.reserved_bytes:,} B of model-local KV "
        f"(at max_num_seqs={plan.max_num_seqs}) leaves {worst.pool_bytes_after:,} B of the paged pool's "
        f"{worst.pool_bytes_before:,} B, less than the {worst.needed_bytes:,} B one sequence of "
        f"max_model_len={plan.max_model_len:,} needs ({worst.sequence_bytes:,} B + a {worst.block_bytes:,} B "
        "null block). Lower --max-num-seqs or --max-model-len, give vLLM more memory, or use "
        "--model-local-kv-policy cap"
    )


def _ledger_lines(plan: Plan) -> list[str]:
    """Who else holds model-local KV on this engine's devices, and what this
    engine recorded, so an operator can add the device up by hand."""
    if plan.ledger is None:
        return []
    lines = [f"  device ledger {plan.ledger.directory}:"]
    if not plan.ledger.others:
        lines.append("    no other engine holds model-local KV on these devices")
    for r in plan.ledger.others:
        lines.append(f"    other engine on {r.device}: {r.engine}: {format_bytes(r.reserved_bytes)} reserved")
    for r in plan.ledger.recorded:
        lines.append(f"    this engine on {r.device}: {format_bytes(r.reserved_bytes)} reserved (predicted peak)")
    return lines


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
        f"but {plan.headroom_bytes:,} B are available ({plan.headroom_source}). Declarations: {names}. "
        "To start: a smaller paged pool (a lower --gpu-memory-utilization or --kv-cache-memory-bytes; "
        "VLLM_CPU_KVCACHE_SPACE on vLLM's CPU build), a shorter --max-model-len where the declared capacity "
        "follows it, a smaller --model-local-kv-margin, or --model-local-kv-policy warn to start without the bound"
    )


def _stage_label(stage: StagePlan) -> str:
    replicas = stage.settings.replicas
    if len(replicas) > 1:
        return f"stage {stage.stage_id} ({len(replicas)} replicas)"
    return f"stage {stage.stage_id}"


def render_deploy_table(plan: DeployPlan) -> str:
    """Multi-line table of a deploy plan: each stage's settings and where
    they came from, then per device vLLM-Omni's admission terms, the
    model-local KV, what is left and the split, then each stage's
    ``max_num_seqs``. Every figure in exact bytes and MiB."""
    stages = {stage.stage_id: stage for stage in plan.stages}
    lines = [
        f"vLLM-Omni deploy plan: policy={plan.policy.value}, split rule: {plan.split_rule}",
        f"  deploy file: {plan.deploy_file}",
    ]
    if plan.base_files:
        lines.append(f"  base_config: {' -> '.join(plan.base_files)}")
    lines += [f"  platform: {plan.platform_note}", "  stages (setting [where it came from]):"]
    for stage in plan.stages:
        s = stage.settings
        devices = s.replicas if len(s.replicas) > 1 else s.replicas[0]
        lines += [
            f"    {_stage_label(stage)}: devices {devices} [{s.devices_source}]",
            f"      gpu_memory_utilization {s.gpu_memory_utilization} [{s.gpu_memory_utilization_source}]",
            f"      max_num_seqs {s.max_num_seqs} [{s.max_num_seqs_source}]",
            f"      CUDA graphs {'captured' if s.captures_cuda_graphs else 'not captured'} "
            f"[{s.graph_reserve_source}]",
        ]
        if s.kv_cache_memory_bytes is not None:
            lines.append(f"      kv_cache_memory_bytes {format_bytes(s.kv_cache_memory_bytes)} "
                         f"[{s.kv_cache_memory_bytes_source}]")
        lines.append(f"      declarations: {stage.declarations_source or 'none given'}")
    for device in plan.devices:
        lines += _device_lines(device, stages)
    lines.append(f"  max_num_seqs per stage (model-local KV shares: {plan.split_rule}):")
    for stage in plan.stages:
        lines += _stage_lines(stage)
    verdict = "every device fits" if plan.fits else "some device does NOT fit"
    if plan.infeasible:
        verdict += f"; policy {plan.policy.value}: do not start"
    lines.append(f"  -> {verdict}")
    return "\n".join(lines)


def _device_lines(device: DeviceAccount, stages: dict[int, StagePlan]) -> list[str]:
    if device.headroom_bytes is not None:
        lines = [
            f"  device {device.device}: headroom {format_bytes(device.headroom_bytes)} [{device.headroom_source}]",
            "    vLLM-Omni admission terms: not counted (the headroom is the room outside every stage's pool)",
        ]
        return lines + _model_local_lines(device, stages, "headroom", "")
    capacity = device.capacity_bytes
    graph_stages = [e for e in device.stages if e.graph_reserve_bytes]
    lines = [
        f"  device {device.device}: capacity {format_bytes(capacity)} [{device.capacity_source}]",
        "    vLLM-Omni admission terms (its evaluate() arithmetic):",
    ]
    for e in device.stages:
        lines.append(
            f"      stage {e.stage_id}{_replica(e)} requested: int({capacity:,} x {e.gpu_memory_utilization}) "
            f"= {format_bytes(e.requested_bytes)}"
        )
    lines += [
        f"      requested (sum): {format_bytes(device.requested_bytes)}",
        f"      graph reserve: {GRAPH_RESERVE_BYTES // GiB} GiB x {len(graph_stages)} stage(s) capturing CUDA graphs "
        f"({', '.join(f'stage {e.stage_id}{_replica(e)}' for e in graph_stages) or 'none'}) "
        f"= {format_bytes(device.graph_reserve_bytes)}",
        f"      external reserve (vLLM-Omni constant): {format_bytes(device.external_reserve_bytes)}",
        f"      margin (vLLM-Omni constant): {format_bytes(device.margin_bytes)}",
        f"      required = requested + graph reserve + external reserve + margin: "
        f"{format_bytes(device.required_bytes)} "
        f"{'<=' if device.admission_fits else '>'} capacity: "
        f"{'admitted' if device.admission_fits else 'vLLM-Omni admission FAILS'}",
    ]
    for e in device.stages:
        if e.kv_cache_excess_bytes:
            lines.append(
                f"      stage {e.stage_id}{_replica(e)} kv_cache_memory_bytes {e.kv_cache_memory_bytes:,} B exceeds "
                f"its requested share by {format_bytes(e.kv_cache_excess_bytes)} (charged on top)"
            )
    excess = " - kv_cache excess" if device.kv_cache_excess_bytes else ""
    return lines + _model_local_lines(device, stages, "capacity - required", excess)


def _model_local_lines(device: DeviceAccount, stages: dict[int, StagePlan], room: str, excess: str) -> list[str]:
    """The model-local KV part of a device's account; ``room`` names what
    the per-sequence KV is left from (a capacity's admission terms, or an
    operator's headroom)."""
    lines = ["    model-local KV:"]
    declaring = [e for e in device.stages if stages[e.stage_id].declarations_source is not None]
    if not declaring:
        lines.append("      none declared for the stages on this device (--stage-declarations)")
    for e in declaring:
        demand = (f"per sequence {e.per_seq_bytes:,} B x max_num_seqs {e.configured_max_num_seqs} = "
                  f"{format_bytes(e.per_seq_demand_bytes)}")
        lines.append(
            f"      stage {e.stage_id}{_replica(e)} ({stages[e.stage_id].declarations_source}): already charged "
            f"{format_bytes(e.charged_bytes)} (inside its requested share or graph reserve; not subtracted); "
            f"uncharged fixed {format_bytes(e.uncharged_fixed_bytes)}; {demand}"
        )
    if device.left_for_per_seq_bytes < 0:
        verdict = "the uncharged fixed part alone does NOT fit"
    elif device.per_seq_demand_bytes <= device.left_for_per_seq_bytes:
        verdict = "fits: every stage keeps its configured value"
    else:
        verdict = "does NOT fit: split in proportion to each stage's demand"
    lines += [
        f"    left for per-sequence KV = {room}{excess} - uncharged fixed "
        f"{format_bytes(device.uncharged_fixed_bytes)}: {format_bytes(device.left_for_per_seq_bytes)}",
        f"    per-sequence demand at configured max_num_seqs: {format_bytes(device.per_seq_demand_bytes)} ({verdict})",
    ]
    for e in device.stages:
        if e.share_bytes is not None:
            lines.append(
                f"      stage {e.stage_id}{_replica(e)}: share {format_bytes(e.share_bytes)} -> safe max_num_seqs "
                f"{e.safe_max_num_seqs} here"
            )
    lines += [
        f"    model-local KV at effective max_num_seqs (uncharged): {format_bytes(device.model_local_bytes)}",
        f"    free = {room}{excess} - model-local KV: {format_bytes(device.free_bytes)}",
        f"    -> device {device.device} {'fits' if device.fits else 'does NOT fit'}",
    ]
    return lines


def _replica(entry: StageOnDevice) -> str:
    return f" replica {entry.replica}" if entry.replica else ""


def _stage_lines(stage: StagePlan) -> list[str]:
    if stage.declarations_source is None:
        return [f"    {_stage_label(stage)}: max_num_seqs {stage.configured_max_num_seqs} "
                "(no declarations given: not bounded here)"]
    lines = [f"    {_stage_label(stage)} ({stage.declarations_source}): per sequence "
             f"{format_bytes(stage.per_seq_bytes)}, uncharged fixed {format_bytes(stage.uncharged_fixed_bytes)}, "
             f"already charged {format_bytes(stage.charged_bytes)}"]
    for d in stage.declarations:
        rows = f"fixed {d.rows_fixed}" if d.rows is RowDriver.FIXED else "max_num_seqs"
        lines.append(
            f"      {_owner_label(d.owner)} / {d.name}: {format_bytes(d.bytes_per_row)} per row, rows {rows}, "
            f"scope {d.scope.value} [{d.charge.value}]"
        )
    for c in stage.constraints:
        lines.append(f"      {c.name}: {c.value}  [{c.detail}]")
    safe = "unbounded" if stage.safe_max_num_seqs is None else stage.safe_max_num_seqs
    lines.append(f"      -> safe {safe}, effective max_num_seqs = {stage.effective_max_num_seqs} "
                 f"({stage.decision.value})")
    return lines


def deploy_infeasible_message(plan: DeployPlan) -> str:
    """Why a deployment must not start: each device that does not fit, with
    the figures that decide it."""
    reasons = []
    for device in plan.devices:
        if device.fits:
            continue
        if not device.admission_fits:
            why = (f"vLLM-Omni's admission needs {device.required_bytes:,} B > capacity "
                   f"{device.capacity_bytes:,} B")
        elif device.left_for_per_seq_bytes < 0:
            why = (f"uncharged fixed model-local KV {device.uncharged_fixed_bytes:,} B exceeds the "
                   f"{device.uncharged_fixed_bytes + device.left_for_per_seq_bytes:,} B the admission terms leave")
        else:
            starved = [f"stage {e.stage_id} ({e.per_seq_bytes:,} B per sequence, share {e.share_bytes or 0:,} B)"
                       for e in device.stages if e.safe_max_num_seqs == 0]
            why = f"not even one sequence fits for {', '.join(starved)}"
        reasons.append(f"device {device.device}: {why}")
    return f"deployment {plan.deploy_file} does not fit: " + "; ".join(reasons)


def report_file(settings: ModelLocalKVSettings, stage: Stage | None) -> Path:
    """Where the startup plan goes: ``report_path``, with the stage's tag
    in a vLLM-Omni stage (:func:`kv_budget.stage.stage_file_name`)."""
    return stage_file_name(settings.report_path, stage)


def write_report(path: str | Path, report: dict, vllm_figures: dict, stage: Stage | None = None) -> bool:
    """Write a startup report (``cap``/``warn`` or ``reserve``) with the vLLM
    it ran on (``vllm_figures``: version, distribution, support) and the
    vLLM-Omni stage (``stage``: null for a plain vLLM engine); return
    whether it was written. A path that cannot be written logs one warning
    and the engine starts: the plan the report would hold is in the log
    already, and the protection does not depend on the file (failing the
    start over a report path took a protected server down)."""
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = {"stage": stage.model_dump() if stage is not None else None}
        target.write_text(json.dumps({**report, **vllm_figures, **staged}, indent=2))
    except OSError as exc:
        logger.warning("cannot write the startup plan to %s (%s: %s); the plan is in this log",
                       path, type(exc).__name__, exc)
        return False
    logger.info("startup plan written to %s", path)
    return True
