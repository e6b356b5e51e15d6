"""The plan: how many sequences fit once model-local KV is counted.

One worker's budget splits its declarations three ways:

* **already charged**: scope ``model``. Those tensors exist when memory is
  sampled (made during load or graph capture), so the sample already paid
  for them. They are reported and never subtracted again: an earlier design
  subtracted them a second time and capped servers that had room.
* **uncharged, fixed**: any other scope with a fixed row count. Subtracted
  once from the headroom.
* **uncharged, per sequence**: any other scope with ``max_num_seqs`` rows.
  Their ``bytes_per_row`` summed is what one more running sequence costs.

``safe_max_num_seqs = floor((headroom - fixed) / per_sequence)``, computed
per worker; the engine takes the smallest over workers, because every worker
runs every sequence. Each bound on ``max_num_seqs`` is kept as a named
:class:`Constraint`, and the effective value is their visible minimum, so the
log shows which one bit. All arithmetic is on integer bytes.
"""

from __future__ import annotations

from enum import Enum
from fractions import Fraction

from pydantic import BaseModel, ConfigDict

from kv_budget.collect.model import Collection, DeclarerFailure, OwnedSpec
from kv_budget.declare.spec import RowDriver, Scope
from kv_budget.settings import Policy
from kv_budget.units import GiB

__all__ = [
    "Decision",
    "Charge",
    "Headroom",
    "FieldOverride",
    "DeclarationLine",
    "FailureLine",
    "WorkerBudget",
    "Constraint",
    "ReservationLine",
    "LedgerLine",
    "Plan",
    "DEFAULT_MARGIN_FRACTION",
    "MIN_DEFAULT_MARGIN_BYTES",
    "default_margin_bytes",
    "LIVE_MARGIN_FLOOR_BYTES",
    "live_margin_bytes",
    "headroom_from_free",
    "headroom_override",
    "headroom_outside_requested",
    "budget_worker",
    "shared_budget",
    "make_plan",
]


class Decision(str, Enum):
    OK = "ok"
    """The configured ``max_num_seqs`` fits: nothing to do."""

    CAPPED = "capped"
    """``cap`` lowered ``max_num_seqs``."""

    WARNED = "warned"
    """It does not fit and the policy left it as configured."""

    INFEASIBLE = "infeasible"
    """Under ``cap``, not even one sequence fits: the engine must not start."""


class Charge(str, Enum):
    """How a declaration enters the budget (see the module docstring)."""

    CHARGED = "already-charged"
    FIXED = "uncharged-fixed"
    PER_SEQUENCE = "per-sequence"


DEFAULT_MARGIN_FRACTION = Fraction(5, 100)
"""Default safety margin: 5% of the device total, and at least
:data:`MIN_DEFAULT_MARGIN_BYTES`. Free memory sampled once at startup moves
afterwards: allocator fragmentation, activation temporaries of shapes the
profile run did not see, NCCL and other library buffers. A margin that scales
with the device keeps a large GPU from being planned to its last byte."""

MIN_DEFAULT_MARGIN_BYTES = 1 * GiB


def default_margin_bytes(total_bytes: int) -> int:
    return max(MIN_DEFAULT_MARGIN_BYTES, int(total_bytes * DEFAULT_MARGIN_FRACTION))


LIVE_MARGIN_FRACTION = Fraction(1, 8)
"""The part of the default margin, or of what was free at startup, the live
watch keeps (:func:`live_margin_bytes`)."""

LIVE_MARGIN_FLOOR_BYTES = 64 * 1024 * 1024
"""The least the live watch keeps free of a measured headroom while serving."""


class Headroom(BaseModel):
    """The bytes per-request model-local KV may use, with their origin."""

    model_config = ConfigDict(frozen=True)

    bytes: int
    source: str
    """E.g. ``"NVML device 0: nvmlDeviceGetMemoryInfo free 12,884,901,888 B
    minus margin 1,073,741,824 B"``; ``"operator override"``."""

    sampled_free_bytes: int | None = None
    margin_bytes: int = 0
    margin_given: bool = False
    """Whether the operator set the margin (``--model-local-kv-margin``):
    the live watch then keeps all of it (:func:`live_margin_bytes`)."""
    default_margin_bytes: int = 0
    """The default margin on this device (:func:`default_margin_bytes`):
    where the operator's is smaller, the live limit starts at what the
    default one admits (:class:`kv_budget.watch.live.LiveMonitor`)."""
    sharers: int = 1
    """Workers drawing on the same memory, which split it evenly."""
    reserved_by_others_bytes: int = 0
    """Taken off for other engines' model-local KV on the same device
    (:mod:`kv_budget.ledger`); 0 when none or the ledger is off."""


def live_margin_bytes(headroom: Headroom) -> int:
    """What the live watch keeps free on a device: the whole margin where
    the operator set it; else an eighth of the default margin or of what
    was free at startup, whichever is less, at least
    :data:`LIVE_MARGIN_FLOOR_BYTES` and never more than the margin. Why less
    than at startup: the default margin stands for what startup could not
    measure (the engine's own growth under load); serving, the device is
    read every sample and the sequences' measured cost takes that part, so
    the margin is left to cover what a sample cannot see coming (another
    process, an estimate a step later proves short). Why scaled to what was
    free: that part grows with what is admitted, and a small room admits
    few (a container with 400 MB left would keep a third of it)."""
    if headroom.margin_given:
        return headroom.margin_bytes
    part = int(headroom.margin_bytes * LIVE_MARGIN_FRACTION)
    if headroom.sampled_free_bytes is not None:
        part = min(part, int(headroom.sampled_free_bytes * LIVE_MARGIN_FRACTION))
    return min(headroom.margin_bytes, max(part, LIVE_MARGIN_FLOOR_BYTES))


def live_room_bytes(headroom: Headroom) -> int | None:
    """What the live margin leaves of a sample taken with the default
    margin, per sharer, less other engines' reservations; None where the
    margin was given or nothing was sampled."""
    if headroom.margin_given or headroom.sampled_free_bytes is None or not headroom.margin_bytes:
        return None
    free = max(headroom.sampled_free_bytes - live_margin_bytes(headroom), 0) // headroom.sharers
    return free - headroom.reserved_by_others_bytes


def bound_on(headroom: Headroom, fixed: int, per_seq: int) -> int | None:
    """:func:`safe_max_num_seqs` on the headroom, except where the default
    margin leaves not one sequence and the live margin does: then 1. Why:
    the default margin is a guess of what the engine adds under load, which
    the live watch measures while serving (:mod:`kv_budget.watch.live`);
    refusing on the guess alone would turn away a device with room (a 1 MiB
    sequence in a container with 400 MB left, a default margin of 1 GiB)."""
    safe = safe_max_num_seqs(headroom.bytes, fixed, per_seq)
    room = live_room_bytes(headroom)
    if safe == 0 and per_seq and room is not None and room >= fixed + per_seq:
        return 1
    return safe


def headroom_from_free(
    free_bytes: int, total_bytes: int, source: str, margin_bytes: int | None = None, sharers: int = 1
) -> Headroom:
    """Headroom from a sample of free memory, minus the margin (the default
    margin when ``margin_bytes`` is None), split evenly between ``sharers``
    workers that draw on the same memory (the workers of vLLM's CPU build
    all allocate from one host's RAM: giving each the whole of it would
    plan the host ``sharers`` times over). Never negative."""
    margin = default_margin_bytes(total_bytes) if margin_bytes is None else margin_bytes
    if margin < 0:
        raise ValueError(f"margin_bytes={margin} is negative")
    if sharers < 1:
        raise ValueError(f"sharers={sharers} must be >= 1")
    split = f", split between {sharers} workers sharing it" if sharers > 1 else ""
    return Headroom(
        bytes=max(free_bytes - margin, 0) // sharers,
        source=f"{source}: free {free_bytes:,} B minus margin {margin:,} B{split}",
        sampled_free_bytes=free_bytes,
        margin_bytes=margin,
        margin_given=margin_bytes is not None,
        default_margin_bytes=default_margin_bytes(total_bytes),
        sharers=sharers,
    )


def headroom_override(headroom_bytes: int, source: str = "operator override") -> Headroom:
    """An explicit headroom, used as given: the operator already decided
    what to leave spare, so no margin is taken off it."""
    if headroom_bytes < 0:
        raise ValueError(f"headroom_bytes={headroom_bytes} is negative")
    return Headroom(bytes=headroom_bytes, source=source)


def headroom_outside_requested(
    device_bytes: int, gpu_memory_utilization: float, margin_bytes: int | None = None
) -> Headroom:
    """What vLLM leaves outside its requested budget: after startup the
    process holds about ``device x gpu_memory_utilization``, so the rest of
    the device, minus the margin, is the headroom. For sizing before start."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} is not in (0, 1]")
    requested = int(device_bytes * Fraction(str(gpu_memory_utilization)))
    return headroom_from_free(
        device_bytes - requested,
        device_bytes,
        f"device {device_bytes:,} B minus vLLM's requested {requested:,} B "
        f"(gpu_memory_utilization {gpu_memory_utilization})",
        margin_bytes,
    )


class FieldOverride(BaseModel):
    """A field an operator corrected: what the model declared, what the plan
    used."""

    field: str
    declared: int | str
    applied: int | str


class DeclarationLine(BaseModel):
    """One declaration as it enters the plan, with its figures worked out."""

    owner: str
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    dtype_bytes: int
    physical_capacity_positions: int
    capacity_source: str
    scope: Scope
    rows: RowDriver
    rows_fixed: int | None
    """The fixed count; None when rows follow max_num_seqs (a declaration's
    ``rows_fixed`` is ignored there, as vLLM-Omni documents)."""
    rows_reason: str | None
    allocation_note: str | None
    bytes_per_row: int
    charge: Charge
    rows_at_peak: int
    """Rows at the max_num_seqs the budget was computed for."""

    peak_bytes: int
    overrides: list[FieldOverride] = []
    """Operator corrections applied to this declaration, in order."""
    supplied_by: str | None = None
    """None: the model declared it; else the operator's source of it
    (``preset NAME``, ``spec file PATH``)."""

    @classmethod
    def from_owned(cls, owned: OwnedSpec, max_num_seqs: int) -> DeclarationLine:
        spec = owned.spec
        if spec.scope is Scope.MODEL:
            charge = Charge.CHARGED
        elif spec.rows is RowDriver.FIXED:
            charge = Charge.FIXED
        else:
            charge = Charge.PER_SEQUENCE
        rows = spec.row_count(max_num_seqs)
        fixed = spec.rows is RowDriver.FIXED
        return cls(
            owner=owned.owner,
            name=spec.name,
            layers=spec.layers,
            kv_heads=spec.kv_heads,
            head_dim=spec.head_dim,
            dtype=str(spec.dtype).removeprefix("torch."),
            dtype_bytes=spec.dtype_bytes,
            physical_capacity_positions=spec.physical_capacity_positions,
            capacity_source=spec.capacity_source,
            scope=spec.scope,
            rows=spec.rows,
            rows_fixed=spec.rows_fixed if fixed else None,
            rows_reason=spec.rows_reason if fixed else None,
            allocation_note=spec.allocation_note,
            bytes_per_row=spec.bytes_per_row,
            charge=charge,
            rows_at_peak=rows,
            peak_bytes=spec.bytes_per_row * rows,
            overrides=[
                FieldOverride(field=field, declared=declared, applied=applied)
                for field, declared, applied in owned.overridden
            ],
            supplied_by=owned.supplied_by,
        )


class FailureLine(BaseModel):
    """A declarer that failed, by rank and owner path."""

    rank: int
    owner: str
    error: str

    @classmethod
    def from_failure(cls, rank: int, failure: DeclarerFailure) -> FailureLine:
        return cls(rank=rank, owner=failure.owner, error=failure.error)


class WorkerBudget(BaseModel):
    """One worker's budget: its declarations split three ways, its headroom,
    and the largest ``max_num_seqs`` that fits it."""

    rank: int
    declarations: list[DeclarationLine]
    failures: list[FailureLine]
    charged_bytes: int
    uncharged_fixed_bytes: int
    per_seq_bytes: int
    headroom: Headroom
    safe_max_num_seqs: int | None
    """None when nothing scales with sequences and the fixed part fits: no
    bound from this worker. 0 when not even one sequence (or the fixed part
    alone) fits."""


def safe_max_num_seqs(headroom: int, fixed: int, per_seq: int) -> int | None:
    if headroom < fixed:
        return 0
    if per_seq == 0:
        return None
    return (headroom - fixed) // per_seq


def budget_worker(collection: Collection, headroom: Headroom, rank: int = 0, max_num_seqs: int = 1) -> WorkerBudget:
    """Split a worker's declarations and bound ``max_num_seqs`` on it.

    ``max_num_seqs`` (the configured value) only sizes the per-row listing
    and any ``model``-scope declaration whose rows follow it; the bound
    itself does not depend on it.
    """
    lines = [DeclarationLine.from_owned(owned, max_num_seqs) for owned in collection.specs]
    charged = sum(line.peak_bytes for line in lines if line.charge is Charge.CHARGED)
    fixed = sum(line.peak_bytes for line in lines if line.charge is Charge.FIXED)
    per_seq = sum(line.bytes_per_row for line in lines if line.charge is Charge.PER_SEQUENCE)
    return WorkerBudget(
        rank=rank,
        declarations=lines,
        failures=[FailureLine.from_failure(rank, f) for f in collection.failures],
        charged_bytes=charged,
        uncharged_fixed_bytes=fixed,
        per_seq_bytes=per_seq,
        headroom=headroom,
        safe_max_num_seqs=bound_on(headroom, fixed, per_seq),
    )


def shared_budget(worker: WorkerBudget, others_bytes: int, others: str, share_bytes: int | None = None) -> WorkerBudget:
    """The worker's budget once the device is shared: ``others_bytes`` that
    other engines reserved on its device (``others`` names them) come off
    its headroom, and with ``share_bytes`` (the operator's share for this
    engine) the rest is capped at that share, leaving the remainder to
    engines that start later. Never negative."""
    if others_bytes < 0 or (share_bytes is not None and share_bytes < 0):
        raise ValueError(f"others_bytes={others_bytes}, share_bytes={share_bytes}: must be >= 0")
    room = worker.headroom
    left = max(room.bytes - others_bytes, 0)
    source = room.source
    if others_bytes:
        source += f"; minus {others_bytes:,} B reserved by other engines on this device ({others})"
    if share_bytes is not None and share_bytes < left:
        left = share_bytes
        source += f"; capped at this engine's share {share_bytes:,} B (--model-local-kv-share)"
    headroom = room.model_copy(update={"bytes": left, "source": source, "reserved_by_others_bytes": others_bytes})
    fixed, per_seq = worker.uncharged_fixed_bytes, worker.per_seq_bytes
    shared = safe_max_num_seqs(left, fixed, per_seq) if share_bytes is not None else bound_on(headroom, fixed, per_seq)
    return worker.model_copy(update={"headroom": headroom, "safe_max_num_seqs": shared})


class Constraint(BaseModel):
    """One named bound on ``max_num_seqs``; the effective value is the
    minimum over all of them (under ``cap``)."""

    name: str
    value: int
    detail: str


class ReservationLine(BaseModel):
    """One engine's model-local bytes on one device, as the ledger holds them."""

    device: str
    engine: str
    pid: int
    reserved_bytes: int


class LedgerLine(BaseModel):
    """What the device ledger said and what this engine recorded in it."""

    directory: str
    others: list[ReservationLine]
    """Other live engines' reservations on this engine's devices, taken off
    its headroom."""
    recorded: list[ReservationLine]
    """This engine's reservations: its predicted peak per device."""


class Plan(BaseModel):
    """The engine's plan: the minimum over workers, and the decision.

    The flat figures (``per_seq_bytes``, ``headroom_bytes``, ...) are those
    of the binding worker, the one whose bound is smallest.
    """

    policy: Policy
    decision: Decision
    configured_max_num_seqs: int
    safe_max_num_seqs: int | None
    effective_max_num_seqs: int
    binding_rank: int
    charged_bytes: int
    uncharged_fixed_bytes: int
    per_seq_bytes: int
    headroom_bytes: int
    headroom_source: str
    margin_bytes: int
    predicted_peak_bytes: int
    """Uncharged model-local KV at the effective max_num_seqs on the binding
    worker: fixed + per_seq x effective. What a measurement must match."""

    required_bytes_at_configured: int
    """fixed + per_seq x configured: what the unmodified server would need."""

    constraints: list[Constraint]
    declarations: list[DeclarationLine]
    failures: list[FailureLine]
    workers: list[WorkerBudget]
    ledger: LedgerLine | None = None
    """The shared device ledger, when the engine used one."""

    @property
    def fits(self) -> bool:
        return self.decision is Decision.OK


def _worker_constraint(worker: WorkerBudget) -> Constraint | None:
    if worker.safe_max_num_seqs is None:
        return None
    headroom, fixed, per_seq = worker.headroom, worker.uncharged_fixed_bytes, worker.per_seq_bytes
    if safe_max_num_seqs(headroom.bytes, fixed, per_seq) == 0 and worker.safe_max_num_seqs == 1:
        return Constraint(
            name=f"one sequence until measured on rank {worker.rank}",
            value=1,
            detail=(f"headroom {headroom.bytes:,} B < one sequence {fixed + per_seq:,} B (fixed + per-sequence) under "
                    f"the default margin {headroom.margin_bytes:,} B; the live margin "
                    f"{live_margin_bytes(headroom):,} B leaves {live_room_bytes(headroom):,} B: the live watch "
                    "admits what the device holds"),
        )
    return Constraint(
        name=f"model-local KV fits headroom on rank {worker.rank}",
        value=worker.safe_max_num_seqs,
        detail=(
            f"floor((headroom {worker.headroom.bytes:,} B - uncharged fixed "
            f"{worker.uncharged_fixed_bytes:,} B) / per-sequence {worker.per_seq_bytes:,} B)"
            if worker.headroom.bytes >= worker.uncharged_fixed_bytes
            else f"headroom {worker.headroom.bytes:,} B < uncharged fixed "
            f"{worker.uncharged_fixed_bytes:,} B"
        ),
    )


def at_max_num_seqs(line: DeclarationLine, max_num_seqs: int) -> DeclarationLine:
    """The line's rows at the effective max_num_seqs. Charged lines keep the
    rows they were allocated with: they are resident already."""
    if line.rows is RowDriver.FIXED or line.charge is Charge.CHARGED:
        return line
    return line.model_copy(
        update={"rows_at_peak": max_num_seqs, "peak_bytes": line.bytes_per_row * max_num_seqs}
    )


def make_plan(workers: list[WorkerBudget], configured_max_num_seqs: int, policy: Policy | str) -> Plan:
    """Combine worker budgets into the engine's plan under ``policy``."""
    policy = Policy(policy)
    if policy is Policy.RESERVE:
        raise ValueError(
            "policy reserve plans the paged pool, not max_num_seqs: use kv_budget.plan.reserve.plan_reserve"
        )
    if not workers:
        raise ValueError("make_plan needs at least one worker budget")
    if isinstance(configured_max_num_seqs, bool) or configured_max_num_seqs < 1:
        raise ValueError(f"configured max_num_seqs={configured_max_num_seqs} must be >= 1")
    constraints = [
        Constraint(
            name="configured max_num_seqs",
            value=configured_max_num_seqs,
            detail="scheduler config (--max-num-seqs)",
        )
    ]
    bounded = []
    for worker in workers:
        constraint = _worker_constraint(worker)
        if constraint is not None:
            constraints.append(constraint)
            bounded.append(worker)
    binding = min(bounded, key=lambda w: (w.safe_max_num_seqs, w.rank)) if bounded else workers[0]
    safe = binding.safe_max_num_seqs
    if safe is None or safe >= configured_max_num_seqs:
        decision, effective = Decision.OK, configured_max_num_seqs
    elif policy is Policy.CAP:
        decision, effective = (Decision.CAPPED, safe) if safe >= 1 else (Decision.INFEASIBLE, 0)
    else:
        decision, effective = Decision.WARNED, configured_max_num_seqs
    fixed, per_seq = binding.uncharged_fixed_bytes, binding.per_seq_bytes
    declarations = [at_max_num_seqs(line, effective) for line in binding.declarations]
    return Plan(
        policy=policy,
        decision=decision,
        configured_max_num_seqs=configured_max_num_seqs,
        safe_max_num_seqs=safe,
        effective_max_num_seqs=effective,
        binding_rank=binding.rank,
        charged_bytes=binding.charged_bytes,
        uncharged_fixed_bytes=fixed,
        per_seq_bytes=per_seq,
        headroom_bytes=binding.headroom.bytes,
        headroom_source=binding.headroom.source,
        margin_bytes=binding.headroom.margin_bytes,
        predicted_peak_bytes=fixed + per_seq * effective,
        required_bytes_at_configured=fixed + per_seq * configured_max_num_seqs,
        constraints=constraints,
        declarations=declarations,
        failures=[failure for worker in workers for failure in worker.failures],
        workers=workers,
    )
