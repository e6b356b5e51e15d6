"""Test support: vLLM-Omni 0.30.0's own Qwen3-TTS deploy file, changed only where this machine needs it.

Test support, not vLLM-Omni code and not part of kv-budget. What it
replaces: nothing of vLLM-Omni's; it reads vLLM-Omni's installed
``vllm_omni/deploy/qwen3_tts.yaml`` (the deploy ``vllm serve --omni`` uses
for a ``qwen3_tts`` checkpoint by default) and writes a copy with the few
settings a CPU-only machine and the small random checkpoint of
:mod:`kv_budget_omni_cpu.qwen3_tts_checkpoint` require. Every change is
listed in :attr:`Qwen3TTSDeploy.changes` with its reason, so tests and docs
can print exactly what differs from the shipped file; everything else
(connectors and their chunking, the pipeline, sampling temperatures, the
stage dtypes, devices, memory fractions, batching limits, the ``platforms:``
sections) is as shipped.

Why each kind of change:

* ``model_runner: v1``: the shipped default is Model Runner V2, which needs
  Triton (vLLM falls back to V1 on the CPU anyway, ``vllm/config/vllm.py``);
  said explicitly so the file says what runs.
* ``enforce_eager: true`` on both stages: there are no CUDA graphs on the
  CPU, and vLLM's CPU build would otherwise ``torch.compile`` each stage at
  start (minutes on 2 cores).
* stage 0 ``compilation_config.max_cudagraph_capture_size: 0``: vLLM-Omni's
  model runner sizes the talker's MTP buffers with
  ``max(max_num_reqs, compilation_config.max_cudagraph_capture_size)``
  (``worker/gpu_model_runner.py``, ``_init_talker_mtp``); vLLM sets that
  value to 0 for an eager model only on CUDA-alike platforms and leaves it
  ``None`` on the CPU, where the comparison raises. 0 is what vLLM itself
  sets under ``enforce_eager``.
* ``max_num_seqs: 256`` on both stages: the load is 256 concurrent requests
  (shipped: 64).
* stage 0 ``default_sampling_params.min_tokens`` = ``max_tokens`` =
  :data:`FRAMES`: random weights sample codec end-of-speech early in some
  requests; a fixed number of codec frames makes every request reach the
  decoder's sliding window (72) and its steady state, and keeps the run short.
"""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = ["FRAMES", "MAX_NUM_SEQS", "Change", "Qwen3TTSDeploy", "shipped_deploy_path", "qwen3_tts_deploy"]

FRAMES = 150
"""Codec frames (talker decode steps) per request: past the window of 72 and
three full 25-frame chunks, so the decoder's cache reaches steady state."""
MAX_NUM_SEQS = 256


@dataclass(frozen=True)
class Change:
    key: str
    """Dotted path in the deploy file (``stages[1].max_num_seqs``)."""
    shipped: Any
    """The shipped value (None: the key is absent there)."""
    value: Any
    reason: str

    def __str__(self) -> str:
        return f"{self.key}: {self.shipped!r} -> {self.value!r} ({self.reason})"


@dataclass
class Qwen3TTSDeploy:
    path: Path
    shipped_path: Path
    changes: list[Change] = field(default_factory=list)
    document: dict = field(default_factory=dict)


def shipped_deploy_path() -> Path:
    """vLLM-Omni's installed ``deploy/qwen3_tts.yaml`` (found without importing vLLM-Omni)."""
    spec = importlib.util.find_spec("vllm_omni")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("vllm_omni is not installed in this interpreter")
    path = Path(next(iter(spec.submodule_search_locations))) / "deploy" / "qwen3_tts.yaml"
    if not path.is_file():
        raise FileNotFoundError(path)
    return path


def _stage(document: dict, stage_id: int) -> dict:
    for stage in document["stages"]:
        if stage["stage_id"] == stage_id:
            return stage
    raise KeyError(f"stage {stage_id} not in the shipped deploy")


def qwen3_tts_deploy(directory: str | Path, *, frames: int = FRAMES, max_num_seqs: int = MAX_NUM_SEQS,
                     name: str = "qwen3_tts_cpu.yaml") -> Qwen3TTSDeploy:
    """Write the changed copy into ``directory``; returns its path and the changes."""
    shipped_path = shipped_deploy_path()
    shipped = yaml.safe_load(shipped_path.read_text())
    document = copy.deepcopy(shipped)
    changes: list[Change] = []

    def set_key(target: dict, key: str, value: Any, label: str, reason: str) -> None:
        changes.append(Change(label, copy.deepcopy(target.get(key)), value, reason))
        target[key] = value

    set_key(document, "model_runner", "v1", "model_runner",
            "Model Runner V2 needs Triton; vLLM runs V1 on the CPU")
    for stage_id in (0, 1):
        stage = _stage(document, stage_id)
        set_key(stage, "enforce_eager", True, f"stages[{stage_id}].enforce_eager",
                "no CUDA graphs on the CPU; avoids vLLM's CPU torch.compile at start")
        set_key(stage, "max_num_seqs", max_num_seqs, f"stages[{stage_id}].max_num_seqs",
                f"the load is {max_num_seqs} concurrent requests")
    talker = _stage(document, 0)
    compilation = dict(talker.get("compilation_config") or {})
    changes.append(Change("stages[0].compilation_config.max_cudagraph_capture_size",
                          compilation.get("max_cudagraph_capture_size"), 0,
                          "vLLM leaves it None off CUDA; vLLM-Omni's _init_talker_mtp compares it with an int "
                          "(0 is vLLM's own value under enforce_eager)"))
    compilation["max_cudagraph_capture_size"] = 0
    talker["compilation_config"] = compilation
    sampling = talker["default_sampling_params"]
    for key in ("min_tokens", "max_tokens"):
        set_key(sampling, key, frames, f"stages[0].default_sampling_params.{key}",
                f"random weights sample codec EOS early; {frames} frames per request reach the decoder's "
                "sliding window (72) and its steady state, and keep the run short")

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    header = "".join(f"# {change}\n" for change in changes)
    path.write_text(f"# vLLM-Omni's {shipped_path.name}, changed for a CPU-only machine (kv_budget_omni_cpu):\n"
                    f"{header}" + yaml.safe_dump(document, sort_keys=False))
    return Qwen3TTSDeploy(path=path, shipped_path=shipped_path, changes=changes, document=document)


if __name__ == "__main__":
    import sys

    deploy = qwen3_tts_deploy(sys.argv[1] if len(sys.argv) > 1 else ".")
    print(deploy.path)
    for change in deploy.changes:
        print(f"  {change}")
