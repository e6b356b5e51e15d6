"""Memory sampling. NVML cannot run without a GPU, so the NVML path is tested
against a fake of the NVML calls only; the CPU sampler reads real psutil
figures and cgroup files written by the test."""

from __future__ import annotations

import os
import socket
import types
from pathlib import Path

import psutil
import pytest

from kv_budget.memory import (
    CpuSampler,
    MemorySamplingError,
    NvmlSampler,
    device_identity,
    nvml_index_for_torch_device,
    sample_memory,
)
from kv_budget.units import GiB


class FakeNvml:
    """The handful of pynvml calls the sampler makes, over a table of devices."""

    def __init__(self, devices, processes=None, init_error=None):
        self.devices = devices  # list of (uuid, total, free)
        self.processes = processes or {}
        self.init_error = init_error
        self.shutdowns = 0

    def nvmlInit(self):
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index):
        if not 0 <= index < len(self.devices):
            raise RuntimeError(f"NVML: invalid index {index}")
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid):
        for index, (u, _, _) in enumerate(self.devices):
            if u == uuid:
                return index
        raise RuntimeError("NVML: not found")

    def nvmlDeviceGetUUID(self, handle):
        return self.devices[handle][0].encode()

    def nvmlDeviceGetMemoryInfo(self, handle):
        _, total, free = self.devices[handle]
        return types.SimpleNamespace(total=total, free=free, used=total - free)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self.processes.get(handle, [])]


DEVICES = [
    ("GPU-aaaa1111", 80 * GiB, 10 * GiB),
    ("GPU-bbbb2222", 80 * GiB, 20 * GiB),
    ("GPU-bbbc3333", 141 * GiB, 30 * GiB),
]


def test_nvml_without_visible_devices_uses_the_torch_index(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake = FakeNvml(DEVICES, processes={1: [(os.getpid(), 5 * GiB), (1, 7 * GiB)]})
    sample = NvmlSampler(1, nvml=fake).sample()
    assert (sample.total_bytes, sample.free_bytes, sample.used_bytes) == (80 * GiB, 20 * GiB, 60 * GiB)
    assert sample.process_bytes == 5 * GiB
    assert "NVML device 1" in sample.source
    assert fake.shutdowns == 1


def test_nvml_maps_reordered_indices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    sample = NvmlSampler(0, nvml=FakeNvml(DEVICES)).sample()
    assert sample.free_bytes == 30 * GiB
    assert "NVML device 2" in sample.source
    assert NvmlSampler(1, nvml=FakeNvml(DEVICES)).sample().free_bytes == 10 * GiB


def test_nvml_maps_uuids_and_unique_prefixes(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbbb2222, GPU-aaaa")
    fake = FakeNvml(DEVICES)
    assert NvmlSampler(0, nvml=fake).sample().free_bytes == 20 * GiB
    assert NvmlSampler(1, nvml=fake).sample().free_bytes == 10 * GiB


def test_nvml_refuses_an_ambiguous_or_unknown_uuid(monkeypatch):
    fake = FakeNvml(DEVICES)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbb")
    with pytest.raises(MemorySamplingError, match="matches 2 devices"):
        nvml_index_for_torch_device(0, fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-ffff")
    with pytest.raises(MemorySamplingError, match="matches no device"):
        nvml_index_for_torch_device(0, fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(MemorySamplingError, match="not in CUDA_VISIBLE_DEVICES"):
        nvml_index_for_torch_device(1, fake)


def test_nvml_hidden_process_usage_is_none_not_zero(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake = FakeNvml(DEVICES, processes={0: [(os.getpid(), None)]})
    assert NvmlSampler(0, nvml=fake).sample().process_bytes is None


def test_nvml_init_failure_is_a_sampling_error():
    fake = FakeNvml(DEVICES, init_error=RuntimeError("NVML Shared Library Not Found"))
    with pytest.raises(MemorySamplingError, match="NVML could not be initialised"):
        NvmlSampler(0, nvml=fake).sample()


def test_real_nvml_on_this_machine_fails_cleanly():
    """Where no GPU exists, the real pynvml must give a clear error."""
    try:
        sample = NvmlSampler(0).sample()
    except MemorySamplingError as exc:
        assert "NVML" in str(exc)
    else:  # a GPU machine: the sample must be sane
        assert 0 < sample.free_bytes <= sample.total_bytes


def _cgroup(tmp_path: Path, limit: str, current: str) -> tuple[Path, Path]:
    proc = tmp_path / "proc" / "self"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text("0::/kv.slice\n")
    group = tmp_path / "cgroup" / "kv.slice"
    group.mkdir(parents=True)
    (group / "memory.max").write_text(limit + "\n")
    (group / "memory.current").write_text(current + "\n")
    return tmp_path / "proc", tmp_path / "cgroup"


def test_cpu_sampler_honours_a_cgroup_limit(tmp_path):
    proc, root = _cgroup(tmp_path, str(4 * GiB), str(3 * GiB))
    sample = CpuSampler(proc, root).sample()
    assert sample.total_bytes == 4 * GiB
    assert sample.free_bytes == min(GiB, psutil.virtual_memory().available)
    assert "memory.max" in sample.source
    assert sample.process_bytes > 0


def test_cpu_sampler_without_a_limit_reads_system_memory(tmp_path):
    proc, root = _cgroup(tmp_path, "max", str(GiB))
    sample = CpuSampler(proc, root).sample()
    assert sample.total_bytes == psutil.virtual_memory().total
    assert "psutil" in sample.source


def test_cpu_sampler_without_cgroup_files(tmp_path):
    sample = CpuSampler(tmp_path / "none", tmp_path / "none").sample()
    assert 0 < sample.free_bytes <= sample.total_bytes


def test_sample_memory_dispatches_and_refuses_unknown_devices():
    assert sample_memory("cpu").total_bytes > 0
    with pytest.raises(MemorySamplingError, match="'xpu'"):
        sample_memory("xpu")


def test_device_identity_is_the_nvml_uuid_whatever_the_process_numbering(monkeypatch):
    """Two processes that number one GPU differently (their own
    CUDA_VISIBLE_DEVICES) must key the device ledger the same."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    fake = FakeNvml(DEVICES)
    assert device_identity("cuda", 0, nvml=fake) == "GPU-bbbc3333"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2")
    assert device_identity("cuda", 1, nvml=fake) == "GPU-bbbc3333"
    assert fake.shutdowns == 2
    assert device_identity("cpu") == f"host:{socket.gethostname()}"
    with pytest.raises(MemorySamplingError, match="'xpu'"):
        device_identity("xpu")
