"""Every row of the figures table in budget.md, reproduced from declarations.

The figures are the published ones; what is computed is the declaration's
own arithmetic (protocol) and the planner's sums over the presets.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import Qwen2Config

from kv_budget import RowDriver, spec_from_hf_config
from kv_budget.collect.presets import PRESETS, preset_collection
from kv_budget.declare.spec import Scope
from kv_budget.override import apply_overrides, parse_override
from kv_budget.plan.planner import budget_worker, headroom_override


def _by_name(preset):
    return {o.spec.name: o.spec for o in preset_collection(preset).specs}


QWEN3_TTS_ROW_F32 = 2 * 8 * 16 * 64 * 71 * 4  # the published row: 4,653,056 B


def test_qwen3_tts_codec_decoder_rows():
    """The published row (float32) from the preset's geometry; the preset
    itself is bfloat16, the dtype deploy/qwen3_tts.yaml runs, so half."""
    specs = _by_name("qwen3-tts-async-chunk")
    decoder = specs["codec_decoder_request"]
    assert decoder.physical_capacity_positions == 71
    published = dataclasses.replace(decoder, dtype=torch.float32)
    assert published.bytes_per_row == QWEN3_TTS_ROW_F32 == 4_653_056
    # Per-request cache alone at max_num_seqs=256, as published (float32).
    assert published.peak_bytes(256) == 1_191_182_336
    assert decoder.dtype is torch.bfloat16 and decoder.bytes_per_row == 2_326_528
    assert specs["codec_decoder_working_copy"].bytes_per_row == 2_326_528
    assert decoder.rows is RowDriver.MAX_NUM_SEQS
    assert specs["codec_decoder_working_copy"].rows is RowDriver.MAX_NUM_SEQS
    budget = budget_worker(preset_collection("qwen3-tts-async-chunk"), headroom_override(0), max_num_seqs=256)
    assert budget.per_seq_bytes * 256 == 1_191_182_336  # two bfloat16 rows per sequence


def test_qwen3_tts_graph_pool_is_already_charged():
    pool = _by_name("qwen3-tts-async-chunk")["codec_decoder_graph_pool"]
    assert pool.scope is Scope.MODEL
    assert dataclasses.replace(pool, dtype=torch.float32).peak_bytes(256) == 23_265_280  # published, float32
    assert pool.peak_bytes(256) == 11_632_640
    budget = budget_worker(preset_collection("qwen3-tts-async-chunk"), headroom_override(0), max_num_seqs=256)
    assert budget.charged_bytes == 11_632_640
    assert budget.uncharged_fixed_bytes == 0


def test_mimo_audio_rows():
    specs = _by_name("mimo-audio")
    local = specs["local_transformer"]
    assert local.physical_capacity_positions == 11
    assert local.bytes_per_row == 720_896
    pool = specs["local_transformer_graph_pool"]
    assert pool.rows_fixed == sum([1, 2, 4, 6, 8, 16, 32, 64, 128]) == 261
    assert pool.peak_bytes(256) == 188_153_856


def test_minicpm_o_whisper_encoder_row():
    (spec,) = _by_name("minicpm-o-streaming").values()
    assert spec.physical_capacity_positions == 1500
    assert spec.peak_bytes(256) == 147_456_000
    budget = budget_worker(preset_collection("minicpm-o-streaming"), headroom_override(0), max_num_seqs=256)
    assert budget.uncharged_fixed_bytes == 147_456_000 and budget.per_seq_bytes == 0


def test_ming_talker_from_its_hf_config_geometry():
    """Geometry as budget.md gives it: 24 layers, 2 kv heads, hidden 896 / 14
    heads = head_dim 64, bf16, 2048 positions."""
    config = Qwen2Config(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, num_hidden_layers=24)
    spec = spec_from_hf_config(
        config, name="talker", dtype=torch.bfloat16, physical_capacity_positions=2048,
        capacity_source="hard-coded", scope="invocation", rows="fixed", rows_fixed=1, rows_reason="serialized",
    )
    assert spec.head_dim == 64
    assert spec.bytes_per_row == 25_165_824
    (preset,) = _by_name("ming-talker").values()
    assert preset.bytes_per_row == spec.bytes_per_row
    assert preset.rows_fixed == 1


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_correction_applies_to_its_preset_and_adds_bytes(name):
    """A correction that matched nothing, or lowered a figure, would be a
    stale line in --list-presets."""
    collection = preset_collection(name)
    for override, why in PRESETS[name].corrections:
        corrected, unmatched = apply_overrides(collection, [parse_override(override)])
        assert unmatched == [] and why
        before = budget_worker(collection, headroom_override(0), max_num_seqs=256)
        after = budget_worker(corrected, headroom_override(0), max_num_seqs=256)
        assert after.per_seq_bytes + after.uncharged_fixed_bytes > before.per_seq_bytes + before.uncharged_fixed_bytes


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_valid_and_non_empty(name):
    collection = preset_collection(name)
    assert collection.specs and not collection.failures


def test_unknown_preset_lists_the_known():
    with pytest.raises(ValueError, match="ming-talker"):
        preset_collection("qwen9")
