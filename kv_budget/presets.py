"""Published declarations of real models, for sizing before a server starts.

Each preset is what vLLM-Omni 0.30.0's declarer makes for that model: the
same owner path (as the collector reports it inside the stage model) and
declaration names, so an override written for a running server
(``--model-local-kv-override OWNER/NAME:FIELD=VALUE``) works on
``kv-budget plan --preset ... --override`` unchanged. The geometries
reproduce the per-row bytes of the published figures; where a figure gives
only bytes per row, the geometry here is one consistent with it (the
product, not each factor, is what the planner uses), and each preset says
which. Where vLLM-Omni's declaration holds less than its caches do, the
preset keeps the declared figure (it is what a server plans with) and its
docstring gives the correcting override (docs/vllm-omni.md has the
measurements).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .protocol import Collection, ModelLocalKVSpec, OwnedSpec, RowDriver, Scope

__all__ = ["PRESETS", "preset_collection"]


def _qwen3_tts_async_chunk() -> list[OwnedSpec]:
    """Qwen3-TTS codec decoder in async-chunk mode (the stateless path holds
    no KV and must declare nothing). Sliding window 72 keeps 71 positions.
    8 layers x 16 kv heads x head_dim 64 in float32 = 4,653,056 B per row.

    71 is the published figure and is kept so the preset reproduces it; the
    audit shows transformers 5.x sliding layers keep W = 72 positions of
    storage alive after a decode step (4,718,592 B per row), more with
    multi-token chunks (docs/semantics.md)."""
    geometry = dict(layers=8, kv_heads=16, head_dim=64, dtype=torch.float32,
                    physical_capacity_positions=71, capacity_source="sliding_window - 1")
    owner = "decoder"
    return [
        OwnedSpec(owner, ModelLocalKVSpec(
            name="codec_decoder_request", scope=Scope.REQUEST, rows=RowDriver.MAX_NUM_SEQS,
            allocation_note="retained per request between chunks", **geometry)),
        OwnedSpec(owner, ModelLocalKVSpec(
            name="codec_decoder_working_copy", scope=Scope.INVOCATION, rows=RowDriver.MAX_NUM_SEQS,
            allocation_note="per-call copy of the retained cache", **geometry)),
        OwnedSpec(owner, ModelLocalKVSpec(
            name="codec_decoder_graph_pool", scope=Scope.MODEL, rows=RowDriver.FIXED, rows_fixed=5,
            rows_reason="one dummy cache per captured shape; 5 rows measured", **geometry)),
    ]


def _mimo_audio() -> list[OwnedSpec]:
    """MiMo-Audio local transformer: group_size 4 + max(delay_pattern) 7 =
    11 positions. Published: 720,896 B per row; geometry here 16 layers x
    8 kv heads x head_dim 128 in bfloat16 reproduces it."""
    geometry = dict(layers=16, kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                    physical_capacity_positions=11,
                    capacity_source="group_size + max(delay_pattern)")
    return [
        OwnedSpec("fused_thinker_talker", ModelLocalKVSpec(
            name="local_transformer", scope=Scope.INVOCATION, rows=RowDriver.MAX_NUM_SEQS, **geometry)),
        OwnedSpec("fused_thinker_talker", ModelLocalKVSpec(
            name="local_transformer_graph_pool", scope=Scope.MODEL, rows=RowDriver.FIXED, rows_fixed=261,
            rows_reason="sum of captured buckets 1,2,4,6,8,16,32,64,128", **geometry)),
    ]


def _minicpm_o_streaming() -> list[OwnedSpec]:
    """MiniCPM-o Whisper encoder in streaming mode: 1500 embed_positions
    rows. Published: 147,456,000 B per row; geometry 24 layers x 16 heads x
    head_dim 64 in bfloat16 (Whisper-medium's encoder) reproduces it."""
    return [
        OwnedSpec("thinker.apm", ModelLocalKVSpec(
            name="whisper_encoder_self_attn", layers=24, kv_heads=16, head_dim=64, dtype=torch.bfloat16,
            physical_capacity_positions=1500, capacity_source="embed_positions rows",
            scope=Scope.SESSION, rows=RowDriver.FIXED, rows_fixed=1,
            rows_reason="one streaming session at a time")),
    ]


def _ming_talker() -> list[OwnedSpec]:
    """ming-flash-omni talker: a StaticCache of a hard-coded 2048 positions,
    24 layers x 2 kv heads x head_dim 64 (hidden 896 / 14 heads) in bfloat16
    = 25,165,824 B."""
    return [
        OwnedSpec("", ModelLocalKVSpec(
            name="talker_llm_static_cache", layers=24, kv_heads=2, head_dim=64, dtype=torch.bfloat16,
            physical_capacity_positions=2048, capacity_source="hard-coded static cache length",
            scope=Scope.INVOCATION, rows=RowDriver.FIXED, rows_fixed=1,
            rows_reason="talker calls are serialized")),
    ]


PRESETS: dict[str, tuple[str, Callable[[], list[OwnedSpec]]]] = {
    "qwen3-tts-async-chunk": (
        "Qwen3-TTS codec decoder, async-chunk: 2 x 4.44 MiB per sequence + 5-row graph pool",
        _qwen3_tts_async_chunk,
    ),
    "mimo-audio": (
        "MiMo-Audio local transformer: 704 KiB per sequence + 261-row graph pool",
        _mimo_audio,
    ),
    "minicpm-o-streaming": (
        "MiniCPM-o Whisper encoder, streaming: 140.62 MiB, one session",
        _minicpm_o_streaming,
    ),
    "ming-talker": (
        "ming-flash-omni talker StaticCache: 24.00 MiB, calls serialized",
        _ming_talker,
    ),
}
"""Name -> (one-line summary for ``--list-presets``, builder)."""


def preset_collection(name: str) -> Collection:
    """The declarations of preset ``name``; unknown names raise, listing the known."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
    return Collection(specs=tuple(PRESETS[name][1]()), failures=())
