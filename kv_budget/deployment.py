"""The record a vLLM-Omni deployment's stages share, and the split it gives
each of them (:func:`split_for`).

vLLM-Omni starts the stages of one GPU one after another (or, with
``parallel_stage_init``, side by side), and a stage samples free memory once
its own pool exists. A stage that plans before the others on its device
would count the memory their pools will take, and no stage can see another's
model-local KV before that stage has loaded its model. The driver process,
where vLLM-Omni's orchestrator resolves the whole deploy before it spawns a
stage, can see every stage's placement and sizing; so:

1. the driver writes the deployment's record (:func:`create_deployment`):
   each stage's devices, ``gpu_memory_utilization``, graph capture, pool
   size and ``max_num_seqs`` as vLLM-Omni resolved them, each device's size
   (NVML, or the operator's ``device_memory`` where nothing can be
   measured) or the operator's headroom, and which stages plan;
2. each planning stage adds what it knows of itself when it plans
   (:func:`record_stage`): its declarations, split once, and the room it
   measured;
3. :func:`split_for` gives a stage its part: vLLM-Omni's admission terms of
   every stage on its devices set aside, the declaring stages' share of
   what is left by the rule ``kv-budget plan --deploy`` uses
   (:func:`kv_budget.plan.deploy.plan_deploy` computes both), and the
   stage's own measured room, the smaller winning. Until every planning
   stage on its devices has recorded, the split is provisional: stages not
   yet planned count their admission terms and no model-local KV, so a
   provisional bound is never below the final one, and the engine applies
   the final one before its first request (lowering only).

Entries of processes that are gone are dropped when the record is read (the
ledger's liveness rule: pid and start time), so a stage that dies frees its
part and a restarted one plans against what the others hold. The record is
a JSON file beside the device ledger, written under an exclusive ``flock``
of its own. Nothing here imports vLLM or vLLM-Omni.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel

from kv_budget.errors import KvBudgetError, ModelLocalKVInfeasibleError
from kv_budget.ledger import process_alive, this_process
from kv_budget.log import logger
from kv_budget.plan.deploy import SPLIT_RULE, DeviceAccount, StageBudget, plan_deploy
from kv_budget.plan.deploy_file import DeployFile, StageDeploy
from kv_budget.plan.planner import LedgerLine, WorkerBudget, safe_max_num_seqs
from kv_budget.runtime_files import UnsafeRuntimeDirError, checked_dir, exclusive_lock, read_text, write_atomically
from kv_budget.settings import ModelLocalKVSettings
from kv_budget.stage import Stage


__all__ = [
    "DEPLOYMENT_ENV",
    "DeploymentPlanning",
    "DeploymentError",
    "PlannedStage",
    "DeploymentRecord",
    "SetAside",
    "DeviceSplit",
    "StageSplit",
    "create_deployment",
    "deployment_path",
    "read_deployment",
    "record_stage",
    "record_live_excess",
    "split_for",
    "split_max_num_seqs",
    "starved",
]

DEPLOYMENT_ENV = "KV_BUDGET_DEPLOYMENT"
"""Set by the driver to the record's path before vLLM-Omni spawns a stage;
each stage process inherits it."""


class DeploymentError(KvBudgetError, RuntimeError):
    """The record cannot be written or read; the message names the file."""


class PlannedStage(BaseModel):
    """What one stage replica recorded when it planned."""

    stage: Stage
    pid: int
    process_start: float
    budget: WorkerBudget
    """Its declarations split once (its binding worker's): the same figures
    ``kv-budget plan --deploy`` gets from a preset or spec file."""

    measured_bytes: dict[int, int] | None
    """Per device: the headroom its workers had (measured free memory minus
    the margin, or the operator's), minus other engines' ledger entries,
    before anything this deployment sets aside."""

    measured_source: str | None = None
    planned_before: list[Stage]
    """Stages that had planned when it sampled: their pools were out of its
    sample; the others' admission terms come off its measured room."""

    policy: str
    """``cap`` or ``warn``: whether its bound lowers its ``max_num_seqs``."""

    configured_max_num_seqs: int

    live_excess_per_seq_bytes: int = 0
    """Bytes per sequence its live measurement found beyond its declarations
    (an under-declaration, or caches of a model that declares nothing):
    charged as declared ones in the split from then on, so a stage that
    holds caches nobody declared gets a share of the device, not 0 B."""

    live_excess_fixed_bytes: int = 0
    """Fixed bytes its live measurement found beyond its declarations (what
    a step adds over an undeclared holder's kept caches), charged likewise."""

    def split_budget(self) -> WorkerBudget:
        """Its budget as the split charges it: declared plus measured bytes."""
        if not (self.live_excess_per_seq_bytes or self.live_excess_fixed_bytes):
            return self.budget
        return self.budget.model_copy(update={
            "per_seq_bytes": self.budget.per_seq_bytes + self.live_excess_per_seq_bytes,
            "uncharged_fixed_bytes": self.budget.uncharged_fixed_bytes + self.live_excess_fixed_bytes})


class DeploymentRecord(BaseModel):
    """One deployment, as its driver resolved it, and what its stages recorded."""

    driver_pid: int
    driver_start: float
    stages: list[StageDeploy]
    """Devices are physical indices, as vLLM-Omni resolved them."""

    planning: list[Stage]
    """The stage replicas that plan (LLM stages under ``cap`` or ``warn``)
    and so record; the others count by their admission terms alone."""

    capacities: dict[int, int]
    capacity_sources: dict[int, str]
    headrooms: dict[int, tuple[int, str]]
    """Device -> the operator's room outside the pools, and where it was set."""

    planned: list[PlannedStage] = []

    def devices_of(self, stage: Stage) -> list[int]:
        for deploy in self.stages:
            if deploy.stage_id == stage.stage_id and stage.replica < len(deploy.replicas):
                return list(deploy.replicas[stage.replica])
        return []

    def waiting_for(self, stage: Stage) -> list[Stage]:
        """Planning stages sharing a device with ``stage`` that have not
        recorded yet: while any is left, ``stage``'s split is provisional."""
        mine = set(self.devices_of(stage))
        done = {entry.stage for entry in self.planned}
        return [other for other in self.planning
                if other not in done and mine & set(self.devices_of(other))]


class SetAside(BaseModel):
    """Bytes of another stage on the device, kept out of this stage's room."""

    stage: str
    """Its label, ``"stage 1 replica 0"``."""
    stage_id: int
    replica: int
    what: str
    """``"admission terms"`` or ``"model-local KV"``."""
    bytes: int
    source: str


class DeviceSplit(BaseModel):
    """This stage's part of one device."""

    device: int
    capacity_bytes: int | None
    capacity_source: str
    headroom_bytes: int | None
    """The operator's room outside the pools; None: the admission terms decide."""

    set_aside: list[SetAside]
    left_for_per_seq_bytes: int
    """What every declaring stage's per-sequence KV on the device must fit."""

    share_bytes: int | None
    """This stage's share of it under the split rule."""

    split_bytes: int
    """Own uncharged fixed + share: its headroom under the split."""

    split_source: str
    measured_room_bytes: int | None
    """Its own measured headroom less what the split sets aside for the
    others (stages that had not allocated when it sampled, the declaring
    stages' model-local KV); None when the operator gave the headroom."""

    measured_source: str | None
    room_bytes: int
    """The smaller of the two: the headroom it plans against on this device."""

    binding: str
    """Which one that is: ``"deployment split"`` or ``"measured"``."""


class StageSplit(BaseModel):
    """What the deployment gives one stage replica."""

    stage: Stage
    final: bool
    """Every planning stage on its devices has recorded."""

    waiting_for: list[Stage]
    split_rule: str
    devices: list[DeviceSplit]

    def room_on(self, device: int) -> DeviceSplit | None:
        return next((split for split in self.devices if split.device == device), None)


def deployment_path(directory: Path) -> Path:
    """A new record's path for this driver process."""
    pid, _ = this_process()
    return directory / f"deployment-{pid}-{time.time_ns()}.json"


CHOOSE_ANOTHER = ("choose another with --model-local-kv-ledger-dir (the deployment record lives beside the "
                  "device ledger)")


def _write(path: Path, record: DeploymentRecord) -> None:
    try:
        write_atomically(path, record.model_dump_json(indent=1))
    except OSError as exc:
        raise DeploymentError(f"cannot write the kv-budget deployment record {path}: {exc.strerror or exc}") from exc


def _read(path: Path) -> DeploymentRecord:
    try:
        text = read_text(path)
        record = None if text is None else DeploymentRecord.model_validate(json.loads(text))
    except (OSError, ValueError) as exc:
        raise DeploymentError(f"the kv-budget deployment record {path} cannot be read ({exc})") from exc
    if record is None:
        raise DeploymentError(f"the kv-budget deployment record {path} cannot be read (it does not exist)")
    live = [entry for entry in record.planned if process_alive(entry.pid, entry.process_start)]
    return record.model_copy(update={"planned": live})


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(exclusive_lock(path.with_suffix(".lock")))
        except OSError as exc:
            raise DeploymentError(f"cannot lock the kv-budget deployment record {path}: "
                                  f"{exc.strerror or exc}") from exc
        yield


def create_deployment(path: Path, record: DeploymentRecord, shared: bool = False) -> Path:
    """Write the driver's record (no stage has planned yet) in a checked
    directory (:func:`kv_budget.runtime_files.checked_dir`; ``shared``: the
    operator's shared ledger directory). The record itself is always this
    user's: the stages of one deployment run as its driver does."""
    try:
        checked_dir(path.parent, CHOOSE_ANOTHER, shared)
    except UnsafeRuntimeDirError as exc:
        raise DeploymentError(str(exc)) from None
    with _locked(path):
        _write(path, record)
    return path


def read_deployment(path: Path) -> DeploymentRecord:
    """The record, with entries of processes that are gone dropped."""
    with _locked(path):
        return _read(path)


def record_stage(path: Path, stage: Stage, budget: WorkerBudget, measured_bytes: dict[int, int] | None,
                 measured_source: str | None, policy: str, configured_max_num_seqs: int) -> DeploymentRecord:
    """Add this process's entry for ``stage`` (replacing any earlier one of
    the same stage replica: a restart) and return the record as it is now."""
    pid, start = this_process()
    with _locked(path):
        record = _read(path)
        others = [entry for entry in record.planned if entry.stage != stage]
        mine = PlannedStage(stage=stage, pid=pid, process_start=start, budget=budget, measured_bytes=measured_bytes,
                            measured_source=measured_source, planned_before=[entry.stage for entry in others],
                            policy=policy, configured_max_num_seqs=configured_max_num_seqs)
        record = record.model_copy(update={"planned": [*others, mine]})
        _write(path, record)
    return record


def record_live_excess(path: Path, stage: Stage, per_seq_bytes: int, fixed_bytes: int = 0) -> DeploymentRecord:
    """Set what ``stage``'s live measurement found beyond its declarations,
    per sequence and fixed (raising each only), and return the record as it
    is now."""
    with _locked(path):
        record = _read(path)
        planned, changed = [], False
        for entry in record.planned:
            if entry.stage == stage and (per_seq_bytes > entry.live_excess_per_seq_bytes
                                         or fixed_bytes > entry.live_excess_fixed_bytes):
                entry = entry.model_copy(update={
                    "live_excess_per_seq_bytes": max(per_seq_bytes, entry.live_excess_per_seq_bytes),
                    "live_excess_fixed_bytes": max(fixed_bytes, entry.live_excess_fixed_bytes)})
                changed = True
            planned.append(entry)
        if changed:
            record = record.model_copy(update={"planned": planned})
            _write(path, record)
    return record


def _account(record: DeploymentRecord) -> dict[int, DeviceAccount]:
    """Every device's account under the split rule, with the stages that
    recorded charged by their own declarations and what their live
    measurement found beyond them."""
    budgets = {}
    for entry in record.planned:
        source = f"stage {entry.stage.stage_id}'s own declarations"
        if entry.live_excess_per_seq_bytes or entry.live_excess_fixed_bytes:
            source += (f" and {entry.live_excess_per_seq_bytes:,} B per sequence + {entry.live_excess_fixed_bytes:,} B "
                       "fixed measured beyond them")
        budgets.setdefault(entry.stage.stage_id, StageBudget(entry.stage.stage_id, source, entry.split_budget()))
    deploy = DeployFile(path="the deploy as vLLM-Omni resolved it", base_files=[], platform=None,
                        platform_note="resolved by vLLM-Omni", stages=record.stages)
    plan = plan_deploy(deploy, record.capacities, budgets, "cap", record.capacity_sources, record.headrooms)
    return {account.device: account for account in plan.devices}


def _set_aside(record: DeploymentRecord, account: DeviceAccount, stage: Stage,
               entry: PlannedStage) -> tuple[list[SetAside], int]:
    """The other stages' parts of the device, and how much of them comes off
    what ``stage`` measured: the admission terms of those that had not
    planned when it sampled (their pools were not there yet), and everyone's
    model-local KV (allocated while serving)."""
    recorded = {e.stage: e for e in record.planned}
    parts: list[SetAside] = []
    off_measured = 0
    for other in account.stages:
        who = Stage(stage_id=other.stage_id, replica=other.replica)
        if who == stage:
            continue
        label = who.label()
        if account.headroom_bytes is None:  # an operator's headroom is the room outside every pool already
            admission = other.requested_bytes + other.graph_reserve_bytes + other.kv_cache_excess_bytes
            parts.append(SetAside(
                stage=label, stage_id=who.stage_id, replica=who.replica, what="admission terms", bytes=admission,
                source=(f"vLLM-Omni's admission arithmetic: int({account.capacity_bytes:,} x "
                        f"{other.gpu_memory_utilization}) = {other.requested_bytes:,} B + graph reserve "
                        f"{other.graph_reserve_bytes:,} B + pool beyond share {other.kv_cache_excess_bytes:,} B")))
            if who not in entry.planned_before:
                off_measured += admission
        if who in recorded:
            theirs = recorded[who]
            # under warn a stage keeps its configured value: it holds that many
            sequences = (other.safe_max_num_seqs or 0) if theirs.policy == "cap" else theirs.configured_max_num_seqs
            source = (f"{label}'s own declarations, recorded by pid {theirs.pid}: fixed "
                      f"{other.uncharged_fixed_bytes:,} B + {other.per_seq_bytes:,} B x {sequences} sequences "
                      f"(policy {theirs.policy})")
            model_local = other.uncharged_fixed_bytes + other.per_seq_bytes * sequences
        elif who in record.planning:
            source, model_local = f"{label} has not planned yet: its declarations are not known until it records", 0
        else:
            source, model_local = f"{label} does not plan (policy off or reserve, or not an LLM stage)", 0
        parts.append(SetAside(stage=label, stage_id=who.stage_id, replica=who.replica, what="model-local KV",
                              bytes=model_local, source=source))
        off_measured += model_local
    return parts, off_measured


def split_for(record: DeploymentRecord, stage: Stage) -> StageSplit:
    """``stage``'s part of each of its devices (see the module docstring)."""
    accounts = _account(record)
    entry = next((e for e in record.planned if e.stage == stage), None)
    if entry is None:
        raise DeploymentError(f"{stage.label()} has not recorded itself in the deployment record")
    devices = []
    for device in record.devices_of(stage):
        account = accounts[device]
        mine = next(s for s in account.stages if Stage(stage_id=s.stage_id, replica=s.replica) == stage)
        set_aside, off_measured = _set_aside(record, account, stage, entry)
        if account.left_for_per_seq_bytes >= 0:
            split_bytes = mine.uncharged_fixed_bytes + (mine.share_bytes or 0)
        else:  # not even the fixed parts fit: each stage gets less than its own
            split_bytes = max(mine.uncharged_fixed_bytes + account.left_for_per_seq_bytes, 0)
        measured = None if entry.measured_bytes is None else entry.measured_bytes.get(device)
        room, binding, measured_room, measured_source = split_bytes, "deployment split", None, None
        if measured is not None:
            measured_room = max(measured - off_measured, 0)
            measured_source = (f"{entry.measured_source}: {measured:,} B, minus {off_measured:,} B of the other "
                               "stages' parts (admission terms of those that had not planned when it sampled, "
                               "model-local KV of all)")
            if _bound(measured_room, entry.split_budget()) < _bound(split_bytes, entry.split_budget()):
                room, binding = measured_room, "measured"
        devices.append(DeviceSplit(
            device=device,
            capacity_bytes=account.capacity_bytes,
            capacity_source=account.capacity_source,
            headroom_bytes=account.headroom_bytes,
            set_aside=set_aside,
            left_for_per_seq_bytes=account.left_for_per_seq_bytes,
            share_bytes=mine.share_bytes,
            split_bytes=split_bytes,
            split_source=mine.headroom_source or "",
            measured_room_bytes=measured_room,
            measured_source=measured_source,
            room_bytes=room,
            binding=binding,
        ))
    waiting = record.waiting_for(stage)
    return StageSplit(stage=stage, final=not waiting, waiting_for=waiting, split_rule=SPLIT_RULE, devices=devices)


def split_max_num_seqs(record: DeploymentRecord, stage: Stage) -> int | None:
    """The ``max_num_seqs`` ``stage``'s split allows: the smallest over its
    devices, at most its configured value (which it keeps when nothing of
    it scales with sequences and its fixed part fits); None when it has not
    recorded."""
    entry = next((e for e in record.planned if e.stage == stage), None)
    return None if entry is None else _max_num_seqs(entry, split_for(record, stage))


def _max_num_seqs(entry: PlannedStage, split: StageSplit) -> int:
    budget = entry.split_budget()
    bounds = [safe_max_num_seqs(part.room_bytes, budget.uncharged_fixed_bytes, budget.per_seq_bytes)
              for part in split.devices]
    return min([bound for bound in bounds if bound is not None] + [entry.configured_max_num_seqs])


def starved(record: DeploymentRecord, stage: Stage) -> list[str]:
    """Once ``stage``'s split is final: the other stages on its devices
    under ``cap`` that the final split leaves not one sequence, each with
    its figures. The stage that completes the record refuses on them, since
    they started on a provisional split and cannot refuse any more."""
    mine = set(record.devices_of(stage))
    found = []
    for entry in record.planned:
        if entry.stage == stage or entry.policy != "cap" or not mine & set(record.devices_of(entry.stage)):
            continue
        split = split_for(record, entry.stage)
        if _max_num_seqs(entry, split) == 0:
            rooms = ", ".join(f"device {p.device}: {p.room_bytes:,} B" for p in split.devices)
            budget = entry.split_budget()
            found.append(f"{entry.stage.label()} (uncharged fixed {budget.uncharged_fixed_bytes:,} B, "
                         f"per sequence {budget.per_seq_bytes:,} B; its part {rooms})")
    return found


def _bound(room: int, budget: WorkerBudget) -> float:
    """The max_num_seqs ``room`` allows (infinite when nothing scales)."""
    bound = safe_max_num_seqs(room, budget.uncharged_fixed_bytes, budget.per_seq_bytes)
    return float("inf") if bound is None else bound


class DeploymentPlanning:
    """This stage's side of its vLLM-Omni deployment's record
    (:mod:`kv_budget.deployment`): it records what its workers found, plans
    against the split, and re-reads the record until the split is final."""

    def __init__(self, path: Path, record: DeploymentRecord, stage: Stage) -> None:
        self.path = path
        self.stage = stage
        self.physical = record.devices_of(stage)
        self.split: StageSplit | None = None
        self.workers: list[WorkerBudget] = []
        """Its workers' budgets against their own headroom, before the split."""
        self.devices: list[str | None] = []
        """The workers' device ledger keys."""
        self.ledger: LedgerLine | None = None
        """What the device ledger said at its plan (the final plan keeps its others)."""

    @classmethod
    def of_this_process(cls, stage: Stage | None) -> DeploymentPlanning | None:
        """The deployment the driver recorded (:data:`DEPLOYMENT_ENV`), when
        it lists ``stage`` among those that plan; None otherwise. A record
        that cannot be read logs one warning: the stage then plans alone."""
        path = os.environ.get(DEPLOYMENT_ENV)
        if stage is None or not path:
            return None
        try:
            record = read_deployment(Path(path))
        except DeploymentError as exc:
            logger.warning("%s; %s plans against its own headroom and the device ledger only",
                           exc, stage.label())
            return None
        return cls(Path(path), record, stage) if stage in record.planning else None

    def pids(self) -> set[int]:
        """The stage processes of this deployment that recorded: their
        ledger entries are counted by the split, not as other engines."""
        return {entry.pid for entry in read_deployment(self.path).planned}

    def physical_device(self, rank: int) -> int:
        return self.physical[min(rank, len(self.physical) - 1)]

    def plan_against(self, workers: list[WorkerBudget], settings: ModelLocalKVSettings,
                     configured: int) -> list[WorkerBudget]:
        """Record this stage (its binding worker's declarations, the
        headroom each device gave its workers) and return the workers with
        the split's room as their headroom. The stage that completes the
        record refuses (:class:`ModelLocalKVInfeasibleError`) when the final
        split leaves a stage under ``cap`` that planned before it no
        sequence: that one cannot refuse any more."""
        measured: dict[int, int] = {}
        for worker in workers:
            device = self.physical_device(worker.rank)
            measured[device] = min(measured.get(device, worker.headroom.bytes), worker.headroom.bytes)
        binding = max(workers, key=lambda w: (w.per_seq_bytes, w.uncharged_fixed_bytes, -w.rank))
        record = record_stage(self.path, self.stage, binding, measured, binding.headroom.source,
                              settings.policy.value, configured)
        self.workers = workers
        placed = self._against(record)
        if self.split.final and (left_out := starved(record, self.stage)):
            raise ModelLocalKVInfeasibleError(
                f"kv-budget: with {self.stage.label()} planned, the final split of the devices leaves "
                f"{'; '.join(left_out)} not one sequence under cap; lower the stages' max_num_seqs or "
                "gpu_memory_utilization on the device, or give it more headroom")
        return placed

    def with_live_excess(self, per_seq_bytes: int, fixed_bytes: int = 0) -> list[WorkerBudget]:
        """Record what live measurement found beyond this stage's
        declarations (per sequence, fixed), and return its workers under the split as it
        is now: the other stages' measurements count too, so a stage that
        holds caches nobody declared gets its share of the device, and one
        whose neighbour's caches grew gets less."""
        return self._against(record_live_excess(self.path, self.stage, per_seq_bytes, fixed_bytes))

    def final(self) -> list[WorkerBudget] | None:
        """The workers under the final split; None while a stage on its
        devices has not recorded."""
        record = read_deployment(self.path)
        if record.waiting_for(self.stage):
            return None
        return self._against(record)

    def _against(self, record: DeploymentRecord) -> list[WorkerBudget]:
        self.split = split_for(record, self.stage)
        placed = []
        state = "final" if self.split.final else "provisional"
        for worker in self.workers:
            part = self.split.room_on(self.physical_device(worker.rank))
            own = "not measured" if part.measured_room_bytes is None else f"{part.measured_room_bytes:,} B"
            text = (f"{self.stage.label()}: the smaller of its {state} deployment split on device {part.device} "
                    f"({part.split_bytes:,} B) and its own headroom less the other stages' parts ({own}): "
                    f"{part.binding}")
            headroom = worker.headroom.model_copy(update={"bytes": part.room_bytes, "source": text})
            placed.append(worker.model_copy(update={
                "headroom": headroom,
                "safe_max_num_seqs": safe_max_num_seqs(part.room_bytes, worker.uncharged_fixed_bytes,
                                                       worker.per_seq_bytes),
            }))
        return placed
