"""Which vLLM-Omni the glue can patch, checked beside vLLM's before its patches are applied."""

from __future__ import annotations

import importlib.metadata
import inspect
import sys

from vllm_patches.compat.support import UnsupportedVllmError

__all__ = ["SUPPORTED_VLLM_OMNI", "check_vllm_omni", "running_vllm_omni"]

SUPPORTED_VLLM_OMNI = ("0.30.0",)
"""vLLM-Omni releases whose hook points :func:`check_vllm_omni` checks were read and run (docs/support.md)."""


def running_vllm_omni() -> bool:
    """Whether this process runs vLLM-Omni: its package is imported (its
    driver, a stage engine core and worker import it before vLLM loads
    plugins) and installed (files of its wheel imported one by one, as the
    audit targets do, are not a vLLM-Omni runtime). A plain vLLM process of
    a venv that has vLLM-Omni installed is left alone."""
    if "vllm_omni" not in sys.modules:
        return False
    try:
        importlib.metadata.version("vllm-omni")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def check_vllm_omni() -> str:
    """The vLLM-Omni version, or UnsupportedVllmError naming what does not
    hold: the version, or a hook point this module wraps."""

    version = importlib.metadata.version("vllm-omni")
    if version not in SUPPORTED_VLLM_OMNI:
        raise UnsupportedVllmError(
            f"kv-budget supports vLLM-Omni {', '.join(SUPPORTED_VLLM_OMNI)}, found {version}: its settings paths, "
            "stage runtime and stat logger were read for those releases (docs/support.md)")
    from vllm_omni.config.model import OmniModelConfig
    from vllm_omni.config.omni_config import VllmOmniConfig
    from vllm_omni.core.sched.omni_generation_scheduler import OmniGenerationScheduler
    from vllm_omni.engine import stage_admission, stage_init_utils
    from vllm_omni.engine.stage_runtime import StageRuntime
    from vllm_omni.entrypoints import stage_utils
    from vllm_omni.metrics.stat_logger import OmniPrometheusStatLogger

    needed = [(VllmOmniConfig, "from_pipeline_config"), (StageRuntime, "_build_logical_stage_init_plans"),
              (StageRuntime, "_finalize_initialized_stages"), (StageRuntime, "launch_stage_engines"),
              (OmniPrometheusStatLogger, "register_replica"),
              # what the deployment's record reads, as vLLM-Omni's admission reads it
              (stage_admission, "graph_reserve_bytes"), (stage_admission, "_diffusion_utilization"),
              (stage_init_utils, "parse_physical_device_ids"), (stage_utils, "resolve_stage_physical_devices"),
              # what counts requests parked between async chunks (vllm_patches.omni_chunks)
              (OmniGenerationScheduler, "_get_async_chunk_reserved_running_slots")]
    missing = [f"{getattr(owner, '__name__', owner)}.{name}" for owner, name in needed if not hasattr(owner, name)]
    if "retains_state_across_chunks" not in getattr(OmniModelConfig, "__dataclass_fields__", {}):
        missing.append("OmniModelConfig.retains_state_across_chunks")
    finalize = list(inspect.signature(StageRuntime._finalize_initialized_stages).parameters)
    if finalize[:2] != ["self", "stage_plans"]:
        missing.append(f"StageRuntime._finalize_initialized_stages(self, stage_plans, ...) (it takes {finalize})")
    if missing:
        raise UnsupportedVllmError(f"vLLM-Omni {version} lacks {', '.join(missing)}, which kv-budget wraps or reads")
    return version
