"""The engine's plan and live figures as Prometheus series, without Prometheus.

An operator who scrapes vLLM's ``/metrics`` should see, next to vLLM's own
``vllm:`` gauges, what kv-budget decided and what it measures: the
configured, startup and live ``max_num_seqs``, each worker's headroom and
per-sequence bytes, every declaration, and (once the live monitor has
sampled) what each declaring owner holds against what its declarations
allow. This module is the mapping from an :class:`~kv_budget.watch.status.EngineStatus`
(the engine core's status file) to ``(name, labels, value)`` samples;
the ``prometheus_client`` gauges that carry them live in
``vllm_patches.frontend`` only, so the mapping is tested without vLLM, and
the names, help texts and label names are one table (:data:`METRICS`) that
both read.

Naming follows vLLM's conventions (``namespace:name``, units in the name,
``_bytes``, ``_seconds``), in a namespace of our own, ``kv_budget:``, so no
name can collide with a vLLM release. Every series carries vLLM's two
labels, ``model_name`` and ``engine``, so it joins with ``vllm:`` series of
the same engine; per-worker series add ``rank``, per-declaration ones
``owner``, ``name``, ``scope`` and ``rows``.

Every figure is a gauge, counts included (completed requests, samples,
corrections): they mirror a file the engine core rewrites, they are not
incremented here, and a gauge set to the file's value is right however
many API-server processes publish it.

Label sets never disappear. With ``--api-server-count`` > 1 vLLM runs
``prometheus_client`` in multiprocess mode, whose files cannot drop a label
set once written. So a series that describes a state with several possible
values (an owner's verdict, the count of findings per kind) is published for
every value: 1 on the current verdict and 0 on the others, 0 for a kind
with no finding, rather than a series that would have to vanish.

In a vLLM-Omni deployment the ``engine`` label becomes ``stage`` and
``replica``, as vLLM-Omni relabels vLLM's own series
(:func:`label_names`), so each stage's figures join with its ``vllm:``
series there.

The root module (owner ``""``) is labelled ``<root>``, as the log lines
name it: Prometheus treats an empty label value as no label.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, get_args

from kv_budget.deployment import StageSplit
from kv_budget.plan.planner import DeclarationLine, Plan, at_max_num_seqs
from kv_budget.watch.live_state import Finding, LiveState, Verdict
from kv_budget.watch.status import EngineStatus

__all__ = [
    "NAMESPACE",
    "ENGINE_LABELS",
    "RANK_LABELS",
    "OWNER_LABELS",
    "DECLARATION_LABELS",
    "VERDICTS",
    "FINDING_KINDS",
    "MetricSpec",
    "Sample",
    "METRICS",
    "METRICS_BY_NAME",
    "label_names",
    "owner_label",
    "status_samples",
]

NAMESPACE = "kv_budget"

ENGINE_LABELS = ("model_name", "engine")
"""vLLM's own labels on its per-engine series."""
STAGE_LABELS = ("stage", "replica")
"""What vLLM-Omni puts in place of ``engine`` on its per-stage series."""
RANK_LABELS = (*ENGINE_LABELS, "rank")
DEVICE_LABELS = (*ENGINE_LABELS, "device")
"""A vLLM-Omni stage's series about one device of its deployment."""
SET_ASIDE_LABELS = (*DEVICE_LABELS, "other_stage", "other_replica", "part")
SET_ASIDE_PARTS = {"admission terms": "admission_terms", "model-local KV": "model_local_kv"}
"""A set-aside's ``part`` label for each kind of :class:`kv_budget.deployment.SetAside`."""
BINDINGS = ("deployment split", "measured")
"""Which bound a stage plans against on a device (:class:`kv_budget.deployment.DeviceSplit`)."""
OWNER_LABELS = (*RANK_LABELS, "owner")
DECLARATION_LABELS = (*OWNER_LABELS, "name", "scope", "rows")

VERDICTS: tuple[str, ...] = get_args(Verdict)
"""Every verdict an owner can have (:data:`kv_budget.watch.live.Verdict`)."""
FINDING_KINDS: tuple[str, ...] = get_args(Finding.model_fields["kind"].annotation)
"""Every kind of live finding (:class:`kv_budget.watch.live_state.Finding`)."""


@dataclass(frozen=True)
class MetricSpec:
    """One gauge: its full name, its help text, its label names in order."""

    name: str
    help: str
    labels: tuple[str, ...]


class Sample(NamedTuple):
    """One value of one series."""

    name: str
    labels: dict[str, str]
    value: float


def _spec(name: str, help: str, labels: tuple[str, ...]) -> MetricSpec:
    return MetricSpec(f"{NAMESPACE}:{name}", help, labels)


_PLAN = "from the startup plan (--model-local-kv-report writes the same figures)"
_SPLIT = ("from the stage's part of its vLLM-Omni deployment (the report's deployment section has each figure's "
          "source); a vLLM-Omni stage only")
_LIVE = "from the live monitor's last sample; absent until the first sample"

METRICS: tuple[MetricSpec, ...] = (
    # --- the engine's limits
    _spec("configured_max_num_seqs",
          f"max_num_seqs as configured (--max-num-seqs), {_PLAN}.", ENGINE_LABELS),
    _spec("startup_max_num_seqs",
          f"max_num_seqs the engine started with: the plan's effective value (capped under policy cap), {_PLAN}; "
          "in a vLLM-Omni stage that planned before the others on its device, the final split's, applied before "
          "its first request.",
          ENGINE_LABELS),
    _spec("live_max_num_seqs",
          "max_num_seqs the Scheduler admits to now: the live limit, lowered by live corrections under policy "
          "cap, never raised; the startup value until the first live sample.", ENGINE_LABELS),
    _spec("safe_max_num_seqs",
          f"Largest max_num_seqs whose model-local KV fits the binding worker's headroom, {_PLAN}; absent when "
          "nothing scales with sequences.", ENGINE_LABELS),
    _spec("predicted_peak_bytes",
          f"Uncharged model-local KV on the binding worker at the startup max_num_seqs (fixed + per-sequence x "
          f"max_num_seqs), {_PLAN}.", ENGINE_LABELS),
    _spec("plan_info",
          f"The plan's policy (--model-local-kv-policy) and decision (ok, capped, warned), {_PLAN}; always 1.",
          (*ENGINE_LABELS, "policy", "decision")),
    _spec("status_updated_timestamp_seconds",
          "Unix time the engine core last wrote its kv-budget status file (at startup and after every live "
          "sample): how fresh the kv_budget figures are.", ENGINE_LABELS),
    # --- per worker, from the plan
    _spec("headroom_bytes",
          f"Bytes per-request model-local KV may use on this worker (operator override, or measured free memory "
          f"minus the margin, minus other engines' reservations in the device ledger), {_PLAN}.", RANK_LABELS),
    _spec("per_sequence_bytes",
          f"Declared model-local KV one more running sequence costs on this worker (bytes_per_row of every "
          f"uncharged per-sequence declaration), {_PLAN}.", RANK_LABELS),
    _spec("fixed_bytes",
          f"Uncharged fixed-row model-local KV on this worker, taken once off the headroom, {_PLAN}.",
          RANK_LABELS),
    _spec("charged_bytes",
          f"Model-scope model-local KV on this worker, already resident when memory was sampled, so never "
          f"subtracted again, {_PLAN}.", RANK_LABELS),
    _spec("rank_safe_max_num_seqs",
          f"floor((headroom - fixed) / per-sequence) on this worker, {_PLAN}; absent when nothing scales with "
          "sequences. The engine's bound is the smallest over workers.", RANK_LABELS),
    # --- per declaration, from the plan
    _spec("declaration_bytes_per_row",
          f"Bytes of one row of this declaration (layers x kv_heads x head_dim x positions x dtype x K and V), "
          f"after operator overrides, {_PLAN}.", DECLARATION_LABELS),
    _spec("declaration_peak_bytes",
          f"Bytes this declaration holds at the startup max_num_seqs (rows max_num_seqs) or at its fixed rows, "
          f"{_PLAN}.", DECLARATION_LABELS),
    # --- live, per worker and owner
    _spec("live_owner_held_bytes",
          f"Bytes this declaring owner's caches held at the last sample, counted by walking its attributes, "
          f"{_LIVE}.", OWNER_LABELS),
    _spec("live_owner_peak_bytes",
          f"Most bytes this declaring owner's caches held at any sample, {_LIVE}.", OWNER_LABELS),
    _spec("live_owner_step_bytes",
          f"Most bytes this owner's caches held at once inside the last sampled step (--model-local-kv-step-peaks "
          f"on), per-step working copies included; for an undeclared holder, what it built under the forward, "
          f"{_LIVE}.", OWNER_LABELS),
    _spec("live_owner_step_allowed_bytes",
          f"Bytes all this owner's declarations (every scope) allow at once at the sequences of that step, {_LIVE}.",
          OWNER_LABELS),
    _spec("live_owner_allowed_bytes",
          f"Bytes this owner's retained declarations allow at the sequences the workers may hold at the last "
          f"sample (running plus finished but not yet freed), {_LIVE}.", OWNER_LABELS),
    _spec("live_owner_verdict_info",
          f"1 on this owner's current verdict (ok, under-declared, undeclared, declared-but-absent, leak, "
          f"not-observable, idle), 0 on the others, {_LIVE}.", (*OWNER_LABELS, "verdict")),
    # --- live, per worker
    _spec("live_held_bytes",
          f"Model-local bytes this worker held at the last sample: the most at once inside its step when the step "
          f"was watched, else the declaring owners' after it, {_LIVE}.", RANK_LABELS),
    _spec("live_step_peak_bytes",
          f"Most bytes every transformers cache of the model (undeclared ones included) held at once inside the "
          f"last watched step, {_LIVE}.", RANK_LABELS),
    _spec("live_peak_bytes",
          f"Most model-local bytes this worker held at once at any sample, inside a step or after it, {_LIVE}.",
          RANK_LABELS),
    _spec("live_peak_bytes_within_limit",
          f"Most bytes held at a sample taken while no more sequences ran than the live limit it left in force: "
          f"what the correction keeps within the headroom, {_LIVE}.", RANK_LABELS),
    _spec("live_per_sequence_bytes",
          f"Declared per-sequence bytes plus the largest per-sequence excess any owner was measured holding, "
          f"{_LIVE}; equals per_sequence_bytes while every declaration holds.", RANK_LABELS),
    # --- live, engine
    _spec("live_running_sequences",
          f"Requests the Scheduler was running at the last sample, {_LIVE}.", ENGINE_LABELS),
    _spec("live_held_sequences",
          f"Sequences the workers may hold at the last sample: running plus finished but not yet freed, {_LIVE}.",
          ENGINE_LABELS),
    _spec("live_completed_requests",
          f"Requests the engine core completed since it started, as of the last sample, {_LIVE}.",
          ENGINE_LABELS),
    _spec("live_samples",
          f"Live samples taken since the engine started, {_LIVE}.", ENGINE_LABELS),
    _spec("live_corrections",
          f"Times the live monitor lowered the live max_num_seqs (policy cap), {_LIVE}.", ENGINE_LABELS),
    _spec("live_last_sample_seconds",
          f"CPU time the last sample took, the engine core's plus the slowest worker's (in-step tracking "
          f"included), {_LIVE}.",
          ENGINE_LABELS),
    # --- a vLLM-Omni stage's part of its devices
    _spec("deployment_split_final",
          f"1 once every planning stage on this stage's devices has recorded (the split is final and applied), "
          f"0 while it is provisional, {_SPLIT}.", ENGINE_LABELS),
    _spec("deployment_left_bytes",
          f"What the device leaves for the declaring stages' per-sequence model-local KV: capacity minus "
          f"vLLM-Omni's admission terms of every stage there (or the operator's headroom) minus every stage's "
          f"fixed model-local KV, {_SPLIT}.", DEVICE_LABELS),
    _spec("deployment_share_bytes",
          f"This stage's share of deployment_left_bytes under the split rule (proportional to per-sequence bytes x "
          f"configured max_num_seqs), {_SPLIT}; absent when it declares nothing per sequence.", DEVICE_LABELS),
    _spec("deployment_set_aside_bytes",
          f"Bytes of another stage on the device kept out of this stage's room: part admission_terms "
          f"(int(capacity x gpu_memory_utilization) + graph reserve + pool beyond its share) or model_local_kv "
          f"(its fixed + per-sequence x max_num_seqs under the split), {_SPLIT}.", SET_ASIDE_LABELS),
    _spec("deployment_room_bytes",
          f"The headroom this stage plans against on the device: the smaller of its split (fixed + share) and "
          f"its own measured headroom less the other stages' parts, {_SPLIT}.", DEVICE_LABELS),
    _spec("deployment_binding_info",
          f"1 on the bound deployment_room_bytes came from (deployment split, measured), 0 on the other, {_SPLIT}.",
          (*DEVICE_LABELS, "binding")),
    _spec("live_findings",
          f"Live findings of each kind (under-declared, declared-but-absent, leak, limit-lowered, nothing-fits, "
          f"memory-low, memory-room) "
          f"since the engine started, each logged once as a warning, {_LIVE}.", (*ENGINE_LABELS, "kind")),
)
"""Every gauge the stat logger publishes."""

METRICS_BY_NAME = {spec.name: spec for spec in METRICS}


def owner_label(owner: str) -> str:
    return owner or "<root>"


def label_names(spec: MetricSpec, staged: bool) -> tuple[str, ...]:
    """``spec``'s label names; with ``staged``, ``engine`` replaced by
    :data:`STAGE_LABELS` in its place (a vLLM-Omni stage's series)."""
    if not staged:
        return spec.labels
    names: list[str] = []
    for name in spec.labels:
        names.extend(STAGE_LABELS if name == "engine" else (name,))
    return tuple(names)


class _Samples:
    def __init__(self, base: dict[str, str], staged: bool) -> None:
        self.base = base
        self.staged = staged
        self.samples: list[Sample] = []

    def add(self, metric: str, value: float | int | None, /, **labels: str) -> None:
        if value is None:
            return
        spec = METRICS_BY_NAME[f"{NAMESPACE}:{metric}"]
        merged = {**self.base, **labels}
        assert tuple(merged) == label_names(spec, self.staged), (spec.name, tuple(merged))
        self.samples.append(Sample(spec.name, merged, float(value)))


def _declaration_labels(rank: int, line: DeclarationLine) -> dict[str, str]:
    return {"rank": str(rank), "owner": owner_label(line.owner), "name": line.name, "scope": line.scope.value,
            "rows": line.rows.value}


def _plan_samples(out: _Samples, plan: Plan) -> None:
    out.add("configured_max_num_seqs", plan.configured_max_num_seqs)
    out.add("startup_max_num_seqs", plan.effective_max_num_seqs)
    out.add("safe_max_num_seqs", plan.safe_max_num_seqs)
    out.add("predicted_peak_bytes", plan.predicted_peak_bytes)
    out.add("plan_info", 1, policy=plan.policy.value, decision=plan.decision.value)
    for worker in plan.workers:
        rank = str(worker.rank)
        out.add("headroom_bytes", worker.headroom.bytes, rank=rank)
        out.add("per_sequence_bytes", worker.per_seq_bytes, rank=rank)
        out.add("fixed_bytes", worker.uncharged_fixed_bytes, rank=rank)
        out.add("charged_bytes", worker.charged_bytes, rank=rank)
        out.add("rank_safe_max_num_seqs", worker.safe_max_num_seqs, rank=rank)
        for line in worker.declarations:
            # A worker's lines are sized at the configured max_num_seqs; the plan's peak is at the startup value.
            at_plan = at_max_num_seqs(line, plan.effective_max_num_seqs)
            labels = _declaration_labels(worker.rank, line)
            out.add("declaration_bytes_per_row", line.bytes_per_row, **labels)
            out.add("declaration_peak_bytes", at_plan.peak_bytes, **labels)


def _live_samples(out: _Samples, live: LiveState) -> None:
    out.add("live_running_sequences", live.running_sequences)
    out.add("live_held_sequences", live.held_sequences)
    out.add("live_completed_requests", live.completed_requests)
    out.add("live_samples", live.samples)
    out.add("live_corrections", live.corrections)
    out.add("live_last_sample_seconds", live.last_sample_seconds)
    found = {kind: 0 for kind in FINDING_KINDS}
    for finding in live.findings:
        found[finding.kind] += 1
    for kind, count in found.items():
        out.add("live_findings", count, kind=kind)
    for rank_live in live.ranks:
        rank = str(rank_live.rank)
        out.add("live_held_bytes", max(rank_live.bytes, rank_live.step_bytes or 0), rank=rank)
        out.add("live_step_peak_bytes", rank_live.step_bytes, rank=rank)
        out.add("live_peak_bytes", rank_live.peak_bytes, rank=rank)
        out.add("live_peak_bytes_within_limit", rank_live.peak_bytes_within_limit, rank=rank)
        out.add("live_per_sequence_bytes", rank_live.live_per_seq_bytes, rank=rank)
        for owner in rank_live.owners:
            labels = {"rank": rank, "owner": owner_label(owner.owner)}
            out.add("live_owner_held_bytes", owner.bytes, **labels)
            out.add("live_owner_peak_bytes", owner.peak_bytes, **labels)
            out.add("live_owner_allowed_bytes", owner.allowed_bytes, **labels)
            out.add("live_owner_step_bytes", owner.step_bytes, **labels)
            out.add("live_owner_step_allowed_bytes", owner.step_allowed_bytes, **labels)
            for verdict in VERDICTS:
                out.add("live_owner_verdict_info", int(owner.verdict == verdict), **labels, verdict=verdict)


def _split_samples(out: _Samples, split: StageSplit) -> None:
    out.add("deployment_split_final", int(split.final))
    for device in split.devices:
        where = {"device": str(device.device)}
        out.add("deployment_left_bytes", device.left_for_per_seq_bytes, **where)
        out.add("deployment_share_bytes", device.share_bytes, **where)
        out.add("deployment_room_bytes", device.room_bytes, **where)
        for binding in BINDINGS:
            out.add("deployment_binding_info", int(device.binding == binding), **where, binding=binding)
        for part in device.set_aside:
            out.add("deployment_set_aside_bytes", part.bytes, **where, other_stage=str(part.stage_id),
                    other_replica=str(part.replica), part=SET_ASIDE_PARTS[part.what])


def status_samples(status: EngineStatus, model_name: str | None = None) -> list[Sample]:
    """Every sample of ``status``. ``model_name`` is the ``model_name``
    label (vLLM's served model name); the status's model by default."""
    name = model_name or status.model
    if status.stage is None:
        out = _Samples({"model_name": name, "engine": str(status.engine_index)}, staged=False)
    else:
        out = _Samples({"model_name": name, "stage": str(status.stage.stage_id),
                        "replica": str(status.stage.replica)}, staged=True)
    _plan_samples(out, status.plan)
    out.add("live_max_num_seqs", status.live.limit if status.live is not None else status.plan.effective_max_num_seqs)
    out.add("status_updated_timestamp_seconds", status.updated_unix_s)
    if status.live is not None:
        _live_samples(out, status.live)
    if status.deployment is not None:
        _split_samples(out, status.deployment)
    return out.samples
