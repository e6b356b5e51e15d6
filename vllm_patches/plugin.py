"""The general-plugin entry point: every patch, in order.

``register`` is named in the ``vllm.general_plugins`` entry-point group
(plugin name ``kv_budget``), so installing kv-budget is enough: vLLM calls
it in the API server, the engine core and every worker process. This
module imports vLLM and every layer of the glue at import time (vLLM
imports a plugin only to call it); the layers below import no vLLM at
import time, so they load without it. ``register`` is idempotent (a
per-process flag, and every patch checks its own mark), because vLLM may
call it more than once.

What it does, in order:

1. ``compat.check_vllm``: every hook point below holds (presence,
   signature, call order), or startup fails naming the vLLM version found,
   what does not hold, and the versions supported.
2. ``flags.patch_engine_args``: the ``--model-local-kv-*`` flags on every
   parser built from EngineArgs, copied into
   ``additional_config["model_local_kv"]``.
3. ``startup_hook.patch_engine_config_validation``: bad settings raise
   ValueError where the config is built.
4. ``startup_hook.patch_engine_core``: the startup plan after the paged KV
   pool is allocated, before the Scheduler is built.
5. ``startup_hook.patch_scheduler``: the Scheduler, once built, confirms it
   runs with the capped ``max_num_seqs``.
6. ``pool_hook.patch_executor``: under ``reserve``, model-local KV comes
   off the executor's memory figure before the paged pool is sized.
7. ``live_hook.patch_engine_steps``: live sampling around engine steps
   (under ``cap``, ``warn`` and ``reserve``), the live correction under
   ``cap`` and ``reserve``; in the workers, on the first sampled step,
   ``cache_updates.install`` wraps ``transformers``' ``Cache.update`` so
   the sampled step is watched inside.
8. ``frontend.patch_ready_response``: the API-server process takes the
   engine's capped ``max_num_seqs`` from its startup ready response.
9. ``frontend.patch_async_llm``: the ``kv_budget:`` figures on ``/metrics``,
   where vLLM logs stats (not under ``--disable-log-stats``).
10. ``omni.register_omni``: where vLLM-Omni runs, its settings paths and
    the check of overrides across stages; then
    ``frontend.patch_omni_stat_logger``: its ``/metrics``.

Every patch goes through :func:`vllm_patches.patching.patch_method`.
Nothing here registers a model: the demo architecture is the demo's own
plugin (``demo/``, installed only where the demo or the tests run).

It also makes sure ``KV_BUDGET_STATUS_DIR`` is set before any engine
process starts (:func:`ensure_status_dir`): the engine cores write their
plan and live figures there, the API servers publish them on ``/metrics``.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

from vllm.engine.arg_utils import EngineArgs
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.core_client import MPClient
from vllm.v1.executor.abstract import Executor

from kv_budget.watch.status import STATUS_DIR_ENV
from vllm_patches.compat import check_vllm
from vllm_patches.flags import patch_engine_args
from vllm_patches.frontend import patch_async_llm, patch_omni_stat_logger, patch_ready_response
from vllm_patches.live_hook import patch_engine_steps
from vllm_patches.omni import register_omni
from vllm_patches.pool_hook import patch_executor
from vllm_patches.startup_hook import patch_engine_config_validation, patch_engine_core, patch_scheduler

_registered = False


def ensure_status_dir() -> str:
    """The engines' status directory: ``$KV_BUDGET_STATUS_DIR`` as found,
    else a private temporary directory this process creates, removes at
    exit, and hands down to every process it starts through the variable."""
    directory = os.environ.get(STATUS_DIR_ENV)
    if directory:
        return directory
    directory = tempfile.mkdtemp(prefix="kv-budget-status-")
    os.environ[STATUS_DIR_ENV] = directory
    atexit.register(shutil.rmtree, directory, True)
    return directory


def register() -> None:
    """vLLM general-plugin entry point; safe to call any number of times."""
    global _registered
    if _registered:
        return
    check_vllm()
    patch_engine_args(EngineArgs)
    patch_engine_config_validation(EngineArgs)
    patch_engine_core(EngineCore)
    patch_scheduler(Scheduler)
    patch_executor(Executor)
    patch_engine_steps(EngineCore)
    patch_ready_response(MPClient)
    patch_async_llm(AsyncLLM)
    if register_omni():
        from vllm_omni.metrics.stat_logger import OmniPrometheusStatLogger

        patch_omni_stat_logger(OmniPrometheusStatLogger)
    ensure_status_dir()
    _registered = True
