"""Memory sampling. NVML cannot run without a GPU, so the NVML path is tested
against a fake of the NVML calls only; the CPU sampler reads real psutil
figures and cgroup files written by the test."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import types
from pathlib import Path

import psutil
import pytest

from kv_budget.sample.device import (
    CpuSampler,
    MemorySamplingError,
    NvmlSampler,
    cgroup_memory,
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


class FailingNvml(FakeNvml):
    """NVML that initialises but fails one call, as a broken driver or a
    container without process accounting does."""

    def __init__(self, failing: str):
        super().__init__(DEVICES)
        self.failing = failing

    def __getattribute__(self, name):
        if name == object.__getattribute__(self, "failing"):
            def fail(*args):
                raise RuntimeError(f"NVMLError_Unknown: {name}")
            return fail
        return object.__getattribute__(self, name)


@pytest.mark.parametrize("failing, expected", [
    ("nvmlDeviceGetMemoryInfo", "NVML device 0: nvmlDeviceGetMemoryInfo failed: RuntimeError: NVMLError_Unknown"),
    ("nvmlDeviceGetHandleByIndex", "NVML could not find the device of cuda:0: RuntimeError"),
])
def test_nvml_call_failures_are_sampling_errors_naming_the_call(monkeypatch, failing, expected):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake = FailingNvml(failing)
    with pytest.raises(MemorySamplingError) as info:
        NvmlSampler(0, nvml=fake).sample()
    assert expected in str(info.value)
    assert fake.shutdowns == 1


def test_nvml_without_process_accounting_still_samples(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    sample = NvmlSampler(0, nvml=FailingNvml("nvmlDeviceGetComputeRunningProcesses")).sample()
    assert (sample.free_bytes, sample.process_bytes) == (10 * GiB, None)


def test_nvml_maps_a_mig_uuid(monkeypatch):
    mig = "MIG-4f0c5a9e-7d1b-5c2a-9f3e-1a2b3c4d5e6f"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mig)
    fake = FakeNvml([*DEVICES, (mig, 20 * GiB, 5 * GiB)])
    sample = NvmlSampler(0, nvml=fake).sample()
    assert sample.free_bytes == 5 * GiB and f"NVML MIG device {mig}" in sample.source


def test_device_identity_lookup_failure_is_a_sampling_error(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(MemorySamplingError, match="could not identify the device of cuda:0"):
        device_identity("cuda", 0, nvml=FailingNvml("nvmlDeviceGetUUID"))


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
    """A cgroup v2 host: the unified hierarchy mounted at the root."""
    proc = tmp_path / "proc" / "self"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text("0::/kv.slice\n")
    (tmp_path / "cgroup").mkdir()
    (tmp_path / "cgroup" / "cgroup.controllers").write_text("cpu io memory pids\n")
    group = tmp_path / "cgroup" / "kv.slice"
    group.mkdir(parents=True)
    (group / "memory.max").write_text(limit + "\n")
    (group / "memory.current").write_text(current + "\n")
    return tmp_path / "proc", tmp_path / "cgroup"


def _cgroup_v1(tmp_path: Path, limit: str, usage: str, path: str = "/process_api/abc") -> tuple[Path, Path]:
    """A hybrid host as this one: v1 controllers (memory among them) and an
    empty unified hierarchy under ``unified``, so /proc/self/cgroup has a
    ``0::/`` line too."""
    proc = tmp_path / "proc" / "self"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(f"9:name=systemd:/\n4:memory:{path}\n1:cpu,cpuacct:/\n0::/\n")
    (tmp_path / "cgroup" / "unified").mkdir(parents=True)
    (tmp_path / "cgroup" / "unified" / "cgroup.controllers").write_text("\n")
    group = tmp_path / "cgroup" / "memory" / path.lstrip("/")
    group.mkdir(parents=True)
    (group / "memory.limit_in_bytes").write_text(limit + "\n")
    (group / "memory.usage_in_bytes").write_text(usage + "\n")
    return tmp_path / "proc", tmp_path / "cgroup"


def test_cpu_sampler_honours_a_cgroup_v1_limit_on_a_hybrid_host(tmp_path):
    proc, root = _cgroup_v1(tmp_path, str(4 * GiB), str(3 * GiB))
    sample = CpuSampler(proc, root).sample()
    assert sample.total_bytes == 4 * GiB
    assert sample.free_bytes == min(GiB, psutil.virtual_memory().available)
    assert sample.source.startswith(f"cgroup v1 {root / 'memory' / 'process_api' / 'abc'}: "
                                    "memory.limit_in_bytes - memory.usage_in_bytes")


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_reclaimable_page_cache_is_not_counted_as_used(tmp_path, version):
    """The kernel reclaims inactive file pages before it kills in a cgroup:
    usage less ``inactive_file`` is the working set (the kubelet's figure),
    and the source says the figure used."""
    if version == "v1":
        proc, root = _cgroup_v1(tmp_path, str(4 * GiB), str(3 * GiB))
        group, key = root / "memory" / "process_api" / "abc", "total_inactive_file"
        stat = f"cache {2 * GiB}\ninactive_file {GiB // 4}\n{key} {GiB}\nactive_file 5\n"
    else:
        proc, root = _cgroup(tmp_path, str(4 * GiB), str(3 * GiB))
        group, key = root / "kv.slice", "inactive_file"
        stat = f"anon 7\nfile {2 * GiB}\n{key} {GiB}\nactive_file 5\n"
    (group / "memory.stat").write_text(stat)
    sample = CpuSampler(proc, root).sample()
    assert sample.free_bytes == min(2 * GiB, psutil.virtual_memory().available)
    assert f"memory.stat {key} {GiB:,} B (reclaimable page cache) not counted as used" in sample.source


def test_page_cache_larger_than_usage_leaves_no_negative_working_set(tmp_path):
    proc, root = _cgroup_v1(tmp_path, str(4 * GiB), str(GiB))
    (root / "memory" / "process_api" / "abc" / "memory.stat").write_text(f"total_inactive_file {2 * GiB}\n")
    assert CpuSampler(proc, root).sample().free_bytes == min(4 * GiB, psutil.virtual_memory().available)


def test_without_memory_stat_the_raw_usage_counts_and_the_source_says_so(tmp_path):
    proc, root = _cgroup_v1(tmp_path, str(4 * GiB), str(3 * GiB))
    sample = CpuSampler(proc, root).sample()
    assert sample.free_bytes == min(GiB, psutil.virtual_memory().available)
    assert "page cache counted as used (memory.stat: FileNotFoundError" in sample.source


def test_cgroup_v1_no_limit_is_the_huge_page_counter_maximum(tmp_path):
    proc, root = _cgroup_v1(tmp_path, "9223372036854771712", str(GiB))
    sample = CpuSampler(proc, root).sample()
    assert sample.total_bytes == psutil.virtual_memory().total
    assert sample.source == "psutil.virtual_memory (system memory)"


def test_cgroup_v1_path_invisible_in_the_container_is_the_mount_itself(tmp_path):
    proc, root = _cgroup_v1(tmp_path, str(2 * GiB), str(GiB), path="/")
    (proc / "self" / "cgroup").write_text("4:memory:/kubepods/pod1/c1\n")
    found = cgroup_memory(proc, root)
    assert (found.version, found.directory) == ("v1", root / "memory")
    assert CpuSampler(proc, root).sample().total_bytes == 2 * GiB


@pytest.mark.parametrize("content, expected", [
    (None, "IsADirectoryError"),
    ("garbage", "holds 'garbage', not a byte count"),
])
def test_unreadable_cgroup_files_leave_system_memory_and_say_so(tmp_path, content, expected):
    proc, root = _cgroup_v1(tmp_path, str(4 * GiB), str(GiB))
    limit = root / "memory" / "process_api" / "abc" / "memory.limit_in_bytes"
    limit.unlink()
    if content is None:
        limit.mkdir()  # unreadable as a file, even for root
    else:
        limit.write_text(content)
    sample = CpuSampler(proc, root).sample()
    assert sample.total_bytes == psutil.virtual_memory().total
    assert "cgroup v1 limit not applied" in sample.source and expected in sample.source


def test_this_hosts_cgroup_is_found_and_read():
    """Whatever this machine runs (v1, v2 or hybrid), the sampler names it or psutil."""
    found = cgroup_memory()
    sample = CpuSampler().sample()
    assert 0 < sample.free_bytes <= sample.total_bytes
    if found is not None:
        limit_file, _ = found.files
        assert (found.directory / limit_file).is_file(), found


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


def test_the_process_peak_is_the_high_water_mark_above_the_resident_set_and_is_reset_after_reading(tmp_path):
    from kv_budget.sample.device import ProcessPeak

    (tmp_path / "self").mkdir()
    status = tmp_path / "self" / "status"
    status.write_text("Name:\tpython\nVmHWM:\t  300000 kB\nVmRSS:\t  200000 kB\n")
    (tmp_path / "self" / "clear_refs").write_text("")
    peak = ProcessPeak("cpu", proc_root=tmp_path)
    assert peak.read() == 100000 * 1024
    assert (tmp_path / "self" / "clear_refs").read_text() == "5"  # the kernel's reset of VmHWM
    status.write_text("Name:\tpython\n")
    assert peak.read() is None  # no high-water mark to read: the watch works from free memory alone
    assert ProcessPeak("xpu").read() is None


_HEAP_SLACK = """
import ctypes
from kv_budget.sample.device import return_free_heap
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD: 8 MiB blocks come from the heap, as a step's tensors under 32 MiB do
libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: free() keeps what it frees, as the heap does under a later block
blocks = [libc.malloc(8 << 20) for _ in range(20)]
for block in blocks:
    ctypes.memset(block, 1, 8 << 20)
for block in blocks:
    libc.free(block)
print(return_free_heap(), return_free_heap())
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc_trim and /proc/self/status are Linux's")
def test_the_free_heap_is_handed_back_to_the_kernel_and_the_fall_of_the_resident_set_is_reported():
    """160 MiB written and freed on glibc's heap stay resident until the
    allocator is asked; once returned, a second call finds nothing left."""
    out = subprocess.run([sys.executable, "-c", _HEAP_SLACK], capture_output=True, text=True, check=True).stdout
    first, second = (int(figure) for figure in out.split())
    assert first >= 150 * 2**20
    assert second < 2**20


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_the_demos_cgroup_reads_its_page_cache_and_major_faults(tmp_path, version):
    """The memory-limit demo reports what the kernel took back from the
    group's page cache during a load: v1 reads the hierarchical ``total_``
    figures, not the group's own; a figure the kernel lacks reads 0."""
    from kv_budget_demo.memory_limit import MemoryCgroup

    prefix = "total_" if version == "v1" else ""
    (tmp_path / "memory.stat").write_text(
        f"active_file 1\ninactive_file 2\npgmajfault 3\n{prefix}active_file {5 * GiB}\n"
        f"{prefix}inactive_file {GiB}\n" if version == "v1" else
        f"active_file {5 * GiB}\ninactive_file {GiB}\n")
    (tmp_path / ("memory.usage_in_bytes" if version == "v1" else "memory.current")).write_text(str(7 * GiB))
    group = MemoryCgroup(version, tmp_path)
    assert group.file_pages() == {"active_file_bytes": 5 * GiB, "inactive_file_bytes": GiB, "major_faults": 0}
    assert group.working_set() == 6 * GiB
