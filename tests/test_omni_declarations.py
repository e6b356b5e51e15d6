"""vLLM-Omni's own declarations, taken as it makes them.

Every declaration here is built by vLLM-Omni 0.30.0's code: its declaration
module, its Qwen3-TTS codec decoder's declarer and its real CUDA-graph
decoder wrapper (constructed without capture, which is what makes the
decoder declare its per-request caches), all from the wheel
(``peers.vllm_omni.files``). No class here imitates theirs: a hand-written
look-alike is how kv-budget came to refuse every per-sequence declaration
vLLM-Omni makes while its tests passed.
"""

from __future__ import annotations

import pytest
import torch

import kv_budget
from kv_budget import InvalidDeclarationError, ModelLocalKVSpec, RowDriver, collect_model_local_kv_specs
from kv_budget.declare.spec import Scope, normalize_spec
from kv_budget.plan.planner import budget_worker, headroom_override, make_plan
from peers.vllm_omni.files import DECLARATION_MODULE, OmniFilesUnavailable, exec_omni_source, import_omni_module

TOKENIZER = "vllm_omni.model_executor.models.qwen3_tts.tokenizer_12hz."
DECODER_MODULE = TOKENIZER + "modeling_qwen3_tts_tokenizer_v2"
WRAPPER_MODULE = "vllm_omni.model_executor.models.qwen3_tts.segmented_graph_wrapper"
OMNI_IMPORT = "from vllm_omni.model_executor.models.model_local_kv import"

# Qwen3-TTS's published decoder geometry (the config class's defaults):
# 8 layers, 16 kv heads, hidden 1024 / 16 heads = head_dim 64, float32,
# sliding window 72 -> 71 positions declared.
QWEN3_TTS_ROW = 2 * 8 * 16 * 64 * 71 * 4

# Every test reads vLLM-Omni's wheel, whose declaration module imports vllm.logger.
pytestmark = [pytest.mark.network, pytest.mark.vllm]


def _omni(name: str):
    try:
        return import_omni_module(name)
    except OmniFilesUnavailable as exc:
        pytest.skip(f"vLLM-Omni's files are unavailable: {exc}")


@pytest.fixture(scope="module")
def omni():
    """vLLM-Omni 0.30.0's declaration module, from its wheel."""
    return _omni(DECLARATION_MODULE)


@pytest.fixture(scope="module")
def decoder_config():
    """vLLM-Omni's Qwen3-TTS decoder config class, shrunk (2 layers, 2 heads
    of 64) but with its real sliding window of 72."""
    config_module = _omni(TOKENIZER + "configuration_qwen3_tts_tokenizer_v2")
    return config_module.Qwen3TTSTokenizerV2DecoderConfig(
        codebook_size=64, codebook_dim=16, hidden_size=128, latent_dim=64, num_attention_heads=2,
        num_key_value_heads=2, intermediate_size=64, num_hidden_layers=2, num_quantizers=4,
        upsample_rates=(2, 2), upsampling_ratios=(2,), decoder_dim=32,
    )


def _declaring_decoder(modeling, config):
    """vLLM-Omni's decoder with its real wrapper attached in async-chunk mode:
    what ``enable_cudagraph`` sets up on CUDA, minus the capture (which
    needs a GPU). With it the decoder declares its per-request caches."""
    wrapper_module = _omni(WRAPPER_MODULE)
    decoder = modeling.Qwen3TTSTokenizerV2Decoder(config)
    decoder._cudagraph_wrapper = wrapper_module.CUDAGraphDecoderWrapper(
        decoder=decoder, num_quantizers=config.num_quantizers, async_chunk=True
    )
    return decoder


class StageModel(torch.nn.Module):
    """Only a root to walk from: a vLLM-Omni stage model keeps the decoder
    as its ``decoder`` child, which is the owner path the collector reports."""

    def __init__(self, decoder: torch.nn.Module) -> None:
        super().__init__()
        self.decoder = decoder


@pytest.fixture(scope="module")
def omni_decoder(decoder_config):
    return _declaring_decoder(_omni(DECODER_MODULE), decoder_config)


def test_every_per_sequence_declaration_vllm_omni_makes_is_planned(omni, omni_decoder):
    """The defect: vLLM-Omni's specs carry ``rows_fixed=1`` beside
    ``rows=MAX_NUM_SEQS`` (its default, documented as ignored) and were
    refused, so the plan saw zero per-sequence bytes."""
    declared = omni_decoder.model_local_kv_specs()
    assert [type(spec) for spec in declared] == [omni.ModelLocalKVSpec] * 2
    assert all(spec.rows is omni.RowDriver.MAX_NUM_SEQS and spec.rows_fixed == 1 for spec in declared)

    collection = collect_model_local_kv_specs(StageModel(omni_decoder))
    assert collection.failures == ()
    assert [(o.owner, o.spec.name) for o in collection.specs] == [
        ("decoder", "codec_decoder_request"),
        ("decoder", "codec_decoder_working_copy"),
    ]
    row = 2 * 2 * 2 * 64 * 71 * 4  # layers x kv heads x head_dim x (72 - 1) positions x float32
    worker = budget_worker(collection, headroom_override(100 * row), max_num_seqs=256)
    plan = make_plan([worker], 256, "cap")
    assert plan.per_seq_bytes == 2 * row == sum(spec.bytes_per_row for spec in declared)
    assert plan.effective_max_num_seqs == 50
    assert [line.rows_fixed for line in plan.declarations] == [None, None]


def test_our_collector_reads_what_vllm_omnis_collector_reads(omni, omni_decoder):
    """Same owners, names and bytes as vLLM-Omni's own collector on the same
    model; ours also iterates as its (path, spec) pairs."""
    root = StageModel(omni_decoder)
    theirs = omni.collect_model_local_kv_specs(root)
    ours = collect_model_local_kv_specs(root)
    assert len(ours) == len(theirs) == 2
    assert [(path, spec.name, spec.peak_bytes(256)) for path, spec in ours] == [
        (path, spec.name, spec.peak_bytes(256)) for path, spec in theirs
    ]


def test_published_qwen3_tts_row_from_vllm_omnis_helper_and_config(omni):
    """vLLM-Omni's helper on its own config class (defaults = the published
    model) gives 4,653,056 B per row; normalised, the figure is unchanged."""
    config_module = _omni(TOKENIZER + "configuration_qwen3_tts_tokenizer_v2")
    config = config_module.Qwen3TTSTokenizerV2DecoderConfig()
    theirs = omni.spec_from_hf_config(
        config, name="codec_decoder_request", dtype=torch.float32, physical_capacity_positions=71,
        capacity_source="sliding_window(72) - 1", scope=omni.ModelLocalKVScope.REQUEST,
        rows=omni.RowDriver.MAX_NUM_SEQS,
    )
    ours = normalize_spec(theirs)
    assert theirs.bytes_per_row == ours.bytes_per_row == QWEN3_TTS_ROW == 4_653_056
    assert ours.peak_bytes(256) == theirs.peak_bytes(256) == 1_191_182_336
    mirrored = kv_budget.spec_from_hf_config(
        config, name="codec_decoder_request", dtype=torch.float32, physical_capacity_positions=71,
        capacity_source="sliding_window(72) - 1", scope=Scope.REQUEST, rows=RowDriver.MAX_NUM_SEQS,
    )
    assert mirrored == ours


CASES = [
    # (fields beyond the valid base, what vLLM-Omni does)
    (dict(rows="MAX_NUM_SEQS"), "accepts"),
    (dict(rows="MAX_NUM_SEQS", rows_fixed=0), "accepts"),
    (dict(rows="MAX_NUM_SEQS", rows_fixed=7, rows_reason=""), "accepts"),
    (dict(rows="FIXED", rows_fixed=4, rows_reason="four sessions"), "accepts"),
    (dict(rows="MAX_NUM_SEQS", capacity_source=""), "accepts"),
    (dict(rows="FIXED", rows_fixed=0, rows_reason="none"), "refuses"),
    (dict(rows="FIXED", rows_fixed=3), "refuses"),
    (dict(rows="FIXED", rows_fixed=3, rows_reason="   "), "refuses"),
]


@pytest.mark.parametrize("fields, verdict", CASES)
def test_refuse_exactly_what_vllm_omni_refuses(omni, fields, verdict):
    """Built with vLLM-Omni's class where it accepts, the object normalises
    with its bytes and rows; where its class raises, ours raises too."""
    fields = dict(fields)
    rows = getattr(omni.RowDriver, fields.pop("rows"))
    base = dict(
        name="kv", layers=2, kv_heads=2, head_dim=64, dtype=torch.bfloat16, physical_capacity_positions=9,
        capacity_source="test bound", scope=omni.ModelLocalKVScope.REQUEST, rows=rows,
    )
    base.update(fields)
    if verdict == "refuses":
        with pytest.raises(ValueError):
            omni.ModelLocalKVSpec(**base)
        with pytest.raises(InvalidDeclarationError):
            ModelLocalKVSpec(**base)
        return
    theirs = omni.ModelLocalKVSpec(**base)
    ours = normalize_spec(theirs)
    assert ours.bytes_per_row == theirs.bytes_per_row
    for max_num_seqs in (1, 5, 256):
        assert ours.row_count(max_num_seqs) == theirs.row_count(max_num_seqs)
        assert ours.peak_bytes(max_num_seqs) == theirs.peak_bytes(max_num_seqs)


def test_geometry_that_cannot_be_counted_is_refused_saying_why(omni):
    """The one place kv-budget is stricter than vLLM-Omni's class: a
    geometry that is not a positive int gives no believable byte count."""
    theirs = omni.ModelLocalKVSpec(
        name="kv", layers=0, kv_heads=2, head_dim=64, dtype=torch.bfloat16, physical_capacity_positions=9,
        capacity_source="t", scope=omni.ModelLocalKVScope.REQUEST, rows=omni.RowDriver.MAX_NUM_SEQS,
    )
    with pytest.raises(InvalidDeclarationError, match="'layers' = 0 is invalid: expected an int >= 1"):
        normalize_spec(theirs)


def test_a_vllm_omni_declarer_runs_on_kv_budget_by_changing_its_import_line(omni, decoder_config):
    """The drop-in: the real Qwen3-TTS decoder source with only its import
    of vLLM-Omni's declaration module rewritten to ``from kv_budget import``
    declares the same thing, as kv-budget objects."""
    original = _declaring_decoder(_omni(DECODER_MODULE), decoder_config)
    edited_module = exec_omni_source(DECODER_MODULE, {OMNI_IMPORT: "from kv_budget import"}, "dropin_decoder")
    edited = _declaring_decoder(edited_module, decoder_config)

    theirs = original.model_local_kv_specs()
    ours = edited.model_local_kv_specs()
    assert [type(spec) for spec in ours] == [ModelLocalKVSpec, ModelLocalKVSpec]
    assert ours == [normalize_spec(spec) for spec in theirs]
    assert [spec.peak_bytes(64) for spec in ours] == [spec.peak_bytes(64) for spec in theirs]


def test_vllm_omnis_public_names_are_importable_from_kv_budget(omni):
    for name in omni.__all__:
        assert hasattr(kv_budget, name), name
    assert {m.value for m in kv_budget.ModelLocalKVScope} == {m.value for m in omni.ModelLocalKVScope}
    assert {m.value for m in kv_budget.RowDriver} == {m.value for m in omni.RowDriver}
    assert [f for f in ModelLocalKVSpec.__dataclass_fields__] == [f for f in omni.ModelLocalKVSpec.__dataclass_fields__]
