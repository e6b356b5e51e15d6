"""Shim: a vLLM-Omni platform for vLLM's CPU build.

Test support, not vLLM-Omni code and not part of kv-budget.

What it replaces: vLLM-Omni 0.30.0 ships platforms for CUDA, ROCm, NPU, XPU
and MUSA only; on a machine without one it falls back to
``UnspecifiedOmniPlatform``, which names no worker classes, so no LLM stage
can start. vLLM-Omni loads out-of-tree platforms from its own entry-point
group ``vllm_omni.platform_plugins`` (``vllm_omni.platforms``), and this
distribution names :func:`kv_budget_omni_cpu.platform_plugin` there.

Why it is shaped like this: the class derives from vLLM-Omni's own
``OmniPlatform`` and vLLM's own ``CpuPlatform`` (as vLLM-Omni's XPU
platform derives from ``OmniPlatform`` and ``XPUPlatform``), so everything
vLLM asks of a platform is vLLM's CPU answer. What it adds is what
``OmniPlatform`` leaves raising ``NotImplementedError``, answered for the
host: one device per NUMA memory node (the CPU build's device-control
variable ``CPU_VISIBLE_MEMORY_NODES`` selects nodes), no device to
synchronize, free memory as vLLM's CPU worker reads it, and the worker
classes of :mod:`kv_budget_omni_cpu.worker` (an AR worker for ``LLM_AR``
stages, a generation worker for ``LLM_GENERATION`` stages such as
Qwen3-TTS's code2wav).
"""

from __future__ import annotations

import torch
from vllm.platforms.cpu import CpuPlatform
from vllm.utils.cpu_resource_utils import get_memory_affinity, get_memory_node_info, get_visible_memory_node
from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum


def _node(device: torch.device | int | None) -> int:
    """The memory node behind a device: the first visible one (the CPU
    build's worker binds to one node per rank, and a stage here has one)."""
    visible = get_visible_memory_node()
    return visible[0] if visible else 0


class CpuOmniPlatform(OmniPlatform, CpuPlatform):
    """vLLM-Omni's platform interface over vLLM's ``CpuPlatform``."""

    _omni_enum = OmniPlatformEnum.OOT

    @classmethod
    def get_omni_ar_worker_cls(cls) -> str:
        return "kv_budget_omni_cpu.worker.CpuARWorker"

    @classmethod
    def get_omni_generation_worker_cls(cls) -> str:
        return "kv_budget_omni_cpu.worker.CpuGenerationWorker"

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        return False

    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        return max(1, len(get_memory_affinity()))

    @classmethod
    def get_device_version(cls) -> str | None:
        return None

    @classmethod
    def synchronize(cls) -> None:
        """Nothing runs asynchronously on the CPU build."""

    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        return get_memory_node_info(_node(device)).available_memory

    @classmethod
    def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
        info = get_memory_node_info(_node(device))
        return info.available_memory, info.total_memory
