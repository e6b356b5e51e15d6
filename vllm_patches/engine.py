"""What an engine knows about itself: which vLLM-Omni stage it is (if any),
its log prefix, how its ``max_num_seqs`` is lowered, and whether vLLM
sized its paged pool without profiling.

Every hook (startup, pool, live, the frontend's copy of the limit, the
vLLM-Omni driver's copies) needs these, so they sit below all of them: a
hook imports this module, never another hook for them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, TypeVar

from kv_budget.log import label_stage
from kv_budget.stage import Stage
from kv_budget.units import GiB
from vllm_patches.compat import checked_vllm

__all__ = ["REPLICA_ENV", "CPU_POOL_ENV", "SCALE_UP_ENV", "STATE_ATTRIBUTE", "attached_state", "existing_state",
           "lower_max_num_seqs", "prefix_stage_logs", "stage_of", "UnprofiledPool", "unprofiled_pool"]

REPLICA_ENV = "VLLM_OMNI_REPLICA_ID"
"""Set by vLLM-Omni in each stage replica's engine-core process."""

CPU_POOL_ENV = "VLLM_CPU_KVCACHE_SPACE"
"""GiB; vLLM's CPU platform copies it into ``cache_config.kv_cache_memory_bytes``, over the flag."""

SCALE_UP_ENV = "VLLM_ELASTIC_EP_SCALE_UP_LAUNCH"
"""Set on an engine core vLLM launches to join a running elastic-EP deployment."""

STATE_ATTRIBUTE = "_kv_budget"
"""The one attribute kv-budget sets on a vLLM or vLLM-Omni object (an engine core, a worker, a scheduler
config, a stage config): its typed state there. State on the object, not in a module dict keyed by
``id()``: it goes where the object goes (a deep copy carries it) and dies with it."""

State = TypeVar("State")


def attached_state(owner: Any, state_type: type[State]) -> State:
    """kv-budget's ``state_type`` on ``owner``, created on first use. One
    typed object per vLLM object, so a reader of a hook sees every field
    kv-budget keeps there in one class."""
    state = getattr(owner, STATE_ATTRIBUTE, None)
    if state is None:
        state = state_type()
        setattr(owner, STATE_ATTRIBUTE, state)
    return _checked(owner, state, state_type)


def existing_state(owner: Any, state_type: type[State]) -> State | None:
    """kv-budget's ``state_type`` on ``owner`` where a hook attached one,
    else None: a read that leaves objects kv-budget never touched as they
    are."""
    state = getattr(owner, STATE_ATTRIBUTE, None)
    return None if state is None else _checked(owner, state, state_type)


def _checked(owner: Any, state: Any, state_type: type[State]) -> State:
    if not isinstance(state, state_type):
        raise TypeError(f"{type(owner).__name__}.{STATE_ATTRIBUTE} holds a {type(state).__name__}, "
                        f"not kv-budget's {state_type.__name__}")
    return state


def stage_of(vllm_config: Any) -> Stage | None:
    """The vLLM-Omni stage this engine is (its model config's ``stage_id``,
    the replica from :data:`REPLICA_ENV`); None in plain vLLM, whose model
    config has no stage id."""
    stage_id = getattr(vllm_config.model_config, "stage_id", None)
    if stage_id is None:
        return None
    return Stage(stage_id=int(stage_id), replica=int(os.environ.get(REPLICA_ENV) or 0))


def prefix_stage_logs(stage: Stage | None) -> None:
    """Put ``[stage S replica R]`` before every kv-budget line of this
    process (:func:`kv_budget.log.label_stage`) where it is a stage engine
    core: the stages of one deployment log into one stream."""
    if stage is not None:
        label_stage(stage.label())


def lower_max_num_seqs(scheduler_config: Any, limit: int) -> list[str]:
    """Lower ``max_num_seqs`` to ``limit``, and ``max_num_active_seqs``
    where the vLLM has it and it is larger (vLLM checks
    ``max_num_active_seqs <= max_num_seqs`` only when the config is built);
    never raise either. Returns what changed, as ``"field old -> new"``,
    empty when nothing did. The engine core's cap and the frontend's copy
    of it both go through here."""
    current = scheduler_config.max_num_seqs
    if limit >= current:
        return []
    scheduler_config.max_num_seqs = limit
    applied = [f"max_num_seqs {current} -> {limit}"]
    if checked_vllm().features.max_num_active_seqs:
        active = scheduler_config.max_num_active_seqs
        if active is not None and active > limit:
            scheduler_config.max_num_active_seqs = limit
            applied.append(f"max_num_active_seqs {active} -> {limit}")
    return applied


@dataclass(frozen=True)
class UnprofiledPool:
    """How vLLM sized an engine's paged pool without profiling its memory.
    kv-budget measures the headroom after the pool is allocated on every
    path, so ``cap`` plans the same; ``reserve`` takes its bytes out of the
    figure vLLM hands the executor, and on one path it hands none."""

    why: str
    """In words, for the log and the plan's pool source."""
    asks_executor: bool
    """Whether vLLM still asks the executor for the pool figure (a pinned
    size: it returns that size, and ``reserve`` carves it); the elastic-EP
    scale-up launch does not (``EngineCore`` reuses the running ranks' figure)."""


def unprofiled_pool(vllm_config: Any) -> UnprofiledPool | None:
    """How vLLM sized this engine's pool without profiling; None where it profiled."""
    import vllm.envs

    if getattr(vllm.envs, SCALE_UP_ENV, False):  # vLLM's own parse of it, as EngineCore reads it
        return UnprofiledPool(f"the elastic-EP scale-up launch ({SCALE_UP_ENV}) reuses the running ranks' pool "
                              "figure", asks_executor=False)
    pinned = getattr(vllm_config.cache_config, "kv_cache_memory_bytes", None)
    if not pinned:
        return None
    space = os.environ.get(CPU_POOL_ENV, "")
    by = CPU_POOL_ENV if space.isdigit() and int(space) * GiB == pinned else "--kv-cache-memory-bytes"
    return UnprofiledPool(f"pinned at {pinned:,} B by {by}", asks_executor=True)
