"""vLLM-Omni 0.30.0's MiMo-Audio local transformer and MiniCPM-o 4.5 streaming
Whisper encoder, run on the CPU and audited.

Both models are built by vLLM-Omni's own constructors and driven through
their own decode and streaming paths (``peers.vllm_omni.mimo_audio`` and
``peers.vllm_omni.minicpm_o`` say exactly what is not theirs). Expected bytes
are computed here from the geometry those modules configure
(2 x layers x kv heads x head_dim x positions x 2 bytes for bfloat16, times
rows), never read back from what the audit measured, so each test fails if
either the declaration or the audit miscounts.
"""

from __future__ import annotations

import pytest

from kv_budget.audit import audit_module
from peers.vllm_omni.files import OmniFilesUnavailable

# network as well: a run given its own -m (make test-fast) replaces setup.cfg's
# "not omni_models", and these build their models from vLLM-Omni's wheel.
pytestmark = [pytest.mark.omni_models, pytest.mark.network]

BF16 = 2


def _row(layers: int, heads: int, head_dim: int, positions: int) -> int:
    """Bytes of one row (one sequence or session) of K and V."""
    return 2 * layers * heads * head_dim * positions * BF16


def _needs_omni(call):
    try:
        return call()
    except OmniFilesUnavailable as exc:
        pytest.skip(f"vLLM-Omni's files are unavailable: {exc}")


def _only_owner(report, owner):
    (entry,) = [o for o in report.owners if o.owner == owner]
    assert [o.owner for o in report.owners] == [owner], "no other owner declares or holds"
    return entry


# --------------------------------------------------------------------------
# MiMo-Audio


@pytest.fixture(scope="module")
def mimo():
    from peers.vllm_omni import mimo_audio

    return mimo_audio


@pytest.fixture(scope="module")
def mimo_row(mimo):
    # group_size 4 + max(delay_pattern 0-7) = 11 decode steps, one position each.
    assert mimo.GROUP_SIZE == 4 and mimo.DELAY_PATTERN == "0-1-2-3-4-5-6-7"
    return _row(mimo.LOCAL_LAYERS, mimo.LOCAL_HEADS, mimo.LOCAL_HEAD_DIM, 4 + 7)


@pytest.fixture(scope="module")
def mimo_figures(mimo):
    return _needs_omni(lambda: mimo.measure(batch=4))


def test_mimo_declares_the_local_transformer_and_no_graph_pool_on_cpu(mimo_figures, mimo_row):
    """Off CUDA the constructor captures no local-decode graph, so the
    graph-pool declaration is absent and only the per-sequence one remains."""
    assert mimo_figures["cuda_available"] is False
    assert mimo_figures["captured_graph_buckets"] == []
    assert list(mimo_figures["declared"]) == ["local_transformer"]
    declared = mimo_figures["declared"]["local_transformer"]
    assert (declared["scope"], declared["rows"], declared["positions"]) == ("invocation", "max_num_seqs", 11)
    assert declared["bytes_per_row"] == mimo_row == 5_632


def test_mimo_local_decode_builds_one_cache_of_declared_size(mimo_figures, mimo_row):
    """One DynamicCache, filled by 11 local-transformer calls, four rows of
    11 positions: exactly the declared bytes per row x 4, no slack in storage."""
    assert mimo_figures["local_transformer_calls"] == 11
    assert mimo_figures["cache_objects"] == 1
    assert mimo_figures["cache_class"] == "DynamicCache"
    assert mimo_figures["positions_per_layer"] == [11]
    assert mimo_figures["rows_per_layer"] == [4]
    assert mimo_figures["measured_bytes"] == 4 * mimo_row == 22_528
    assert mimo_figures["view_bytes"] == mimo_figures["measured_bytes"]
    assert mimo_figures["declared_bytes_at_batch"] == mimo_figures["measured_bytes"]


@pytest.mark.parametrize("batch", [1, 4])
def test_mimo_audit_matches(mimo, mimo_row, batch):
    report = audit_module(_needs_omni(lambda: mimo.local_transformer_batch(batch)))
    entry = _only_owner(report, "fused_thinker_talker")
    assert entry.verdict == "match"
    assert entry.live_sequences == batch
    assert entry.declared_bytes == entry.measured_bytes == batch * mimo_row
    assert not report.failed and not report.failures


# --------------------------------------------------------------------------
# MiniCPM-o 4.5


@pytest.fixture(scope="module")
def minicpm():
    from peers.vllm_omni import minicpm_o

    return minicpm_o


@pytest.fixture(scope="module")
def minicpm_geometry(minicpm):
    """Declared row (embed_positions = 30 positions) and a full session's
    row (5 chunks of 5 positions: the 6th would reach 30 and reset)."""
    assert (minicpm.MAX_SOURCE_POSITIONS, minicpm.CHUNK_POSITIONS, minicpm.CHUNKS_TO_FULL) == (30, 5, 5)
    shape = (minicpm.ENCODER_LAYERS, minicpm.HEADS, minicpm.HEAD_DIM)
    return {"declared_row": _row(*shape, 30), "full_session": _row(*shape, 25), "chunk": _row(*shape, 5)}


@pytest.fixture(scope="module")
def minicpm_figures(minicpm):
    return _needs_omni(lambda: minicpm.measure(sessions=4))


def test_minicpm_declaration_is_one_session_of_embed_positions(minicpm_figures, minicpm_geometry):
    declared = minicpm_figures["declared"]
    assert list(declared) == ["thinker.apm/whisper_encoder_self_attn"]
    spec = declared["thinker.apm/whisper_encoder_self_attn"]
    assert (spec["scope"], spec["rows"], spec["rows_fixed"], spec["positions"]) == ("session", "fixed", 1, 30)
    assert spec["bytes_per_row"] == minicpm_geometry["declared_row"] == 7_680


def test_minicpm_deploy_file_allows_four_sessions(minicpm_figures):
    deploy = minicpm_figures["deploy"]
    assert deploy["session_mode"] == "duplex"
    assert deploy["max_sessions"] == 4
    assert deploy["stage_max_num_seqs"] == [4, 4, 4]


def test_minicpm_sessions_fill_then_reset(minicpm_figures, minicpm_geometry):
    """Each session's cache grows 5 positions a chunk up to 25; the next
    chunk resets it. During that reset the runtime still holds the old cache
    on the session while the encoder builds the new one: 25 + 5 = 30
    positions, exactly the declared row."""
    assert minicpm_figures["positions_after_each_chunk"] == {
        f"session-{i}": [5, 10, 15, 20, 25] for i in range(4)
    }
    assert minicpm_figures["held_bytes_per_session"] == {
        f"session-{i}": minicpm_geometry["full_session"] for i in range(4)
    }
    assert minicpm_figures["held_bytes_total"] == 4 * minicpm_geometry["full_session"] == 25_600
    assert minicpm_figures["thinker_holds_between_calls"] is None
    reset = minicpm_figures["reset_step"]
    assert reset["input_cache_was_reset"] == 1
    assert reset["positions_after"] == 5
    assert reset["old_bytes"] == minicpm_geometry["full_session"]
    assert reset["new_bytes"] == minicpm_geometry["chunk"]
    assert reset["peak_bytes"] == minicpm_geometry["declared_row"]


def test_minicpm_production_declaration(minicpm_figures):
    """Their declarer on a whisper-medium-sized encoder (meta device):
    24 layers x 16 heads x 64 x 1500 positions x bfloat16, per session."""
    assert minicpm_figures["production"] == {"positions": 1500, "bytes_per_session": 2 * 24 * 16 * 64 * 1500 * BF16}
    assert minicpm_figures["production"]["bytes_per_session"] == 147_456_000


def test_minicpm_audit_one_session_is_over_declared(minicpm, minicpm_geometry):
    entry = _only_owner(audit_module(_needs_omni(minicpm.streaming_one_session)), "thinker.apm")
    assert entry.verdict == "over-declared"
    assert entry.declared_bytes == minicpm_geometry["declared_row"]
    assert entry.measured_bytes == minicpm_geometry["full_session"]


def test_minicpm_audit_four_sessions_is_under_declared(minicpm, minicpm_geometry):
    """What the deploy file allows holds more than one declared session;
    the correction rows_fixed=4 covers it."""
    report = audit_module(_needs_omni(minicpm.streaming_four_sessions))
    entry = _only_owner(report, "thinker.apm")
    assert entry.verdict == "under-declared" and report.failed
    assert entry.declared_bytes == minicpm_geometry["declared_row"]
    assert entry.measured_bytes == 4 * minicpm_geometry["full_session"]
    assert [len(c.layers) for c in entry.caches] == [2] * 4
    assert 4 * minicpm_geometry["declared_row"] >= entry.measured_bytes
