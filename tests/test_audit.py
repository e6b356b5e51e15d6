"""The audit against real transformers caches filled by real forward passes.

Expected byte figures are computed from the geometry (2 x layers x batch x
kv heads x head_dim x positions x dtype size), never read back from the
tensors the audit measures, so each test can fail if the audit miscounts.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from typing import Any

import audit_models as am
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import (
    Cache,
    DynamicLayer,
    LinearAttentionLayer,
    QuantizedLayer,
)

from kv_budget.audit import AuditReport, audit_module, load_factory
from kv_budget.declare.hf_config import spec_from_hf_config
from kv_budget.declare.spec import ModelLocalKVSpec, RowDriver, Scope
from kv_budget.sample.caches import UnsupportedCacheError, cache_breakdown, measure_cache_bytes
from kv_budget.units import format_bytes

F32 = 4
BF16 = 2
# small_qwen2_config geometry
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16


def kv_bytes(*, layers: int, batch: int, kv_heads: int, head_dim: int, positions: int, dtype_bytes: int) -> int:
    return 2 * layers * batch * kv_heads * head_dim * positions * dtype_bytes


def small_bytes(batch: int, positions: int) -> int:
    return kv_bytes(
        layers=LAYERS, batch=batch, kv_heads=KV_HEADS, head_dim=HEAD_DIM, positions=positions, dtype_bytes=F32
    )


def by_owner(report: AuditReport) -> dict[str, object]:
    return {o.owner: o for o in report.owners}


def manual_cache(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A DynamicCache whose layers hold exactly the given tensors (no copy),
    to test storage accounting on views we control."""
    cache = DynamicCache()
    for keys, values in pairs:
        layer = DynamicLayer()
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        cache.layers.append(layer)
    return cache


@pytest.fixture(scope="module")
def ming_lm():
    return am.tiny_lm(am.ming_talker_config(), torch.bfloat16)


@pytest.fixture(scope="module")
def small_lm():
    return am.tiny_lm(am.small_qwen2_config())


# --------------------------------------------------------------------------
# Sliding windows: what transformers 5.x really keeps


WINDOW = 8
BATCH = 3


def test_sliding_layer_view_is_w_minus_1_but_storage_holds_w_after_decode():
    config = am.small_qwen2_config(sliding_window=WINDOW)
    lm = am.tiny_lm(config)
    cache = am.generate_into(lm, DynamicCache(config=config), batch=BATCH, prompt=5, new_tokens=12)
    layers = cache_breakdown(cache)
    assert [layer.layer_class for layer in layers] == ["DynamicSlidingWindowLayer"] * LAYERS
    assert cache.get_seq_length() == 5 + 12 - 1 > WINDOW  # really generated past the window
    for layer in layers:
        assert layer.kind == "self"
        assert layer.batch == BATCH
        assert layer.positions == WINDOW - 1
        assert layer.view_bytes == small_bytes(BATCH, WINDOW - 1) // LAYERS
        assert layer.bytes == small_bytes(BATCH, WINDOW) // LAYERS
    assert measure_cache_bytes(cache) == small_bytes(BATCH, WINDOW)
    # A deepcopy copies the whole storage, not the W - 1 view.
    assert measure_cache_bytes(copy.deepcopy(cache)) == small_bytes(BATCH, WINDOW)


def test_sliding_layer_storage_after_prefill_and_after_a_chunk():
    config = am.small_qwen2_config(sliding_window=WINDOW)
    lm = am.tiny_lm(config)
    cache = DynamicCache(config=config)
    prompt = 20
    with torch.no_grad():
        lm(torch.randint(3, am.VOCAB, (1, prompt)), past_key_values=cache, use_cache=True)
    # Right after a prefill the W - 1 view keeps the whole prompt's storage.
    assert measure_cache_bytes(cache) == small_bytes(1, prompt)
    assert {layer.positions for layer in cache_breakdown(cache)} == {WINDOW - 1}
    chunk = 3
    with torch.no_grad():
        lm(torch.randint(3, am.VOCAB, (1, chunk)), past_key_values=cache, use_cache=True)
    # A C-token step on a full window keeps W - 1 + C positions.
    assert measure_cache_bytes(cache) == small_bytes(1, WINDOW - 1 + chunk)


def test_sliding_declaration_of_w_minus_1_is_under_declared_by_one_position_per_row():
    owner = am.SlidingCodecDecoder(
        window=WINDOW, declared_positions=WINDOW - 1, capacity_source="sliding_window - 1"
    )
    owner.run(batch=BATCH, prompt=5, new_tokens=12)
    report = audit_module(owner)
    (entry,) = report.owners
    assert entry.owner == ""
    assert entry.live_sequences == BATCH
    assert entry.declared_bytes == small_bytes(BATCH, WINDOW - 1)
    assert entry.measured_bytes == small_bytes(BATCH, WINDOW)
    assert entry.verdict == "under-declared"
    assert entry.measured_bytes - entry.declared_bytes == small_bytes(BATCH, 1)
    assert report.failed


def test_sliding_declaration_of_w_matches_after_generating_past_the_window():
    owner = am.SlidingCodecDecoder(
        window=WINDOW,
        declared_positions=WINDOW,
        capacity_source="sliding_window: the W - 1 view keeps the W-position cat result alive",
    )
    owner.run(batch=BATCH, prompt=5, new_tokens=12)
    report = audit_module(owner)
    (entry,) = report.owners
    assert entry.declaration_names == ["codec_cache"]
    assert entry.declared_bytes == entry.measured_bytes == small_bytes(BATCH, WINDOW)
    assert entry.verdict == "match"
    assert entry.rows_source == "measured"
    assert not report.failed
    # The LM's own modules hold nothing and declare nothing: not listed.
    assert [o.owner for o in report.owners] == [""]


def test_static_sliding_layers_preallocate_the_window():
    config = am.small_qwen2_config(sliding_window=WINDOW)
    lm = am.tiny_lm(config)
    cache = am.generate_into(lm, StaticCache(config=config, max_cache_len=32), batch=2, prompt=5, new_tokens=3)
    layers = cache_breakdown(cache)
    assert {layer.layer_class for layer in layers} == {"StaticSlidingWindowLayer"}
    assert {layer.positions for layer in layers} == {WINDOW}  # min(window, max_cache_len), not W - 1
    assert measure_cache_bytes(cache) == small_bytes(2, WINDOW)


# --------------------------------------------------------------------------
# StaticCache: the ming talker


MING_BYTES = 25_165_824


def test_ming_talker_static_cache_is_24_mib(ming_lm):
    model = am.MingOmni(ming_lm)
    model.talker.run(tokens=4)
    expected = kv_bytes(layers=24, batch=1, kv_heads=2, head_dim=896 // 14, positions=2048, dtype_bytes=BF16)
    assert expected == MING_BYTES
    assert measure_cache_bytes(model.talker.static_cache) == expected
    layers = cache_breakdown(model.talker.static_cache)
    assert len(layers) == 24
    assert {(layer.positions, layer.bytes, layer.batch) for layer in layers} == {(2048, expected // 24, 1)}
    report = audit_module(model)
    (entry,) = report.owners
    assert entry.owner == "talker"
    assert entry.declared_bytes == entry.measured_bytes == MING_BYTES
    assert entry.verdict == "match"
    assert entry.live_sequences is None and entry.rows_source == "none"
    assert [c.path for c in entry.caches] == ["static_cache"]


def test_ming_talker_before_its_first_call_is_declared_but_absent(ming_lm):
    model = am.MingOmni(ming_lm)  # static_cache is None until the talker runs
    report = audit_module(model)
    (entry,) = report.owners
    assert entry.verdict == "declared-but-absent"
    assert entry.declared_bytes == MING_BYTES and entry.measured_bytes == 0
    assert not report.failed


def test_static_cache_longer_than_declared_is_under_and_shorter_is_over(ming_lm):
    talker = am.MingTalker(ming_lm)
    talker.run()
    declared = talker.model_local_kv_specs()[0]
    for positions, verdict in ((1024, "under-declared"), (4096, "over-declared")):
        owner = am.Declarer([dataclasses.replace(declared, physical_capacity_positions=positions)])
        owner.cache = talker.static_cache
        (entry,) = audit_module(owner).owners
        assert entry.declared_bytes == MING_BYTES * positions // 2048
        assert entry.measured_bytes == MING_BYTES
        assert entry.verdict == verdict


# --------------------------------------------------------------------------
# Encoder-decoder (Whisper)


def whisper_part_bytes(report_entry, kind: str) -> int:
    return sum(layer.bytes for cache in report_entry.caches for layer in cache.layers if layer.kind == kind)


def test_whisper_encoder_decoder_cache_both_parts_match():
    config = am.whisper_config(max_source_positions=16)
    owner = am.WhisperDecoderOwner(config, max_decoder_tokens=5)
    owner.run(batch=2)
    assert type(owner.past).__name__ == "EncoderDecoderCache"
    head_dim = 64 // 4
    self_expected = kv_bytes(layers=2, batch=2, kv_heads=4, head_dim=head_dim, positions=5, dtype_bytes=F32)
    cross_expected = kv_bytes(layers=2, batch=2, kv_heads=4, head_dim=head_dim, positions=16, dtype_bytes=F32)
    layers = cache_breakdown(owner.past)
    assert [(layer.kind, layer.index) for layer in layers] == [
        ("self", 0), ("self", 1), ("cross", 0), ("cross", 1),
    ]
    assert {layer.positions for layer in layers if layer.kind == "cross"} == {16}
    assert measure_cache_bytes(owner.past) == self_expected + cross_expected

    assert owner.self_attention_spec().bytes_per_row * 2 == self_expected
    assert owner.cross_attention_spec().bytes_per_row * 2 == cross_expected
    (entry,) = audit_module(owner).owners
    assert entry.live_sequences == 2
    assert whisper_part_bytes(entry, "self") == self_expected
    assert whisper_part_bytes(entry, "cross") == cross_expected
    assert entry.declared_bytes == entry.measured_bytes == self_expected + cross_expected
    assert entry.verdict == "match"


ASYMMETRIC = dict(encoder_layers=2, decoder_layers=3, encoder_heads=4, decoder_heads=2)


def asymmetric_whisper_owner() -> am.WhisperDecoderOwner:
    owner = am.WhisperDecoderOwner(am.whisper_config(**ASYMMETRIC, max_source_positions=16), max_decoder_tokens=3)
    owner.run(batch=1)
    return owner


def test_whisper_cross_attention_lives_in_decoder_layers_with_decoder_heads():
    owner = asymmetric_whisper_owner()
    cross_expected = kv_bytes(layers=3, batch=1, kv_heads=2, head_dim=64 // 2, positions=16, dtype_bytes=F32)
    (entry,) = audit_module(owner, max_num_seqs=1).owners
    assert whisper_part_bytes(entry, "cross") == cross_expected
    by_hand = ModelLocalKVSpec(
        name="whisper_cross_attention",
        layers=3,
        kv_heads=2,
        head_dim=32,
        dtype=torch.float32,
        physical_capacity_positions=16,
        capacity_source="max_source_positions",
        scope=Scope.REQUEST,
        rows=RowDriver.MAX_NUM_SEQS,
    )
    assert by_hand.bytes_per_row == cross_expected


def test_whisper_decoder_spec_from_config_is_not_read_from_encoder_aliases():
    """WhisperConfig.attribute_map aliases num_hidden_layers, num_attention_heads
    and num_key_value_heads to the *encoder*; with encoder and decoder geometry
    different, a declaration read through those aliases would be wrong."""
    owner = asymmetric_whisper_owner()
    (entry,) = audit_module(owner, max_num_seqs=1).owners
    cross = owner.cross_attention_spec()
    assert (cross.layers, cross.kv_heads, cross.head_dim) == (3, 2, 32)
    assert cross.bytes_per_row == whisper_part_bytes(entry, "cross")
    assert owner.self_attention_spec().bytes_per_row == whisper_part_bytes(entry, "self")
    assert entry.verdict == "match"


# --------------------------------------------------------------------------
# Working copies, sequences, rows


@pytest.mark.parametrize("k", [1, 3])
def test_working_copy_is_a_second_allocation_and_k_sequences_are_k_rows(k):
    owner = am.SlidingCodecDecoder(
        window=WINDOW,
        declared_positions=WINDOW,
        capacity_source="sliding_window",
        keep_working_copy=True,
        declare_working_copy=True,
    )
    owner.run(batch=k, prompt=4, new_tokens=10)
    (entry,) = audit_module(owner).owners
    assert entry.live_sequences == k
    assert sorted(c.path for c in entry.caches) == ["cache", "working"]
    assert [c.rows for c in entry.caches] == [k, k]
    assert [d.rows for d in entry.declarations] == [k, k]
    assert entry.measured_bytes == 2 * small_bytes(k, WINDOW)
    assert entry.declared_bytes == entry.measured_bytes
    assert entry.verdict == "match"


def test_working_copy_kept_but_not_declared_is_under_declared():
    owner = am.SlidingCodecDecoder(
        window=WINDOW, declared_positions=WINDOW, capacity_source="sliding_window", keep_working_copy=True
    )
    owner.run(batch=2, prompt=4, new_tokens=10)
    (entry,) = audit_module(owner).owners
    assert entry.verdict == "under-declared"
    assert entry.measured_bytes - entry.declared_bytes == small_bytes(2, WINDOW)


def test_declaration_for_a_working_copy_that_does_not_exist_is_over_declared():
    owner = am.SlidingCodecDecoder(
        window=WINDOW, declared_positions=WINDOW, capacity_source="sliding_window", declare_working_copy=True
    )
    owner.run(batch=2, prompt=4, new_tokens=10)
    assert owner.working is None
    report = audit_module(owner)
    (entry,) = report.owners
    assert entry.live_sequences == 2
    assert entry.declared_bytes == 2 * small_bytes(2, WINDOW)
    assert entry.measured_bytes == small_bytes(2, WINDOW)
    assert entry.verdict == "over-declared"
    assert not report.failed


def test_per_sequence_cache_declared_as_fixed_one_is_under_declared(small_lm):
    k = 4
    cache = am.generate_into(small_lm, DynamicCache(), batch=k, prompt=3, new_tokens=4)
    positions = 3 + 4 - 1
    owner = am.Declarer(
        [
            spec_from_hf_config(
                small_lm.config,
                name="decoder_cache",
                dtype=torch.float32,
                physical_capacity_positions=positions,
                capacity_source="prompt + decode steps",
                scope=Scope.REQUEST,
                rows=RowDriver.FIXED,
                rows_fixed=1,
                rows_reason="wrongly assumed one request at a time",
            )
        ]
    )
    owner.cache = cache
    report = audit_module(owner)
    (entry,) = report.owners
    assert entry.declared_bytes == small_bytes(1, positions)
    assert entry.measured_bytes == small_bytes(k, positions)
    assert entry.verdict == "under-declared"
    assert report.failed


def per_seq_spec(config, positions: int, name: str = "cache") -> ModelLocalKVSpec:
    return spec_from_hf_config(
        config,
        name=name,
        dtype=torch.float32,
        physical_capacity_positions=positions,
        capacity_source="prompt + decode steps",
        scope=Scope.SESSION,
        rows=RowDriver.MAX_NUM_SEQS,
    )


def test_sessions_in_a_dict_are_sequences_and_a_fixed_pool_is_not(small_lm):
    positions = 3 + 2 - 1
    sessions = {name: am.generate_into(small_lm, DynamicCache(), batch=1, prompt=3, new_tokens=2) for name in "abc"}
    pool = [am.generate_into(small_lm, DynamicCache(), batch=1, prompt=3, new_tokens=2) for _ in range(5)]
    pool_spec = dataclasses.replace(
        per_seq_spec(small_lm.config, positions, "graph_pool"),
        rows=RowDriver.FIXED,
        rows_fixed=5,
        rows_reason="one per captured bucket",
        scope=Scope.MODEL,
    )
    owner = am.Declarer([per_seq_spec(small_lm.config, positions, "session_cache"), pool_spec])
    owner.sessions = sessions
    owner.pool = pool
    (entry,) = audit_module(owner).owners
    assert entry.live_sequences == 3
    assert {d.name: d.rows for d in entry.declarations} == {"session_cache": 3, "graph_pool": 5}
    assert entry.measured_bytes == small_bytes(8, positions)
    assert entry.verdict == "match"
    assert "sessions['b']" in {c.path for c in entry.caches}
    assert "pool[4]" in {c.path for c in entry.caches}


def test_state_held_by_a_parent_for_its_declaring_child_is_audited_as_the_childs(small_lm):
    """vLLM-Omni's Qwen3-TTS stage keeps per-request decoder state (caches
    included) in a dict of its own; its ``decoder`` child declares them.
    One owner, one verdict, the holder named; never "undeclared" on the
    parent and "declared-but-absent" on the child for the same cache."""
    positions = 3 + 2 - 1
    stage = torch.nn.Module()
    stage.decoder = am.Declarer([per_seq_spec(small_lm.config, positions, "codec_cache")])
    stage.state = {
        request: {"cache": am.generate_into(small_lm, DynamicCache(), batch=1, prompt=3, new_tokens=2), "frames": 3}
        for request in ("req-0", "req-1")
    }
    (entry,) = audit_module(stage).owners
    assert (entry.owner, entry.verdict, entry.live_sequences) == ("decoder", "match", 2)
    assert entry.measured_bytes == entry.declared_bytes == small_bytes(2, positions)
    assert {c.held_by for c in entry.caches} == {""}
    assert "(held by <root>)" in audit_module(stage).render_table()

    stage.decoder.declared = []  # a path that declares nothing: the holder's caches are undeclared
    (entry,) = audit_module(stage).owners
    assert (entry.owner, entry.verdict, entry.measured_bytes) == ("", "undeclared", small_bytes(2, positions))

    stage.decoder.declared = [per_seq_spec(small_lm.config, positions, "codec_cache")]
    stage.other = am.Declarer([per_seq_spec(small_lm.config, positions, "other_cache")])
    owners = {o.owner: o.verdict for o in audit_module(stage).owners}
    assert owners == {"": "undeclared", "decoder": "declared-but-absent", "other": "declared-but-absent"}


def test_caches_in_session_objects_of_a_runtime_helper_are_found(small_lm):
    """vLLM-Omni's MiniCPM-o keeps each duplex session's encoder cache on a
    session-state dataclass in its runtime helper's ``sessions`` dict, an
    attribute of the stage model: three levels below the module."""

    @dataclasses.dataclass
    class SessionState:
        session_id: str
        audio_past_key_values: Any = None

    class Runtime:
        def __init__(self, stage):
            self.stage = stage  # back-reference to the module: not entered again
            self.sessions = {}

    positions = 3 + 2 - 1
    stage = torch.nn.Module()
    stage.encoder = am.Declarer([dataclasses.replace(
        per_seq_spec(small_lm.config, positions, "encoder_self_attn"),
        rows=RowDriver.FIXED, rows_fixed=1, rows_reason="one session")])
    stage.helper = Runtime(stage)
    for name in ("s0", "s1", "s2"):
        stage.helper.sessions[name] = SessionState(
            name, am.generate_into(small_lm, DynamicCache(), batch=1, prompt=3, new_tokens=2))
    (entry,) = audit_module(stage).owners
    assert (entry.owner, entry.verdict) == ("encoder", "under-declared")
    assert entry.measured_bytes == small_bytes(3, positions) and entry.declared_bytes == small_bytes(1, positions)
    assert "helper.sessions['s2'].audio_past_key_values" in {c.path for c in entry.caches}


def test_explicit_max_num_seqs_is_charged_instead_of_measured_rows(small_lm):
    cache = am.generate_into(small_lm, DynamicCache(), batch=2, prompt=3, new_tokens=2)
    owner = am.Declarer([per_seq_spec(small_lm.config, 4)])
    owner.cache = cache
    assert audit_module(owner, max_num_seqs=2).owners[0].verdict == "match"
    entry = audit_module(owner, max_num_seqs=3).owners[0]
    assert (entry.verdict, entry.live_sequences, entry.rows_source) == ("over-declared", 3, "argument")
    assert audit_module(owner, max_num_seqs=1).owners[0].verdict == "under-declared"
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="max_num_seqs"):
            audit_module(owner, max_num_seqs=bad)


def test_caches_without_any_declarer_are_undeclared(small_lm):
    holder = torch.nn.Module()
    holder.inner = torch.nn.Module()
    holder.inner.last_cache = am.generate_into(small_lm, DynamicCache(), batch=1, prompt=3, new_tokens=3)
    report = audit_module(holder)
    (entry,) = report.owners
    assert entry.owner == "inner"
    assert entry.verdict == "undeclared"
    assert entry.measured_bytes == small_bytes(1, 5) and entry.declared_bytes == 0
    assert report.failed


def test_failing_declarer_is_recorded_and_its_cache_is_undeclared(small_lm):
    root = torch.nn.Module()
    root.codec = am.BrokenDeclarer()
    root.codec.cache = am.generate_into(small_lm, DynamicCache(), batch=1, prompt=3, new_tokens=2)
    report = audit_module(root)
    assert [(f.owner, "config attribute missing" in f.error) for f in report.failures] == [("codec", True)]
    assert by_owner(report)["codec"].verdict == "undeclared"
    assert "declarer failed: codec" in report.render_table()


def test_non_module_root_with_attributes(small_lm):
    class Runner:
        def __init__(self, cache):
            self.caches = (cache,)

        def model_local_kv_specs(self):
            return [per_seq_spec(small_lm.config, 4)]

    runner = Runner(am.generate_into(small_lm, DynamicCache(), batch=2, prompt=3, new_tokens=2))
    (entry,) = audit_module(runner).owners
    assert (entry.owner, entry.verdict, entry.measured_bytes) == ("", "match", small_bytes(2, 4))
    with pytest.raises(TypeError, match="measure_cache_bytes"):
        audit_module(runner.caches[0])


# --------------------------------------------------------------------------
# Storage accounting: dedup, meta, quantized, refusals


def test_views_of_one_storage_are_counted_once():
    base = torch.zeros(1, 2, 10, 16)
    cache = manual_cache([(base[:, :, :4], base[:, :, 4:8]), (base[:, :, 2:9], base)])
    layers = cache_breakdown(cache)
    assert measure_cache_bytes(cache) == base.numel() * F32
    assert [layer.bytes for layer in layers] == [base.numel() * F32, 0]
    assert layers[1].view_bytes == (7 + 10) * 2 * 16 * F32


def test_a_cache_held_twice_or_by_two_owners_is_counted_once(small_lm):
    cache = am.generate_into(small_lm, DynamicCache(), batch=2, prompt=3, new_tokens=2)
    root = torch.nn.Module()
    root.child = am.Declarer([per_seq_spec(small_lm.config, 4)])
    root.child.cache = cache
    root.child.sessions = {"same": cache}
    root.shortcut = cache  # the parent keeps a reference too
    shallow = copy.copy(cache)  # a shallow copy shares the layer tensors
    root.child.backup = shallow
    report = audit_module(root)
    assert [o.owner for o in report.owners] == ["child"]
    (entry,) = report.owners
    assert [c.path for c in entry.caches] == ["cache", "backup"]
    assert [c.bytes for c in entry.caches] == [small_bytes(2, 4), 0]
    assert report.total_measured_bytes == small_bytes(2, 4)


@settings(max_examples=40, deadline=None)
@given(
    length=st.integers(min_value=2, max_value=12),
    cuts=st.lists(st.tuples(st.integers(0, 11), st.integers(1, 12)), min_size=2, max_size=6),
)
def test_any_set_of_slices_counts_the_base_storage_once(length, cuts):
    base = torch.zeros(2, 1, length, 4)
    views = [base[:, :, min(a, length - 1) : max(min(b, length), min(a, length - 1) + 1)] for a, b in cuts]
    pairs = list(zip(views[0::2], views[1::2]))
    cache = manual_cache(pairs)
    assert measure_cache_bytes(cache) == base.numel() * F32
    assert sum(layer.view_bytes for layer in cache_breakdown(cache)) == sum(
        v.numel() * F32 for pair in pairs for v in pair
    )


def test_meta_tensors_hold_no_memory_and_empty_caches_hold_nothing():
    meta = torch.empty(1, 2, 8, 16, device="meta")
    cache = manual_cache([(meta, meta.clone())])
    assert measure_cache_bytes(cache) == 0
    assert cache_breakdown(cache)[0].positions == 8
    assert measure_cache_bytes(DynamicCache()) == 0


def test_wrapper_tensor_subclasses_are_counted_by_their_inner_tensors():
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    a, b = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4)
    wrapped = two_tensor.TwoTensor(a, b)
    cache = manual_cache([(wrapped, torch.zeros(1, 2, 3, 4))])
    assert measure_cache_bytes(cache) == 3 * a.numel() * F32


class Int8Layer(QuantizedLayer):
    """A real transformers QuantizedLayer with a plain int8 per-position
    quantizer (the quanto and HQQ backends are not installed here)."""

    def _quantize(self, tensor, axis):
        scale = tensor.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127
        return (torch.round(tensor / scale).to(torch.int8), scale)

    def _dequantize(self, packed):
        return packed[0].to(packed[1].dtype) * packed[1]


def test_quantized_layers_count_packed_states_and_residual():
    config = am.small_qwen2_config()
    lm = am.tiny_lm(config)
    cache = Cache(layers=[Int8Layer(nbits=8, residual_length=4) for _ in range(LAYERS)])
    batch, prompt, new_tokens = 2, 6, 6
    am.generate_into(lm, cache, batch=batch, prompt=prompt, new_tokens=new_tokens)
    # Seen: 6 + 5 = 11 tokens. The prompt is packed at once; the residual then
    # grows to 3 and is flushed with the 4th token (10 packed), then 1 more.
    packed, residual = 10, 1
    per_position = batch * KV_HEADS * HEAD_DIM
    expected_per_layer = 2 * (
        per_position * packed * 1  # int8 values
        + batch * KV_HEADS * packed * F32  # one fp32 scale per position
        + per_position * residual * F32  # full-precision residual
    )
    layers = cache_breakdown(cache)
    assert [layer.bytes for layer in layers] == [expected_per_layer] * LAYERS
    assert {layer.positions for layer in layers} == {packed + residual}
    assert {layer.batch for layer in layers} == {batch}


def test_unknown_state_is_refused_rather_than_half_counted():
    with pytest.raises(UnsupportedCacheError, match="linear-attention"):
        measure_cache_bytes(Cache(layers=[LinearAttentionLayer()]))

    class LayerWithExtraState(DynamicLayer):
        pass

    layer = LayerWithExtraState()
    keys = torch.zeros(1, 2, 3, 4)
    layer.lazy_initialization(keys, keys)
    layer.keys, layer.values = keys, keys.clone()
    layer.rotary_cache = torch.zeros(1000)
    cache = DynamicCache()
    cache.layers.append(layer)
    with pytest.raises(UnsupportedCacheError, match="rotary_cache"):
        measure_cache_bytes(cache)

    sparse = manual_cache([(torch.zeros(1, 2, 3, 4).to_sparse(), torch.zeros(1, 2, 3, 4))])
    with pytest.raises(UnsupportedCacheError, match="layout"):
        measure_cache_bytes(sparse)
    with pytest.raises(UnsupportedCacheError, match="not a transformers Cache"):
        measure_cache_bytes({"keys": keys})


# --------------------------------------------------------------------------
# load_factory, JSON, table


def test_load_factory_builds_the_model_and_it_audits_clean():
    model = load_factory("audit_models:build_ming_omni")
    assert isinstance(model, am.MingOmni)
    report = audit_module(model)
    assert [(o.owner, o.verdict, o.measured_bytes) for o in report.owners] == [("talker", "match", MING_BYTES)]


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("audit_models.build_ming_omni", "one ':'"),
        ("a:b:c", "one ':'"),
        (":build", "non-empty"),
        ("audit_models:", "non-empty"),
        ("no_such_module_for_kv_budget:f", "cannot import 'no_such_module_for_kv_budget'"),
        ("audit_models:no_such_factory", "has no attribute 'no_such_factory'"),
        ("audit_models:NOT_CALLABLE", "not callable"),
        ("audit_models:returns_none", "returned None"),
    ],
)
def test_load_factory_rejects_bad_targets_with_one_line(target, message):
    with pytest.raises(ValueError, match=message) as info:
        load_factory(target)
    assert "\n" not in str(info.value)


def test_load_factory_import_error_message_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "broken_factory_mod.py").write_text("def f(:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="cannot import 'broken_factory_mod': SyntaxError") as info:
        load_factory("broken_factory_mod:f")
    assert "\n" not in str(info.value)
    sys.modules.pop("broken_factory_mod", None)


def test_load_factory_lets_the_factorys_own_error_through(tmp_path, monkeypatch):
    (tmp_path / "raising_factory_mod.py").write_text("def f():\n    raise KeyError('weights')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(KeyError, match="weights"):
        load_factory("raising_factory_mod:f")
    sys.modules.pop("raising_factory_mod", None)


def mixed_report(small_lm, ming_lm) -> AuditReport:
    """One owner per verdict, all from real caches."""
    root = torch.nn.Module()
    root.talker = am.MingTalker(ming_lm)
    root.talker.run()
    root.absent = am.MingTalker(ming_lm)
    root.codec = am.Declarer(
        [dataclasses.replace(root.talker.model_local_kv_specs()[0], name="too_small", physical_capacity_positions=1024)]
    )
    root.codec.cache = root.talker.static_cache.__class__(config=root.talker.config, max_cache_len=2048)
    with torch.no_grad():
        ming_lm(torch.tensor([[5, 6]]), past_key_values=root.codec.cache, use_cache=True)
    root.spare = am.Declarer([per_seq_spec(small_lm.config, 4, "spare"), per_seq_spec(small_lm.config, 4, "copy")])
    root.spare.cache = am.generate_into(small_lm, DynamicCache(), batch=1, prompt=3, new_tokens=2)
    root.loose = torch.nn.Module()
    root.loose.cache = am.generate_into(small_lm, DynamicCache(), batch=1, prompt=3, new_tokens=2)
    return audit_module(root)


def test_report_json_round_trip_and_table_figures(small_lm, ming_lm):
    report = mixed_report(small_lm, ming_lm)
    verdicts = {o.owner: o.verdict for o in report.owners}
    assert verdicts == {
        "talker": "match",
        "absent": "declared-but-absent",
        "codec": "under-declared",
        "spare": "over-declared",
        "loose": "undeclared",
    }
    assert report.failed
    text = report.model_dump_json()
    data = json.loads(text)
    assert data["failed"] is True
    assert {o["owner"]: o["verdict"] for o in data["owners"]} == verdicts
    assert AuditReport.model_validate_json(text) == report

    table = report.render_table()
    for owner in report.owners:
        line = next(line for line in table.splitlines() if line.startswith(owner.owner + " "))
        assert owner.verdict in line
        assert format_bytes(owner.declared_bytes) in line
        assert format_bytes(owner.measured_bytes) in line
    assert "25,165,824 B (24.00 MiB)" in table
    assert "12,582,912 B (12.00 MiB)" in table  # the codec's 1024-position declaration
    assert "measured exceeds declared by 12,582,912 B (12.00 MiB)" in table
    assert table.splitlines()[-1].endswith("FAILED")


def test_clean_report_is_not_failed_and_says_ok(ming_lm):
    model = am.MingOmni(ming_lm)
    model.talker.run()
    report = audit_module(model)
    assert not report.failed
    assert json.loads(report.model_dump_json())["failed"] is False
    assert report.render_table().splitlines()[-1].endswith("ok")
