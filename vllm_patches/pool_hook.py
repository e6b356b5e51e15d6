"""Policy ``reserve`` on the engine: model-local KV out of the paged pool.

``_initialize_kv_caches`` asks the executor for one memory figure per
worker (``Executor.determine_available_memory``: the profiled memory left
inside ``gpu_memory_utilization``, or ``kv_cache_memory_bytes`` when set;
vLLM-Omni's workers override the worker-side method, which this does not
touch), sizes the pool from it, then hands the pool's layout to the workers
(``Executor.initialize_from_config``). Two wrappers on vLLM's ``Executor``,
in the engine-core process, under ``reserve`` only:

* ``determine_available_memory``: every worker's budget is collected (the
  same RPC as ``cap``, without sampling a headroom), each worker's
  model-local KV at the configured ``max_num_seqs`` comes off its figure
  (:func:`kv_budget.plan.reserve.reserve_out_of_pool`), and a pool left too
  small for one ``max_model_len`` sequence refuses to start, naming both
  figures. ``max_num_seqs`` is never touched.
* ``initialize_from_config``: vLLM's own block count and bytes per block
  replace the prediction in the plan, which is logged and written; a
  difference from the prediction is logged, never hidden.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kv_budget.log import logger
from kv_budget.plan.planner import WorkerBudget
from kv_budget.plan.reserve import POOL_SOURCE, ReservePlan, plan_reserve, reserve_out_of_pool
from kv_budget.report import reserve_infeasible_message
from kv_budget.settings import ModelLocalKVSettings, Policy, settings_from_additional_config
from kv_budget.startup import ModelLocalKVInfeasibleError, record_in_ledger, report_reserve
from vllm_patches.engine import attached_state, prefix_stage_logs, stage_of, unprofiled_pool
from vllm_patches.patching import patch_method
from vllm_patches.workers import collect_budgets, this_engine, vllm_figures


@dataclass
class PendingReservation:
    """What ``reserve`` planned when vLLM asked for the pool figure, kept
    until vLLM allocates the pool and it is confirmed against vLLM's blocks."""

    plan: ReservePlan
    binding: WorkerBudget
    settings: ModelLocalKVSettings
    seconds: float
    workers: list[WorkerBudget]
    overrides: list[str]


@dataclass
class WatchedReservation:
    """What live monitoring of a ``reserve`` engine needs once the pool is allocated."""

    plan: ReservePlan
    """The reservation as confirmed against vLLM's blocks."""
    workers: list[WorkerBudget]
    overrides: list[str]
    """The operator's overrides that applied."""


@dataclass
class ExecutorState:
    """kv-budget's state on a vLLM executor (policy ``reserve``)."""

    reserved: bool = False
    """Whether the reservation came off this executor's pool figure (False
    when vLLM never sized a pool: the engine has no attention layer)."""
    pending: PendingReservation | None = None
    watched: WatchedReservation | None = None


def reservation_to_watch(executor: Any) -> WatchedReservation | None:
    """The confirmed reservation, the workers' budgets and the overrides
    applied, once vLLM has allocated the reduced pool; None before."""
    return attached_state(executor, ExecutorState).watched


def reserved_in_pool(executor: Any) -> bool:
    """Whether the reservation was taken out of this executor's pool."""
    return attached_state(executor, ExecutorState).reserved


def _kv_layer_figures(executor: Any, vllm_config: Any) -> list[tuple[int, int]]:
    """(bytes of one block across every KV layer, bytes one max_model_len
    sequence needs) per worker, from vLLM's own KV cache specs."""
    figures = []
    for specs in executor.get_kv_cache_specs():
        block = sum(spec.page_size_bytes for spec in specs.values())
        sequence = sum(spec.max_memory_usage_bytes(vllm_config) for spec in specs.values())
        figures.append((block, sequence))
    return figures


def reserve_in_pool(executor: Any, available: list[int], settings: ModelLocalKVSettings) -> list[int]:
    """Under ``reserve``: the pool figures less each worker's model-local KV.
    Raises :class:`ModelLocalKVInfeasibleError` when a pool left cannot hold
    one ``max_model_len`` sequence."""
    vllm_config = executor.vllm_config
    ignored = [flag for flag, value in (
        ("--model-local-kv-headroom", settings.headroom_bytes), ("--model-local-kv-margin", settings.margin_bytes),
        ("--model-local-kv-share", settings.share_bytes)) if value is not None]
    if ignored:
        logger.warning("%s bound a headroom outside the pool; policy reserve has none: ignored",
                       ", ".join(ignored))
    start = time.perf_counter()
    results = collect_budgets(executor, vllm_config, settings, sample=False)
    workers = [r.budget for r in results]
    configured = vllm_config.scheduler_config.max_num_seqs
    reservations = [
        reserve_out_of_pool(worker, configured, pool, block, sequence)
        for worker, pool, (block, sequence) in zip(workers, available, _kv_layer_figures(executor, vllm_config))
    ]
    unprofiled = unprofiled_pool(vllm_config)
    plan = plan_reserve(reservations, configured, vllm_config.model_config.max_model_len,
                        f"{POOL_SOURCE}, {unprofiled.why}" if unprofiled else POOL_SOURCE)
    binding = next(w for w in workers if w.rank == plan.binding_rank)
    if not plan.feasible:
        report_reserve(plan, binding, settings, time.perf_counter() - start, vllm_figures(), stage_of(vllm_config))
        raise ModelLocalKVInfeasibleError(reserve_infeasible_message(plan))
    if unprofiled:
        logger.warning("policy reserve takes %s B out of the paged pool %s: vLLM allocates %s B for it on "
                       "rank %d", f"{plan.reserved_bytes:,}", unprofiled.why, f"{plan.kv_pool_bytes_after:,}",
                       plan.binding_rank)
    record_in_ledger(settings, [r.device for r in results], [r.reserved_bytes for r in plan.reservations],
                     this_engine(vllm_config))
    state = attached_state(executor, ExecutorState)
    state.pending = PendingReservation(plan, binding, settings, time.perf_counter() - start, workers,
                                       results[0].overrides)
    state.reserved = True
    return [r.pool_bytes_after for r in plan.reservations]


def confirm_reservation(executor: Any, kv_cache_configs: list[Any]) -> None:
    """Replace the predicted blocks with vLLM's, then log and write the plan."""
    state = attached_state(executor, ExecutorState)
    pending, state.pending = state.pending, None
    if pending is None:
        return
    plan = pending.plan
    blocks_after = min(config.num_blocks for config in kv_cache_configs)
    block_bytes = [
        sum(t.size for t in config.kv_cache_tensors) // config.num_blocks for config in kv_cache_configs
    ]
    confirmed = plan_reserve(
        [r.model_copy(update={"block_bytes": b}) for r, b in zip(plan.reservations, block_bytes)],
        plan.max_num_seqs, plan.max_model_len, plan.pool_source,
    )
    if (confirmed.num_blocks_after, confirmed.num_blocks_before) != (plan.num_blocks_after, plan.num_blocks_before):
        logger.warning(
            "vLLM sized the pool at %d blocks of %d B; predicted from the layers' page sizes: "
            "%d blocks of %d B (before the reservation: %d vs %d)", blocks_after, block_bytes[0],
            plan.num_blocks_after, plan.reservations[0].block_bytes, confirmed.num_blocks_before,
            plan.num_blocks_before,
        )
    if confirmed.num_blocks_after != blocks_after:
        logger.warning(
            "vLLM allocated %d blocks, not the %d the reduced pool holds "
            "(num_gpu_blocks_override?)", blocks_after, confirmed.num_blocks_after,
        )
        confirmed = confirmed.model_copy(update={
            "num_blocks_after": blocks_after,
            "max_concurrency_at_max_model_len": blocks_after / confirmed.blocks_per_sequence,
        })
    report_reserve(confirmed, pending.binding, pending.settings, pending.seconds, vllm_figures(),
                   stage_of(executor.vllm_config))
    state.watched = WatchedReservation(confirmed, pending.workers, pending.overrides)


def patch_executor(executor_cls) -> None:
    """Wrap ``determine_available_memory`` and ``initialize_from_config``;
    both do nothing unless the policy is ``reserve``."""

    def wrap_available(original):
        def determine_available_memory(self):
            available = original(self)
            settings = settings_from_additional_config(self.vllm_config.additional_config)
            if settings.policy is not Policy.RESERVE:
                return available
            prefix_stage_logs(stage_of(self.vllm_config))  # reserve logs before the startup hook runs
            return reserve_in_pool(self, available, settings)
        return determine_available_memory

    def wrap_initialize(original):
        def initialize_from_config(self, kv_cache_configs):
            confirm_reservation(self, kv_cache_configs)
            return original(self, kv_cache_configs)
        return initialize_from_config

    patch_method(executor_cls, "determine_available_memory", wrap_available)
    patch_method(executor_cls, "initialize_from_config", wrap_initialize)
