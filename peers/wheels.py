"""Published wheels of the projects kv-budget meets, unpacked into a cache.

kv-budget is checked against its peers' real files: vLLM-Omni's modules
(imported by file, :mod:`peers.vllm_omni.files`) and the Python source of a
vLLM release that has no CPU build to run (read, never imported, by
``vllm_patches.compat.VllmSourceTree``). Both come from here: fetched once
with ``pip download --no-deps`` (the project's own dependencies are not
needed to read or import single files), unpacked into
``$XDG_CACHE_HOME/kv-budget/PROJECT-VERSION`` (default ``~/.cache``), and
reused by every later run. A marker written last makes an interrupted fetch
start over.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

__all__ = ["WheelUnavailable", "unpacked_wheel"]

_MARKER = ".kv-budget-complete"


class WheelUnavailable(RuntimeError):
    """The wheel could not be had (no registry, no cache). Tests skip on it,
    naming this message; nothing else may quietly continue."""


def _cache_dir(project: str, version: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kv-budget" / f"{project}-{version}"


def unpacked_wheel(project: str, version: str, keep: Callable[[str], bool] = lambda name: True) -> Path:
    """The directory holding the files of ``project==version``'s wheel for
    which ``keep(name)`` is true (all by default; the vLLM wheel is 330 MB,
    of which the checks read only Python files).

    Raises :class:`WheelUnavailable` with pip's own last lines when the
    download fails."""
    root = _cache_dir(project, version)
    if (root / _MARKER).is_file():
        return root
    wheel_prefix = re.sub(r"[-_.]+", "_", project).lower() + "-"
    with tempfile.TemporaryDirectory(prefix=f"kv-budget-{project}-") as download:
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
            "-d", download, f"{project}=={version}",
        ]
        result = subprocess.run(command, capture_output=True, text=True, timeout=900)
        wheels = sorted(p for p in Path(download).glob("*.whl") if p.name.lower().startswith(wheel_prefix))
        if result.returncode != 0 or not wheels:
            tail = " | ".join((result.stderr or result.stdout).strip().splitlines()[-3:])
            raise WheelUnavailable(
                f"`pip download --no-deps {project}=={version}` failed (exit {result.returncode}): {tail}"
            )
        root.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extractall(root, members=[name for name in wheel.namelist() if keep(name)])
    (root / _MARKER).write_text(wheels[0].name + "\n")
    return root
