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
import time
from dataclasses import dataclass
from pathlib import Path

from kv_budget.sample.device import cgroup_memory

__all__ = ["MemoryCgroup", "cgroup_unavailable"]


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


def cgroup_unavailable() -> str | None:
    """None where a child memory cgroup with a limit can be made here;
    else why not, in one line."""
    try:
        group = MemoryCgroup.create("kv-budget-probe", 1 << 30)
    except OSError as exc:
        return f"no memory cgroup can be made here ({type(exc).__name__}: {exc})"
    group.remove()
    return None
