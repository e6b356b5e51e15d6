"""The startup hook: plan model-local KV after the paged KV pool exists.

``EngineCore.__init__`` builds the executor (workers load the model), then
``_initialize_kv_caches`` (profile, allocate the paged KV pool, warm up or
capture CUDA graphs), then the Scheduler from ``scheduler_config``. The hook
runs when ``_initialize_kv_caches`` returns: everything startup made
resident is out of the device's free memory, and a lower ``max_num_seqs``
set now is the one the Scheduler is built with. Lowering it only in the
engine core is safe: workers were sized for the larger value. Raising it is
not, and the planner never does.

Engines sharing a device plan against the device ledger
(:mod:`kv_budget.ledger`): under its lock, what the other live engines
reserved comes off the headroom, and this engine records its predicted peak.

The patch is on ``EngineCore`` (which ``EngineCoreProc`` and
``DPEngineCoreProc`` inherit), not on a worker class: the CPU worker
overrides ``determine_available_memory``, and the engine level covers both.

What the hook relies on is checked twice. Before patching, by
``compat.check_vllm`` (the call order in ``EngineCore.__init__``, the
signatures). While the engine starts, here: no Scheduler exists yet when the
hook runs, the configured Scheduler class is vLLM's ``Scheduler`` or a
subclass, and the Scheduler, once built, runs with the capped value (the
patched ``Scheduler.__init__``). Where one does not hold, a capping engine
refuses to start rather than report a cap that does nothing.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

from kv_budget.collect import collect_model_local_kv_specs
from kv_budget.ledger import default_ledger_dir, open_ledger
from kv_budget.override import OverrideError, apply_overrides, declaration_label, parse_overrides, unmatched_message
from kv_budget.plan.planner import (
    Decision,
    Headroom,
    LedgerLine,
    Plan,
    Policy,
    ReservationLine,
    WorkerBudget,
    budget_worker,
    headroom_from_free,
    headroom_override,
    make_plan,
    shared_budget,
)
from kv_budget.report import infeasible_message, render_plan_table, summary_line
from kv_budget.sample.device import MemorySamplingError, device_identity, sample_memory
from kv_budget.settings import LEDGER_OFF, ModelLocalKVSettings, settings_from_additional_config
from kv_budget.vllm.compat import (
    UnsupportedVllmError,
    checked_vllm,
    require_no_scheduler_yet,
    scheduler_cap_problem,
    scheduler_class_problem,
)
from kv_budget.vllm.live_hook import start_live
from kv_budget.vllm.patching import patch_method

logger = logging.getLogger("vllm.kv_budget")


class ModelLocalKVInfeasibleError(RuntimeError):
    """Under ``cap``, not even one sequence's model-local KV fits: the
    engine refuses to start rather than fail on the first requests."""


class ModelLocalKVPlanningError(ModelLocalKVInfeasibleError):
    """A worker failed while collecting or budgeting (not a declarer: those
    are recorded and planned around). Under ``cap`` and ``reserve`` the
    engine refuses in one line naming the rank and the error, rather than
    end in the RPC's traceback."""

    def __init__(self, failures: list[str], policy: Policy) -> None:
        self.failures = failures
        super().__init__(f"kv-budget could not plan model-local KV ({'; '.join(failures)}); "
                         f"policy {policy.value} refuses to start without a plan")


class ModelLocalKVOverrideError(ValueError):
    """An operator override matches no declaration on any worker, or makes
    a declaration invalid. Raised under every policy: a correction that
    silently does nothing leaves the figure it was meant to fix."""


NO_HEADROOM_UNDER_RESERVE = "not sampled: policy reserve takes model-local KV out of the paged pool"


def budget_on_worker(
    worker: Any, settings: dict, configured_max_num_seqs: int, sharers: int, sample: bool = True,
) -> dict:
    """Runs in every worker (``collective_rpc``): collect the loaded model's
    declarations, apply the operator's overrides, sample this worker's
    device (unless ``sample`` is False: ``reserve`` needs no headroom), and
    budget it. Returns plain JSON data (it crosses a process boundary); a
    problem is reported in ``error`` / ``override_error`` for the engine
    core to raise, with every rank's figures in hand."""
    start = time.perf_counter()
    result: dict[str, Any] = {
        "rank": worker.rank,
        "budget": None,
        "error": None,
        "override_error": None,
        "failure": None,
        "declarations": [],
        "unmatched_overrides": [],
    }
    try:
        config = ModelLocalKVSettings.model_validate(settings)
        collection = collect_model_local_kv_specs(worker.model_runner.model)
        result["declarations"] = [declaration_label(owned.owner, owned.spec.name) for owned in collection.specs]
        collection, unmatched = apply_overrides(collection, parse_overrides(config.overrides))
        result["unmatched_overrides"] = [o.text for o in unmatched]
        headroom = _worker_headroom(worker, config, sharers) if sample else headroom_override(
            0, NO_HEADROOM_UNDER_RESERVE)
        if config.ledger_dir != LEDGER_OFF:
            result["device"] = device_identity(worker.device.type, worker.device.index or 0)
        budget = budget_worker(collection, headroom, rank=worker.rank, max_num_seqs=configured_max_num_seqs)
        result["budget"] = budget.model_dump(mode="json")
    except OverrideError as exc:
        result["override_error"] = str(exc)
    except MemorySamplingError as exc:
        result["error"] = str(exc)
    except Exception as exc:  # noqa: BLE001 - reported to the engine core, which refuses in one line
        result["failure"] = f"{type(exc).__name__}: {exc}"
    result["seconds"] = time.perf_counter() - start
    return result


def _worker_headroom(worker: Any, config: ModelLocalKVSettings, sharers: int) -> Headroom:
    """The operator's headroom, or this worker's device sampled now."""
    if config.headroom_bytes is not None:
        return headroom_override(config.headroom_bytes, "--model-local-kv-headroom (operator override, per worker)")
    device = worker.device
    sample = sample_memory(device.type, device.index or 0)
    return headroom_from_free(sample.free_bytes, sample.total_bytes, sample.source, config.margin_bytes, sharers)


def _workers_sharing_memory(vllm_config: Any) -> int:
    """On vLLM's CPU build every worker allocates from the same host RAM;
    on a GPU each worker has its own device."""
    from vllm.platforms import current_platform

    return vllm_config.parallel_config.world_size if current_platform.is_cpu() else 1


def engine_label(vllm_config: Any) -> str:
    """How this engine is named in the device ledger."""
    return f"pid {os.getpid()}: model {vllm_config.model_config.model}"


def ledger_directory(settings: ModelLocalKVSettings) -> Path:
    return Path(settings.ledger_dir) if settings.ledger_dir else default_ledger_dir()


def log_vllm() -> None:
    vllm = checked_vllm()
    logger.info("kv-budget: vLLM %s (%s, support: %s)", vllm.version, vllm.distribution, vllm.support)


def write_report(path: str, report: dict) -> bool:
    """Write a startup report (``cap``/``warn`` or ``reserve``) with the vLLM
    it ran on; return whether it was written. A path that cannot be written
    logs one warning and the engine starts: the plan the report would hold
    is in the log already, and the protection does not depend on the file
    (failing the start over a report path took a protected server down)."""
    vllm = checked_vllm()
    report = {**report, "vllm_version": vllm.version, "vllm_distribution": vllm.distribution,
              "vllm_support": vllm.support}
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(report, indent=2))
    except OSError as exc:
        logger.warning("kv-budget: cannot write the startup plan to %s (%s: %s); the plan is in this log",
                       path, type(exc).__name__, exc)
        return False
    logger.info("kv-budget: startup plan written to %s", path)
    return True


def _write_report(path: str, plan: Plan, seconds: float, worker_seconds: list[float]) -> None:
    write_report(path, {**plan.model_dump(mode="json"), "plugin_seconds": seconds, "worker_seconds": worker_seconds})


def collect_budgets(core: Any, vllm_config: Any, settings: ModelLocalKVSettings, sample: bool = True) -> list[dict]:
    """Every worker's budget (``budget_on_worker``), overrides checked."""
    results = core.collective_rpc(
        budget_on_worker,
        args=(settings.model_dump(mode="json"), vllm_config.scheduler_config.max_num_seqs,
              _workers_sharing_memory(vllm_config), sample),
    )
    failures = [f"rank {r['rank']}: {r['failure']}" for r in results if r["failure"]]
    if failures:
        raise ModelLocalKVPlanningError(failures, settings.policy)
    _check_overrides(results)
    return results


def _check_overrides(results: list[dict]) -> None:
    """Refuse an override that made a declaration invalid on some rank, or
    that matched no declaration on any rank (tensor-parallel ranks may
    declare differently: an override for the last rank's postnet is fine)."""
    for result in results:
        if result["override_error"]:
            raise ModelLocalKVOverrideError(f"rank {result['rank']}: {result['override_error']}")
    nowhere = set.intersection(*(set(r["unmatched_overrides"]) for r in results))
    if nowhere:
        texts = [text for text in results[0]["unmatched_overrides"] if text in nowhere]
        available = [label for r in results for label in r["declarations"]]
        raise ModelLocalKVOverrideError(unmatched_message(parse_overrides(texts), available))


def _plan_on_shared_devices(
    workers: list[WorkerBudget], devices: list[str | None], settings: ModelLocalKVSettings, configured: int,
    label: str,
) -> Plan:
    """Plan against the device ledger: under its lock, take off each
    worker's headroom what other live engines reserved on its device (and
    cap it at the operator's share), plan, and record this engine's
    predicted peak per device, so an engine that plans later cannot count
    the same bytes. Workers that share one device (the CPU build's host)
    split the others' reservations and the share between them, as they
    split the headroom. With the ledger off, only the share applies."""
    if settings.ledger_dir == LEDGER_OFF:
        if settings.share_bytes is not None:
            workers = [shared_budget(w, 0, "", settings.share_bytes) for w in workers]
        return make_plan(workers, configured, settings.policy)
    directory = ledger_directory(settings)
    keys = [device or "" for device in devices]
    per_device = Counter(keys)
    with open_ledger(directory, keys) as ledger:
        shared = []
        for worker, device in zip(workers, keys):
            others = ledger.others(device)
            named = ", ".join(f"{o.engine}: {o.reserved_bytes:,} B" for o in others)
            share = None if settings.share_bytes is None else settings.share_bytes // per_device[device]
            taken = sum(o.reserved_bytes for o in others) // per_device[device]
            shared.append(shared_budget(worker, taken, named, share))
        plan = make_plan(shared, configured, settings.policy)
        others_lines = [
            ReservationLine(device=o.device, engine=o.engine, pid=o.pid, reserved_bytes=o.reserved_bytes)
            for device in per_device for o in ledger.others(device)
        ]
        recorded = []
        if plan.decision is not Decision.INFEASIBLE:
            for device in per_device:
                peak = sum(
                    w.uncharged_fixed_bytes + w.per_seq_bytes * plan.effective_max_num_seqs
                    for w, key in zip(shared, keys) if key == device
                )
                mine = ledger.record(device, label, peak)
                recorded.append(ReservationLine(device=device, engine=label, pid=mine.pid, reserved_bytes=peak))
    return plan.model_copy(
        update={"ledger": LedgerLine(directory=str(directory), others=others_lines, recorded=recorded)}
    )


def plan_after_kv_caches(core: Any, vllm_config: Any) -> Plan | None:
    """Collect, sample and plan on every worker, take the minimum, apply
    the policy. Returns the plan (None under ``off`` and ``reserve``)."""
    settings = settings_from_additional_config(vllm_config.additional_config)
    if settings.policy in (Policy.OFF, Policy.RESERVE):
        return None  # reserve acted on the pool already (pool_hook)
    require_no_scheduler_yet(core)
    scheduler_config = vllm_config.scheduler_config
    scheduler_problem = scheduler_class_problem(scheduler_config)
    if scheduler_problem and settings.policy is Policy.CAP:
        raise UnsupportedVllmError(f"kv-budget cannot cap this engine: {scheduler_problem}")
    if scheduler_problem:
        logger.warning("kv-budget: %s (policy warn: nothing is changed)", scheduler_problem)
    configured = scheduler_config.max_num_seqs
    start = time.perf_counter()
    try:
        results = collect_budgets(core, vllm_config, settings)
    except ModelLocalKVPlanningError as exc:
        if settings.policy is Policy.CAP:
            raise
        logger.warning("kv-budget could not plan model-local KV (%s); policy warn: the engine starts unprotected, "
                       "max_num_seqs left at %d", "; ".join(exc.failures), configured)
        return None
    errors = [f"rank {r['rank']}: {r['error']}" for r in results if r["error"]]
    if errors:
        message = (
            "kv-budget could not measure device memory (" + "; ".join(errors) + "); "
            "pass --model-local-kv-headroom SIZE to plan against an explicit headroom"
        )
        if settings.policy is Policy.CAP:
            raise ModelLocalKVInfeasibleError(message)
        logger.warning("%s; policy warn: max_num_seqs left at %d", message, configured)
        return None
    workers = [WorkerBudget.model_validate(r["budget"]) for r in results]
    plan = _plan_on_shared_devices(
        workers, [r.get("device") for r in results], settings, configured, engine_label(vllm_config))
    seconds = time.perf_counter() - start
    log_vllm()
    for line in render_plan_table(plan).splitlines():
        logger.info("%s", line)
    logger.info(
        "kv-budget: collect + sample + plan took %.3f s over %d worker(s)", seconds, len(workers)
    )
    if settings.report_path:
        _write_report(settings.report_path, plan, seconds, [r["seconds"] for r in results])
    if plan.decision is Decision.INFEASIBLE:
        raise ModelLocalKVInfeasibleError(infeasible_message(plan))
    if plan.decision is Decision.CAPPED:
        applied = [f"max_num_seqs {configured} -> {plan.effective_max_num_seqs}"]
        scheduler_config.max_num_seqs = plan.effective_max_num_seqs
        _caps_awaiting_scheduler[id(scheduler_config)] = plan.effective_max_num_seqs
        # vLLM checks max_num_active_seqs <= max_num_seqs only when the
        # config is built; keep it true for the Scheduler built next.
        active = scheduler_config.max_num_active_seqs if checked_vllm().features.max_num_active_seqs else None
        if active is not None and active > plan.effective_max_num_seqs:
            scheduler_config.max_num_active_seqs = plan.effective_max_num_seqs
            applied.append(f"max_num_active_seqs {active} -> {plan.effective_max_num_seqs}")
        logger.warning("%s", summary_line(plan))
        logger.info("kv-budget: scheduler_config %s", "; ".join(applied))
    elif plan.decision is Decision.WARNED:
        logger.warning("%s", summary_line(plan))
    start_live(core, vllm_config, plan, settings)
    return plan


def patch_engine_core(engine_core_cls) -> None:
    """Run :func:`plan_after_kv_caches` when ``_initialize_kv_caches``
    returns, before the Scheduler is built."""

    def wrap(original):
        def _initialize_kv_caches(self, vllm_config):
            kv_cache_config = original(self, vllm_config)
            plan_after_kv_caches(self, vllm_config)
            return kv_cache_config
        return _initialize_kv_caches

    patch_method(engine_core_cls, "_initialize_kv_caches", wrap)


_caps_awaiting_scheduler: dict[int, int] = {}
"""id(scheduler_config) -> the cap set on it, until the Scheduler built
from that config confirms it took the cap."""


def patch_scheduler(scheduler_cls) -> None:
    """Confirm, when ``Scheduler.__init__`` returns, that a Scheduler built
    from a capped config admits at most the cap. Subclasses
    (AsyncScheduler, vLLM-Omni's schedulers) reach it through ``super()``."""

    def wrap(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            cap = _caps_awaiting_scheduler.pop(id(self.scheduler_config), None)
            if cap is None:
                return
            problem = scheduler_cap_problem(type(self).__qualname__, self.max_num_running_reqs, cap)
            if problem:
                raise UnsupportedVllmError(f"kv-budget: {problem}")
            logger.info(
                "kv-budget: Scheduler built (class %s) with max_num_running_reqs %d, the cap",
                type(self).__qualname__, self.max_num_running_reqs,
            )
        return __init__

    patch_method(scheduler_cls, "__init__", wrap)


def patch_engine_config_validation(engine_args_cls) -> None:
    """Validate ``additional_config["model_local_kv"]`` where the config is
    built, in the process the user called: a bad value through
    ``LLM(additional_config=...)`` raises ValueError naming the key there,
    not later inside an engine-core process as "initialization failed"."""

    def wrap(original):
        def create_engine_config(self, *args, **kwargs):
            vllm_config = original(self, *args, **kwargs)
            settings_from_additional_config(vllm_config.additional_config)
            return vllm_config
        return create_engine_config

    patch_method(engine_args_cls, "create_engine_config", wrap)
