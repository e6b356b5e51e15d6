"""Test support: vLLM-Omni 0.30.0's real orchestrator on vLLM's CPU build.

Not vLLM-Omni code and not part of kv-budget: a distribution of its own
(``tests/omni_cpu``, ``kv-budget-omni-cpu``), installed editable by the
Makefile into ``.venv-omni-serve`` only, never into the kv-budget wheel or
the other venvs. Everything that runs as vLLM-Omni is vLLM-Omni's own code
from its wheel (``vllm-omni==0.30.0``); this package holds only the shims
that let it run on a machine with no accelerator, each with what it
replaces and why in its docstring:

* :mod:`.import_alias`: transformers' torchvision module for Qwen2-VL,
  answered by its torchvision-free twin (installed by a ``.pth`` line);
* :mod:`.platform`: a vLLM-Omni platform over vLLM's ``CpuPlatform``,
  through vLLM-Omni's own ``vllm_omni.platform_plugins`` group
  (:func:`platform_plugin`);
* :mod:`.worker`: vLLM-Omni's AR and generation model runners over vLLM's
  CPU runner, in vLLM's CPU worker;
* :mod:`.pipelines`: text pipelines of kv-budget's demo model, registered
  with vLLM-Omni's ``register_pipeline``;
* :mod:`.qwen3_tts_checkpoint` and :mod:`.qwen3_tts_deploy` (imported by
  the tests only): a small Qwen3-TTS checkpoint for vLLM-Omni's own
  ``qwen3_tts`` pipeline, and vLLM-Omni's own ``deploy/qwen3_tts.yaml``
  with what this machine needs changed, each change with its reason;
* :mod:`.torchaudio_melscale`: a pure-torch ``melscale_fbanks`` served
  as torchaudio's (vLLM-Omni's speaker encoder needs it for voice clones;
  no torchaudio is built for this torch);
* :mod:`.qwen3_tts_probe` (switched on by environment variables): the
  test's own count of what the code2wav stage holds, and the real
  CUDA-graph wrapper attached so its decoder declares off CUDA;
* :func:`register` (a ``vllm.general_plugins`` entry point, so it runs in
  the driver, each stage's engine core and its workers): the demo
  architecture in vLLM-Omni's own model registry, and the pipelines.

Importing this package imports nothing else: the ``.pth`` line imports
:mod:`.import_alias` in every interpreter of the venv.
"""

from __future__ import annotations

PLATFORM = "kv_budget_omni_cpu.platform.CpuOmniPlatform"
DEMO_MODEL_CLASS = "kv_budget_demo.model:KvBudgetDemoForCausalLM"
"""kv_budget_demo.MODEL_CLASS, where a registry finds the demo architecture."""

_registered = False


def platform_plugin() -> str | None:
    """``vllm_omni.platform_plugins`` entry point: this platform where vLLM
    itself runs on its CPU build, none elsewhere (a machine with a GPU keeps
    vLLM-Omni's own platform)."""
    from vllm.platforms import current_platform

    return PLATFORM if current_platform.is_cpu() else None


def register_demo_architecture() -> None:
    """Make ``KvBudgetDemoForCausalLM`` resolvable by vLLM-Omni's model registry.

    Shim. What it replaces: the registration a model shipped with vLLM-Omni
    gets from ``_OMNI_MODELS``. Why: a stage resolves its architecture
    through ``OmniModelConfig.registry``, vLLM-Omni's ``OmniModelRegistry``,
    which is built once at import from vLLM's static model table and
    vLLM-Omni's own; the demo's vLLM plugin registers the architecture in
    vLLM's ``ModelRegistry``, which that registry never reads. The demo's
    class is named, not imported, as vLLM's registry does it."""
    from vllm_omni.model_executor.models.registry import OmniModelRegistry

    from kv_budget_omni_cpu.pipelines import ARCHITECTURE

    if ARCHITECTURE not in OmniModelRegistry.get_supported_archs():
        OmniModelRegistry.register_model(ARCHITECTURE, DEMO_MODEL_CLASS)


def register() -> None:
    """``vllm.general_plugins`` entry point (every vLLM process of the venv)."""
    global _registered
    if _registered:
        return
    from kv_budget_omni_cpu.import_alias import install
    from kv_budget_omni_cpu.pipelines import register_pipelines

    install()
    register_demo_architecture()
    register_pipelines()
    from kv_budget_omni_cpu.qwen3_tts_probe import install as install_qwen3_tts_probe

    install_qwen3_tts_probe()
    _registered = True
