"""What an engine does with model-local KV at startup, in the flow's order.

The vLLM glue gathers what only vLLM can give and applies what comes back;
everything between is here, as three calls:

* :func:`budget_loaded_model`, in every worker: settings -> collect ->
  override -> sample -> budget, returned as a :class:`WorkerResult`'s JSON
  (it crosses a process boundary, vLLM's ``collective_rpc``), which
  :func:`checked_results` reads back;
* :func:`plan_startup`, in the engine core, with every worker's result:
  failures and overrides checked -> the device ledger (and, in a vLLM-Omni
  stage, its deployment's record: :class:`DeploymentPlanning`) -> the plan
  -> the report (the log table, the report file). The glue then applies the
  plan: the cap on ``scheduler_config``, then live sampling.
* :func:`final_deployment_plan`, in a stage that planned before the others
  on its devices: once they have recorded, the plan under the final split,
  for the glue to apply before the first request.

Policy ``reserve`` uses the same worker call without sampling, then
:func:`record_in_ledger` and :func:`report_reserve` for its own plan
(:mod:`kv_budget.plan.reserve`, applied by the glue's pool hook).

Every refusal is one of three exceptions whose message says what to do.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from kv_budget.collect.model import collect_model_local_kv_specs
from kv_budget.collect.supplied import SuppliedDeclarationsError, supplied_collection, with_supplied
from kv_budget.deployment import DeploymentPlanning, StageSplit
from kv_budget.errors import KvBudgetError, ModelLocalKVInfeasibleError
from kv_budget.ledger import LedgerSession, default_ledger_dir, open_ledger
from kv_budget.log import logger
from kv_budget.override import (
    OverrideError,
    apply_overrides,
    declaration_label,
    overrides_for_stage,
    parse_overrides,
    unmatched_message,
)
from kv_budget.plan.planner import (
    Decision,
    Headroom,
    LedgerLine,
    Plan,
    ReservationLine,
    WorkerBudget,
    budget_worker,
    headroom_from_free,
    headroom_override,
    make_plan,
    shared_budget,
)
from kv_budget.plan.reserve import ReservePlan
from kv_budget.report import (
    infeasible_message,
    render_plan_table,
    render_reserve_table,
    render_split,
    report_file,
    write_report,
)
from kv_budget.sample.device import MemorySamplingError, device_identity, sample_memory
from kv_budget.settings import LEDGER_OFF, ModelLocalKVSettings, Policy
from kv_budget.stage import Stage


__all__ = [
    "NO_HEADROOM_UNDER_RESERVE",
    "EngineContext",
    "WorkerProblem",
    "WorkerResult",
    "worker_result",
    "ModelLocalKVInfeasibleError",
    "ModelLocalKVOverrideError",
    "ModelLocalKVPlanningError",
    "budget_loaded_model",
    "checked_results",
    "unmatched_on_every_worker",
    "engine_label",
    "final_deployment_plan",
    "ledger_directory",
    "plan_startup",
    "record_in_ledger",
    "report_reserve",
]


class ModelLocalKVPlanningError(ModelLocalKVInfeasibleError):
    """A worker failed while collecting or budgeting (not a declarer: those
    are recorded and planned around). Under ``cap`` and ``reserve`` the
    engine refuses in one line naming the rank and the error, rather than
    end in the RPC's traceback."""

    def __init__(self, failures: list[str], policy: Policy) -> None:
        self.failures = failures
        super().__init__(f"kv-budget could not plan model-local KV ({'; '.join(failures)}); "
                         f"policy {policy.value} refuses to start without a plan")


class ModelLocalKVOverrideError(KvBudgetError, ValueError):
    """An operator override matches no declaration on any worker (of its
    stage, when it names one), or makes a declaration invalid; or supplied
    declarations cannot be read or clash with the model's. Raised under
    every policy: a correction that silently does nothing leaves the figure
    it was meant to fix."""


NO_HEADROOM_UNDER_RESERVE = "not sampled: policy reserve takes model-local KV out of the paged pool"


# --- in every worker ----------------------------------------------------------

class WorkerProblem(BaseModel):
    """Why a worker has no budget; ``kind`` decides the engine core's answer."""

    kind: Literal["sampling", "override", "failure"]
    """``sampling``: the device could not be measured (under ``cap`` a refusal
    naming ``--model-local-kv-headroom``, under ``warn`` a warning);
    ``override``: an override or supplied declarations are invalid (refused
    under every policy); ``failure``: anything else (refused)."""

    message: str


class WorkerResult(BaseModel):
    """One worker's answer to :func:`budget_loaded_model`."""

    rank: int
    budget: WorkerBudget | None = None
    """None where ``problem`` says why."""
    problem: WorkerProblem | None = None
    declarations: list[str] = []
    """Every declaration collected, ``owner/name``: what an unmatched override's message lists."""
    overrides: list[str] = []
    """The operator's overrides that apply here (its stage's and unqualified ones), as given."""
    unmatched_overrides: list[str] = []
    device: str | None = None
    """The device's identity for the ledger; None with the ledger off."""
    seconds: float = 0.0


def worker_result(rank: int, failure: str | None = None) -> dict:
    """The wire form of a worker's answer with no budget: with ``failure``,
    a refusal :func:`checked_results` names."""
    problem = WorkerProblem(kind="failure", message=failure) if failure else None
    return WorkerResult(rank=rank, problem=problem).model_dump(mode="json")


def budget_loaded_model(
    model: Any, rank: int, device: tuple[str, int], settings: dict, configured_max_num_seqs: int, sharers: int,
    sample: bool = True, stage_id: int | None = None,
) -> dict:
    """Collect the loaded model's declarations and the operator's supplied
    ones, apply the operator's overrides (those for vLLM-Omni stage
    ``stage_id``; None: a plain vLLM engine), sample the worker's device
    (unless ``sample`` is False: ``reserve`` needs no headroom), and budget
    it. Returns a :class:`WorkerResult`'s JSON; a problem is its
    ``problem``, for :func:`checked_results` and :func:`plan_startup` to
    raise with every rank's figures in hand; this never raises."""
    start = time.perf_counter()
    result = WorkerResult(rank=rank)
    try:
        config = ModelLocalKVSettings.model_validate(settings)
        collection = collect_model_local_kv_specs(model)
        if config.declarations:
            collection = with_supplied(collection, supplied_collection(config.declarations))
        result.declarations = [declaration_label(owned.owner, owned.spec.name) for owned in collection.specs]
        overrides = overrides_for_stage(parse_overrides(config.overrides), stage_id)
        collection, unmatched = apply_overrides(collection, overrides)
        result.overrides = [o.text for o in overrides]
        result.unmatched_overrides = [o.text for o in unmatched]
        headroom = _worker_headroom(rank, device, config, sharers) if sample else headroom_override(
            0, NO_HEADROOM_UNDER_RESERVE)
        if config.ledger_dir != LEDGER_OFF:
            result.device = device_identity(*device)
        result.budget = budget_worker(collection, headroom, rank=rank, max_num_seqs=configured_max_num_seqs)
    except (OverrideError, SuppliedDeclarationsError) as exc:
        result.problem = WorkerProblem(kind="override", message=str(exc))
    except MemorySamplingError as exc:
        result.problem = WorkerProblem(kind="sampling", message=str(exc))
    except Exception as exc:  # noqa: BLE001 - reported to the engine core, which refuses in one line
        result.problem = WorkerProblem(kind="failure", message=f"{type(exc).__name__}: {exc}")
    result.seconds = time.perf_counter() - start
    return result.model_dump(mode="json")


def _worker_headroom(rank: int, device: tuple[str, int], config: ModelLocalKVSettings, sharers: int) -> Headroom:
    """The operator's headroom, or this worker's device sampled now."""
    if config.headroom_bytes is not None:
        return headroom_override(config.headroom_bytes, "--model-local-kv-headroom (operator override, per worker)")
    sample = sample_memory(*device)
    return headroom_from_free(sample.free_bytes, sample.total_bytes, sample.source, config.margin_bytes, sharers)


# --- in the engine core -------------------------------------------------------

def checked_results(answers: list[dict], policy: Policy, stage: Stage | None = None) -> list[WorkerResult]:
    """Every worker's result (its wire form read back), or the refusal it calls for: a worker that
    failed (:class:`ModelLocalKVPlanningError`), an override that made a
    declaration invalid on some rank or matched no declaration on any rank
    (:class:`ModelLocalKVOverrideError`; tensor-parallel ranks may declare
    differently, so an override for the last rank's postnet is fine).

    In vLLM-Omni ``stage``, an override that names this stage and matches
    nothing is refused here; an unqualified one is the deployment's to
    judge (another stage may have the declaration): logged, and left in
    ``unmatched_overrides`` for the driver's check across stages."""
    results = [WorkerResult.model_validate(answer) for answer in answers]
    failures = [f"rank {r.rank}: {r.problem.message}" for r in results if r.problem and r.problem.kind == "failure"]
    if failures:
        raise ModelLocalKVPlanningError(failures, policy)
    for result in results:
        if result.problem and result.problem.kind == "override":
            raise ModelLocalKVOverrideError(f"rank {result.rank}: {result.problem.message}")
    texts = unmatched_on_every_worker(results)
    refused = [o for o in parse_overrides(texts) if stage is None or o.stage is not None]
    available = [label for r in results for label in r.declarations]
    if refused:
        where = "" if stage is None else f"{stage.label()}: "
        raise ModelLocalKVOverrideError(where + unmatched_message(refused, available))
    if texts:
        logger.info("override(s) %s match no declaration in %s (declarations: %s); they apply in the "
                    "stages that have them, and the deployment stops if no stage does",
                    ", ".join(map(repr, texts)), stage.label(), ", ".join(sorted(set(available))) or "none")
    return results


def unmatched_on_every_worker(results: list[WorkerResult]) -> list[str]:
    """The overrides that matched a declaration on no worker, in order."""
    nowhere = set.intersection(*(set(r.unmatched_overrides) for r in results))
    return [text for text in results[0].unmatched_overrides if text in nowhere]


@dataclass(frozen=True)
class EngineContext:
    """What the startup flow knows of the engine it plans for, passed as one
    through the plan, the deployment's final split and the report."""

    settings: ModelLocalKVSettings
    configured_max_num_seqs: int
    label: str
    """Its name in the device ledger (:func:`engine_label`)."""
    vllm_figures: dict
    """The vLLM it runs on (version, distribution, support), for the log and the report."""
    stage: Stage | None = None
    """Its vLLM-Omni stage; None in plain vLLM."""


def plan_startup(results: list[WorkerResult], engine: EngineContext, started: float,
                 deployment: DeploymentPlanning | None = None) -> Plan | None:
    """Plan from every worker's :func:`checked_results`: against the device
    ledger (and ``deployment``'s split, in a vLLM-Omni stage), the minimum
    over workers, logged as a table with its timing (from ``started``, a
    ``perf_counter`` reading) and written to the report file
    (:func:`report_file`, with ``stage``). Raises
    :class:`ModelLocalKVInfeasibleError` when nothing fits under ``cap``,
    or when a device could not be measured under ``cap``; under ``warn`` the
    latter logs and returns None."""
    settings, configured, label, stage = engine.settings, engine.configured_max_num_seqs, engine.label, engine.stage
    vllm_figures = engine.vllm_figures
    errors = [f"rank {r.rank}: {r.problem.message}" for r in results if r.problem and r.problem.kind == "sampling"]
    if errors:
        message = (
            "kv-budget could not measure device memory (" + "; ".join(errors) + "); "
            "pass --model-local-kv-headroom SIZE to plan against an explicit headroom"
        )
        if settings.policy is Policy.CAP:
            raise ModelLocalKVInfeasibleError(message)
        logger.warning("%s; policy warn: max_num_seqs left at %d", message, configured)
        return None
    workers = [r.budget for r in results]
    devices = [r.device for r in results]
    plan = _plan_on_shared_devices(workers, devices, settings, configured, label, deployment)
    seconds = time.perf_counter() - started
    split = deployment.split if deployment is not None else None
    if any(worker.declarations or worker.failures for worker in plan.workers):
        _log_vllm(vllm_figures)
        for line in render_plan_table(plan).splitlines():
            logger.info("%s", line)
        if split is not None:
            for line in render_split(split, plan.effective_max_num_seqs).splitlines():
                logger.info("%s", line)
        logger.info("collect + sample + plan took %.3f s over %d worker(s)", seconds, len(workers))
    else:
        # One line: in a deployment of many stages most declare nothing.
        logger.info("the model declares no model-local KV: nothing to plan, max_num_seqs %d stays "
                    "(%.3f s over %d worker(s))", configured, seconds, len(workers))
    if settings.report_path:
        write_report(report_file(settings, stage), {**plan.model_dump(mode="json"), "plugin_seconds": seconds,
                                                    "worker_seconds": [r.seconds for r in results],
                                                    "deployment": _split_json(split)},
                     vllm_figures, stage)
    if plan.decision is Decision.INFEASIBLE:
        raise ModelLocalKVInfeasibleError(infeasible_message(plan))
    if deployment is not None:
        deployment.devices = devices
        deployment.ledger = plan.ledger
    return plan


def _split_json(split: StageSplit | None) -> dict | None:
    return None if split is None else split.model_dump(mode="json")


def final_deployment_plan(deployment: DeploymentPlanning, engine: EngineContext) -> Plan | None:
    """The plan under ``deployment``'s final split, once every stage on its
    devices has recorded; None while some have not. It is logged, recorded
    in the device ledger in place of the provisional one, and written to
    the report file; under ``cap`` the glue lowers the live limit to it
    before the first request."""
    workers = deployment.final()
    if workers is None:
        return None
    settings, label, vllm_figures = engine.settings, engine.label, engine.vllm_figures
    plan = make_plan(workers, engine.configured_max_num_seqs, settings.policy)
    if settings.ledger_dir != LEDGER_OFF and plan.decision is not Decision.INFEASIBLE:
        keys = [device or "" for device in deployment.devices]
        with open_ledger(ledger_directory(settings), keys, settings.ledger_shared) as ledger:
            recorded = _record_peaks(ledger, workers, keys, plan.effective_max_num_seqs, label)
        others = deployment.ledger.others if deployment.ledger is not None else []
        plan = plan.model_copy(update={"ledger": LedgerLine(directory=str(ledger_directory(settings)),
                                                            others=others, recorded=recorded)})
    for line in render_split(deployment.split, plan.effective_max_num_seqs).splitlines():
        logger.info("%s", line)
    if settings.report_path:
        write_report(report_file(settings, deployment.stage),
                     {**plan.model_dump(mode="json"), "deployment": _split_json(deployment.split)},
                     vllm_figures, deployment.stage)
    return plan


def report_reserve(plan: ReservePlan, binding: WorkerBudget, settings: ModelLocalKVSettings, seconds: float,
                   vllm_figures: dict, stage: Stage | None = None) -> None:
    """Policy ``reserve``'s plan in the log (a table, with its timing) and
    in the report file, in the fields a ``cap`` report has."""
    _log_vllm(vllm_figures)
    for line in render_reserve_table(plan, binding).splitlines():
        logger.info("%s", line)
    logger.info("collect + reserve took %.3f s over %d worker(s)", seconds, len(plan.reservations))
    if not settings.report_path:
        return
    report = {
        "policy": Policy.RESERVE.value,
        "decision": "reserved" if plan.feasible else "infeasible",
        "configured_max_num_seqs": plan.max_num_seqs,
        "effective_max_num_seqs": plan.max_num_seqs,
        "charged_bytes": binding.charged_bytes,
        "uncharged_fixed_bytes": binding.uncharged_fixed_bytes,
        "per_seq_bytes": binding.per_seq_bytes,
        "predicted_peak_bytes": plan.reserved_bytes,
        "declarations": [line.model_dump(mode="json") for line in binding.declarations],
        "failures": [failure.model_dump(mode="json") for failure in binding.failures],
        **plan.model_dump(mode="json"),
        "plugin_seconds": seconds,
    }
    write_report(report_file(settings, stage), report, vllm_figures, stage)


def _log_vllm(vllm_figures: dict) -> None:
    logger.info("vLLM %s (%s, support: %s)", vllm_figures["vllm_version"],
                vllm_figures["vllm_distribution"], vllm_figures["vllm_support"])


def engine_label(pid: int, model: str, stage: Stage | None = None) -> str:
    """How an engine is named in the device ledger."""
    return f"pid {pid}: model {model}" + (f", {stage.label()}" if stage is not None else "")


def ledger_directory(settings: ModelLocalKVSettings) -> Path:
    return Path(settings.ledger_dir) if settings.ledger_dir else default_ledger_dir()


def _plan_on_shared_devices(
    workers: list[WorkerBudget], devices: list[str | None], settings: ModelLocalKVSettings, configured: int,
    label: str, deployment: DeploymentPlanning | None = None,
) -> Plan:
    """Plan against the device ledger: under its lock, take off each
    worker's headroom what other live engines reserved on its device (and
    cap it at the operator's share), plan, and record this engine's
    predicted peak per device, so an engine that plans later cannot count
    the same bytes. Workers that share one device (the CPU build's host)
    split the others' reservations and the share between them, as they
    split the headroom. In a vLLM-Omni deployment the other stages of it
    are not "other engines": the deployment's split counts them
    (:class:`DeploymentPlanning`), still under the ledger's lock. With the
    ledger off, only the share and the split apply."""
    if settings.ledger_dir == LEDGER_OFF:
        if settings.share_bytes is not None:
            workers = [shared_budget(w, 0, "", settings.share_bytes) for w in workers]
        if deployment is not None:
            workers = deployment.plan_against(workers, settings, configured)
        return make_plan(workers, configured, settings.policy)
    directory = ledger_directory(settings)
    keys = [device or "" for device in devices]
    per_device = Counter(keys)
    with open_ledger(directory, keys, settings.ledger_shared) as ledger:
        same_deployment = deployment.pids() if deployment is not None else set()
        others_of = {device: [o for o in ledger.others(device) if o.pid not in same_deployment]
                     for device in per_device}
        shared = []
        for worker, device in zip(workers, keys):
            others = others_of[device]
            named = ", ".join(f"{o.engine}: {o.reserved_bytes:,} B" for o in others)
            share = None if settings.share_bytes is None else settings.share_bytes // per_device[device]
            taken = sum(o.reserved_bytes for o in others) // per_device[device]
            shared.append(shared_budget(worker, taken, named, share))
        if deployment is not None:
            shared = deployment.plan_against(shared, settings, configured)
        plan = make_plan(shared, configured, settings.policy)
        others_lines = [
            ReservationLine(device=o.device, engine=o.engine, pid=o.pid, reserved_bytes=o.reserved_bytes)
            for device in per_device for o in others_of[device]
        ]
        recorded = []
        if plan.decision is not Decision.INFEASIBLE:
            recorded = _record_peaks(ledger, shared, keys, plan.effective_max_num_seqs, label)
    return plan.model_copy(
        update={"ledger": LedgerLine(directory=str(directory), others=others_lines, recorded=recorded)}
    )


def _record_peaks(ledger: LedgerSession, workers: list[WorkerBudget], keys: list[str], max_num_seqs: int,
                  label: str) -> list[ReservationLine]:
    """Record this engine's predicted peak per device (fixed + per sequence
    x ``max_num_seqs`` of the workers on it), in the order the workers name
    their devices."""
    recorded = []
    for device in dict.fromkeys(keys):
        peak = sum(w.uncharged_fixed_bytes + w.per_seq_bytes * max_num_seqs
                   for w, key in zip(workers, keys) if key == device)
        mine = ledger.record(device, label, peak)
        recorded.append(ReservationLine(device=device, engine=label, pid=mine.pid, reserved_bytes=peak))
    return recorded


def record_in_ledger(settings: ModelLocalKVSettings, devices: list[str | None], reserved: list[int],
                     label: str) -> None:
    """Record bytes this engine will hold per device (policy ``reserve``:
    other engines on the device sample free memory that does not hold them
    yet), as ``cap`` records its predicted peak."""
    if settings.ledger_dir == LEDGER_OFF:
        return
    by_device: dict[str, int] = {}
    for device, size in zip(devices, reserved):
        by_device[device or ""] = by_device.get(device or "", 0) + size
    with open_ledger(ledger_directory(settings), list(by_device), settings.ledger_shared) as ledger:
        for device, size in by_device.items():
            ledger.record(device, label, size)
