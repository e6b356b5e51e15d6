"""The live monitor's state as it is written to an engine's status file.

What :class:`kv_budget.watch.live.LiveMonitor` knows after each sample,
in the shape the status file, ``/metrics`` (:mod:`kv_budget.watch.metrics`)
and the benchmarks read: per rank and owner the bytes held and allowed,
the verdicts, the findings, and the monitor's own cost. Kept apart from the
judging so a reader of the file needs only the schema.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from kv_budget.settings import Policy

__all__ = ["Verdict", "OwnerLive", "RankLive", "Finding", "LiveState"]

Verdict = Literal["ok", "under-declared", "undeclared", "declared-but-absent", "leak", "not-observable", "idle"]
"""What a sample says of one owner (:meth:`kv_budget.watch.live.LiveMonitor.state`)."""


class OwnerLive(BaseModel):
    """One owner on one rank, as of the last sample."""

    owner: str
    declarations: list[str]
    """Empty for an ``undeclared`` holder."""
    bytes: int
    """After the step."""
    peak_bytes: int
    """The most it held at once in any sample, inside a step or after it."""
    allowed_bytes: int
    """What its retained declarations allow at the sequences the workers may hold."""
    step_bytes: int | None = None
    """The most it held at once inside the last watched step; None before one."""
    step_allowed_bytes: int | None = None
    """What all its declarations allow at once at the sequences of that step."""
    excess_per_seq_bytes: int
    """Largest excess seen, per sequence held (0 when never over)."""
    ever_held: bool
    verdict: Verdict


class RankLive(BaseModel):
    """One worker's figures."""

    rank: int
    bytes: int
    """Model-local bytes the declaring owners held at the last sample, after its step."""
    step_bytes: int | None = None
    """The most every cache of the model held at once inside the last
    watched step (undeclared ones included); None before one."""
    peak_bytes: int
    """The most held at once in any sample, inside a step or after it."""
    peak_bytes_within_limit: int
    """Peak over the samples taken while no more sequences ran than the
    live limit the sample left in force: what the correction guarantees
    stays within the headroom (0 before such a sample)."""
    headroom_bytes: int
    uncharged_fixed_bytes: int
    declared_per_seq_bytes: int
    live_per_seq_bytes: int
    """Declared per-sequence bytes plus the largest per-sequence excess measured."""
    safe_max_num_seqs: int | None
    """The bound with ``live_per_seq_bytes``; None when nothing scales with sequences."""
    owners: list[OwnerLive]


class Finding(BaseModel):
    """Something a sample showed, logged once."""

    kind: Literal["under-declared", "undeclared", "declared-but-absent", "leak", "limit-lowered", "nothing-fits",
                  "memory-low", "memory-room"]
    rank: int | None
    owner: str | None
    bytes: int
    message: str


class LiveState(BaseModel):
    """Everything the live monitor knows; written to the status file."""

    policy: Policy
    sample_interval_s: float
    step_peaks: bool = False
    """Whether sampled steps are watched inside (:mod:`kv_budget.sample.in_step`)."""
    samples: int
    running_sequences: int
    held_sequences: int
    """``running`` plus finished requests the workers have not freed yet."""
    completed_requests: int
    startup_max_num_seqs: int
    limit: int
    """The live limit on running sequences: the smaller of ``bytes_limit``
    and ``memory_limit``."""
    bytes_limit: int | None = None
    """The startup value, lowered by corrections of the measured caches; never raised."""
    memory_limit: int | None = None
    """What the devices hold at the sequences' measured cost (:meth:`LiveMonitor._watch_memory`); None
    while no device was read."""
    ceiling: int | None = None
    """The most the live limit may reach: the configured ``max_num_seqs`` where it follows the device."""
    cost_per_seq_bytes: int | None = None
    """The last sample's measured cost of one held sequence on the binding device."""
    corrections: int
    last_sample_seconds: float
    """CPU time the last sample took: the engine core's (RPC, comparison,
    status file) plus the slowest worker's (measuring, in-step tracking)."""
    sample_seconds_total: float
    steps: int = 0
    """Engine steps since live sampling began."""
    step_seconds_total: float = 0.0
    """Wall time of those steps, without the live hook."""
    hook_seconds_total: float = 0.0
    """Wall time of the live hook around those steps, samples included: the
    overhead, against ``step_seconds_total``."""
    watched_steps: int = 0
    """Steps watched inside (in-step windows open)."""
    watched_step_seconds_total: float = 0.0
    """Wall time of those steps, the workers' in-step tracking included."""
    tracking_seconds_total: float = 0.0
    """CPU time the slowest worker spent counting caches inside the watched
    steps: what watching added to them, beside ``hook_seconds_total``."""
    ranks: list[RankLive]
    findings: list[Finding]
