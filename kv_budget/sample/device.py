"""Memory samples: what the device can still give, and where the figure came from.

The sample is taken after vLLM has allocated its paged KV pool and captured
CUDA graphs, so everything startup made resident is already out of it. On a
GPU the figure is device-level free memory from NVML, not the caching
allocator's view of this process: other processes on the device and memory
torch has reserved but not returned are both real, and both are invisible to
``torch.cuda.memory_allocated``. On vLLM's CPU build the "device" is system
memory, bounded by the cgroup (v1 or v2) limit when the process runs under one.

Each sample carries a ``source`` string naming the call and the device, so a
log line can be checked by hand with ``nvidia-smi`` or ``cat memory.max``.
"""

from __future__ import annotations

import ctypes
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from kv_budget.errors import KvBudgetError

__all__ = [
    "MemorySample",
    "MemorySamplingError",
    "NvmlSampler",
    "CpuSampler",
    "CgroupMemory",
    "cgroup_memory",
    "nvml_index_for_torch_device",
    "sample_memory",
    "ProcessPeak",
    "return_free_heap",
]


class MemorySamplingError(KvBudgetError, RuntimeError):
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
            try:
                handle, label = nvml_index_for_torch_device(self._torch_index, nvml)
            except MemorySamplingError:
                raise
            except Exception as exc:  # an NVMLError from a handle lookup
                raise MemorySamplingError(
                    f"NVML could not find the device of cuda:{self._torch_index}: {type(exc).__name__}: {exc}"
                ) from exc
            try:
                info = nvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception as exc:
                raise MemorySamplingError(
                    f"{label}: nvmlDeviceGetMemoryInfo failed: {type(exc).__name__}: {exc}") from exc
            process_bytes = None
            pid = os.getpid()
            try:
                processes = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except Exception:  # not supported in some containers: this process's share is unknown
                processes = []
            for proc in processes:
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


CGROUP_V1_NO_LIMIT = 2**62
"""cgroup v1 reports "no limit" as the largest page count times the page
size (9,223,372,036,854,771,712 B on 4 KiB pages), not as a word: any limit
at or above this is none."""


@dataclass(frozen=True)
class CgroupMemory:
    """Where this process's memory controller keeps its limit and usage."""

    version: str
    """``"v1"`` (``memory.limit_in_bytes``, ``memory.usage_in_bytes``) or
    ``"v2"`` (``memory.max``, ``memory.current``)."""
    directory: Path

    @property
    def files(self) -> tuple[str, str]:
        return ("memory.limit_in_bytes", "memory.usage_in_bytes") if self.version == "v1" else (
            "memory.max", "memory.current")

    @property
    def inactive_file_key(self) -> str:
        """The ``memory.stat`` line of file pages the kernel reclaims before
        it kills in this cgroup (v1 counts the subtree as ``total_``)."""
        return "total_inactive_file" if self.version == "v1" else "inactive_file"

    def reclaimable(self) -> tuple[int, str]:
        """Bytes of inactive page cache, and what the sample's source says of
        them: usage less these is the working set, the figure the kubelet
        evicts on. An unreadable ``memory.stat`` counts them as used."""
        key = self.inactive_file_key
        try:
            for line in (self.directory / "memory.stat").read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == key:
                    size = int(value)
                    return size, f"memory.stat {key} {size:,} B (reclaimable page cache) not counted as used"
            raise ValueError(f"no {key} line")
        except (OSError, ValueError) as exc:
            return 0, f"page cache counted as used (memory.stat: {type(exc).__name__}: {exc})"


def _under(root: Path, path: str) -> Path:
    """A cgroup path under its mount; inside a container the namespaced path
    is often "/" or one the container cannot see, and the container's own
    cgroup is the mount itself."""
    directory = root / path.lstrip("/")
    return directory if directory.is_dir() else root


def cgroup_memory(proc_root: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> CgroupMemory | None:
    """This process's memory controller, from ``/proc/self/cgroup``.

    A v1 line naming the ``memory`` controller (``4:memory:/path``) wins: on
    a hybrid host (v1 controllers, plus a unified hierarchy holding none of
    them, as on the machines this was built on) the ``0::/`` line exists
    too, and reading v2 files there found nothing. Otherwise the ``0::/path``
    line, under ``cgroup_root`` when it is a v2 mount (it has
    ``cgroup.controllers``), else under ``cgroup_root/unified``. None where
    neither is found."""
    try:
        lines = (proc_root / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    unified: str | None = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if "memory" in controllers.split(","):
            return CgroupMemory("v1", _under(cgroup_root / "memory", path))
        if parts[0] == "0" and controllers == "":
            unified = path
    if unified is None:
        return None
    for root in (cgroup_root, cgroup_root / "unified"):
        if (root / "cgroup.controllers").is_file():
            return CgroupMemory("v2", _under(root, unified))
    return None


def _read_bytes(path: Path) -> int | None:
    """A byte count from a cgroup file; None for "max" (v2's no limit).
    Unreadable or malformed files raise :class:`OSError`/``ValueError``: the
    caller names them."""
    text = path.read_text().strip()
    if text == "max":
        return None
    if not text.isdigit():
        raise ValueError(f"{path} holds {text[:40]!r}, not a byte count")
    return int(text)


class CpuSampler:
    """System memory for vLLM's CPU build, bounded by a cgroup memory limit
    (v1 or v2) when the process runs under one.

    ``psutil.virtual_memory().available`` alone overstates what a process in
    a container may use: the kernel kills it at the cgroup limit long before
    the host runs out. Where a limit is set, free = limit - working set
    (usage less the inactive page cache the kernel reclaims before it kills,
    :meth:`CgroupMemory.reclaimable`), and the smaller of that and psutil's
    figure wins. A limit of "no limit" (v2 ``max``, v1's huge number) or one
    above the host's memory leaves psutil's figure. Cgroup files that cannot
    be read leave psutil's figure too, and the source says which file and
    why, so the log shows the container limit was not applied.
    ``proc_root`` and ``cgroup_root`` exist so tests can point at files they
    wrote.
    """

    def __init__(self, proc_root: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")):
        self._proc_root = proc_root
        self._cgroup_root = cgroup_root

    def sample(self) -> MemorySample:
        vm = psutil.virtual_memory()
        total, free = int(vm.total), int(vm.available)
        source = "psutil.virtual_memory (system memory)"
        cgroup = cgroup_memory(self._proc_root, self._cgroup_root)
        if cgroup is not None:
            limit_file, usage_file = cgroup.files
            try:
                limit = _read_bytes(cgroup.directory / limit_file)
                usage = _read_bytes(cgroup.directory / usage_file)
            except (OSError, ValueError) as exc:
                source += f"; cgroup {cgroup.version} limit not applied: {type(exc).__name__}: {exc}"
            else:
                if limit is not None and limit < min(total, CGROUP_V1_NO_LIMIT) and usage is not None:
                    reclaimable, note = cgroup.reclaimable()
                    total = limit
                    free = min(free, max(limit - max(usage - reclaimable, 0), 0))
                    source = (f"cgroup {cgroup.version} {cgroup.directory}: {limit_file} - {usage_file}, "
                              f"capped by psutil; {note}")
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
    except MemorySamplingError:
        raise
    except Exception as exc:  # an NVMLError from a lookup
        raise MemorySamplingError(
            f"NVML could not identify the device of cuda:{torch_index}: {type(exc).__name__}: {exc}") from exc
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


class ProcessPeak:
    """How far above what it holds now this process went since the last
    reading: what a step's transients (activations, working copies,
    allocator slack) took for a moment, which a sample of free memory
    between steps cannot see. ``"cpu"``: the resident set's high-water mark
    (``VmHWM`` less ``VmRSS``, ``/proc/self/status``), reset after each
    reading through ``/proc/self/clear_refs``; ``"cuda"``: torch's caching
    allocator, ``max_memory_reserved`` less ``memory_reserved``, reset with
    ``reset_peak_memory_stats``. :meth:`read` returns None where neither
    can be read (another device type, a kernel without the files): the
    watch then works from free memory alone."""

    def __init__(self, device_type: str, torch_index: int = 0, proc_root: Path = Path("/proc")) -> None:
        self.device_type = device_type
        self.torch_index = torch_index
        self._status = proc_root / "self" / "status"
        self._clear_refs = proc_root / "self" / "clear_refs"

    def read(self) -> int | None:
        """Bytes above the present since the previous call (or since the
        process began, on the first), then start counting again."""
        if self.device_type == "cuda":
            import torch

            excess = torch.cuda.max_memory_reserved(self.torch_index) - torch.cuda.memory_reserved(self.torch_index)
            torch.cuda.reset_peak_memory_stats(self.torch_index)
            return max(int(excess), 0)
        if self.device_type != "cpu":
            return None
        figures = _status_bytes(self._status, "VmHWM", "VmRSS")
        if figures is None:
            return None
        try:
            self._clear_refs.write_text("5")  # the kernel's reset of the high-water mark to the present
        except OSError:
            return None
        high, resident = figures
        return max(high - resident, 0)


def _status_bytes(status: Path, *names: str) -> tuple[int, ...] | None:
    """The named figures of ``/proc/<pid>/status`` (kB there), in bytes;
    None where the file or a figure cannot be read."""
    try:
        fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        return tuple(int(fields[name].split()[0]) * 1024 for name in names)
    except (OSError, KeyError, ValueError, IndexError):
        return None


def return_free_heap(status: Path = Path("/proc/self/status")) -> int | None:
    """Hand the pages glibc's allocator holds free back to the kernel
    (``malloc_trim(0)``) and return how far this process's resident set
    fell, in bytes. Why: on vLLM's CPU build without tcmalloc, a tensor under
    glibc's mmap threshold (which rises to 32 MiB as the process frees
    larger ones) comes from the heap, and its pages stay resident after it
    is freed; a later step of larger tensors maps fresh pages on top of
    them. The kernel cannot reclaim those pages, so under a memory limit
    they count as used until the allocator returns them (torch here: eight
    20 MiB tensors freed after eight of 30 MiB left 168 MB resident, under
    which eight of 122 MiB were then mapped).
    None where the C library has no ``malloc_trim`` (musl, macOS) or the
    resident set cannot be read."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    before = _status_bytes(status, "VmRSS")
    trim(0)
    after = _status_bytes(status, "VmRSS")
    if before is None or after is None:
        return None
    return max(before[0] - after[0], 0)
