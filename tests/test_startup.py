"""The core's startup calls (:mod:`kv_budget.startup`) without vLLM: a
worker's budget of a loaded model, the refusals, the plan and its report.
Engines sharing the device ledger are separate processes: the engine tests
(``test_engine_ledger.py``) and ``test_ledger.py`` cover it."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from audit_models import REQUEST_ROW_BYTES, RequestDeclaringModel

from kv_budget.plan.planner import Decision
from kv_budget.settings import ModelLocalKVSettings, Policy
from kv_budget.startup import (
    ModelLocalKVInfeasibleError,
    ModelLocalKVOverrideError,
    ModelLocalKVPlanningError,
    EngineContext,
    budget_loaded_model,
    checked_results,
    plan_startup,
)

ROW = REQUEST_ROW_BYTES
VLLM = {"vllm_version": "0.0.test", "vllm_distribution": "none", "vllm_support": "untested"}




def worker_result(rank=0, **settings):
    config = ModelLocalKVSettings(**{"headroom_bytes": 10 * ROW, "ledger_dir": "off", **settings})
    return budget_loaded_model(RequestDeclaringModel(), rank, ("cpu", 0), config.model_dump(mode="json"), 256, 1)


def test_a_worker_budgets_its_loaded_model_against_the_operators_headroom():
    result = worker_result()
    assert result["problem"] is None
    assert result["declarations"] == ["talker/kv"]
    assert result["budget"]["per_seq_bytes"] == ROW and result["budget"]["headroom"]["bytes"] == 10 * ROW


def test_the_plan_caps_at_what_fits_logs_its_table_and_writes_the_report(tmp_path, caplog):
    settings = ModelLocalKVSettings(headroom_bytes=10 * ROW, ledger_dir="off", report_path=str(tmp_path / "p.json"))
    results = checked_results([worker_result()], settings.policy)
    with caplog.at_level(logging.INFO, logger="vllm.kv_budget"):
        plan = plan_startup(results, EngineContext(settings, 256, "pid 1: model m", VLLM), started=0.0)
    assert (plan.decision, plan.effective_max_num_seqs) == (Decision.CAPPED, 10)
    assert "kv-budget: vLLM 0.0.test (none, support: untested)" in caplog.text
    report = json.loads((tmp_path / "p.json").read_text())
    assert (report["effective_max_num_seqs"], report["vllm_version"]) == (10, "0.0.test")


def test_nothing_fits_under_cap_refuses():
    settings = ModelLocalKVSettings(headroom_bytes=ROW - 1, ledger_dir="off")
    results = [worker_result(headroom_bytes=ROW - 1)]
    with pytest.raises(ModelLocalKVInfeasibleError):
        plan_startup(checked_results(results, settings.policy), EngineContext(settings, 256, "e", VLLM), started=0.0)


def test_an_override_that_matches_nothing_or_a_failed_worker_refuses_naming_it():
    unmatched = worker_result(overrides=("talker/nope:rows_fixed=2",))
    with pytest.raises(ModelLocalKVOverrideError, match="talker/nope"):
        checked_results([unmatched], Policy.CAP)
    failed = {**worker_result(), "problem": {"kind": "failure", "message": "RuntimeError: boom"}}
    with pytest.raises(ModelLocalKVPlanningError, match="rank 0: RuntimeError: boom"):
        checked_results([failed], Policy.WARN)


def test_an_unmeasured_device_refuses_under_cap_and_leaves_the_engine_alone_under_warn():
    answers = [{**worker_result(), "budget": None, "problem": {"kind": "sampling", "message": "no memory figure"}}]
    results = checked_results(answers, Policy.CAP)  # not the worker's fault: the plan decides what it means
    with pytest.raises(ModelLocalKVInfeasibleError, match=r"rank 0: no memory figure.*--model-local-kv-headroom SIZE"):
        plan_startup(results, EngineContext(ModelLocalKVSettings(ledger_dir="off"), 256, "e", VLLM), started=0.0)
    warn = EngineContext(ModelLocalKVSettings(policy="warn", ledger_dir="off"), 256, "e", VLLM)
    assert plan_startup(results, warn, started=0.0) is None


def test_a_model_that_declares_nothing_gets_one_line_and_its_configured_limit(caplog):
    settings = ModelLocalKVSettings(headroom_bytes=10 * ROW, ledger_dir="off")
    result = budget_loaded_model(torch.nn.Linear(2, 2), 0, ("cpu", 0), settings.model_dump(mode="json"), 256, 1)
    with caplog.at_level(logging.INFO, logger="vllm.kv_budget"):
        engine = EngineContext(settings, 256, "pid 1: model m", VLLM)
        plan = plan_startup(checked_results([result], settings.policy), engine, started=0.0)
    assert (plan.decision, plan.effective_max_num_seqs) == (Decision.OK, 256)
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.kv_budget"]
    assert len(lines) == 1 and lines[0].startswith(
        "kv-budget: the model declares no model-local KV: nothing to plan, max_num_seqs 256 stays"), lines
