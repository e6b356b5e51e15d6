"""Memory samples: what the device can still give, and where the figure came from.

The sample is taken after vLLM has allocated its paged KV pool and captured
CUDA graphs, so everything startup made resident is already out of it. On a
GPU the figure is device-level free memory from NVML, not the caching
allocator's view of this process: other processes on the device and memory
torch has reserved but not returned are both real, and both are invisible to
``torch.cuda.memory_allocated``. On vLLM's CPU build the "device" is system
memory, bounded by the cgroup (v2) limit when the process runs under one.

Each sample carries a ``source`` string naming the call and the device, so a
log line can be checked by hand with ``nvidia-smi`` or ``cat memory.max``.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

__all__ = [
    "MemorySample",
    "MemorySamplingError",
    "NvmlSampler",
    "CpuSampler",
    "nvml_index_for_torch_device",
    "sample_memory",
]


class MemorySamplingError(RuntimeError):
    """No way to sample the device: the planner must not invent a headroom."""


@dataclass(frozen=True)
class MemorySample:
    """Device memory at one instant, in bytes."""

    total_bytes: int
    free_bytes: int
    used_bytes: int
    process_bytes: int | None
    """What this process holds on the device, when the driver reports it
    (NVML hides it in some containers; it is then ``None``, never 0)."""

    source: str
    """Human-readable origin, e.g. ``"NVML device 1 (GPU-3f...)"``."""


def _visible_devices() -> list[str] | None:
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    return [entry.strip() for entry in raw.split(",") if entry.strip()]


def nvml_index_for_torch_device(torch_index: int, nvml: Any) -> tuple[Any, str]:
    """Map a torch CUDA device index to an NVML handle and a label.

    torch numbers devices *after* ``CUDA_VISIBLE_DEVICES`` filtering; NVML
    numbers every device on the host. Sampling NVML index ``torch_index``
    directly reads the wrong GPU whenever the variable reorders or subsets
    devices, which vLLM does for every worker. Entries may be indices or
    (prefixes of) UUIDs, as CUDA accepts; an entry that matches no device, or
    a UUID prefix that matches several, raises.
    """
    visible = _visible_devices()
    if visible is None:
        handle = nvml.nvmlDeviceGetHandleByIndex(torch_index)
        return handle, f"NVML device {torch_index}"
    if torch_index >= len(visible):
        raise MemorySamplingError(
            f"torch device cuda:{torch_index} is not in CUDA_VISIBLE_DEVICES={','.join(visible)}"
        )
    entry = visible[torch_index]
    if entry.isdigit():
        handle = nvml.nvmlDeviceGetHandleByIndex(int(entry))
        return handle, f"NVML device {entry} (cuda:{torch_index} via CUDA_VISIBLE_DEVICES)"
    if entry.startswith("MIG-"):
        handle = nvml.nvmlDeviceGetHandleByUUID(entry)
        return handle, f"NVML MIG device {entry} (cuda:{torch_index})"
    matches = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        uuid = nvml.nvmlDeviceGetUUID(handle)
        if isinstance(uuid, bytes):
            uuid = uuid.decode()
        if uuid.startswith(entry):
            matches.append((index, uuid, handle))
    if len(matches) != 1:
        found = "no device" if not matches else f"{len(matches)} devices"
        raise MemorySamplingError(
            f"CUDA_VISIBLE_DEVICES entry {entry!r} for cuda:{torch_index} matches {found} in NVML"
        )
    index, uuid, handle = matches[0]
    return handle, f"NVML device {index} ({uuid}, cuda:{torch_index} via CUDA_VISIBLE_DEVICES)"


class NvmlSampler:
    """Device-level memory through NVML.

    ``nvml`` is the ``pynvml`` module (from the ``nvidia-ml-py``
    distribution); tests pass a fake of those calls because NVML cannot run
    without a GPU.
    """

    def __init__(self, torch_index: int, nvml: Any | None = None) -> None:
        if nvml is None:
            try:
                import pynvml as nvml  # type: ignore[no-redef]
            except ImportError as exc:
                raise MemorySamplingError(
                    "NVML is unavailable: the pynvml module (package nvidia-ml-py) is not installed"
                ) from exc
        self._nvml = nvml
        self._torch_index = torch_index

    def sample(self) -> MemorySample:
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except Exception as exc:  # NVMLError has many subclasses; all mean "no NVML"
            raise MemorySamplingError(f"NVML could not be initialised: {exc}") from exc
        try:
            handle, label = nvml_index_for_torch_device(self._torch_index, nvml)
            info = nvml.nvmlDeviceGetMemoryInfo(handle)
            process_bytes = None
            pid = os.getpid()
            for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == pid and proc.usedGpuMemory is not None:
                    process_bytes = int(proc.usedGpuMemory)
            return MemorySample(
                total_bytes=int(info.total),
                free_bytes=int(info.free),
                used_bytes=int(info.used),
                process_bytes=process_bytes,
                source=f"{label}: nvmlDeviceGetMemoryInfo",
            )
        finally:
            nvml.nvmlShutdown()


def _cgroup_dir(proc_root: Path, cgroup_root: Path) -> Path | None:
    """The cgroup v2 directory of this process, from ``/proc/self/cgroup``
    (the ``0::/path`` line); None where the host has no unified hierarchy."""
    try:
        lines = (proc_root / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            path = cgroup_root / line[3:].lstrip("/")
            # Inside a container the namespaced path is often "/", which is
            # the container's own cgroup mounted at cgroup_root.
            return path if path.is_dir() else cgroup_root
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


class CpuSampler:
    """System memory for vLLM's CPU build, bounded by a cgroup v2 limit.

    ``psutil.virtual_memory().available`` alone overstates what a process in
    a container may use: the kernel kills it at ``memory.max`` long before
    the host runs out. Where a limit is set, free = limit - memory.current,
    and the smaller of the two readings wins. ``proc_root`` and
    ``cgroup_root`` exist so tests can point at files they wrote.
    """

    def __init__(self, proc_root: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")):
        self._proc_root = proc_root
        self._cgroup_root = cgroup_root

    def sample(self) -> MemorySample:
        vm = psutil.virtual_memory()
        total, free = int(vm.total), int(vm.available)
        source = "psutil.virtual_memory (system memory)"
        cgroup = _cgroup_dir(self._proc_root, self._cgroup_root)
        if cgroup is not None:
            limit = _read_int(cgroup / "memory.max")  # "max" (no limit) reads as None
            current = _read_int(cgroup / "memory.current")
            if limit is not None and current is not None and limit < total:
                total = limit
                free = min(free, max(limit - current, 0))
                source = f"cgroup v2 {cgroup}: memory.max - memory.current, capped by psutil"
        process_bytes = int(psutil.Process().memory_info().rss)
        return MemorySample(
            total_bytes=total,
            free_bytes=free,
            used_bytes=total - free,
            process_bytes=process_bytes,
            source=source,
        )


def device_identity(device_type: str, torch_index: int = 0, nvml: Any | None = None) -> str:
    """A name for the physical memory a worker allocates from, the same in
    every process on the host: the NVML UUID of a CUDA device (indices differ
    between processes with different ``CUDA_VISIBLE_DEVICES``), or the host
    for vLLM's CPU build (every engine there draws on one RAM). The device
    ledger is keyed by it."""
    if device_type == "cpu":
        return f"host:{socket.gethostname()}"
    if device_type != "cuda":
        raise MemorySamplingError(f"no device identity for device type {device_type!r}")
    if nvml is None:
        try:
            import pynvml as nvml  # type: ignore[no-redef]
        except ImportError as exc:
            raise MemorySamplingError("NVML is unavailable: the pynvml module is not installed") from exc
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError has many subclasses; all mean "no NVML"
        raise MemorySamplingError(f"NVML could not be initialised: {exc}") from exc
    try:
        handle, _ = nvml_index_for_torch_device(torch_index, nvml)
        uuid = nvml.nvmlDeviceGetUUID(handle)
        return uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    finally:
        nvml.nvmlShutdown()


def sample_memory(device_type: str, torch_index: int = 0) -> MemorySample:
    """Sample the memory of the device vLLM runs on: ``"cuda"`` through NVML,
    ``"cpu"`` through the CPU sampler. Anything else raises rather than
    pretend: a ROCm or XPU device has no sampler here yet."""
    if device_type == "cuda":
        return NvmlSampler(torch_index).sample()
    if device_type == "cpu":
        return CpuSampler().sample()
    raise MemorySamplingError(
        f"no memory sampler for device type {device_type!r}: kv-budget samples 'cuda' "
        "(NVML) and 'cpu' (system/cgroup memory); pass an explicit headroom instead"
    )
