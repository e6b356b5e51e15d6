"""A real memory limit for a demo server: a child memory cgroup, made and removed here.

A container's memory limit is a memory cgroup; the kernel OOM-kills a
process of the group that would take it past ``memory.limit_in_bytes`` (v1)
or ``memory.max`` (v2). :class:`MemoryCgroup` creates one under this
process's own memory cgroup (it needs write access there, as root has),
starts commands inside it (a shell writes its pid into the group, then
``exec``\\ s the command, so every child the server spawns is inside too),
reads its usage, peak usage and OOM kills, and removes it, killing what is
left in it first. :func:`cgroup_unavailable` says in one line why none can be
made where that is so.

Demo support, not part of kv-budget: kv-budget itself only reads the limit
(``kv_budget.sample.device.CpuSampler``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kv_budget.sample.device import cgroup_memory

__all__ = ["MemoryCgroup", "ProcessPeaks", "cgroup_unavailable"]


@dataclass
class MemoryCgroup:
    """One child memory cgroup (v1 or v2) and the figures a demo reports of it."""

    version: str
    directory: Path

    @classmethod
    def create(cls, name: str, limit_bytes: int | None = None) -> MemoryCgroup:
        """A new child of this process's memory cgroup; OSError where it
        cannot be made (:func:`cgroup_unavailable` says why)."""
        parent = cgroup_memory()
        if parent is None:
            raise OSError("this process is in no memory cgroup (no memory line in /proc/self/cgroup)")
        directory = parent.directory / f"{name}-{os.getpid()}"
        directory.mkdir()
        group = cls(parent.version, directory)
        if parent.version == "v2":
            # A v2 child's memory files exist only where the parent delegates the controller.
            if "memory" not in (directory / "cgroup.controllers").read_text().split():
                group.remove()
                raise OSError(f"{parent.directory} does not delegate the memory controller (cgroup.subtree_control)")
        if limit_bytes is not None:
            group.set_limit(limit_bytes)
        return group

    def _file(self, v1: str, v2: str) -> Path:
        return self.directory / (v1 if self.version == "v1" else v2)

    def set_limit(self, limit_bytes: int) -> None:
        """The hard limit; under v1 swap is limited to it too, so the
        kernel kills at the limit rather than swap."""
        self._file("memory.limit_in_bytes", "memory.max").write_text(str(limit_bytes))
        swap = self._file("memory.memsw.limit_in_bytes", "memory.swap.max")
        if swap.exists():
            try:
                swap.write_text(str(limit_bytes) if self.version == "v1" else "0")
            except OSError:  # swap accounting off: nothing to limit
                pass

    def limit(self) -> int | None:
        text = self._file("memory.limit_in_bytes", "memory.max").read_text().strip()
        return None if text == "max" or int(text) >= 2**62 else int(text)

    def usage(self) -> int:
        return int(self._file("memory.usage_in_bytes", "memory.current").read_text())

    def working_set(self) -> int:
        """What the group uses less its inactive page cache (v1
        ``total_inactive_file``, v2 ``inactive_file``), which the kernel
        reclaims before it kills: how kv-budget's CPU sampler and the
        kubelet count it. Why a demo sets limits above it, not above the raw
        usage: the page cache a start reads is charged to whichever group
        reads it first, so raw usage after startup moves by a few hundred MB
        between runs of the same server."""
        return self.usage() - self.stat("inactive_file")

    def stat(self, name: str) -> int:
        """One figure of ``memory.stat``, by its v2 name (v1 reads the
        hierarchical ``total_`` one); 0 where the kernel has none."""
        return self._stats().get(name, 0)

    def _stats(self) -> dict[str, int]:
        """``memory.stat``, read once, by v2 names (v1's hierarchical ``total_`` figures)."""
        prefix = "total_" if self.version == "v1" else ""
        figures = {}
        for line in self._file("memory.stat", "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key.startswith(prefix):
                figures[key[len(prefix):]] = int(value)
        return figures

    def file_pages(self) -> dict[str, int]:
        """The group's page cache, active and inactive, and its major faults
        so far: what shows the kernel reclaiming file pages to stay under the
        limit (a load that drops active file pages and faults them back has
        lived on the code and data a working set counts as used). One read."""
        stats = self._stats()
        return {"active_file_bytes": stats.get("active_file", 0),
                "inactive_file_bytes": stats.get("inactive_file", 0), "major_faults": stats.get("pgmajfault", 0)}

    def peak(self) -> int | None:
        """The most the group used since it was made (v2 kernels before 5.19
        have no ``memory.peak``: None)."""
        path = self._file("memory.max_usage_in_bytes", "memory.peak")
        return int(path.read_text()) if path.exists() else None

    def reset_peak(self) -> None:
        """Count the peak from now on (v1 only; v2's cannot be reset before 6.12)."""
        if self.version == "v1":
            (self.directory / "memory.max_usage_in_bytes").write_text("0")

    def oom_kills(self) -> int:
        """Processes of the group the OOM killer killed."""
        path = self._file("memory.oom_control", "memory.events")
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def command_prefix(self) -> list[str]:
        """What to put before a command so that it runs inside the group."""
        return ["sh", "-c", f'echo $$ > {self.directory / "cgroup.procs"} && exec "$@"', "sh"]

    def pids(self) -> list[int]:
        return [int(p) for p in (self.directory / "cgroup.procs").read_text().split()]

    def remove(self, timeout: float = 30) -> None:
        """Kill what is left in the group, then remove it."""
        deadline = time.monotonic() + timeout
        while self.directory.exists():
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                self.directory.rmdir()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


def _anonymous_rss(pid: int) -> tuple[str, int] | None:
    """(command name, anonymous resident bytes) of a live process; None once it is gone."""
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return name, int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


@dataclass
class ProcessPeaks:
    """Where a group's memory went: each process's anonymous resident bytes
    (``RssAnon``, what the group is charged for besides page cache) when
    :meth:`start` is called and at its largest until :meth:`stop`, sampled
    every ``interval`` seconds, by command name (vLLM names its processes:
    ``VLLM::EngineCore``, ``VLLM::Worker_TP0``; the API server is
    ``vllm`` or ``python``)."""

    group: MemoryCgroup
    interval: float = 0.25
    start_bytes: dict[str, int] = field(default_factory=dict)
    peak_bytes: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _read(self) -> dict[str, int]:
        figures: dict[str, int] = {}
        for pid in self.group.pids():
            found = _anonymous_rss(pid)
            if found is not None:
                figures[found[0]] = figures.get(found[0], 0) + found[1]
        return figures

    def start(self) -> None:
        self.start_bytes = self._read()
        self.peak_bytes = dict(self.start_bytes)
        self._thread = threading.Thread(target=self._run, name="process-peaks", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                figures = self._read()
            except OSError:  # the group is being removed
                return
            for name, rss in figures.items():
                self.peak_bytes[name] = max(self.peak_bytes.get(name, 0), rss)

    def stop(self) -> dict[str, dict[str, int]]:
        """Per process name: its bytes at the start, at the peak, and the growth."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return {name: {"start_bytes": self.start_bytes.get(name, 0), "peak_bytes": peak,
                       "growth_bytes": peak - self.start_bytes.get(name, 0)}
                for name, peak in sorted(self.peak_bytes.items())}


def cgroup_unavailable() -> str | None:
    """None where a child memory cgroup with a limit can be made here;
    else why not, in one line."""
    try:
        group = MemoryCgroup.create("kv-budget-probe", 1 << 30)
    except OSError as exc:
        return f"no memory cgroup can be made here ({type(exc).__name__}: {exc})"
    group.remove()
    return None
