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
7. ``live_hook.patch_engine_steps``: live sampling after engine steps
   (under ``cap`` and ``warn``), the live correction under ``cap``.
8. ``frontend.patch_ready_response``: the API-server process takes the
   engine's capped ``max_num_seqs`` from its startup ready response.
9. ``demo_requests.patch_worker_for_demo``: plain vLLM's worker tells the demo
   architecture which requests are scheduled and finished, as vLLM-Omni's
   runners tell its models.
10. Registers the demo architecture ``KvBudgetDemoForCausalLM`` (lazily: its
    module is imported only when a checkpoint names it).

It also makes sure ``KV_BUDGET_STATUS_DIR`` is set before any engine
process starts (:func:`ensure_status_dir`): the engine cores write their
plan and live figures there, the API servers publish them on ``/metrics``.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

_registered = False


def ensure_status_dir() -> str:
    """The engines' status directory: ``$KV_BUDGET_STATUS_DIR`` as found,
    else a private temporary directory this process creates, removes at
    exit, and hands down to every process it starts through the variable."""
    from kv_budget.status import STATUS_DIR_ENV

    directory = os.environ.get(STATUS_DIR_ENV)
    if directory:
        return directory
    directory = tempfile.mkdtemp(prefix="kv-budget-status-")
    os.environ[STATUS_DIR_ENV] = directory
    atexit.register(shutil.rmtree, directory, True)
    return directory


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
    from vllm.v1.engine.core_client import MPClient
    from vllm.v1.executor.abstract import Executor
    from vllm.v1.worker.gpu_worker import Worker

    from kv_budget.demo_checkpoint import ARCHITECTURE

    from .cli_flags import patch_engine_args
    from .compat import check_vllm
    from .demo_requests import patch_worker_for_demo
    from .engine_hook import patch_engine_config_validation, patch_engine_core, patch_scheduler
    from .frontend import patch_ready_response
    from .live_hook import patch_engine_steps
    from .pool_hook import patch_executor

    check_vllm()
    patch_engine_args(EngineArgs)
    patch_engine_config_validation(EngineArgs)
    patch_engine_core(EngineCore)
    patch_scheduler(Scheduler)
    patch_executor(Executor)
    patch_engine_steps(EngineCore)
    patch_ready_response(MPClient)
    patch_worker_for_demo(Worker)
    ensure_status_dir()
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, DEMO_ARCHITECTURE_CLASS)
    _registered = True
