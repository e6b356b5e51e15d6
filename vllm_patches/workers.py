"""What the engine core asks of its workers and of vLLM, for both startup
hooks (``cap`` in :mod:`.startup_hook`, ``reserve`` in :mod:`.pool_hook`).

Every worker's budget comes through ``collective_rpc`` (checked by
``compat.check_vllm``: ``EngineCore.collective_rpc`` and
``Executor.collective_rpc`` take ``args``); the worker side unpacks its
model, rank and device and calls the core
(:func:`kv_budget.startup.budget_loaded_model`).

A worker running vLLM's Model Runner V2 first checks that its model is
where kv-budget reads it (``compat.model_runner_v2_problem``); where it is
not, the worker reports a failure instead of a budget, and the engine core
refuses under ``cap`` and ``reserve`` in one line naming what is missing
(``ModelLocalKVPlanningError``; ``warn`` logs it and starts unprotected),
rather than plan on a model that holds nothing.
"""

from __future__ import annotations

import os
from typing import Any

from kv_budget.log import logger
from kv_budget.settings import ModelLocalKVSettings
from kv_budget.startup import WorkerResult, budget_loaded_model, checked_results, engine_label, worker_result
from vllm_patches.compat import checked_vllm, model_runner_v2_problem, runs_model_runner_v2
from vllm_patches.engine import stage_of


def budget_on_worker(worker: Any, settings: dict, configured_max_num_seqs: int, sharers: int,
                     sample: bool = True, stage_id: int | None = None) -> dict:
    """Runs in every worker (``collective_rpc``):
    :func:`kv_budget.startup.budget_loaded_model` on its model and device,
    or, where the worker runs Model Runner V2 and its model is not at
    ``worker.model_runner.model``, a failure naming why."""
    problem = model_runner_v2_problem(worker)
    if problem is not None:
        return worker_result(worker.rank, problem)
    runner = getattr(worker, "model_runner", None)
    if runner is not None and runs_model_runner_v2(runner):
        logger.info("rank %d runs vLLM's Model Runner V2 (%s); planning on worker.model_runner.model (%s)",
                    worker.rank, type(runner).__qualname__, type(runner.model).__qualname__)
    device = worker.device
    return budget_loaded_model(worker.model_runner.model, worker.rank, (device.type, device.index or 0), settings,
                               configured_max_num_seqs, sharers, sample, stage_id)


def _workers_sharing_memory(vllm_config: Any) -> int:
    """On vLLM's CPU build every worker allocates from the same host RAM;
    on a GPU each worker has its own device."""
    from vllm.platforms import current_platform

    return vllm_config.parallel_config.world_size if current_platform.is_cpu() else 1


def vllm_figures() -> dict:
    """The vLLM a plan ran on, for its log line and report file."""
    vllm = checked_vllm()
    return {"vllm_version": vllm.version, "vllm_distribution": vllm.distribution, "vllm_support": vllm.support}


def this_engine(vllm_config: Any) -> str:
    """This engine's name in the device ledger (with its vLLM-Omni stage)."""
    return engine_label(os.getpid(), str(vllm_config.model_config.model), stage_of(vllm_config))


def collect_budgets(core: Any, vllm_config: Any, settings: ModelLocalKVSettings,
                    sample: bool = True) -> list[WorkerResult]:
    """Every worker's budget (``budget_on_worker``), failures and overrides checked."""
    stage = stage_of(vllm_config)
    results = core.collective_rpc(
        budget_on_worker,
        args=(settings.model_dump(mode="json"), vllm_config.scheduler_config.max_num_seqs,
              _workers_sharing_memory(vllm_config), sample, None if stage is None else stage.stage_id),
    )
    return checked_results(results, settings.policy, stage)
