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
from dataclasses import dataclass

import torch

from kv_budget.collect.model import Collection, OwnedSpec
from kv_budget.declare.spec import ModelLocalKVSpec, RowDriver, Scope

__all__ = ["PRESETS", "Preset", "preset_collection"]


def _qwen3_tts_async_chunk() -> list[OwnedSpec]:
    """Qwen3-TTS codec decoder (code2wav stage) in async-chunk mode, as
    vLLM-Omni declares it when a CUDA-graph wrapper exists (the stateless
    path holds no KV and declares nothing; the eager path declares nothing
    although it holds the caches: docs/vllm-omni-qwen3-tts.md).

    Geometry: the decoder config's defaults, 8 layers x 16 kv heads x
    head_dim 64 (hidden 1024 / 16 heads); sliding window 72 declared as 71
    positions. dtype bfloat16: ``deploy/qwen3_tts.yaml`` runs the decoder in
    bfloat16 and the declarer takes its parameters' dtype, so a deployment
    declares 2,326,528 B per row (the published 4,653,056 B is the same row
    in float32). The graph pool's 5 rows are the published measurement (no
    GPU here to re-measure them)."""
    geometry = dict(layers=8, kv_heads=16, head_dim=64, dtype=torch.bfloat16,
                    physical_capacity_positions=71, capacity_source="sliding_window(72) - 1")
    owner = "decoder"
    return [
        OwnedSpec(owner, ModelLocalKVSpec(
            name="codec_decoder_request", scope=Scope.REQUEST, rows=RowDriver.MAX_NUM_SEQS,
            allocation_note="retained across chunks of one request", **geometry)),
        OwnedSpec(owner, ModelLocalKVSpec(
            name="codec_decoder_working_copy", scope=Scope.INVOCATION, rows=RowDriver.MAX_NUM_SEQS,
            allocation_note="deep-copied from the retained cache each chunk; live alongside it", **geometry)),
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


@dataclass(frozen=True)
class Preset:
    """A model's published declarations and the corrections its audit found."""

    summary: str
    """One line for ``--list-presets``."""

    build: Callable[[], list[OwnedSpec]]

    corrections: tuple[tuple[str, str], ...] = ()
    """(override, why): for each declaration that holds less than its
    caches do, the ``--override`` that corrects it and the measurement
    behind it. The preset itself stays as declared: it is what a server
    running vLLM-Omni's declarer plans with."""


PRESETS: dict[str, Preset] = {
    "qwen3-tts-async-chunk": Preset(
        "Qwen3-TTS codec decoder, async-chunk: 2 x 2.22 MiB per sequence + 5-row graph pool (bfloat16)",
        _qwen3_tts_async_chunk,
        (
            ("decoder/codec_decoder_request:physical_capacity_positions=72",
             "a row on the single-request path keeps the whole window of 72 positions alive behind "
             "its 71-position view (measured 72; a reference longer than 72 frames keeps its length)"),
            ("decoder/codec_decoder_working_copy:physical_capacity_positions=168",
             "the per-chunk working copy peaks at 71 kept + 97 fed = 168 positions per row (measured); "
             "239 on the eager batched path, where a batched copy of the retained rows is live too"),
        ),
    ),
    "mimo-audio": Preset(
        "MiMo-Audio local transformer: 704 KiB per sequence + 261-row graph pool",
        _mimo_audio,
    ),
    "minicpm-o-streaming": Preset(
        "MiniCPM-o Whisper encoder, streaming: 140.62 MiB, one session",
        _minicpm_o_streaming,
        (
            ("thinker.apm/whisper_encoder_self_attn:rows_fixed=4",
             "deploy/minicpmo_4_5.yaml allows max_sessions 4 and each session keeps its own cache "
             "(measured: 4 sessions held 4 caches against 1 declared)"),
        ),
    ),
    "ming-talker": Preset(
        "ming-flash-omni talker StaticCache: 24.00 MiB, calls serialized",
        _ming_talker,
    ),
}
"""Name -> preset. Corrections come from ``kv-budget audit`` of vLLM-Omni
0.30.0's own models (docs/vllm-omni.md); MiMo-Audio's declaration matched
what its local transformer holds, and ming-flash-omni's talker was audited
from its Hugging Face geometry only."""


def preset_collection(name: str) -> Collection:
    """The declarations of preset ``name``; unknown names raise, listing the known."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
    return Collection(specs=tuple(PRESETS[name].build()), failures=())
