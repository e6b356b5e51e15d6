"""vLLM-Omni 0.30.0's MiMo-Audio local transformer, built and run on the CPU for the audit.

Why: MiMo-Audio's stage 0 (the fused thinker-talker) decodes the audio codes
of each step with a small "local transformer" whose attention KV is a
``DynamicCache`` built inside ``base_local_forward``, outside vLLM's paged
pool. vLLM-Omni declares it (``model_local_kv_specs`` on
``MiMoAudioLLMForConditionalGeneration``: ``local_transformer``, one row per
sequence, ``group_size + max(delay_pattern)`` positions, plus a graph-pool
entry per captured CUDA-graph bucket). Whether that declaration matches what
the code builds can only be answered by running vLLM-Omni's own code, so
everything here builds and drives the real objects:

* ``MiMoAudioLLMForConditionalGeneration`` (``mimo_audio/mimo_audio_llm.py``)
  is built by its own ``__init__`` from a real ``VllmConfig`` (vLLM's
  ``ModelConfig`` over a small ``config.json``), under a real single-process
  tensor-parallel group (gloo on the loopback address) and the model dtype as
  vLLM's loader sets it. Its inner vLLM ``Qwen2ForCausalLM``, the
  ``ColumnParallelLinear`` projections, the transformers local transformer
  and the CUDA-graph capture decision (skipped off CUDA) are all theirs.
* The local decode loop is driven through
  ``_generate_speech_tokens_and_audio_embeddings``, the method ``forward``
  calls with the last hidden state of every request of a step: it downcasts,
  calls ``local_forward`` (which, with no captured graph, runs
  ``base_local_forward``) and embeds the codes.

What is not vLLM-Omni's here: the small ``config.json`` (``model_type:
qwen2``, which their ``__init__`` converts to ``MiMoAudioConfig`` itself,
with the MiMo fields: group size 4, 8 channels, delay pattern 0-7 as
published, but a local transformer of 2 layers, 4 heads of 16), random
weights (seeded), random hidden states, the ``ModuleDict`` root whose only
child is named ``fused_thinker_talker`` (the attribute under which
``MiMoAudioForConditionalGeneration`` keeps this model, so the owner path the
audit reports is the one a deployment's collector reports), and one
attribute: the cache is a local variable of ``base_local_forward``, so a
forward pre-hook on ``local_transformer`` reads it from the call's keyword
arguments (their code is not changed) and :func:`local_transformer_batch`
keeps a reference to it on the model as ``kv_budget_local_cache`` so that
``kv-budget audit`` sees it as it was when the loop ended.

The vLLM set-up around the constructor is :mod:`peers.vllm_omni.vllm_setup`.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from kv_budget.collect.model import collect_model_local_kv_specs
from kv_budget.sample.caches import cache_breakdown, measure_cache_bytes
from peers.vllm_omni.files import import_omni_module
from peers.vllm_omni.vllm_setup import built_under, finish_loading, vllm_cpu_config

__all__ = [
    "MODULE",
    "OWNER",
    "DTYPE",
    "GROUP_SIZE",
    "DELAY_PATTERN",
    "LOCAL_LAYERS",
    "LOCAL_HEADS",
    "LOCAL_HEAD_DIM",
    "build_fused_thinker_talker",
    "run_local_decode",
    "local_transformer_batch",
    "local_transformer_batch1",
    "local_transformer_batch4",
    "measure",
]

MODULE = "vllm_omni.model_executor.models.mimo_audio.mimo_audio_llm"

OWNER = "fused_thinker_talker"
"""Where ``MiMoAudioForConditionalGeneration`` keeps the declaring model
(``mimo_audio.py``; its ``model`` attribute is the same object, so the
collector, first path wins, reports this one)."""

DTYPE = torch.bfloat16
"""The dtype vLLM-Omni's MiMo buffers are hard-coded to, and the model's."""

GROUP_SIZE = 4
DELAY_PATTERN = "0-1-2-3-4-5-6-7"
"""MiMo-Audio's published decode-loop geometry (``MiMoAudioConfig``
defaults): ``group_size + max(delay_pattern)`` = 11 steps."""

LOCAL_LAYERS = 2
LOCAL_HEADS = 4
LOCAL_HEAD_DIM = 16
"""A small local transformer (published: 16 layers, 64 heads of 16)."""

_CONFIG = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    # The thinker LLM: vLLM-Omni's mrope section [16, 24, 24] needs a head_dim
    # of 128; its ``local_config()`` copies ``layer_types`` from this config,
    # so it needs at least as many layers as the local transformers.
    "hidden_size": 256,
    "intermediate_size": 256,
    "num_hidden_layers": LOCAL_LAYERS,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "group_size": GROUP_SIZE,
    "audio_channels": 8,
    "delay_pattern": DELAY_PATTERN,
    "speech_vocab_size": "33-33-17-17-17-17-17-17",
    "speech_zeroemb_idx": "32-32-16-16-16-16-16-16",
    "local_dim": LOCAL_HEADS * LOCAL_HEAD_DIM,
    "local_layers": LOCAL_LAYERS,
    "local_attn_heads": LOCAL_HEADS,
    "local_ffn_dim": 128,
    "input_local_layers": 1,
}


def build_fused_thinker_talker() -> torch.nn.Module:
    """vLLM-Omni's ``MiMoAudioLLMForConditionalGeneration`` built by its own
    ``__init__`` (random weights, seeded). Off CUDA its constructor captures
    no local-decode graph, so ``local_forward_cg_by_bs`` stays empty: this is
    the model a CPU (or eager) deployment has."""
    module = import_omni_module(MODULE)
    vllm_config = vllm_cpu_config(_CONFIG, DTYPE)
    with built_under(vllm_config):
        torch.manual_seed(0)
        model = module.MiMoAudioLLMForConditionalGeneration(vllm_config=vllm_config, prefix=OWNER)
    return finish_loading(model, vllm_config)


def run_local_decode(model: torch.nn.Module, batch: int) -> tuple[Any, dict[str, Any]]:
    """Run the local decode loop for ``batch`` requests, as ``forward`` does
    for one step, and return the cache it built with what was seen of it.

    The cache never outlives the call, so a forward pre-hook on
    ``local_transformer`` reads ``past_key_values`` from each call's keyword
    arguments. What it saw (how many local-transformer calls, how many
    distinct cache objects) is returned so a caller can check that the one
    cache observed is the one the whole loop filled."""
    seen: list[Any] = []

    def observe(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        seen.append(kwargs.get("past_key_values"))

    handle = model.local_transformer.register_forward_pre_hook(observe, with_kwargs=True)
    try:
        generator = torch.Generator().manual_seed(batch)
        hidden = torch.randn(batch, 1, model.config.hidden_size, generator=generator).to(DTYPE)
        with torch.no_grad():
            tokens, _ = model._generate_speech_tokens_and_audio_embeddings(hidden)
    finally:
        handle.remove()
    caches = {id(c): c for c in seen if c is not None}
    if len(caches) != 1:
        raise RuntimeError(f"expected one local cache per call, observed {len(caches)} over {len(seen)} steps")
    (cache,) = caches.values()
    return cache, {"local_transformer_calls": len(seen), "cache_objects": len(caches), "codes_shape": list(tokens.shape)}


def local_transformer_batch(batch: int) -> torch.nn.Module:
    """The model after one local decode for ``batch`` requests, holding the
    cache that decode built (``kv_budget_local_cache``) under a root that
    names it ``fused_thinker_talker``, for ``kv-budget audit``."""
    model = build_fused_thinker_talker()
    cache, _ = run_local_decode(model, batch)
    model.kv_budget_local_cache = cache
    return torch.nn.ModuleDict({OWNER: model})


def local_transformer_batch1() -> torch.nn.Module:
    """One request: the declaration's per-row figure, alone."""
    return local_transformer_batch(1)


def local_transformer_batch4() -> torch.nn.Module:
    """Four requests in one step: one cache four rows wide."""
    return local_transformer_batch(4)


def measure(batch: int = 4) -> dict[str, Any]:
    """Declared versus built for one local decode of ``batch`` requests, in
    exact bytes, from vLLM-Omni's own declarer and its own decode loop."""
    model = build_fused_thinker_talker()
    declared = {
        owned.spec.name: {
            "scope": owned.spec.scope.value,
            "rows": owned.spec.rows.value,
            "positions": owned.spec.physical_capacity_positions,
            "bytes_per_row": owned.spec.bytes_per_row,
            "capacity_source": owned.spec.capacity_source,
        }
        for owned in collect_model_local_kv_specs(torch.nn.ModuleDict({OWNER: model})).specs
    }
    cache, seen = run_local_decode(model, batch)
    layers = cache_breakdown(cache)
    return {
        "batch": batch,
        "declared": declared,
        "declared_bytes_at_batch": declared["local_transformer"]["bytes_per_row"] * batch,
        "measured_bytes": measure_cache_bytes(cache),
        "cache_class": type(cache).__name__,
        "layers": len(layers),
        "positions_per_layer": sorted({layer.positions for layer in layers}),
        "rows_per_layer": sorted({layer.batch for layer in layers if layer.batch is not None}),
        "view_bytes": sum(layer.view_bytes for layer in layers),
        "captured_graph_buckets": sorted(model.local_forward_cg_by_bs),
        "cuda_available": torch.cuda.is_available(),
        **seen,
    }


if __name__ == "__main__":  # pragma: no cover - a manual look at the figures
    print(json.dumps(measure(), indent=2))
