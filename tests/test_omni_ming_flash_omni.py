"""kv-budget's audit against vLLM-Omni 0.30.0's own ming-flash-omni talker.

The stage model ``MingFlashOmniTalkerForConditionalGeneration``, its
``MingAudioGenerator`` (the declarer and owner of the ``StaticCache``) and
the declaration itself are vLLM-Omni's, imported from its wheel
(``peers.vllm_omni.ming_flash_omni`` builds and drives them on the CPU and
says exactly what is not theirs). Expected bytes are computed here from the
geometry (2 x layers x kv heads x head_dim x 2048 positions x 2 bytes for
bfloat16, one row), never read back from what was measured, so each test
fails if the declaration, the allocation or the audit changes. Run with
``.venv-omni/bin/python -m pytest -m omni_models tests/test_omni_ming_flash_omni.py``.
"""

from __future__ import annotations

import json

import pytest

from kv_budget.audit import audit_module
from kv_budget.cli import main as kv_budget_main
from peers.vllm_omni.files import OmniFilesUnavailable, omni_root

# network as well: a run given its own -m (make test-fast) replaces setup.cfg's
# "not omni_models", and these build their models from vLLM-Omni's wheel.
pytestmark = [pytest.mark.omni_models, pytest.mark.network]

BF16 = 2
STATIC_POSITIONS = 2048
"""``MingAudioGenerator._STATIC_CACHE_LEN``, hard-coded in vLLM-Omni."""


def _row(layers: int, kv_heads: int, head_dim: int, positions: int = STATIC_POSITIONS) -> int:
    """Bytes of one row of K and V."""
    return 2 * layers * kv_heads * head_dim * positions * BF16


SMALL_ROW = _row(2, 2, 16)
REAL_ROW = _row(24, 2, 64)
KEY = "/talker_llm_static_cache"
"""The collector's OWNER/NAME: the stage model is the root ("")."""


@pytest.fixture(scope="module")
def ming():
    try:
        omni_root()
    except OmniFilesUnavailable as exc:
        pytest.skip(f"vLLM-Omni's files are unavailable: {exc}")
    from peers.vllm_omni import ming_flash_omni

    assert (ming_flash_omni.LLM_LAYERS, ming_flash_omni.LLM_KV_HEADS, ming_flash_omni.LLM_HEAD_DIM) == (2, 2, 16)
    real = ming_flash_omni.REAL_LLM
    assert (real["num_hidden_layers"], real["num_key_value_heads"]) == (24, 2)
    assert real["hidden_size"] // real["num_attention_heads"] == 64
    return ming_flash_omni


@pytest.fixture(scope="module")
def figures(ming):
    return ming.measure()


def _only_root(report):
    assert [o.owner for o in report.owners] == [""], "only the stage model declares or holds"
    return report.owners[0]


# --------------------------------------------------------------------------
# The declaration


def test_the_declaration_is_vllm_omnis_own(figures):
    """The spec comes from vLLM-Omni's class, with its name, scope and rows,
    and its positions are the generator's own ``_STATIC_CACHE_LEN``."""
    spec = figures["vllm_omni_spec"]
    assert spec["class"] == "vllm_omni.model_executor.models.model_local_kv.ModelLocalKVSpec"
    assert spec["name"] == "talker_llm_static_cache"
    assert (spec["scope"], spec["rows"], spec["rows_fixed"]) == ("invocation", "fixed", 1)
    assert spec["positions"] == spec["generator_static_cache_len"] == STATIC_POSITIONS
    assert (spec["layers"], spec["kv_heads"], spec["head_dim"], spec["dtype"]) == (2, 2, 16, "torch.bfloat16")


def test_the_collector_reads_one_declaration_at_the_root(figures):
    """``MingAudioGenerator`` is a plain object; the stage model forwards its
    declaration, so kv-budget's collector finds it at the root."""
    assert list(figures["declared"]) == [KEY]
    declared = figures["declared"][KEY]
    assert (declared["scope"], declared["rows"], declared["rows_fixed"], declared["positions"]) == (
        "invocation",
        "fixed",
        1,
        STATIC_POSITIONS,
    )
    assert declared["bytes_per_row"] == SMALL_ROW == 524_288


def test_cpu_build_is_the_deploy_files_eager_talker(figures):
    """``enforce_eager`` (both ming deploy files) and no CUDA: no CFM graph
    pool; no ``vae/`` folder, so no AudioVAE; weights in bfloat16."""
    geometry = figures["geometry"]
    assert geometry["use_cuda_graphs"] is False and geometry["sampler_pool"] is False
    assert geometry["audio_vae"] is False
    assert geometry["parameter_dtype"] == "torch.bfloat16"


# --------------------------------------------------------------------------
# What the forward path allocates


def test_one_request_allocates_the_declared_row_on_the_first_write(figures):
    """One ``StaticCache`` for the whole loop (3 decode steps), all 2048
    positions allocated by the prefill, one row: declared == measured to
    the byte, and gone when ``forward`` returns."""
    run = figures["no_text"]
    (cache,) = run["caches"]
    assert cache["cache_class"] == "StaticCache"
    assert cache["calls"] == run["llm_calls"] == 3
    assert cache["layers"] == 2
    assert cache["positions_per_layer"] == [STATIC_POSITIONS]
    assert cache["rows_per_layer"] == [1]
    assert cache["bytes_after_first_call"] == cache["bytes_after_last_call"] == SMALL_ROW
    assert cache["bytes_after_first_call"] == run["declared_bytes_at_one_row"]
    # 6 prompt ids, then 2 fed-back latents (the third step's is never fed back).
    assert cache["seen_tokens_after_last_call"] == 6 + 3 - 1
    assert run["alive_after_forward"] == 0
    assert run["latent_frames"] == 3 * 4  # 3 steps x patch_size 4


def test_each_text_segment_builds_its_own_cache_one_at_a_time(figures):
    """Two segments: two ``generate_latents`` calls, two caches of one row
    each; the first was freed before the second was written (cyclic
    collection off), so one row is live at a time."""
    run = figures["two_segments"]
    assert len(run["caches"]) == 2
    for cache in run["caches"]:
        assert cache["cache_class"] == "StaticCache"
        assert cache["calls"] == 2
        assert cache["rows_per_layer"] == [1]
        assert cache["positions_per_layer"] == [STATIC_POSITIONS]
        assert cache["bytes_after_first_call"] == SMALL_ROW
        assert cache["earlier_caches_alive_at_first_call"] == 0
        # A segment's prompt (system turn, instruction, text) is well inside 2048.
        assert 20 < cache["seen_tokens_after_last_call"] < STATIC_POSITIONS
    assert run["llm_calls"] == 4
    assert run["alive_after_forward"] == 0


def test_two_requests_in_one_call_still_hold_one_row(figures):
    """``forward`` reads only the first request's information and embeds
    all ids as one sequence: one cache, one row, whatever the batch."""
    run = figures["two_requests_in_one_call"]
    (cache,) = run["caches"]
    assert cache["rows_per_layer"] == [1]
    assert cache["bytes_after_first_call"] == SMALL_ROW
    assert cache["seen_tokens_after_last_call"] == 12 + 3 - 1


def test_static_cache_off_builds_a_fresh_cache_per_step(figures):
    """``use_static_cache: false`` passes no cache: each call makes its own
    ``DynamicCache`` (the prefill's 6 positions, then 1 per step), each far
    under the declared row, none reused."""
    run = figures["static_cache_off"]
    assert run["calls_with_cache_passed_in"] == 0
    assert run["calls_without_cache"] == 3
    assert [c["cache_class"] for c in run["caches"]] == ["DynamicCache"] * 3
    assert [c["positions_per_layer"] for c in run["caches"]] == [[6], [1], [1]]
    assert [c["seen_tokens_after_last_call"] for c in run["caches"]] == [6, 1, 1]
    assert [c["bytes_after_first_call"] for c in run["caches"]] == [_row(2, 2, 16, p) for p in (6, 1, 1)]
    assert all(c["earlier_caches_alive_at_first_call"] == 0 for c in run["caches"])


def test_a_prompt_as_long_as_the_cache_runs_no_step(figures):
    """``generate_latents`` runs ``min(max_steps, 2048 - prompt)`` steps: a
    2048-token prompt runs none, so nothing is written past the declared
    positions (nothing is allocated at all) and no latents come back."""
    run = figures["prompt_fills_cache"]
    assert run["prompt_tokens"] == STATIC_POSITIONS
    assert run["llm_calls"] == 0 and run["caches"] == []
    assert run["outputs"] == []


# --------------------------------------------------------------------------
# The real checkpoint geometry


def test_real_geometry_declaration_from_vllm_omnis_declarer(figures):
    """The stage built on the meta device with the real talker LLM (24
    layers, 2 KV heads, head_dim 64, bfloat16): 24 MiB per instance."""
    real = figures["real_geometry"]
    assert real["parameters_on"] == "meta"
    assert list(real["declared"]) == [KEY]
    spec = real["vllm_omni_spec"]
    assert (spec["layers"], spec["kv_heads"], spec["head_dim"], spec["positions"]) == (24, 2, 64, STATIC_POSITIONS)
    assert real["bytes_per_row"] == REAL_ROW == 25_165_824 == 24 * 2**20


def test_real_geometry_forward_allocates_the_declared_row(figures):
    """Built for real with that attention geometry (MLP and vocabulary
    shrunk) and run once: the cache holds exactly the declared 24 MiB."""
    run = figures["real_geometry_run"]
    assert run["declared"]["bytes_per_row"] == REAL_ROW
    (cache,) = run["caches"]
    assert (cache["layers"], cache["positions_per_layer"], cache["rows_per_layer"]) == (24, [STATIC_POSITIONS], [1])
    assert cache["bytes_after_first_call"] == REAL_ROW
    assert run["alive_after_forward"] == 0


# --------------------------------------------------------------------------
# Audits (what `kv-budget audit peers.vllm_omni.ming_flash_omni:NAME` prints)


@pytest.mark.parametrize("factory", ["talker_after_forward", "talker_after_segments"])
def test_audit_with_the_cache_kept_matches(ming, factory):
    report = audit_module(getattr(ming, factory)())
    entry = _only_root(report)
    assert entry.verdict == "match"
    assert entry.declared_bytes == entry.measured_bytes == SMALL_ROW
    (cache,) = entry.caches
    assert (cache.attribute, cache.cache_class, cache.rows, len(cache.layers)) == (
        "kv_budget_static_cache",
        "StaticCache",
        1,
        2,
    )
    assert not report.failed and not report.failures


def test_audit_at_rest_sees_nothing_held(ming):
    """Between calls nothing holds the cache: declared but absent (not a
    failure: an invocation cache is absent at rest)."""
    report = audit_module(ming.talker_at_rest())
    entry = _only_root(report)
    assert entry.verdict == "declared-but-absent"
    assert (entry.declared_bytes, entry.measured_bytes) == (SMALL_ROW, 0)
    assert not report.failed


def test_cli_audit_at_the_real_geometry(ming, capsys):
    """The command itself, ``kv-budget audit ...:talker_real_geometry_after_forward
    --json``: exit 0, 25,165,824 B declared and held."""
    capsys.readouterr()
    code = kv_budget_main(["audit", "peers.vllm_omni.ming_flash_omni:talker_real_geometry_after_forward", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    report = json.loads(out)
    assert report["failed"] is False
    (owner,) = report["owners"]
    assert (owner["owner"], owner["verdict"]) == ("", "match")
    assert owner["declared_bytes"] == owner["measured_bytes"] == REAL_ROW
    (declaration,) = owner["declarations"]
    assert (declaration["name"], declaration["scope"], declaration["rows"]) == (
        "talker_llm_static_cache",
        "invocation",
        1,
    )
