"""A vLLM-Omni deployment's stages, without vLLM-Omni: what each stage is
called in files, series and logs, which overrides apply in which stage,
operator-supplied declarations, the driver's merge of settings, and its
check of overrides across stages. The same code runs inside vLLM-Omni's
real orchestrator in tests/test_omni_pipeline*.py."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from kv_budget import ModelLocalKVSpec
from kv_budget.collect.model import Collection, OwnedSpec
from kv_budget.collect.supplied import SuppliedDeclarationsError, supplied_collection, with_supplied
from kv_budget.override import OverrideError, apply_overrides, overrides_for_stage, parse_override, parse_overrides
from kv_budget.plan.planner import budget_worker, headroom_override, make_plan
from kv_budget.report import render_plan_table
from kv_budget.stage import Stage, stage_file_name
from kv_budget.startup import ModelLocalKVOverrideError, budget_loaded_model, checked_results, engine_label
from kv_budget.watch.metrics import METRICS, label_names, status_samples
from kv_budget.watch.status import EngineStatus, read_status, stage_status_paths, status_path, write_status
from vllm_patches.omni import deployment_settings, stage_settings, unmatched_across_stages

STAGE1 = Stage(stage_id=1, replica=0)


def spec(name: str, positions: int = 16) -> ModelLocalKVSpec:
    return ModelLocalKVSpec(name=name, layers=1, kv_heads=1, head_dim=8, dtype=torch.float32,
                            physical_capacity_positions=positions, capacity_source="test", scope="request",
                            rows="max_num_seqs")


class Holder(torch.nn.Module):
    """A module that declares one cache, as a model's module does."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def model_local_kv_specs(self):
        return [spec(self.name)]


class Model(torch.nn.Module):
    def __init__(self, *names: str) -> None:
        super().__init__()
        self.holders = torch.nn.ModuleList(Holder(name) for name in names)


def test_a_stage_names_its_files_and_its_ledger_entry():
    assert stage_file_name("/r/plan.json", STAGE1).name == "plan.stage1-replica0.json"
    assert stage_file_name("/r/plan.json", None).name == "plan.json"
    assert status_path("/s", "/m", 0, STAGE1).name.startswith("engine-0-stage1-replica0-")
    assert status_path("/s", "/m", 0, Stage(stage_id=0, replica=0)) != status_path("/s", "/m", 0, STAGE1)
    assert engine_label(7, "/m", STAGE1) == "pid 7: model /m, stage 1 replica 0"
    assert engine_label(7, "/m") == "pid 7: model /m"


def test_a_stage_qualified_override_names_its_stage():
    override = parse_override("1:decoder/codec_decoder_request:physical_capacity_positions=72")
    assert (override.stage, override.owner, override.name, override.value) == (1, "decoder", "codec_decoder_request", 72)
    assert parse_override("0/kv:layers=2").stage is None  # a root ModuleList child, not stage 0
    assert parse_override("0/kv:layers=2").owner == "0"


def test_overrides_apply_in_their_stage_and_unqualified_ones_in_every_stage():
    overrides = parse_overrides(["a/x:layers=2", "1:a/x:layers=3", "0:a/x:layers=4"])
    assert [o.text for o in overrides_for_stage(overrides, 1)] == ["a/x:layers=2", "1:a/x:layers=3"]
    assert [o.text for o in overrides_for_stage(overrides, 2)] == ["a/x:layers=2"]
    with pytest.raises(OverrideError, match="not a vLLM-Omni stage; drop the STAGE: prefix"):
        overrides_for_stage(overrides, None)


def _results(model, overrides, stage_id):
    settings = {"headroom_bytes": 10**9, "overrides": overrides, "ledger_dir": "off"}
    return [budget_loaded_model(model, 0, ("cpu", 0), settings, 8, 1, True, stage_id)]


def test_an_unqualified_override_a_stage_lacks_is_left_to_the_deployment(caplog):
    results = _results(Model("kept"), ["holders.0/other:layers=2"], 0)
    with caplog.at_level(logging.INFO, logger="vllm.kv_budget"):
        checked_results(results, "cap", Stage(stage_id=0, replica=0))
    assert "match no declaration in stage 0 replica 0 (declarations: holders.0/kept)" in caplog.text
    assert results[0]["unmatched_overrides"] == ["holders.0/other:layers=2"]
    assert results[0]["overrides"] == ["holders.0/other:layers=2"]


def test_a_qualified_override_that_matches_nothing_in_its_stage_stops_it():
    results = _results(Model("kept"), ["1:holders.0/other:layers=2"], 1)
    with pytest.raises(ModelLocalKVOverrideError, match=r"^stage 1 replica 0: model-local KV override\(s\) "
                       r"'1:holders.0/other:layers=2' match no declaration; declarations: holders.0/kept"):
        checked_results(results, "cap", STAGE1)
    # the same override is another stage's: stage 0 neither applies nor refuses it
    (result,) = _results(Model("kept"), ["1:holders.0/other:layers=2"], 0)
    assert result["unmatched_overrides"] == [] and result["problem"] is None


def test_outside_vllm_omni_an_unmatched_override_still_stops_the_engine():
    results = _results(Model("kept"), ["holders.0/other:layers=2"], None)
    with pytest.raises(ModelLocalKVOverrideError, match="match no declaration; declarations: holders.0/kept"):
        checked_results(results, "cap")


def test_supplied_declarations_are_planned_marked_and_may_not_shadow_the_models(tmp_path):
    path = tmp_path / "supplied.json"
    path.write_text(json.dumps([{"owner": "decoder", "name": "window", "layers": 2, "kv_heads": 1, "head_dim": 8,
                                 "dtype": "float32", "physical_capacity_positions": 32, "capacity_source": "operator",
                                 "scope": "request", "rows": "max_num_seqs"}]))
    supplied = supplied_collection(str(path))
    assert [(o.owner, o.spec.name, o.supplied_by) for o in supplied.specs] == [
        ("decoder", "window", f"spec file {path}")]
    model = Collection((OwnedSpec("talker", spec("kv")),), ())
    both = with_supplied(model, supplied)
    plan = make_plan([budget_worker(both, headroom_override(10**9), rank=0, max_num_seqs=4)], 4, "cap")
    lines = {d.name: d for d in plan.declarations}
    assert lines["window"].supplied_by == f"spec file {path}" and lines["kv"].supplied_by is None
    assert lines["window"].bytes_per_row == 2 * 2 * 8 * 32 * 4
    assert f"supplied by the operator (spec file {path}), not declared by the model" in render_plan_table(plan)
    with pytest.raises(SuppliedDeclarationsError, match="decoder/window are declared by the model too"):
        with_supplied(Collection((OwnedSpec("decoder", spec("window")),), ()), supplied)
    assert supplied_collection("mimo-audio").specs[0].supplied_by == "preset mimo-audio"
    with pytest.raises(SuppliedDeclarationsError, match="neither a preset"):
        supplied_collection(str(tmp_path / "missing.json"))


def test_an_override_can_correct_a_supplied_declaration():
    supplied = supplied_collection("mimo-audio")
    owned = supplied.specs[0]
    text = f"{owned.owner}/{owned.spec.name}:physical_capacity_positions=8"
    corrected, unmatched = apply_overrides(supplied, parse_overrides([text]))
    assert not unmatched and corrected.specs[0].supplied_by == "preset mimo-audio"
    assert corrected.specs[0].spec.physical_capacity_positions == 8


def test_the_driver_takes_keywords_over_the_global_section_and_the_stage_over_both():
    deployment, rest = deployment_settings({
        "model": "m",
        "additional_config": {"model_local_kv": {"policy": "cap", "headroom_bytes": "96MiB", "overrides": ["a/x:layers=2"]},
                              "other_plugin": 1},
        "model_local_kv_policy": "warn",
        "model_local_kv_override": ["b/y:layers=3"],
        "model_local_kv_report": None,  # not given
    })
    assert deployment == {"policy": "warn", "headroom_bytes": "96MiB", "overrides": ["a/x:layers=2", "b/y:layers=3"]}
    assert rest == {"model": "m", "additional_config": {"other_plugin": 1}}
    own = {"headroom_bytes": "64MiB", "overrides": ["1:c/z:layers=4"]}
    assert stage_settings(deployment, own) == {
        "policy": "warn", "headroom_bytes": "64MiB", "overrides": ["a/x:layers=2", "b/y:layers=3", "1:c/z:layers=4"]}
    assert stage_settings({}, None) == {}
    with pytest.raises(ValueError, match=r"\['overrides'\] must be a list to add more overrides to, got 'c/z:layers=4'"):
        stage_settings(deployment, {"overrides": "c/z:layers=4"})  # never split into characters
    assert deployment_settings({"model_local_kv_override": "a/x:layers=2"})[0] == {"overrides": ["a/x:layers=2"]}


def _staged_status(stage: Stage, declared: list[str], overrides: list[str], unmatched: list[str]) -> EngineStatus:
    collection = Collection(tuple(OwnedSpec("talker", spec(name)) for name in declared), ())
    plan = make_plan([budget_worker(collection, headroom_override(10**9), rank=0, max_num_seqs=4)], 4, "cap")
    return EngineStatus(engine_index=0, model="/m", pid=1, updated_unix_s=1.0, plan=plan, stage=stage,
                        overrides=overrides, unmatched_overrides=unmatched)


def test_the_driver_refuses_an_override_no_stage_matched_naming_every_stages_declarations():
    stage0, stage1 = Stage(stage_id=0, replica=0), STAGE1
    matched_in_one = [_staged_status(stage0, ["a"], ["talker/b:layers=2"], ["talker/b:layers=2"]),
                      _staged_status(stage1, ["b"], ["talker/b:layers=2"], [])]
    assert unmatched_across_stages(matched_in_one) is None
    nowhere = [_staged_status(stage0, ["a"], ["talker/c:layers=2"], ["talker/c:layers=2"]),
               _staged_status(stage1, ["b"], ["talker/c:layers=2"], ["talker/c:layers=2"])]
    assert unmatched_across_stages(nowhere) == (
        "kv-budget: model-local KV override(s) 'talker/c:layers=2' match no declaration in any stage; "
        "declarations: stage 0 replica 0: talker/a; stage 1 replica 0: talker/b")


def test_a_stages_series_carry_vllm_omnis_stage_and_replica_labels(tmp_path):
    status = _staged_status(STAGE1, ["a"], [], [])
    samples = status_samples(read_status(write_status(tmp_path, status)), model_name="demo")
    assert samples and all(s.labels["stage"] == "1" and s.labels["replica"] == "0" and "engine" not in s.labels
                           for s in samples)
    names = label_names(next(m for m in METRICS if m.name == "kv_budget:headroom_bytes"), staged=True)
    assert names == ("model_name", "stage", "replica", "rank")


def test_the_stages_status_files_are_found_by_the_names_they_are_written_under(tmp_path):
    stage0 = Stage(stage_id=0, replica=0)
    first, second = write_status(tmp_path, _staged_status(stage0, ["a"], [], [])), write_status(
        tmp_path, _staged_status(STAGE1, ["b"], [], []))
    plain = _staged_status(stage0, ["a"], [], []).model_copy(update={"stage": None})
    write_status(tmp_path, plain)
    assert set(stage_status_paths(tmp_path)) == {first, second}  # not the plain engine's
    assert stage_status_paths(tmp_path, 0, STAGE1) == [second]
    assert stage_status_paths(tmp_path, 1, STAGE1) == []


def test_a_platform_section_that_replaces_additional_config_is_found(tmp_path):
    from kv_budget.plan.deploy_file import settings_a_platform_replaces

    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(json.dumps({
        "stages": [
            {"stage_id": 0, "additional_config": {"model_local_kv": {"policy": "warn", "headroom_bytes": "1GiB"}}},
            {"stage_id": 1, "engine_args": {"additional_config": {"model_local_kv": {"policy": "cap"}}}},
            {"stage_id": 2, "additional_config": {"model_local_kv": {"policy": "cap"}}},
        ],
        "platforms": {"rocm": {"stages": [
            {"stage_id": 0, "additional_config": {"model_local_kv": {"policy": "warn"}, "other": 1}},
            {"stage_id": 1, "additional_config": {"other": 1}},
            {"stage_id": 2, "devices": "1"},  # no additional_config: the stage keeps its own
        ]}},
    }))
    assert settings_a_platform_replaces(deploy, "rocm", "model_local_kv") == {0: ["headroom_bytes"], 1: ["policy"]}
    assert settings_a_platform_replaces(deploy, "cuda", "model_local_kv") == {}


def test_the_stages_on_a_device_must_give_it_one_size_and_one_headroom():
    """Each is the device's figure, which its stages split: two values for
    one device are refused where the driver resolves the deploy."""
    from vllm_patches.omni_deployment import _one_value

    key = "headroom_bytes (--model-local-kv-headroom)"
    assert _one_value(0, {0: 96 * 2**20, 1: 96 * 2**20, 2: None}, "headrooms", key) == 96 * 2**20
    assert _one_value(0, {0: None}, "headrooms", key) is None
    with pytest.raises(ValueError, match=r"the stages on device 0 give different headrooms \(stage 0: "
                                         r"100,663,296 B, stage 1: 67,108,864 B\); it is the device's figure"):
        _one_value(0, {0: 96 * 2**20, 1: 64 * 2**20}, "headrooms", key)
