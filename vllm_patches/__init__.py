"""The only place kv-budget touches vLLM: the general-plugin entry point.

``register`` is named in the ``vllm.general_plugins`` entry-point group, so
installing kv-budget is enough: vLLM calls it in the API server, the engine
core and every worker process. It is cheap to import (vLLM is imported only
inside ``register``) and idempotent (a per-process flag, and every patch
checks its own mark), because vLLM may call it more than once.

What it does, in order:

1. ``compat.check_vllm``: every hook point below holds (presence,
   signature, call order), or startup fails naming the vLLM version found,
   what does not hold, and the versions supported.
2. ``cli_flags.patch_engine_args``: ``--model-local-kv-policy``, ``-headroom``,
   ``-margin``, ``-report``, ``-override`` on every parser built from
   EngineArgs, copied into ``additional_config["model_local_kv"]``.
3. ``engine_hook.patch_engine_config_validation``: bad settings raise
   ValueError where the config is built.
4. ``engine_hook.patch_engine_core``: the startup plan after the paged KV
   pool is allocated, before the Scheduler is built.
5. ``engine_hook.patch_scheduler``: the Scheduler, once built, confirms it
   runs with the capped ``max_num_seqs``.
6. ``pool_hook.patch_executor``: under ``reserve``, model-local KV comes
   off the executor's memory figure before the paged pool is sized.
7. Registers the demo architecture ``KvBudgetDemoForCausalLM`` (lazily: its
   module is imported only when a checkpoint names it).
"""

from __future__ import annotations

_registered = False

DEMO_ARCHITECTURE_CLASS = "vllm_patches.demo_model:KvBudgetDemoForCausalLM"


def register() -> None:
    """vLLM general-plugin entry point; safe to call any number of times."""
    global _registered
    if _registered:
        return
    from vllm import ModelRegistry
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.executor.abstract import Executor

    from kv_budget.demo_checkpoint import ARCHITECTURE

    from .cli_flags import patch_engine_args
    from .compat import check_vllm
    from .engine_hook import patch_engine_config_validation, patch_engine_core, patch_scheduler
    from .pool_hook import patch_executor

    check_vllm()
    patch_engine_args(EngineArgs)
    patch_engine_config_validation(EngineArgs)
    patch_engine_core(EngineCore)
    patch_scheduler(Scheduler)
    patch_executor(Executor)
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, DEMO_ARCHITECTURE_CLASS)
    _registered = True
