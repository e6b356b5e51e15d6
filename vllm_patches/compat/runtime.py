"""What is checked while an engine starts: no Scheduler built before the plan, and a scheduler the cap reaches."""

from __future__ import annotations

from typing import Any

from vllm_patches.compat.check import vllm_version
from vllm_patches.compat.support import UnsupportedVllmError, supported_summary

__all__ = ["require_no_scheduler_yet", "scheduler_class_problem", "scheduler_cap_problem"]


def require_no_scheduler_yet(core: Any) -> None:
    """The hook lowers ``max_num_seqs`` for a Scheduler not yet built. One
    that exists already would keep the old value: refuse, rather than
    report a cap that does nothing."""
    scheduler = getattr(core, "scheduler", None)
    if scheduler is not None:
        raise UnsupportedVllmError(
            f"kv-budget: a Scheduler ({type(scheduler).__name__}) already exists when "
            f"_initialize_kv_caches returns on vLLM {vllm_version()}; a cap set now would not reach it. "
            f"Tested: {supported_summary()}."
        )


def scheduler_class_problem(scheduler_config: Any) -> str | None:
    """None when the configured Scheduler class is vLLM's ``Scheduler`` or
    a subclass (vLLM's AsyncScheduler, vLLM-Omni's OmniARScheduler and
    OmniGenerationScheduler are), whose ``__init__`` reads ``max_num_seqs``."""
    from vllm.v1.core.sched.scheduler import Scheduler

    cls = scheduler_config.get_scheduler_cls()
    if isinstance(cls, type) and issubclass(cls, Scheduler):
        return None
    name = getattr(cls, "__qualname__", repr(cls))
    return (
        f"the configured scheduler class {getattr(cls, '__module__', '?')}.{name} is not vLLM's Scheduler "
        "or a subclass, so nothing says it reads the capped max_num_seqs"
    )


def scheduler_cap_problem(scheduler_class: str, running: int, cap: int) -> str | None:
    """None when the Scheduler just built admits at most ``cap`` sequences."""
    if running == cap:
        return None
    return (
        f"the Scheduler ({scheduler_class}) was built with max_num_running_reqs {running}, not the "
        f"capped max_num_seqs {cap}; vLLM {vllm_version()} does not take the cap as kv-budget expects"
    )
