"""kv-budget's audit against vLLM-Omni 0.30.0's own Qwen3-TTS code2wav stage.

The stage model, its codec decoder and its CUDA-graph wrapper are vLLM-Omni's
classes, imported from its wheel (``peers.vllm_omni.qwen3_tts`` builds and
drives them on the CPU). Expected bytes come from the geometry
(2 x layers x kv heads x head_dim x positions x dtype size x rows) and the
positions from how the decoder slices its sliding window, never from what the
audit measured, so every assertion can fail if the audit or the model
changes. Run with ``.venv-omni/bin/python -m pytest -m omni_models
tests/test_omni_qwen3_tts.py``.
"""

from __future__ import annotations

import pytest
import torch

from kv_budget.audit import audit_module
from kv_budget.collect.model import collect_model_local_kv_specs
from kv_budget.declare.spec import RowDriver, Scope
from peers.vllm_omni.files import OmniFilesUnavailable, omni_root

# network as well: a run given its own -m (make test-fast) replaces setup.cfg's
# "not omni_models", and these build their models from vLLM-Omni's wheel.
pytestmark = [pytest.mark.omni_models, pytest.mark.network]

LAYERS, KV_HEADS, HEAD_DIM, BF16 = 2, 2, 16, 2
WINDOW, FIRST, CHUNK = 72, 1, 25
PER_POSITION = 2 * LAYERS * KV_HEADS * HEAD_DIM * BF16
"""Bytes of one position of one row (K and V, all layers): 256."""

KEPT = WINDOW - 1
"""Positions a ``DynamicSlidingWindowLayer`` view keeps: the declared bound."""
ROLLING_SUFFIX = 2 + (WINDOW - 2) + CHUNK
"""Frames the rolling suffix step feeds the transformer: 2 boundary conv
frames, the ``window - 2`` conv frames kept, and the new chunk (97)."""
WORKING_PEAK = KEPT + ROLLING_SUFFIX
"""The working copy after that step: its ``torch.cat`` storage (168)."""


def kv_bytes(positions: int, rows: int = 1) -> int:
    return PER_POSITION * positions * rows


@pytest.fixture(scope="module")
def qwen3_tts():
    """The module under test, or a skip naming why vLLM-Omni's files are missing."""
    try:
        omni_root()
    except OmniFilesUnavailable as exc:
        pytest.skip(str(exc))
    from peers.vllm_omni import qwen3_tts

    assert (qwen3_tts.LAYERS, qwen3_tts.KV_HEADS, qwen3_tts.HEAD_DIM, qwen3_tts.DTYPE) == (
        LAYERS,
        KV_HEADS,
        HEAD_DIM,
        torch.bfloat16,
    )
    assert (qwen3_tts.WINDOW, qwen3_tts.FIRST_CHUNK_FRAMES, qwen3_tts.CHUNK_FRAMES) == (WINDOW, FIRST, CHUNK)
    return qwen3_tts


@pytest.fixture(scope="module")
def figures(qwen3_tts):
    return qwen3_tts.measure()


def owners(report):
    return {o.owner: o for o in report.owners}


# --------------------------------------------------------------------------
# Declarations


def test_without_the_wrapper_the_decoder_declares_nothing(qwen3_tts):
    """Off CUDA (and under enforce_eager) ``load_weights`` makes no wrapper,
    and the decoder's declarer returns nothing although async chunk is on."""
    stage = qwen3_tts.build_stage(async_chunk=True)
    assert stage._async_chunk is True
    assert stage.decoder._cudagraph_wrapper is None
    stage.decoder.enable_cudagraph(device=torch.device("cpu"))  # refused off CUDA: no wrapper
    assert stage.decoder._cudagraph_wrapper is None and stage.decoder._cudagraph_enabled is False
    assert stage.decoder.model_local_kv_specs() == []
    collection = collect_model_local_kv_specs(stage)
    assert collection.specs == () and collection.failures == ()


def test_the_real_wrapper_constructs_on_the_cpu_and_makes_the_decoder_declare(qwen3_tts):
    stage = qwen3_tts.build_stage(async_chunk=True)
    wrapper = qwen3_tts.attach_graph_wrapper(stage)
    assert type(wrapper).__module__ == "vllm_omni.model_executor.models.qwen3_tts.segmented_graph_wrapper"
    assert wrapper.async_chunk is True and wrapper.prefix_length == WINDOW
    assert stage.decoder._cudagraph_enabled is False  # no warmup: decoding stays eager
    collection = collect_model_local_kv_specs(stage)
    assert collection.failures == ()
    got = {(o.owner, o.spec.name): o.spec for o in collection.specs}
    assert set(got) == {("decoder", "codec_decoder_request"), ("decoder", "codec_decoder_working_copy")}
    for (_, name), spec in got.items():
        assert (spec.layers, spec.kv_heads, spec.head_dim, spec.dtype) == (LAYERS, KV_HEADS, HEAD_DIM, torch.bfloat16)
        assert spec.physical_capacity_positions == KEPT
        assert spec.rows is RowDriver.MAX_NUM_SEQS
        assert spec.bytes_per_row == kv_bytes(KEPT) == 18_176
    assert got[("decoder", "codec_decoder_request")].scope is Scope.REQUEST
    assert got[("decoder", "codec_decoder_working_copy")].scope is Scope.INVOCATION


def test_the_stateless_paths_declare_nothing(qwen3_tts):
    for stage in (qwen3_tts.stateless(), qwen3_tts.stateless_declared()):
        assert stage._async_chunk is False
        assert collect_model_local_kv_specs(stage).specs == ()


# --------------------------------------------------------------------------
# Audits of the factories (what `kv-budget audit peers.vllm_omni.qwen3_tts:NAME` prints)


def test_audit_async_chunk_eager_is_undeclared(qwen3_tts):
    """Two live requests hold one cache each; nobody declares them."""
    report = audit_module(qwen3_tts.async_chunk_eager())
    assert [(o.owner, o.verdict) for o in report.owners] == [("", "undeclared")]
    (root,) = report.owners
    assert root.declared_bytes == 0
    assert root.measured_bytes == kv_bytes(KEPT, rows=2) == 36_352
    assert report.failed


def test_audit_async_chunk_declared_attributes_the_state_cache_to_the_decoder(qwen3_tts):
    """The stage holds ``_decoder_state_cache``; its child ``decoder``
    declares. They are one owner: the decoder. At rest the working copy
    does not exist, so the owner reads over-declared by exactly it."""
    report = audit_module(qwen3_tts.async_chunk_declared())
    assert [(o.owner, o.verdict) for o in report.owners] == [("decoder", "over-declared")]
    (decoder,) = report.owners
    assert decoder.live_sequences == 2
    assert decoder.measured_bytes == kv_bytes(KEPT, rows=2) == 36_352
    assert decoder.declared_bytes == 2 * kv_bytes(KEPT, rows=2) == 72_704
    assert not report.failed


def test_audit_at_peak_is_under_declared(qwen3_tts):
    """With the invocation caches of the largest step kept alive, the owner
    holds per row: 71 retained + 168 working copy + 71 batched copy."""
    stage = qwen3_tts.async_chunk_declared_at_peak()
    report = audit_module(stage)
    assert [(o.owner, o.verdict) for o in report.owners] == [("decoder", "under-declared")]
    (decoder,) = report.owners
    assert decoder.live_sequences == 2
    assert decoder.declared_bytes == 2 * kv_bytes(KEPT, rows=2) == 72_704
    assert decoder.measured_bytes == kv_bytes(KEPT + WORKING_PEAK + KEPT, rows=2) == 158_720
    held = {c.path: c.bytes for c in decoder.caches}
    assert held["kv_budget_invocation_peak['working_copy']"] == kv_bytes(WORKING_PEAK, rows=2) == 86_016
    assert held["kv_budget_invocation_peak['batched_request_kv']"] == kv_bytes(KEPT, rows=2)
    assert report.failed


def test_audit_fallback_holds_the_whole_window(qwen3_tts):
    """The single-request fallback keeps ``window`` positions behind a
    ``window - 1`` view; the absent working copy hides it in the verdict."""
    report = audit_module(qwen3_tts.async_chunk_fallback_declared())
    assert [(o.owner, o.verdict) for o in report.owners] == [("decoder", "over-declared")]
    (decoder,) = report.owners
    (cache,) = decoder.caches
    assert cache.bytes == kv_bytes(WINDOW) == 18_432
    assert {layer.positions for layer in cache.layers} == {KEPT}
    assert decoder.declared_bytes == 2 * kv_bytes(KEPT)


def test_audit_stateless_holds_nothing(qwen3_tts):
    for factory in (qwen3_tts.stateless, qwen3_tts.stateless_declared):
        report = audit_module(factory())
        assert report.owners == [] and not report.failed


# --------------------------------------------------------------------------
# Measured figures (peers.vllm_omni.qwen3_tts.measure)


def test_measured_declarations(figures):
    assert figures["declared_without_wrapper"] == {}
    assert figures["geometry"]["bytes_per_position_row"] == PER_POSITION == 256
    for name, scope in (("codec_decoder_request", "request"), ("codec_decoder_working_copy", "invocation")):
        assert figures["declared_with_wrapper"][name] == {
            "physical_capacity_positions": KEPT,
            "bytes_per_row": kv_bytes(KEPT),
            "scope": scope,
            "rows": "max_num_seqs",
        }


def test_batched_rows_hold_window_minus_one(figures):
    batched = figures["batched"]
    for held in batched["retained"].values():
        assert held == {"rows": 1, "bytes": kv_bytes(KEPT), "view_positions": KEPT, "positions_per_row": KEPT}
    assert batched["held_after_finish"] == 0


def test_fallback_row_stores_the_window_behind_a_smaller_view(figures):
    (held,) = figures["fallback"]["retained"].values()
    assert held == {"rows": 1, "bytes": kv_bytes(WINDOW), "view_positions": KEPT, "positions_per_row": WINDOW}


def test_a_reference_longer_than_the_window_is_kept_whole(figures):
    (held,) = figures["long_reference"]["retained"].values()
    assert held == {"rows": 1, "bytes": kv_bytes(100), "view_positions": KEPT, "positions_per_row": 100}


def test_xvec_rows_keep_no_kv_but_their_working_copy_grows(figures):
    xvec = figures["xvec"]
    (held,) = xvec["retained"].values()
    assert held["bytes"] == 0
    assert [s["working_copy_positions_per_row"] for s in xvec["working_copy_steps"]] == [
        FIRST,
        FIRST + CHUNK,
        FIRST + 2 * CHUNK,
        FIRST + 3 * CHUNK,
        ROLLING_SUFFIX,
        ROLLING_SUFFIX,
    ]
    assert xvec["working_copy_peak_bytes_per_row"] == kv_bytes(ROLLING_SUFFIX) == 24_832


def test_working_copy_per_step_and_peak(figures):
    """Each step's working copy is the kept 71 plus the frames that step
    feeds; it peaks at 168 once the suffix rolls. The batched path also
    holds a batched copy of the request caches (71) for the same call."""
    batched = figures["batched"]
    steps = batched["working_copy_steps"]
    assert [s["phase"] for s in steps] == ["_decode_icl_first_chunk"] + ["_decode_suffix"] * 5
    assert [s["working_copy_positions_per_row"] for s in steps] == [
        KEPT + FIRST,
        KEPT + FIRST + CHUNK,
        KEPT + FIRST + 2 * CHUNK,
        KEPT + FIRST + 3 * CHUNK,
        WORKING_PEAK,
        WORKING_PEAK,
    ]
    assert all(s["working_copy_view_positions"] == KEPT for s in steps)
    # First chunk: the batched prefix cache (window positions) is sliced per
    # row afterwards; later: the batched concatenation of the retained rows.
    assert [s["other_invocation_positions_per_row"] for s in steps] == [WINDOW] + [KEPT] * 5
    assert WORKING_PEAK == 168
    assert batched["working_copy_peak_bytes_per_row"] == kv_bytes(WORKING_PEAK) == 43_008
    assert batched["invocation_peak_positions_per_row"] == WORKING_PEAK + KEPT == 239
    assert batched["invocation_peak_bytes_per_row"] == kv_bytes(WORKING_PEAK + KEPT) == 61_184


def test_decode_batch_max_size_caps_the_invocation_rows(figures):
    capped = figures["capped"]
    assert len(capped["retained"]) == 6
    assert capped["invocation_rows_max"] == 4
    assert [s["rows"] for s in capped["working_copy_steps"]] == [4, 2] * 6


def test_stateless_path_never_builds_a_cache(figures):
    stateless = figures["stateless"]
    assert stateless["declared"] == {}
    assert stateless["pre_transformer_calls_with_cache"] == 0
    assert stateless["pre_transformer_calls_without_cache"] == 2
    assert stateless["held_caches"] == 0


# --- the same stage watched inside its steps, by the serving engine's own code ---

@pytest.fixture(scope="module")
def watched(qwen3_tts):
    """Two batched ICL requests, six chunks each, under kv-budget's in-step
    tracker (``peers.vllm_omni.qwen3_tts.watch_in_step``), declared and eager."""
    return {declared: qwen3_tts.watch_in_step(declared=declared) for declared in (True, False)}


def test_in_step_tracking_counts_the_working_copy_with_every_cache_alive_beside_it(watched):
    """At each working copy the tracker's running count equals the audit's
    count of the caches alive then: the working copy, the batched copy of
    the request caches (built by concatenation, never updated) and each
    request's retained cache."""
    run = watched[True]
    moments = run["moments"]
    assert len(moments) == 6
    for moment in moments:
        assert moment["tracked"] == {"decoder": moment["invocation_bytes"] + moment["retained_bytes"]}, moment
    # The working copy at its largest: the 168 positions per row of its torch.cat storage, 2 rows.
    assert max(m["working_copy_bytes"] for m in moments) == kv_bytes(WORKING_PEAK, rows=2)
    peaks = run["peaks"]
    assert peaks["owners"]["decoder"] == max(m["invocation_bytes"] + m["retained_bytes"] for m in moments)
    assert peaks["undeclared"] == {}


def test_on_the_eager_path_the_same_caches_are_undeclared_by_holding_module(watched):
    run = watched[False]
    for moment in run["moments"][1:]:  # the suffix steps: the decoder's working copies, the stage's kept caches
        assert moment["tracked"] == {"decoder": moment["invocation_bytes"], "": moment["retained_bytes"]}, moment
    first = run["moments"][0]  # the first chunk: the prefix pass's cache and its working copy
    assert sum(first["tracked"].values()) == first["invocation_bytes"] + first["retained_bytes"]
    peaks = run["peaks"]
    assert peaks["owners"] == {}
    assert set(peaks["undeclared"]) == {"", "decoder", "decoder.pre_transformer"}
    assert peaks["peak_bytes"] == watched[True]["peaks"]["peak_bytes"]


def test_the_live_verdict_on_the_declared_working_copy_is_under_declared(watched):
    from kv_budget.plan.planner import budget_worker, headroom_override, make_plan
    from kv_budget.sample.in_step import InStepPeaks
    from kv_budget.watch.live import LiveMonitor, WorkerSample

    stage = watched[True]["stage"]
    worker = budget_worker(collect_model_local_kv_specs(stage), headroom_override(kv_bytes(4096)), max_num_seqs=4)
    monitor = LiveMonitor(make_plan([worker], 4, "cap"), step_peaks=True)
    sample = WorkerSample(rank=0, owners=[{"owner": "decoder", "bytes": 0}], seconds=0.0,
                          step=InStepPeaks.model_validate(watched[True]["peaks"]))
    update = monitor.observe([sample], running=2, finished_unfreed=0, completed=0, now=0.0)
    (finding,) = [f for f in update.findings if f.kind == "under-declared"]
    declared_per_row = sum(line.bytes_per_row for line in worker.declarations)
    assert finding.bytes == -(-(watched[True]["peaks"]["owners"]["decoder"] - 2 * declared_per_row) // 2)
    assert monitor.state().ranks[0].owners[0].verdict == "under-declared"
