"""vLLM-Omni async-chunk stages: a request parked between chunks still holds its caches.

With ``async_chunk`` on, a generation stage (Qwen3-TTS's code2wav) runs each
request one chunk at a time. Between chunks vLLM-Omni's chunk transfer
adapter takes the request out of the Scheduler's ``running`` list
(``waiting_for_chunk_running_requests``) until its next chunk arrives, and
``OmniGenerationScheduler`` admits new requests against ``len(running)``
alone, unless the stage's model config says ``retains_state_across_chunks``;
then parked requests count against ``max_num_seqs`` too. Qwen3-TTS's
pipeline leaves it False for code2wav, though the decoder keeps each
request's sliding-window cache until the request finishes. A cap on
``max_num_seqs`` then bounds the requests running, not the requests
holding caches.

kv-budget charges what is kept between steps (scope ``request`` or
``session`` with rows per sequence) once per sequence held. Where a stage
keeps such caches, declared or measured, a protecting policy (``cap``,
``reserve``) turns vLLM-Omni's own switch on for that stage and logs it;
``warn`` logs what it leaves uncounted. :func:`parked_requests` is the
count the live monitor adds to the requests running.
"""

from __future__ import annotations

from typing import Any

from kv_budget.declare.spec import RowDriver, Scope
from kv_budget.log import logger
from kv_budget.plan.planner import Plan
from kv_budget.settings import Policy
from kv_budget.stage import Stage


PROTECTING = (Policy.CAP, Policy.RESERVE)
"""The policies whose bound is void unless every request holding caches is counted."""


def parks_requests(vllm_config: Any) -> bool:
    """Whether this engine is a vLLM-Omni async-chunk generation stage:
    its model config has the switch, async chunking is on, and its
    Scheduler is vLLM-Omni's ``OmniGenerationScheduler`` (the only one that
    reads the switch; an AR stage produces chunks and never parks on one)."""
    model_config = vllm_config.model_config
    if not (hasattr(model_config, "retains_state_across_chunks") and getattr(model_config, "async_chunk", False)):
        return False
    from vllm_omni.core.sched.omni_generation_scheduler import OmniGenerationScheduler

    cls = vllm_config.scheduler_config.get_scheduler_cls()
    return isinstance(cls, type) and issubclass(cls, OmniGenerationScheduler)


def kept_per_sequence(plan: Plan) -> list[str]:
    """The declarations held between steps once per sequence, on any worker."""
    names = [
        f"{line.owner or '<root>'}/{line.name}" for worker in plan.workers for line in worker.declarations
        if line.scope in (Scope.REQUEST, Scope.SESSION) and line.rows is RowDriver.MAX_NUM_SEQS
    ]
    return list(dict.fromkeys(names))


def count_parked_at_startup(vllm_config: Any, plan: Plan, stage: Stage | None) -> None:
    """Before the Scheduler is built: where this async-chunk stage declares
    caches kept per sequence, set ``retains_state_across_chunks`` on its
    model config (read by ``OmniGenerationScheduler.__init__``) under a
    protecting policy; under ``warn``, say what stays uncounted."""
    if not parks_requests(vllm_config):
        return
    kept = kept_per_sequence(plan)
    model_config = vllm_config.model_config
    if not kept or model_config.retains_state_across_chunks:
        return
    why = (f"{_who(stage)} keeps {', '.join(kept)} per request between async chunks, and vLLM-Omni's "
           "scheduler counts a request parked between chunks against max_num_seqs only with "
           "retains_state_across_chunks")
    if plan.policy not in PROTECTING:
        logger.warning("%s, which this stage's pipeline leaves False: requests parked between chunks "
                       "are not bounded by max_num_seqs (policy %s: nothing is changed)", why, plan.policy.value)
        return
    model_config.retains_state_across_chunks = True
    logger.warning("%s: retains_state_across_chunks False -> True, so max_num_seqs %d bounds every "
                   "request holding them", why, plan.effective_max_num_seqs)


def count_parked_in_scheduler(scheduler: Any, policy: Policy, holders: list[str], stage: Stage | None) -> None:
    """While serving: live measurement found ``holders`` keeping caches
    nobody declared between steps. Under a protecting policy, turn the
    running Scheduler's switch on (it reads it every ``schedule()``). New
    requests wait until the requests holding caches are under the limit;
    none is preempted."""
    if getattr(scheduler, "_retains_state_across_chunks", True):
        return
    modules = ", ".join(repr(h or "<root>") for h in holders)
    why = f"{_who(stage)}: modules {modules} keep caches between async chunks that nobody declared"
    if policy not in PROTECTING:
        logger.warning("live: %s; requests parked between chunks are not bounded by the limit "
                       "(policy %s: nothing is changed)", why, policy.value)
        return
    scheduler._retains_state_across_chunks = True
    logger.warning("live: %s: the Scheduler now counts requests parked between chunks against its "
                   "limit (retains_state_across_chunks False -> True)", why)


def _who(stage: Stage | None) -> str:
    return stage.label() if stage is not None else "this engine"


def parked_requests(scheduler: Any) -> int:
    """Requests of this stage parked between chunks (out of ``running``,
    still in the engine): vLLM-Omni's own count of them, 0 where the
    Scheduler has none (plain vLLM, an AR stage)."""
    count = getattr(scheduler, "_get_async_chunk_reserved_running_slots", None)
    return int(count()) if count is not None else 0
