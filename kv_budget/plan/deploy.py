"""Plan a vLLM-Omni deployment per device, before starting it
(:func:`plan_deploy`, ``kv-budget plan --deploy``).

vLLM-Omni's default deploy files put several stages on one GPU. Its
admission check (``engine/stage_admission.py``, only with
``parallel_stage_init``) proves per device that the stages' budgets fit::

    sum int(capacity x gpu_memory_utilization) + 2 GiB per stage that
    captures CUDA graphs + 1 GiB external reserve + 1 GiB margin <= capacity

It counts no model-local KV: the caches a stage's model keeps outside the
paged pool (Qwen3-TTS's codec decoder, MiMo-Audio's local transformer,
MiniCPM-o's streaming encoder) come on top, per running sequence. This
module reproduces that arithmetic to the byte on a file read by
:mod:`kv_budget.plan.deploy_file`, then charges each stage's declarations
on every device the stage uses, so an operator sees before starting whether
each device fits (one :class:`DeviceAccount` per device) and which
``max_num_seqs`` each stage can keep. It is pure integer arithmetic on what
was read, the device sizes and each stage's declarations, like vLLM-Omni's
``evaluate()``.

Semantics (docs/deploy.md walks through them with the shipped files):

* **Requested**: ``int(capacity x gpu_memory_utilization)`` per stage and
  device, in floating point exactly as ``evaluate()`` computes it (a
  :class:`fractions.Fraction` would differ by a byte on some sizes, and the
  figures must be vLLM-Omni's own). Attention-free stages (Qwen3-TTS's
  code2wav) allocate no paged pool but are still charged their whole share,
  as vLLM-Omni charges them: the share is the stage's memory budget, not its
  pool.
* **kv_cache_memory_bytes** sizes only a stage's paged pool (vLLM skips
  profiling and ignores ``gpu_memory_utilization`` for the pool; weights and
  activations come on top), and vLLM-Omni's admission still charges the
  utilization share. So the share stays the requested term; where the pool
  alone is larger than the share, the difference is charged as
  ``kv_cache_excess_bytes`` (the stage cannot stay inside its share then).
* **Graph reserve**: 2 GiB per stage and device that captures CUDA graphs
  (:attr:`~kv_budget.plan.deploy_file.StageDeploy.graph_reserve_bytes`).
  From the file alone every stage is taken to be an LLM stage; a diffusion
  stage (no graph reserve in vLLM-Omni) would be over-reserved by 2 GiB here.
* **Already-charged** model-local KV (scope ``model``) is reported and never
  subtracted: it is allocated while the model loads, profiles or captures
  graphs, so it sits inside the stage's requested share (the pool shrinks to
  make room) or in its graph reserve. Subtracting it again would double count
  it, as in :mod:`kv_budget.plan.planner`.
* **Left for per-sequence KV** on a device = capacity - required (vLLM-Omni's
  terms) - kv_cache excess - every stage's uncharged fixed model-local KV.
  A stage's declarations count on *every* device it lists (each
  tensor-parallel worker runs every sequence).
* **Split rule, "proportional to configured demand"**: the declaring stages
  on a device need ``per_seq x max_num_seqs`` each. If their sum fits what
  is left, each keeps its configured value. Otherwise each gets a share of
  what is left in proportion to its configured demand, and its safe value is
  ``floor(share / per_seq)``; a stage on several devices takes its minimum.
  Proportional shares keep the ratio the deploy file chose between stages,
  rather than letting whichever stage is planned first take everything.
* **An operator's headroom** for a device (``headrooms``: the room the
  device has outside the stages' pools, as ``--model-local-kv-headroom``
  gives it in a running deployment) replaces the admission terms there:
  left = headroom - every stage's uncharged fixed model-local KV, split by
  the same rule. The capacity is then optional; vLLM-Omni's own test is
  only made where it is known.
* **fits** (per device) is false when vLLM-Omni's own test fails (required >
  capacity), when the uncharged fixed model-local KV does not fit, or when a
  declaring stage's safe ``max_num_seqs`` there is 0.

Declarations come either as a preset or spec file (:class:`StageDeclarations`,
``kv-budget plan --deploy``) or as a stage's own budget, already split
(:class:`StageBudget`: a running stage records the one its workers made);
both give the same figures for the same declarations.

Every figure is integer bytes. Nothing here imports vLLM or vLLM-Omni.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import BaseModel

from kv_budget.collect.model import Collection
from kv_budget.plan.deploy_file import DeployError, DeployFile, StageDeploy
from kv_budget.plan.planner import (
    Constraint,
    Decision,
    DeclarationLine,
    WorkerBudget,
    budget_worker,
    headroom_override,
    make_plan,
    safe_max_num_seqs,
)
from kv_budget.settings import Policy
from kv_budget.units import GiB

__all__ = [
    "EXTERNAL_RESERVE_BYTES",
    "SAFETY_MARGIN_BYTES",
    "SPLIT_RULE",
    "StageDeclarations",
    "StageBudget",
    "StageOnDevice",
    "DeviceAccount",
    "StagePlan",
    "DeployPlan",
    "plan_deploy",
    "requested_bytes",
]

EXTERNAL_RESERVE_BYTES = 1 * GiB
"""vLLM-Omni's admission reserve for consumers outside every stage."""

SAFETY_MARGIN_BYTES = 1 * GiB
"""vLLM-Omni's admission margin for fragmentation and allocator slack."""

SPLIT_RULE = "proportional to configured demand"
"""Name of the rule that splits what is left on a device between the stages
declaring per-sequence KV there (see the module docstring)."""


@dataclass(frozen=True)
class StageDeclarations:
    """What one stage's model declares, and where the declarations came from
    (a preset name or a spec file), for the plan's inputs."""

    stage_id: int
    source: str
    collection: Collection


@dataclass(frozen=True)
class StageBudget:
    """One stage's model-local KV already split (charged / fixed / per
    sequence, :func:`kv_budget.plan.planner.budget_worker`): what a running
    stage knows of itself, from its own workers, and records for the others."""

    stage_id: int
    source: str
    budget: WorkerBudget


class StageOnDevice(BaseModel):
    """One replica of a stage on one device: its admission terms and its
    model-local KV there."""

    stage_id: int
    replica: int
    gpu_memory_utilization: float
    requested_bytes: int
    """``int(capacity x gpu_memory_utilization)``, as vLLM-Omni computes it."""

    graph_reserve_bytes: int
    kv_cache_memory_bytes: int | None
    kv_cache_excess_bytes: int
    """Pool size beyond the utilization share (0 unless the fixed pool is
    larger than the share)."""

    charged_bytes: int
    uncharged_fixed_bytes: int
    per_seq_bytes: int
    configured_max_num_seqs: int | None
    per_seq_demand_bytes: int
    """per_seq x configured max_num_seqs: its claim in the split."""

    share_bytes: int | None
    """Its part of what is left for per-sequence KV; None when it declares
    nothing per sequence."""

    headroom_source: str | None
    safe_max_num_seqs: int | None
    """min(configured, floor(share / per_seq)) on this device; None when
    model-local KV puts no bound on it here."""


class DeviceAccount(BaseModel):
    """One device: vLLM-Omni's admission terms, then model-local KV."""

    device: int
    capacity_bytes: int | None
    """None only where an operator's headroom stands for the device."""

    capacity_source: str
    headroom_bytes: int | None = None
    """The operator's room outside the pools; None: the admission terms decide."""

    headroom_source: str | None = None
    stages: list[StageOnDevice]
    requested_bytes: int
    """Sum of the stages' ``int(capacity x gpu_memory_utilization)``."""

    graph_reserve_bytes: int
    external_reserve_bytes: int
    margin_bytes: int
    required_bytes: int
    """requested + graph reserve + external reserve + margin: vLLM-Omni's
    left-hand side."""

    admission_fits: bool
    """vLLM-Omni's own test, ``required <= capacity`` (true where the
    capacity is not known: an operator's headroom stands for it)."""

    kv_cache_excess_bytes: int
    charged_bytes: int
    """Already-charged model-local KV, inside the requested shares or graph
    reserves; reported, not subtracted."""

    uncharged_fixed_bytes: int
    left_for_per_seq_bytes: int
    """capacity - required - kv_cache excess - uncharged fixed (or the
    operator's headroom - uncharged fixed): what the per-sequence KV of the
    declaring stages must fit. Negative when even the fixed part does not
    fit."""

    per_seq_demand_bytes: int
    """Sum of per_seq x configured max_num_seqs of the stages here."""

    model_local_bytes: int
    """Uncharged model-local KV at each stage's effective max_num_seqs:
    fixed + per_seq x effective."""

    free_bytes: int
    """left + uncharged fixed - model_local_bytes: what stays unclaimed with
    the plan applied (negative: over-committed, as under ``warn`` when the
    configured values do not fit)."""

    fits: bool


class StagePlan(BaseModel):
    """One stage's figures and its ``max_num_seqs`` under the plan."""

    stage_id: int
    devices: list[int]
    settings: StageDeploy
    """What the deploy file set for the stage, with where each came from."""

    declarations_source: str | None
    """Preset name or spec file; None when nothing was declared for it."""

    configured_max_num_seqs: int | None
    safe_max_num_seqs: int | None
    """min(configured, the smallest per-device bound); None when model-local
    KV puts no bound on the stage (it declares nothing per sequence and its
    fixed part fits)."""

    effective_max_num_seqs: int | None
    decision: Decision
    per_seq_bytes: int
    uncharged_fixed_bytes: int
    charged_bytes: int
    constraints: list[Constraint]
    declarations: list[DeclarationLine]


class DeployPlan(BaseModel):
    """Each device's account and each stage's ``max_num_seqs``."""

    deploy_file: str
    base_files: list[str]
    platform: str | None
    platform_note: str
    policy: Policy
    split_rule: str
    devices: list[DeviceAccount]
    stages: list[StagePlan]
    fits: bool
    """Every device fits."""

    @property
    def infeasible(self) -> bool:
        """Under ``cap``, some device cannot host its stages: start nothing."""
        return self.policy is Policy.CAP and not self.fits


def requested_bytes(capacity_bytes: int, gpu_memory_utilization: float) -> int:
    """A stage's requested term on a device, in floating point exactly as
    vLLM-Omni's ``evaluate()`` computes it, so the figures match to the byte."""
    return int(capacity_bytes * gpu_memory_utilization)


def plan_deploy(
    deploy: DeployFile,
    capacities: Mapping[int, int],
    declarations: Mapping[int, StageDeclarations | StageBudget] | None = None,
    policy: Policy | str = Policy.CAP,
    capacity_sources: Mapping[int, str] | None = None,
    headrooms: Mapping[int, tuple[int, str]] | None = None,
) -> DeployPlan:
    """The per-device accounts of ``deploy`` on devices of ``capacities``
    bytes, with each stage's ``declarations`` charged on its devices;
    ``headrooms`` (device -> (bytes, where they came from)) stand for the
    admission terms on the devices they name.

    Pure arithmetic on integers (no file, no device), like vLLM-Omni's
    ``evaluate()``. Raises :class:`DeployError` when a device has neither a
    size nor a headroom, declarations name a stage the file lacks, or a
    declaring stage has no ``max_num_seqs``.
    """
    policy = Policy(policy)
    headrooms = dict(headrooms or {})
    by_id = {stage.stage_id: stage for stage in deploy.stages}
    budgets = {sid: _stage_budget(decl, by_id) for sid, decl in (declarations or {}).items()}
    used = _check_inputs(deploy, capacities, budgets, headrooms)
    splits = {sid: budget.budget for sid, budget in budgets.items()}

    entries: dict[int, list[StageOnDevice]] = {device: [] for device in used}
    for stage in deploy.stages:
        for replica, replica_devices in enumerate(stage.replicas):
            for device in replica_devices:
                entries[device].append(_stage_on_device(stage, replica, capacities.get(device),
                                                        splits.get(stage.stage_id)))

    workers: dict[int, list[WorkerBudget]] = {sid: [] for sid in splits}
    terms = {}
    for device, here in entries.items():
        terms[device] = _Terms.of(capacities.get(device), here, headrooms.get(device))
        for index, entry in enumerate(here):
            if entry.stage_id in splits and (entry.uncharged_fixed_bytes or entry.per_seq_bytes):
                here[index], worker = _bound(entry, device, terms[device], splits[entry.stage_id])
                workers[entry.stage_id].append(worker)

    stages = [_stage_plan(stage, budgets.get(stage.stage_id), workers.get(stage.stage_id, []), policy)
              for stage in deploy.stages]
    effective = {stage.stage_id: stage.effective_max_num_seqs or 0 for stage in stages}
    sources = capacity_sources or {}
    devices = [_device_account(device, here, terms[device], effective, sources.get(device, "given"),
                               headrooms.get(device))
               for device, here in entries.items()]
    return DeployPlan(
        deploy_file=deploy.path,
        base_files=deploy.base_files,
        platform=deploy.platform,
        platform_note=deploy.platform_note,
        policy=policy,
        split_rule=SPLIT_RULE,
        devices=devices,
        stages=stages,
        fits=all(device.fits for device in devices),
    )


def _stage_budget(decl: StageDeclarations | StageBudget, by_id: Mapping[int, StageDeploy]) -> StageBudget:
    """Declarations split once (charged / fixed / per sequence): those
    figures do not depend on any headroom."""
    if isinstance(decl, StageBudget):
        return decl
    stage = by_id.get(decl.stage_id)
    max_num_seqs = (stage.max_num_seqs if stage else None) or 1
    return StageBudget(decl.stage_id, decl.source,
                       budget_worker(decl.collection, headroom_override(0), max_num_seqs=max_num_seqs))


def _check_inputs(deploy: DeployFile, capacities: Mapping[int, int], budgets: Mapping[int, StageBudget],
                  headrooms: Mapping[int, tuple[int, str]]) -> list[int]:
    """The devices the stages use, once every input the plan needs is there."""
    where = deploy.where()
    by_id = {stage.stage_id: stage for stage in deploy.stages}
    for sid, budget in budgets.items():
        if sid not in by_id:
            raise DeployError(f"{where}: declarations for stage {sid} ({budget.source}): the file has stages "
                              f"{sorted(by_id)}")
        if budget.budget.declarations and by_id[sid].max_num_seqs is None:
            raise DeployError(
                f"{where}: stages[stage_id={sid}].max_num_seqs = None: stage {sid} declares model-local KV "
                f"({budget.source}), which needs its max_num_seqs; vLLM's default depends on the device"
            )
    used = sorted({device for stage in deploy.stages for device in stage.devices})
    missing = [device for device in used if device not in capacities and device not in headrooms]
    if missing:
        raise DeployError(f"{where}: no size for device(s) {missing}; the stages use devices {used}")
    return used


def _stage_on_device(stage: StageDeploy, replica: int, capacity: int | None,
                     split: WorkerBudget | None) -> StageOnDevice:
    requested = 0 if capacity is None else requested_bytes(capacity, stage.gpu_memory_utilization)
    per_seq = split.per_seq_bytes if split else 0
    return StageOnDevice(
        stage_id=stage.stage_id,
        replica=replica,
        gpu_memory_utilization=stage.gpu_memory_utilization,
        requested_bytes=requested,
        graph_reserve_bytes=stage.graph_reserve_bytes,
        kv_cache_memory_bytes=stage.kv_cache_memory_bytes,
        kv_cache_excess_bytes=max(0, (stage.kv_cache_memory_bytes or 0) - requested),
        charged_bytes=split.charged_bytes if split else 0,
        uncharged_fixed_bytes=split.uncharged_fixed_bytes if split else 0,
        per_seq_bytes=per_seq,
        configured_max_num_seqs=stage.max_num_seqs,
        per_seq_demand_bytes=per_seq * (stage.max_num_seqs or 0),
        share_bytes=None,
        headroom_source=None,
        safe_max_num_seqs=None,
    )


@dataclass(frozen=True)
class _Terms:
    """One device's sums: vLLM-Omni's terms, then what they leave."""

    capacity: int | None
    requested: int
    graph: int
    required: int
    excess: int
    fixed: int
    left: int
    demand: int

    @classmethod
    def of(cls, capacity: int | None, entries: list[StageOnDevice], headroom: tuple[int, str] | None) -> _Terms:
        requested = sum(e.requested_bytes for e in entries)
        graph = sum(e.graph_reserve_bytes for e in entries)
        required = requested + graph + EXTERNAL_RESERVE_BYTES + SAFETY_MARGIN_BYTES
        excess = sum(e.kv_cache_excess_bytes for e in entries)
        fixed = sum(e.uncharged_fixed_bytes for e in entries)
        room = headroom[0] if headroom is not None else capacity - required - excess
        return cls(capacity, requested, graph, required, excess, fixed, left=room - fixed,
                   demand=sum(e.per_seq_demand_bytes for e in entries))


def _bound(entry: StageOnDevice, device: int, terms: _Terms, split: WorkerBudget) -> tuple[StageOnDevice, WorkerBudget]:
    """The stage's share of what is left on the device (the split rule) and
    the planner's bound on it there: the share plus the stage's own fixed
    part is its headroom, so the bound is ``floor(share / per_seq)``. When
    even the fixed parts do not fit, every declaring stage on the device
    gets less than its fixed part: 0."""
    if terms.left < 0:
        share = 0
        headroom = max(entry.uncharged_fixed_bytes + terms.left, 0)
        source = (f"device {device}: uncharged fixed {terms.fixed:,} B of all stages exceeds what is left for "
                  f"model-local KV ({terms.left + terms.fixed:,} B) by {-terms.left:,} B")
    else:
        share = terms.left * entry.per_seq_demand_bytes // terms.demand if terms.demand else 0
        headroom = entry.uncharged_fixed_bytes + share
        source = (f"device {device}: own uncharged fixed {entry.uncharged_fixed_bytes:,} B + share "
                  f"{share:,} B = left {terms.left:,} B x demand {entry.per_seq_demand_bytes:,} B / "
                  f"total demand {terms.demand:,} B")
    bound = safe_max_num_seqs(headroom, split.uncharged_fixed_bytes, split.per_seq_bytes)
    worker = split.model_copy(update={"rank": device, "headroom": headroom_override(headroom, source),
                                      "safe_max_num_seqs": bound})
    safe = bound
    if safe is not None and entry.configured_max_num_seqs is not None:
        safe = min(safe, entry.configured_max_num_seqs)
    updated = entry.model_copy(update={
        "share_bytes": share if entry.per_seq_bytes else None,
        "headroom_source": source,
        "safe_max_num_seqs": safe,
    })
    return updated, worker


def _device_account(device: int, entries: list[StageOnDevice], terms: _Terms, effective: Mapping[int, int],
                   capacity_source: str, headroom: tuple[int, str] | None) -> DeviceAccount:
    model_local = sum(e.uncharged_fixed_bytes + e.per_seq_bytes * effective[e.stage_id] for e in entries)
    admission_fits = terms.capacity is None or terms.required <= terms.capacity
    starved = any(e.safe_max_num_seqs == 0 for e in entries)
    return DeviceAccount(
        device=device,
        capacity_bytes=terms.capacity,
        capacity_source=capacity_source if terms.capacity is not None else "not known",
        headroom_bytes=headroom[0] if headroom else None,
        headroom_source=headroom[1] if headroom else None,
        stages=entries,
        requested_bytes=terms.requested,
        graph_reserve_bytes=terms.graph,
        external_reserve_bytes=EXTERNAL_RESERVE_BYTES,
        margin_bytes=SAFETY_MARGIN_BYTES,
        required_bytes=terms.required,
        admission_fits=admission_fits,
        kv_cache_excess_bytes=terms.excess,
        charged_bytes=sum(e.charged_bytes for e in entries),
        uncharged_fixed_bytes=terms.fixed,
        left_for_per_seq_bytes=terms.left,
        per_seq_demand_bytes=terms.demand,
        model_local_bytes=model_local,
        free_bytes=terms.left + terms.fixed - model_local,
        fits=admission_fits and terms.left >= 0 and not starved,
    )


def _stage_plan(stage: StageDeploy, decl: StageBudget | None, workers: list[WorkerBudget],
                policy: Policy) -> StagePlan:
    """A stage's bound: the minimum over its devices, decided by
    :func:`kv_budget.plan.planner.make_plan` under ``policy``."""
    configured = stage.max_num_seqs
    constraints = []
    if configured is not None:
        constraints.append(Constraint(name="configured max_num_seqs", value=configured,
                                      detail=f"deploy file {stage.max_num_seqs_source}"))
    safe, effective, decision = None, configured, Decision.OK
    split = decl.budget if decl else None
    lines: list[DeclarationLine] = split.declarations if split else []
    if workers:
        plan = make_plan(workers, configured, policy)
        lines = plan.declarations
        for worker in workers:
            if worker.safe_max_num_seqs is None:
                continue
            constraints.append(Constraint(
                name=f"model-local KV share on device {worker.rank}",
                value=worker.safe_max_num_seqs,
                detail=(f"floor((headroom {worker.headroom.bytes:,} B - uncharged fixed "
                        f"{worker.uncharged_fixed_bytes:,} B) / per-sequence {worker.per_seq_bytes:,} B); "
                        f"{worker.headroom.source}"),
            ))
        safe = None if plan.safe_max_num_seqs is None else min(plan.safe_max_num_seqs, configured)
        effective, decision = plan.effective_max_num_seqs, plan.decision
    return StagePlan(
        stage_id=stage.stage_id,
        devices=stage.devices,
        settings=stage,
        declarations_source=decl.source if decl else None,
        configured_max_num_seqs=configured,
        safe_max_num_seqs=safe,
        effective_max_num_seqs=effective,
        decision=decision,
        per_seq_bytes=split.per_seq_bytes if split else 0,
        uncharged_fixed_bytes=split.uncharged_fixed_bytes if split else 0,
        charged_bytes=split.charged_bytes if split else 0,
        constraints=constraints,
        declarations=lines,
    )
