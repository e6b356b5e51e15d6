"""The startup hook: plan model-local KV after the paged KV pool exists.

``EngineCore.__init__`` builds the executor (workers load the model), then
``_initialize_kv_caches`` (profile, allocate the paged KV pool, warm up or
capture CUDA graphs), then the Scheduler from ``scheduler_config``. The hook
runs when ``_initialize_kv_caches`` returns: everything startup made
resident is out of the device's free memory, and a lower ``max_num_seqs``
set now is the one the Scheduler is built with. Lowering it only in the
engine core is safe: workers were sized for the larger value. Raising it is
not, and the planner never does.

The core does the work between gathering and applying
(:mod:`kv_budget.startup`: budgets, the device ledger, the plan, the
report); this hook gathers every worker's budget through
``collective_rpc`` and applies the plan it returns.

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

import time
from dataclasses import dataclass
from typing import Any

from kv_budget.deployment import DeploymentPlanning
from kv_budget.log import logger
from kv_budget.plan.planner import Decision, Plan
from kv_budget.plan.reserve import watch_plan
from kv_budget.report import summary_line
from kv_budget.settings import ModelLocalKVSettings, Policy, settings_from_additional_config
from kv_budget.stage import Stage
from kv_budget.startup import (
    EngineContext,
    ModelLocalKVInfeasibleError,
    ModelLocalKVPlanningError,
    plan_startup,
    unmatched_on_every_worker,
)
from vllm_patches.compat import (
    UnsupportedVllmError,
    require_no_scheduler_yet,
    scheduler_cap_problem,
    scheduler_class_problem,
)
from vllm_patches.engine import (
    attached_state,
    existing_state,
    lower_max_num_seqs,
    prefix_stage_logs,
    stage_of,
    UnprofiledPool,
    unprofiled_pool,
)
from vllm_patches.live_hook import CoreState, LiveStart, PendingSplit, start_live
from vllm_patches.omni_chunks import count_parked_at_startup
from vllm_patches.patching import patch_method
from vllm_patches.pool_hook import reservation_to_watch, reserved_in_pool
from vllm_patches.workers import collect_budgets, this_engine, vllm_figures


def plan_after_kv_caches(core: Any, vllm_config: Any) -> Plan | None:
    """Collect, sample and plan on every worker (:mod:`kv_budget.startup`),
    then apply the plan. Returns it (None under ``off`` and ``reserve``)."""
    settings = settings_from_additional_config(vllm_config.additional_config)
    stage = stage_of(vllm_config)
    prefix_stage_logs(stage)
    if stage is None and settings.device_memory_bytes is not None:
        logger.warning("device_memory_bytes (--model-local-kv-device-memory) applies to vLLM-Omni "
                       "deployments only; this plain vLLM engine ignores it")
    if settings.policy is Policy.OFF:
        return None
    unprofiled = unprofiled_pool(vllm_config)
    if settings.policy is Policy.RESERVE:
        if not reserved_in_pool(core.model_executor):
            refuse_reserve_without_pool(core, vllm_config, settings, stage, unprofiled)
            return None
        watched = reservation_to_watch(core.model_executor)
        if watched is not None:  # reserve acted on the pool already (pool_hook); watch what it reserved
            plan = watch_plan(watched.plan, watched.workers)
            count_parked_at_startup(vllm_config, plan, stage)
            engine = _engine_context(vllm_config, settings, vllm_config.scheduler_config.max_num_seqs, stage)
            start_live(core, vllm_config, LiveStart(plan, engine, watched.overrides))
        return None
    require_no_scheduler_yet(core)
    scheduler_config = vllm_config.scheduler_config
    scheduler_problem = scheduler_class_problem(scheduler_config)
    if scheduler_problem and settings.policy is Policy.CAP:
        raise UnsupportedVllmError(f"kv-budget cannot cap this engine: {scheduler_problem}")
    if scheduler_problem:
        logger.warning("%s (policy warn: nothing is changed)", scheduler_problem)
    if unprofiled is not None:
        logger.info("vLLM did not profile this engine's memory (%s); the headroom is measured after its pool "
                    "was allocated, as on every path", unprofiled.why)
    configured = scheduler_config.max_num_seqs
    start = time.perf_counter()
    try:
        results = collect_budgets(core, vllm_config, settings)
    except ModelLocalKVPlanningError as exc:
        if settings.policy is Policy.CAP:
            raise
        logger.warning("could not plan model-local KV (%s); policy warn: the engine starts unprotected, "
                       "max_num_seqs left at %d", "; ".join(exc.failures), configured)
        return None
    deployment = DeploymentPlanning.of_this_process(stage)
    engine = _engine_context(vllm_config, settings, configured, stage)
    plan = plan_startup(results, engine, start, deployment)
    if plan is None:
        return None
    count_parked_at_startup(vllm_config, plan, stage)
    if plan.decision is Decision.CAPPED:
        _apply_cap(scheduler_config, plan)
    elif plan.decision is Decision.WARNED:
        logger.warning("%s", summary_line(plan))
    split = deployment.split if deployment is not None else None
    live = start_live(core, vllm_config,
                      LiveStart(plan, engine, results[0].overrides, unmatched_on_every_worker(results), deployment))
    if split is not None and not split.final:
        attached_state(core, CoreState).pending_split = PendingSplit(deployment, engine, live)
    return plan


def _engine_context(vllm_config: Any, settings: ModelLocalKVSettings, configured: int,
                    stage: Stage | None) -> EngineContext:
    """What the startup flow and live sampling know of this engine, gathered once."""
    return EngineContext(settings, configured, this_engine(vllm_config), vllm_figures(), stage)


def refuse_reserve_without_pool(core: Any, vllm_config: Any, settings: ModelLocalKVSettings, stage: Stage | None,
                                unprofiled: UnprofiledPool | None) -> None:
    """Policy ``reserve`` where vLLM never asked the executor for a pool
    figure, so the pool hook never ran: an engine without a paged KV pool
    (no attention layer), or the elastic-EP scale-up launch (``unprofiled``
    says so), which reuses the running ranks' figure. With declarations,
    refuse in one line: nothing can be taken out of a figure kv-budget is
    never handed, and switching policy in silence is a guess. With none,
    one line and nothing to do."""
    results = collect_budgets(core, vllm_config, settings, sample=False)
    who = stage.label() if stage is not None else "this engine"
    why = no_pool_figure(unprofiled)
    if not any(r.declarations for r in results):
        logger.info("%s declares no model-local KV and %s: policy reserve has nothing to do", who, why)
        return
    raise ModelLocalKVInfeasibleError(
        f"kv-budget: policy reserve cannot protect {who} (model {vllm_config.model_config.model}): {why} to take "
        f"its model-local KV ({', '.join(results[0].declarations)}) out of; use policy cap for it "
        "(--model-local-kv-policy cap, or in vLLM-Omni that stage's additional_config.model_local_kv.policy: cap), "
        "which measures the device after the pool is allocated"
    )


def no_pool_figure(unprofiled: UnprofiledPool | None) -> str:
    """Why the pool hook was never handed a pool figure: the elastic-EP
    scale-up launch where ``unprofiled`` says vLLM did not ask the
    executor, else an engine without a paged KV pool."""
    if unprofiled is not None and not unprofiled.asks_executor:
        return f"{unprofiled.why}, so vLLM never hands kv-budget a pool figure"
    return "it has no paged KV pool"


def _apply_cap(scheduler_config: Any, plan: Plan) -> None:
    """Lower the config to the plan's cap, for the Scheduler built next to confirm."""
    applied = lower_max_num_seqs(scheduler_config, plan.effective_max_num_seqs)
    attached_state(scheduler_config, CapAwaitingScheduler).cap = plan.effective_max_num_seqs
    logger.warning("%s", summary_line(plan))
    logger.info("scheduler_config %s", "; ".join(applied))


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


@dataclass
class CapAwaitingScheduler:
    """kv-budget's state on a scheduler config it lowered."""

    cap: int | None = None
    """The cap set on the config, until the Scheduler built from it confirms it took the cap."""


def patch_scheduler(scheduler_cls) -> None:
    """Confirm, when ``Scheduler.__init__`` returns, that a Scheduler built
    from a capped config admits at most the cap. Subclasses
    (AsyncScheduler, vLLM-Omni's schedulers) reach it through ``super()``."""

    def wrap(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            awaiting = existing_state(self.scheduler_config, CapAwaitingScheduler)
            if awaiting is None or awaiting.cap is None:
                return
            cap, awaiting.cap = awaiting.cap, None
            problem = scheduler_cap_problem(type(self).__qualname__, self.max_num_running_reqs, cap)
            if problem:
                raise UnsupportedVllmError(f"kv-budget: {problem}")
            logger.info(
                "Scheduler built (class %s) with max_num_running_reqs %d, the cap",
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
