"""The mapping from an engine's status to Prometheus samples
(:mod:`kv_budget.watch.metrics`), on a plan the planner built from a real
collection and live figures a real :class:`LiveMonitor` computed, read
back through the status file as the API server reads it. Expected values
are worked out by hand from the declarations' geometry."""

from __future__ import annotations

import re

import pytest
import torch

from kv_budget import ModelLocalKVSpec
from kv_budget.collect.model import Collection, OwnedSpec
from kv_budget.plan.planner import budget_worker, headroom_override, make_plan
from kv_budget.sample.in_step import InStepPeaks
from kv_budget.watch.live import LiveMonitor, OwnerBytes, WorkerSample
from kv_budget.watch.metrics import (
    DECLARATION_LABELS,
    FINDING_KINDS,
    METRICS,
    METRICS_BY_NAME,
    VERDICTS,
    label_names,
    status_samples,
)
from kv_budget.watch.status import EngineStatus, read_status, write_status

ROW = 2 * 64 * 4  # bytes per position: K and V, one layer, one kv head, head_dim 64, fp32


def spec(name, positions, scope="request", rows="max_num_seqs", rows_fixed=None):
    return ModelLocalKVSpec(
        name=name, layers=1, kv_heads=1, head_dim=64, dtype=torch.float32,
        physical_capacity_positions=positions, capacity_source="test", scope=scope, rows=rows,
        rows_fixed=rows_fixed, rows_reason="test" if rows_fixed else None,
    )


COLLECTION = Collection((
    OwnedSpec("talker", spec("step_kv", 100)),                                           # per sequence
    OwnedSpec("talker", spec("pool", 10, scope="model", rows="fixed", rows_fixed=4)),    # already charged
    OwnedSpec("codec", spec("window", 50, scope="session", rows="fixed", rows_fixed=2)),  # uncharged fixed
    OwnedSpec("", spec("scratch", 20, scope="invocation")),                              # per sequence, in a call
), ())
STEP, POOL, WINDOW, SCRATCH = 100 * ROW, 4 * 10 * ROW, 2 * 50 * ROW, 20 * ROW
PER_SEQ = STEP + SCRATCH  # 61,440
FIXED = WINDOW  # 51,200
HEADROOM_0 = FIXED + 10 * PER_SEQ + 100  # rank 0 fits 10 sequences: it binds
HEADROOM_1 = 2 * HEADROOM_0  # rank 1 fits 20
EXCESS = 1000  # per sequence the talker holds beyond its declarations on rank 0, in the second sample


def _plan():
    workers = [
        budget_worker(COLLECTION, headroom_override(HEADROOM_0), rank=0, max_num_seqs=256),
        budget_worker(COLLECTION, headroom_override(HEADROOM_1), rank=1, max_num_seqs=256),
    ]
    return make_plan(workers, 256, "cap")


def _sample(rank: int, sequences: int, excess: int = 0, watched: bool = False) -> WorkerSample:
    """``watched``: the step was watched inside too, and held at once what it keeps after it."""
    talker = POOL + sequences * (STEP + excess)
    step = InStepPeaks(owners={"talker": talker, "codec": WINDOW}, undeclared={}, peak_bytes=talker + WINDOW,
                       caches=2, updates=2, seconds=0.0)
    return WorkerSample(rank=rank, seconds=0.001, step=step if watched else None, owners=[
        OwnerBytes(owner="talker", bytes=talker),
        OwnerBytes(owner="codec", bytes=WINDOW),
    ])


@pytest.fixture(scope="module")
def plan():
    return _plan()


@pytest.fixture(scope="module")
def live_status(plan, tmp_path_factory) -> EngineStatus:
    """Two samples: 4 sequences as declared, then 6 held (5 running, 1
    finished not freed) with rank 0's talker over its declarations."""
    monitor = LiveMonitor(plan, sample_interval_s=1.0)
    monitor.observe([_sample(0, 4), _sample(1, 4)], running=4, finished_unfreed=0, completed=3, now=1.0)
    monitor.note_cost(0.002)
    update = monitor.observe([_sample(0, 6, EXCESS, watched=True), _sample(1, 6, watched=True)], running=5,
                             finished_unfreed=1, completed=8, now=2.0)
    monitor.note_cost(0.003)
    assert update.limit == (HEADROOM_0 - FIXED) // (PER_SEQ + EXCESS) == 9
    status = EngineStatus(engine_index=1, model="/models/demo", pid=4242, updated_unix_s=1_700_000_000.5,
                          plan=plan, live=monitor.state())
    # Through the file, as the API server reads it.
    return read_status(write_status(tmp_path_factory.mktemp("status"), status))


def by_name(samples) -> dict[str, list]:
    grouped: dict[str, list] = {}
    for sample in samples:
        grouped.setdefault(sample.name, []).append(sample)
    return grouped


def value(samples, metric: str, /, **labels) -> float:
    (match,) = [s.value for s in samples if s.name == metric and all(s.labels[k] == v for k, v in labels.items())]
    return match


def test_the_table_follows_prometheus_and_vllm_conventions():
    names = [spec.name for spec in METRICS]
    assert len(names) == len(set(names)) == len(METRICS_BY_NAME)
    for spec in METRICS:
        assert re.fullmatch(r"kv_budget:[a-z_]+", spec.name), spec.name
        assert spec.labels[:2] == ("model_name", "engine")
        assert spec.help.strip().endswith(".") and len(spec.help) > 40
        assert not spec.name.endswith("_total")  # gauges mirroring a file, not counters
    assert {spec.name for spec in METRICS if spec.labels == DECLARATION_LABELS} == {
        "kv_budget:declaration_bytes_per_row", "kv_budget:declaration_peak_bytes"}


def test_the_plan_figures_per_engine_and_per_rank(plan):
    assert (plan.effective_max_num_seqs, plan.binding_rank) == (10, 0)
    status = EngineStatus(engine_index=0, model="/models/demo", pid=1, updated_unix_s=5.0, plan=plan)
    samples = status_samples(status, model_name="demo")
    engine = {"model_name": "demo", "engine": "0"}
    assert all({k: s.labels[k] for k in engine} == engine for s in samples)
    assert value(samples, "kv_budget:configured_max_num_seqs") == 256
    assert value(samples, "kv_budget:startup_max_num_seqs") == 10
    assert value(samples, "kv_budget:live_max_num_seqs") == 10  # no sample yet: the startup value
    assert value(samples, "kv_budget:safe_max_num_seqs") == 10
    assert value(samples, "kv_budget:predicted_peak_bytes") == FIXED + 10 * PER_SEQ
    assert value(samples, "kv_budget:status_updated_timestamp_seconds") == 5.0
    (info,) = [s for s in samples if s.name == "kv_budget:plan_info"]
    assert (info.labels["policy"], info.labels["decision"], info.value) == ("cap", "capped", 1)
    for rank, headroom, safe in ((0, HEADROOM_0, 10), (1, HEADROOM_1, 20)):
        r = str(rank)
        assert value(samples, "kv_budget:headroom_bytes", rank=r) == headroom
        assert value(samples, "kv_budget:per_sequence_bytes", rank=r) == PER_SEQ
        assert value(samples, "kv_budget:fixed_bytes", rank=r) == FIXED
        assert value(samples, "kv_budget:charged_bytes", rank=r) == POOL
        assert value(samples, "kv_budget:rank_safe_max_num_seqs", rank=r) == safe
    assert not [s for s in samples if s.name.startswith("kv_budget:live_") and s.name != "kv_budget:live_max_num_seqs"]


def test_one_series_per_declaration_with_its_peak_at_the_startup_value(plan):
    status = EngineStatus(engine_index=0, model="/models/demo", pid=1, updated_unix_s=5.0, plan=plan)
    samples = by_name(status_samples(status))
    per_row = samples["kv_budget:declaration_bytes_per_row"]
    peaks = samples["kv_budget:declaration_peak_bytes"]
    keys = [tuple(s.labels[k] for k in ("rank", "owner", "name", "scope", "rows")) for s in per_row]
    assert len(keys) == len(set(keys)) == 2 * 4  # four declarations on each of two ranks
    expected = {  # (owner, name, scope, rows) -> (bytes per row, peak at max_num_seqs 10)
        ("talker", "step_kv", "request", "max_num_seqs"): (STEP, 10 * STEP),
        ("talker", "pool", "model", "fixed"): (10 * ROW, POOL),
        ("codec", "window", "session", "fixed"): (50 * ROW, WINDOW),
        ("<root>", "scratch", "invocation", "max_num_seqs"): (SCRATCH, 10 * SCRATCH),
    }
    for rank in ("0", "1"):
        got = {
            tuple(s.labels[k] for k in ("owner", "name", "scope", "rows")): (
                s.value, value(peaks, "kv_budget:declaration_peak_bytes", **s.labels))
            for s in per_row if s.labels["rank"] == rank
        }
        assert got == expected
    assert all(s.labels["model_name"] == "/models/demo" for s in per_row)  # the model when no served name


def test_live_figures_per_owner_rank_and_engine(live_status):
    samples = status_samples(live_status, model_name="demo")
    held = 6  # 5 running + 1 finished, not freed
    assert all(s.labels["engine"] == "1" for s in samples)
    assert value(samples, "kv_budget:startup_max_num_seqs") == 10
    assert value(samples, "kv_budget:live_max_num_seqs") == 9  # the live correction
    assert value(samples, "kv_budget:live_running_sequences") == 5
    assert value(samples, "kv_budget:live_held_sequences") == held
    assert value(samples, "kv_budget:live_completed_requests") == 8
    assert value(samples, "kv_budget:live_samples") == 2
    assert value(samples, "kv_budget:live_corrections") == 1
    assert value(samples, "kv_budget:live_last_sample_seconds") == 0.003
    findings = {s.labels["kind"]: s.value for s in samples if s.name == "kv_budget:live_findings"}
    assert findings == {kind: (1 if kind in ("under-declared", "limit-lowered") else 0) for kind in FINDING_KINDS}

    talker_0 = POOL + held * (STEP + EXCESS)
    assert value(samples, "kv_budget:live_owner_held_bytes", rank="0", owner="talker") == talker_0
    assert value(samples, "kv_budget:live_owner_peak_bytes", rank="0", owner="talker") == talker_0
    assert value(samples, "kv_budget:live_owner_allowed_bytes", rank="0", owner="talker") == POOL + held * STEP
    assert value(samples, "kv_budget:live_owner_held_bytes", rank="1", owner="talker") == POOL + held * STEP
    assert value(samples, "kv_budget:live_owner_held_bytes", rank="0", owner="codec") == WINDOW
    assert value(samples, "kv_budget:live_held_bytes", rank="0") == talker_0 + WINDOW
    assert value(samples, "kv_budget:live_peak_bytes", rank="0") == talker_0 + WINDOW
    assert value(samples, "kv_budget:live_step_peak_bytes", rank="0") == talker_0 + WINDOW
    assert value(samples, "kv_budget:live_owner_step_bytes", rank="0", owner="talker") == talker_0
    assert value(samples, "kv_budget:live_owner_step_allowed_bytes", rank="0", owner="talker") == POOL + held * STEP
    # Both samples ran no more sequences than the limit in force (10).
    assert value(samples, "kv_budget:live_peak_bytes_within_limit", rank="0") == talker_0 + WINDOW
    assert value(samples, "kv_budget:live_per_sequence_bytes", rank="0") == PER_SEQ + EXCESS
    assert value(samples, "kv_budget:live_per_sequence_bytes", rank="1") == PER_SEQ

    verdicts = {
        (s.labels["rank"], s.labels["owner"], s.labels["verdict"]): s.value
        for s in samples if s.name == "kv_budget:live_owner_verdict_info"
    }
    # Every verdict is published for every owner, 1 on the current one only.
    assert len(verdicts) == 2 * 3 * len(VERDICTS)
    current = {(rank, owner): verdict for (rank, owner, verdict), v in verdicts.items() if v == 1}
    assert current == {
        ("0", "talker"): "under-declared", ("0", "codec"): "ok", ("0", "<root>"): "not-observable",
        ("1", "talker"): "ok", ("1", "codec"): "ok", ("1", "<root>"): "not-observable",
    }
    assert sum(verdicts.values()) == 6


DEPLOYMENT_METRICS = {name for name in METRICS_BY_NAME if name.startswith("kv_budget:deployment_")}
"""A vLLM-Omni stage's only (test_a_stages_deployment_split_is_published)."""


def test_every_sample_carries_exactly_its_specs_labels(live_status):
    samples = status_samples(live_status)
    # a live capped plan of a plain engine fills every gauge but a deployment's
    assert {s.name for s in samples} == set(METRICS_BY_NAME) - DEPLOYMENT_METRICS
    for sample in samples:
        assert tuple(sample.labels) == METRICS_BY_NAME[sample.name].labels
        assert all(isinstance(v, str) and v for v in sample.labels.values())
    series = [(s.name, tuple(sorted(s.labels.items()))) for s in samples]
    assert len(series) == len(set(series))


def test_figures_beyond_64_bits_survive_the_status_file_and_render(tmp_path):
    """Bytes no device has (a declaration of 2^63 B per sequence against a
    2^64 B headroom) go through the status file exactly and come out as
    the floats Prometheus samples are, never an overflow."""
    huge = ModelLocalKVSpec(
        name="huge", layers=2**20, kv_heads=2**10, head_dim=2**10, dtype=torch.float32,
        physical_capacity_positions=2**20, capacity_source="test", scope="request", rows="max_num_seqs")
    assert huge.bytes_per_row == 2**63
    worker = budget_worker(Collection((OwnedSpec("talker", huge),), ()), headroom_override(2**64 + 5), rank=0,
                           max_num_seqs=256)
    plan = make_plan([worker], 256, "cap")
    assert plan.effective_max_num_seqs == 2
    status = read_status(write_status(tmp_path, EngineStatus(engine_index=0, model="m", pid=1, updated_unix_s=1.0,
                                                              plan=plan)))
    assert status.plan.workers[0].headroom.bytes == 2**64 + 5
    samples = status_samples(status)
    assert value(samples, "kv_budget:headroom_bytes", rank="0") == float(2**64 + 5)
    assert value(samples, "kv_budget:declaration_peak_bytes", rank="0", owner="talker", name="huge") == 2.0**64
    assert all(isinstance(s.value, float) for s in samples)


def test_a_stages_deployment_split_is_published_per_device_and_other_stage(plan, tmp_path):
    """Stage 0 of two on device 0 (0.25 each of 4,288 MiB), both declaring
    the plan's figures, stage 1 recorded: the split through the status file."""
    from kv_budget.deployment import DeploymentRecord, create_deployment, record_stage, split_for
    from kv_budget.ledger import this_process
    from kv_budget.plan.deploy_file import load_deploy
    from kv_budget.stage import Stage

    stages = "".join(f"  - {{stage_id: {sid}, devices: '0', gpu_memory_utilization: 0.25, max_num_seqs: 16, "
                     "enforce_eager: true}\n" for sid in (0, 1))
    (tmp_path / "deploy.yaml").write_text("stages:\n" + stages)
    deploy = load_deploy(tmp_path / "deploy.yaml")
    pid, start = this_process()
    planning = [Stage(stage_id=0, replica=0), Stage(stage_id=1, replica=0)]
    path = create_deployment(tmp_path / "deployment.json", DeploymentRecord(
        driver_pid=pid, driver_start=start, stages=deploy.stages, planning=planning,
        capacities={0: 4288 * 2**20}, capacity_sources={0: "given"}, headrooms={}))
    for stage in planning:
        record = record_stage(path, stage, plan.workers[0], {0: 10**15}, "test", "cap", 16)
    split = split_for(record, planning[0])
    staged = EngineStatus(engine_index=0, model="/models/demo", pid=4242, updated_unix_s=1.0, plan=plan,
                          stage=planning[0], deployment=split)
    samples = status_samples(read_status(write_status(tmp_path / "status", staged)))
    assert DEPLOYMENT_METRICS <= {s.name for s in samples}
    base = {"model_name": "/models/demo", "stage": "0", "replica": "0", "device": "0"}
    assert value(samples, "kv_budget:deployment_split_final", stage="0") == 1
    assert value(samples, "kv_budget:deployment_left_bytes", **base) == split.devices[0].left_for_per_seq_bytes
    assert value(samples, "kv_budget:deployment_share_bytes", **base) == split.devices[0].left_for_per_seq_bytes // 2
    assert value(samples, "kv_budget:deployment_set_aside_bytes", **base, other_stage="1",
                 part="admission_terms") == 4288 * 2**20 // 4
    assert value(samples, "kv_budget:deployment_binding_info", **base, binding="deployment split") == 1
    assert value(samples, "kv_budget:deployment_binding_info", **base, binding="measured") == 0
    for sample in samples:
        assert tuple(sample.labels) == label_names(METRICS_BY_NAME[sample.name], staged=True)
