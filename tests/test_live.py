"""Live protection, without an engine: real transformers caches filled by
real generation, measured by :class:`kv_budget.sample.caches.HeldBytes`, judged by
:class:`kv_budget.watch.live.LiveMonitor` against a plan made from the owners'
own declarations."""

from __future__ import annotations

import pytest
import torch
from audit_models import generate_into, small_qwen2_config, tiny_lm
from transformers import DynamicCache

from kv_budget.audit import audit_module
from kv_budget.collect.model import collect_model_local_kv_specs
from kv_budget.declare.hf_config import spec_from_hf_config
from kv_budget.declare.spec import RowDriver, Scope
from kv_budget.plan.planner import budget_worker, headroom_from_free, headroom_override, live_margin_bytes, make_plan
from kv_budget.sample.caches import HeldBytes
from kv_budget.sample.in_step import InStepPeaks
from kv_budget.watch.cost_record import CostRecord, HeldCost
from kv_budget.settings import Policy
from kv_budget.watch.live import (
    BEYOND_RECORD_FACTOR,
    BURST_SPREAD,
    RECORD_SWING_FACTOR,
    DEAD_AFTER_COMPLETED,
    DeviceFree,
    LiveMeasurement,
    MAX_SAMPLING_FRACTION,
    first_admission,
    remembered_burst,
    rise_cost_bytes,
    LiveMonitor,
    WorkerSample,
    owner_expectations,
)

PROMPT, NEW = 6, 5
HELD_POSITIONS = PROMPT + NEW - 1  # generate never feeds back its last token
CONFIG = small_qwen2_config()
ROW_BYTES = 2 * CONFIG.num_hidden_layers * CONFIG.num_key_value_heads * 16 * HELD_POSITIONS * 4


class RequestTalker(torch.nn.Module):
    """Keeps one cache per request, filled by real generation, until told
    the request finished: the shape of vLLM-Omni's talkers."""

    def __init__(self, declared_positions: int = HELD_POSITIONS, frees: bool = True, allocates: bool = True) -> None:
        super().__init__()
        self.lm = tiny_lm(CONFIG)
        self.declared_positions = declared_positions
        self.frees = frees
        self.allocates = allocates
        self.caches: dict[str, DynamicCache] = {}

    def start(self, request_id: str) -> None:
        if self.allocates:
            self.caches[request_id] = generate_into(self.lm, DynamicCache(), batch=1, prompt=PROMPT, new_tokens=NEW)

    def finish(self, request_id: str) -> None:
        if self.frees:
            self.caches.pop(request_id, None)

    def model_local_kv_specs(self):
        return [spec_from_hf_config(
            CONFIG, name="talker_request_kv", dtype=torch.float32,
            physical_capacity_positions=self.declared_positions, capacity_source="test",
            scope=Scope.REQUEST, rows=RowDriver.MAX_NUM_SEQS,
        )]


class Stage(torch.nn.Module):
    def __init__(self, talker: RequestTalker) -> None:
        super().__init__()
        self.talker = talker


def plan_for(stage: Stage, headroom: int, policy: str = "cap", max_num_seqs: int = 256):
    worker = budget_worker(collect_model_local_kv_specs(stage), headroom_override(headroom), max_num_seqs=max_num_seqs)
    return make_plan([worker], max_num_seqs, policy)


def sample(stage: Stage, scanner: HeldBytes) -> list[WorkerSample]:
    held = scanner.measure()
    return [WorkerSample(rank=0, owners=[{"owner": o, "bytes": b} for o, b in held.items()], seconds=0.0)]


def test_held_bytes_counts_what_the_audit_counts_for_the_declaring_owners():
    stage = Stage(RequestTalker())
    for i in range(3):
        stage.talker.start(f"r{i}")
    scanner = HeldBytes(stage, ["talker"])
    assert scanner.measure() == {"talker": 3 * ROW_BYTES}
    audit = {o.owner: o.measured_bytes for o in audit_module(stage).owners}
    assert audit == {"talker": 3 * ROW_BYTES}
    stage.talker.finish("r0")
    assert scanner.measure() == {"talker": 2 * ROW_BYTES}


def test_a_true_declaration_gives_no_finding_and_keeps_the_limit():
    stage = Stage(RequestTalker())
    plan = plan_for(stage, headroom=10 * ROW_BYTES)
    assert plan.effective_max_num_seqs == 10
    monitor, scanner = LiveMonitor(plan), HeldBytes(stage, ["talker"])
    for i in range(10):
        stage.talker.start(f"r{i}")
    update = monitor.observe(sample(stage, scanner), running=10, finished_unfreed=0, completed=0, now=0.0)
    assert update.findings == [] and update.limit is None
    state = monitor.state()
    assert state.limit == 10
    assert state.ranks[0].bytes == state.ranks[0].peak_bytes == 10 * ROW_BYTES
    assert state.ranks[0].owners[0].verdict == "ok"


def test_finished_requests_not_yet_freed_are_not_an_under_declaration():
    """Rows of requests that finished in the last step are freed on the
    next: counted as held, they must not read as extra bytes per sequence."""
    stage = Stage(RequestTalker())
    monitor, scanner = LiveMonitor(plan_for(stage, headroom=100 * ROW_BYTES)), HeldBytes(stage, ["talker"])
    for i in range(8):
        stage.talker.start(f"r{i}")
    update = monitor.observe(sample(stage, scanner), running=5, finished_unfreed=3, completed=3, now=0.0)
    assert update.findings == []


def test_under_declaration_under_cap_lowers_the_limit_to_what_the_measurement_allows():
    declared = HELD_POSITIONS // 4  # a quarter of what each request keeps
    stage = Stage(RequestTalker(declared_positions=declared))
    declared_row = ROW_BYTES * declared // HELD_POSITIONS
    headroom = 40 * declared_row
    plan = plan_for(stage, headroom=headroom)
    assert plan.effective_max_num_seqs == 40
    monitor, scanner = LiveMonitor(plan), HeldBytes(stage, ["talker"])
    for i in range(4):
        stage.talker.start(f"r{i}")
    update = monitor.observe(sample(stage, scanner), running=4, finished_unfreed=0, completed=0, now=0.0)
    kinds = [f.kind for f in update.findings]
    assert kinds == ["under-declared", "limit-lowered"]
    assert update.findings[0].bytes == ROW_BYTES - declared_row
    assert monitor.rank_per_seq_bytes(0) == ROW_BYTES
    limit = headroom // ROW_BYTES  # 40 x 1,024 B // 5,120 B = 8
    assert update.limit == limit == 8
    assert f"max_num_seqs 40 -> {limit}" in update.findings[1].message
    # Within the lowered limit the measured footprint stays in the headroom.
    for i in range(4, limit):
        stage.talker.start(f"r{i}")
    monitor.observe(sample(stage, scanner), running=limit, finished_unfreed=0, completed=0, now=1.0)
    state = monitor.state()
    assert state.ranks[0].peak_bytes_within_limit == limit * ROW_BYTES <= headroom
    assert state.limit == limit and state.corrections == 1
    # The same excess again is not a new finding and never raises the limit.
    update = monitor.observe(sample(stage, scanner), running=limit, finished_unfreed=0, completed=0, now=2.0)
    assert update.findings == [] and update.limit is None and monitor.limit == limit


class SilentTalker(RequestTalker):
    """The same per-request caches, declared by nobody: vLLM-Omni's
    Qwen3-TTS decoder off CUDA, whose stage model keeps every request's
    cache while nothing declares it."""

    def model_local_kv_specs(self):
        return []


def test_an_undeclared_holder_is_measured_after_the_step_once_a_window_met_it():
    """A module a watched step showed holding caches it does not declare is
    sampled after every later step too: its retained caches are its figure
    between steps (not 0), counted as excess per sequence held, and the
    live limit is the largest that fits the headroom by that figure."""
    stage = Stage(SilentTalker())
    headroom = 10 * ROW_BYTES
    plan = plan_for(stage, headroom=headroom)
    assert plan.effective_max_num_seqs == 256  # nothing declared: the startup plan cannot bound it
    monitor = LiveMonitor(plan, step_peaks=True)
    for i in range(4):
        stage.talker.start(f"r{i}")
    assert HeldBytes(stage, []).measure() == {}  # no declaring owner: nothing to sample by declarations
    window = InStepPeaks(owners={}, undeclared={"talker": ROW_BYTES}, peak_bytes=ROW_BYTES, caches=1, updates=1,
                         seconds=0.0)  # a step that updated one request's cache
    assert monitor.undeclared_holders() == {0: []}  # not met yet
    # The worker measures the holders its window met right after that step (the engine glue does).
    scanner = HeldBytes(stage, [], list(window.undeclared))
    assert scanner.measure() == {"talker": 4 * ROW_BYTES}
    untouched = {"talker": 3 * ROW_BYTES}  # the other three, kept all along
    first = monitor.observe([WorkerSample(rank=0, owners=[{"owner": "talker", "bytes": 4 * ROW_BYTES}], seconds=0.0,
                                          step=window.with_untouched(untouched))],
                            running=4, finished_unfreed=0, completed=0, now=0.0)
    assert [f.kind for f in first.findings] == ["undeclared", "limit-lowered"]
    assert first.findings[0].bytes == 4 * ROW_BYTES and first.limit == 10
    assert "5,120 B per sequence kept + 0 B added inside the step" in first.findings[0].message
    scanner = HeldBytes(stage, [], monitor.undeclared_holders()[0])
    for i in range(4, 8):
        stage.talker.start(f"r{i}")
    assert scanner.measure() == {"talker": 8 * ROW_BYTES}
    monitor.observe(sample(stage, scanner), running=8, finished_unfreed=0, completed=0, now=1.0)
    (owner,) = monitor.state().ranks[0].owners
    assert (owner.owner, owner.verdict, owner.bytes) == ("talker", "undeclared", 8 * ROW_BYTES)
    assert monitor.state().ranks[0].bytes == 8 * ROW_BYTES and monitor.limit == headroom // ROW_BYTES


def test_requests_parked_between_chunks_count_as_held():
    """A vLLM-Omni async-chunk stage: of 8 requests whose caches are kept,
    2 run and 6 wait for their next chunk out of ``running``. Per sequence,
    the kept bytes are 8 requests' over 8, not over the 2 running (which
    would read 4 rows per sequence and hold the limit a quarter of what
    fits); the requests parked name the holders that keep state."""
    stage = Stage(SilentTalker())
    headroom = 10 * ROW_BYTES
    monitor = LiveMonitor(plan_for(stage, headroom=headroom), step_peaks=True)
    for i in range(8):
        stage.talker.start(f"r{i}")
    scanner = HeldBytes(stage, [], ["talker"])
    window = InStepPeaks(owners={}, undeclared={"talker": ROW_BYTES}, peak_bytes=ROW_BYTES, caches=1, updates=1,
                         seconds=0.0)
    assert monitor.kept_by_undeclared() == []
    update = monitor.observe(
        [WorkerSample(rank=0, owners=[{"owner": "talker", "bytes": 8 * ROW_BYTES}], seconds=0.0,
                      step=window.with_untouched({"talker": 7 * ROW_BYTES}))],
        running=2, finished_unfreed=0, completed=0, now=0.0, waiting=0, parked=6)
    assert scanner.measure() == {"talker": 8 * ROW_BYTES}
    assert monitor.held == 8 and monitor.rank_per_seq_bytes(0) == ROW_BYTES
    assert update.limit == headroom // ROW_BYTES == 10
    assert monitor.kept_by_undeclared() == ["talker"]
    assert monitor.state().ranks[0].peak_bytes_within_limit == 8 * ROW_BYTES  # 2 + 6 admitted, under 10


MARGIN = 64 * ROW_BYTES


def measured_plan(stage: Stage, free: int, policy: str = "cap", sharers: int = 1, margin: int | None = MARGIN):
    """A plan on a sampled device: headroom = (free - margin) / sharers (None: the default margin)."""
    headroom = headroom_from_free(free, 100 * free, "test device", margin, sharers)
    worker = budget_worker(collect_model_local_kv_specs(stage), headroom, max_num_seqs=256)
    return make_plan([worker], 256, policy)


def default_margin_plan(stage: Stage, free: int):
    """A plan on a sampled 4 GiB device, with the default margin (1 GiB)."""
    headroom = headroom_from_free(free, 4 * 1024**3, "test device")
    return make_plan([budget_worker(collect_model_local_kv_specs(stage), headroom, max_num_seqs=256)], 256, "cap")


def device_sample(stage: Stage, scanner: HeldBytes, free: int, peak_excess: int | None = None) -> list[WorkerSample]:
    (one,) = sample(stage, scanner)
    device = DeviceFree(free_bytes=free, source="test device", peak_excess_bytes=peak_excess)
    return [one.model_copy(update={"free": device})]


def held(stage: Stage, count: int) -> None:
    """Hold exactly ``count`` requests' talker rows."""
    for i in range(count):
        stage.talker.start(f"r{i}")


def test_under_cap_with_a_measured_headroom_the_limit_follows_what_the_device_holds():
    """The plan's 10 rests on a guess of what the engine adds under load.
    Admission starts at the first burst the device holds (here one: each
    sequence is charged its share of the test device's 1 GiB default
    margin), and once as many are held as the limit allows rises back to
    the startup cap (it kept the whole margin) where the device holds it:
    held + floor((free at the steps' peak - margin) / cost)."""
    stage = Stage(RequestTalker())
    plan = measured_plan(stage, MARGIN + 10 * ROW_BYTES)
    assert plan.effective_max_num_seqs == 10
    monitor, scanner = LiveMonitor(plan), HeldBytes(stage, ["talker"])
    assert monitor.follows_device and monitor.limit == first_admission(plan, 256).limit == 1 and monitor.ceiling == 256
    held(stage, 1)
    first = monitor.observe(device_sample(stage, scanner, MARGIN + 9 * ROW_BYTES), running=1, finished_unfreed=0,
                            completed=0, now=0.0)
    (finding,) = first.findings
    assert finding.kind == "memory-room" and first.limit == monitor.limit == 10  # straight to what fits
    assert (f"held 1 + floor(({MARGIN + 9 * ROW_BYTES:,} B free at the steps' peak ({MARGIN + 9 * ROW_BYTES:,} B "
            f"between steps - 0 B above) - live margin {MARGIN:,} B) / {ROW_BYTES:,} B per sequence") in finding.message
    held(stage, 8)
    assert monitor.observe(device_sample(stage, scanner, MARGIN + 2 * ROW_BYTES), running=8, finished_unfreed=0,
                           completed=0, now=1.0).limit is None  # 10 still
    # Something the plan never saw takes two rows' worth: each held sequence now costs 10/8 of a row.
    short = monitor.observe(device_sample(stage, scanner, MARGIN), running=8, finished_unfreed=0, completed=0,
                            now=2.0)
    assert [f.kind for f in short.findings] == ["memory-low"] and short.limit == monitor.limit == 8
    assert monitor.cost_per_seq == -(-10 * ROW_BYTES // 8)
    # The same seen only at the steps' peak (the worker's excess over what it holds between steps): the same bound.
    peak = monitor.observe(device_sample(stage, scanner, MARGIN + 2 * ROW_BYTES, peak_excess=2 * ROW_BYTES),
                           running=8, finished_unfreed=0, completed=0, now=3.0)
    assert peak.findings == [] and peak.limit is None and monitor.limit == 8
    # The load drains: the cost measured with the most held stays, so the next burst is not let in as if free.
    stage.talker.caches.clear()
    idle = monitor.observe(device_sample(stage, scanner, MARGIN + 8 * ROW_BYTES), running=0, finished_unfreed=0,
                           completed=8, now=4.0)
    assert monitor.cost_per_seq == -(-10 * ROW_BYTES // 8) and monitor.memory_limit == 6 and idle.limit == 6


def test_a_rise_is_read_at_the_worst_step_seen_not_at_the_last_interval():
    """A step's transients depend on what it runs (a burst's prefill went
    further above the between-steps level than the decode steps after
    it), and the steps that admit a wave prefill again: an interval of
    calm steps must not let a rise into memory an earlier interval showed
    full. The worst excess above the between-steps level is kept for
    rises and for the cost at the most held; the lowering bound still
    reads the last interval. Memory taken from outside the worker, seen
    between steps, is not kept: when it is returned, the limit rises."""
    row = ROW_BYTES
    stage = Stage(RequestTalker())
    plan = measured_plan(stage, MARGIN + 40 * row)
    assert plan.effective_max_num_seqs == 40
    monitor, scanner = LiveMonitor(plan), HeldBytes(stage, ["talker"])
    held(stage, 30)
    prefill = monitor.observe(device_sample(stage, scanner, MARGIN + 10 * row, peak_excess=8 * row), running=30,
                              finished_unfreed=0, completed=0, now=0.0)
    assert prefill.limit == monitor.limit == 31  # 30 + floor(2 rows free at the peak / (38 / 30 rows))
    held(stage, 31)
    calm = monitor.observe(device_sample(stage, scanner, MARGIN + 9 * row, peak_excess=0), running=31,
                           finished_unfreed=0, completed=0, now=1.0)
    # Read at the last interval alone the device holds 40 (9 rows free, one row each): the rise would go there.
    assert monitor.memory_limit == 31 + 9 * row // -(-39 * row // 31) == 38
    assert calm.limit is None and monitor.limit == 31  # at the worst step one row is free: no rise
    assert monitor.cost_to_record()[0].cost_per_seq_bytes == -(-39 * row // 31)

    stage = Stage(RequestTalker())
    monitor, scanner = LiveMonitor(plan), HeldBytes(stage, ["talker"])
    held(stage, 30)
    squeezed = monitor.observe(device_sample(stage, scanner, MARGIN + 5 * row), running=30, finished_unfreed=0,
                               completed=0, now=0.0)  # another process holds 5 rows
    assert squeezed.limit == monitor.limit == 34
    held(stage, 34)
    returned = monitor.observe(device_sample(stage, scanner, MARGIN + 6 * row), running=34, finished_unfreed=0,
                               completed=0, now=1.0)
    assert returned.limit == monitor.limit == 40
    assert "the worst step seen (0 B above between steps)" in returned.findings[0].message


def test_a_wave_that_ended_between_samples_is_read_with_the_sequences_it_held_at_its_peak():
    """The worker's peak since the previous sample came while the wave
    ran; a sample taken after most of it finished holds few. Read against
    those few, each looks three times as costly and the limit falls to
    13; read against the most held after a step since the previous
    sample (the engine hook's count), the device still holds 40."""
    row = ROW_BYTES
    stage = Stage(RequestTalker())
    plan = measured_plan(stage, MARGIN + 40 * row)
    limits = {}
    for most_held in (30, 0):
        stage = Stage(RequestTalker())
        monitor, scanner = LiveMonitor(plan), HeldBytes(stage, ["talker"])
        held(stage, 30)
        wave = monitor.observe(device_sample(stage, scanner, MARGIN + 10 * row), running=30, finished_unfreed=0,
                               completed=0, now=0.0)
        assert monitor.limit == 40 and monitor.cost_per_seq == row, wave
        stage.talker.caches.clear()
        held(stage, 10)  # 20 finished and were freed; the interval's peak left 10 rows free, with 30 held
        after = monitor.observe(device_sample(stage, scanner, MARGIN + 30 * row, peak_excess=20 * row), running=10,
                                finished_unfreed=0, completed=20, now=1.0, most_held=most_held)
        limits[most_held] = monitor.limit
        if most_held:
            assert after.findings == [] and monitor.memory_limit == 40 and monitor.cost_per_seq == row
        else:
            (low,) = after.findings
            assert low.kind == "memory-low" and monitor.cost_per_seq == 3 * row
            assert "held 10 + floor(" in low.message
    assert limits == {30: 40, 0: 13}


def test_a_start_under_the_default_margin_takes_a_first_burst_then_rises_keeping_twice_the_live_margin():
    """Less is free than the default margin: the plan's cap is one sequence
    (the live margin leaves room). Admission starts at the first burst the
    device holds, each sequence charged its rows and its share of the
    default margin beyond the live margin ((1 GiB - 64 MiB) / 256: what the
    engine adds under load, read per sequence); once that burst is held
    whole, the limit rises to what the device holds with twice the live
    margin kept (an eighth of what was free, at least 64 MiB), each
    sequence added charged the burst's cost where that is more than the
    measured one (a new wave costs more than the average held), up to the
    configured max_num_seqs."""
    stage = Stage(RequestTalker())
    live_margin, share = 64 * 1024**2, (1024**3 - 64 * 1024**2) // 256
    guess = ROW_BYTES + share
    free = 2 * live_margin + 40 * guess
    plan = default_margin_plan(stage, free)
    assert plan.headroom_bytes == 0 and plan.effective_max_num_seqs == 1
    assert live_margin_bytes(plan.workers[0].headroom) == live_margin  # free / 8 is under the floor
    monitor, scanner = LiveMonitor(plan), HeldBytes(stage, ["talker"])
    burst = (free - live_margin) // guess
    assert monitor.limit == monitor.first.limit == burst == 57 and monitor.ceiling == 256
    assert monitor.first.cost_by_rank == {0: guess}
    assert (f"(free {free:,} B - live margin {live_margin:,} B - fixed and other engines' 0 B) at "
            f"{guess:,} B per sequence [{ROW_BYTES:,} B declared + (margin {1024**3:,} B - live margin "
            f"{live_margin:,} B) / max_num_seqs 256], in {free - live_margin:,} B [the live margin or 25% of the "
            f"burst's growth kept free, whichever is more") in monitor.first.how
    assert monitor.first.how.endswith(" = 57")
    held(stage, burst)
    measured = 2_000_000  # what one held sequence cost the device: half the guess
    update = monitor.observe(device_sample(stage, scanner, free - burst * measured), running=burst,
                             finished_unfreed=0, completed=0, now=0.0)
    assert monitor.cost_per_seq == measured and monitor.memory_limit == 57 + (free - 57 * measured - live_margin) \
        // measured == 112
    assert update.limit == burst + (free - burst * measured - 2 * live_margin) // guess == 68
    assert (f"a rise keeps twice the live margin at the worst step seen (0 B above between steps), {guess:,} B "
            f"per sequence added [the burst's {guess:,} B or {measured:,} B measured, whichever is more]: 68; "
            f"live limit 57 -> 68") in update.findings[0].message


def test_a_rise_charges_each_sequence_added_the_burst_cost_or_the_measured_one_whichever_is_more():
    """The rule alone: a wave of a new size costs more than the average held
    before it, which the burst's cost (the margin's share, or a record's
    charge past what it held) covers; a measured cost above it is taken."""
    cost, how = rise_cost_bytes(2_000_000, 5_000_000)
    assert cost == 5_000_000
    assert how == "5,000,000 B per sequence added [the burst's 5,000,000 B or 2,000,000 B measured, whichever is more]"
    assert rise_cost_bytes(13_000_000, 12_400_000)[0] == 13_000_000
    assert rise_cost_bytes(2_000_000, 0)[0] == 2_000_000  # no burst was charged on this rank


def test_before_the_first_burst_is_held_whole_its_cost_is_the_most_a_sequence_is_charged():
    """A few sequences' average carries the engine's own growth (a fixed
    cost spread over few) and what the requests still arriving already
    took: until the first burst is held whole a sample keeps it while the
    device has used no more than the burst was admitted at, and past that
    charges each sequence the burst's cost (the average may lower it, never
    raise it)."""
    stage = Stage(RequestTalker())
    live_margin, share = 64 * 1024**2, (1024**3 - 64 * 1024**2) // 256
    guess = ROW_BYTES + share
    free = 2 * live_margin + 40 * ROW_BYTES
    monitor, scanner = LiveMonitor(default_margin_plan(stage, free)), HeldBytes(stage, ["talker"])
    assert monitor.limit == (free - live_margin) // guess == 17
    held(stage, 1)
    grown = 30 * 1024**2  # one sequence, the engine's first allocations and the arrivals
    update = monitor.observe(device_sample(stage, scanner, free - grown), running=1, finished_unfreed=0,
                             completed=0, now=0.0)
    assert monitor.cost_per_seq == guess and update.limit is None and monitor.memory_limit == 17
    assert 1 + (free - grown - live_margin) // guess == 10  # what the bound alone would be
    assert monitor.state().limit == 17
    held(stage, 2)
    grown = 17 * guess + ROW_BYTES  # past what the burst was admitted at
    update = monitor.observe(device_sample(stage, scanner, free - grown), running=2, finished_unfreed=0,
                             completed=0, now=1.0)
    assert update.limit == monitor.memory_limit == 2 + (free - grown - live_margin) // guess == 2
    assert "the burst's" in update.findings[0].message and "until 17 are held" in update.findings[0].message


def test_the_default_margin_is_kept_only_in_part_while_serving_and_the_limit_may_pass_the_startup_cap():
    """The default margin stands for what startup could not measure; the
    first burst reads it per sequence and, once the sequences' cost is
    measured, the watch keeps an eighth of it (at least 64 MiB), so the
    live limit may go past the startup cap, up to the configured
    max_num_seqs. A smaller margin of the operator's is kept whole, and the
    first burst still reads the default one per sequence."""
    stage = Stage(RequestTalker())
    free = 1024**3 + 100 * ROW_BYTES
    plan = default_margin_plan(stage, free)
    headroom = plan.workers[0].headroom
    assert headroom.margin_bytes == headroom.default_margin_bytes == 1024**3 and not headroom.margin_given
    margin = live_margin_bytes(headroom)
    assert margin == 128 * 1024**2
    assert plan.effective_max_num_seqs == 100
    monitor, scanner = LiveMonitor(plan), HeldBytes(stage, ["talker"])
    burst = min(free - margin, int(free / (1 + BURST_SPREAD))) // (ROW_BYTES + (1024**3 - margin) // 256)
    assert monitor.limit == burst == 233  # past the default margin's own cap of 100, a quarter of its growth free
    held(stage, burst)
    update = monitor.observe(device_sample(stage, scanner, free - burst * ROW_BYTES), running=burst,
                             finished_unfreed=0, completed=0, now=0.0)
    assert monitor.memory_limit == burst + (free - burst * ROW_BYTES - margin) // ROW_BYTES > 256
    assert update.limit == 256 == monitor.ceiling  # never past the configured max_num_seqs
    small = headroom_from_free(free, 4 * 1024**3, "test device", 64 * 1024**2)
    assert small.margin_given and live_margin_bytes(small) == 64 * 1024**2  # the operator's margin is kept whole
    plan = make_plan([budget_worker(collect_model_local_kv_specs(stage), small, max_num_seqs=256)], 256, "cap")
    first = first_admission(plan, 256)
    share = (1024**3 - 64 * 1024**2) // 256
    assert plan.effective_max_num_seqs == 256 and first.limit == int(free / (1 + BURST_SPREAD)) // (ROW_BYTES + share)


def test_warn_reports_what_the_device_holds_and_changes_nothing():
    stage = Stage(RequestTalker())
    warned = LiveMonitor(measured_plan(stage, MARGIN + 10 * ROW_BYTES, policy="warn"))
    assert not warned.follows_device and warned.limit == 256
    scanner = HeldBytes(stage, ["talker"])
    held(stage, 4)
    update = warned.observe(device_sample(stage, scanner, MARGIN), running=4, finished_unfreed=0, completed=0,
                            now=0.0)
    assert [f.kind for f in update.findings] == ["memory-low"] and update.limit is None and warned.limit == 256
    assert "what fits is 4; policy warn: nothing is changed" in update.findings[0].message


def test_an_operators_headroom_has_no_margin_to_watch():
    stage = Stage(RequestTalker())
    monitor, scanner = LiveMonitor(plan_for(stage, headroom=10 * ROW_BYTES)), HeldBytes(stage, ["talker"])
    stage.talker.start("r0")
    update = monitor.observe(device_sample(stage, scanner, 0), running=1, finished_unfreed=0, completed=0, now=0.0)
    assert update.findings == [] and update.limit is None and monitor.limit == 10


def test_workers_sharing_the_device_split_what_is_free():
    """Two workers on one host's memory: each held sequence costs a row on
    both, so the device holds held + free / (2 rows)."""
    stage = Stage(RequestTalker())
    plan = measured_plan(stage, MARGIN + 20 * ROW_BYTES, sharers=2)
    assert plan.effective_max_num_seqs == 10
    monitor, scanner = LiveMonitor(plan), HeldBytes(stage, ["talker"])
    held(stage, 1)
    update = monitor.observe(device_sample(stage, scanner, MARGIN + 18 * ROW_BYTES), running=1, finished_unfreed=0,
                             completed=0, now=0.0)
    assert monitor.cost_per_seq == 2 * ROW_BYTES and update.limit == monitor.memory_limit == 1 + 18 // 2 == 10


def test_under_declaration_under_warn_is_reported_and_changes_nothing():
    stage = Stage(RequestTalker(declared_positions=HELD_POSITIONS // 2))
    plan = plan_for(stage, headroom=8 * ROW_BYTES, policy="warn", max_num_seqs=16)
    monitor, scanner = LiveMonitor(plan), HeldBytes(stage, ["talker"])
    for i in range(4):
        stage.talker.start(f"r{i}")
    update = monitor.observe(sample(stage, scanner), running=4, finished_unfreed=0, completed=0, now=0.0)
    assert [f.kind for f in update.findings] == ["under-declared", "limit-lowered"]
    assert update.limit is None and monitor.limit == 16
    assert "policy warn: nothing is changed" in update.findings[1].message


def test_rows_kept_after_every_request_finished_are_a_leak_with_their_bytes():
    stage = Stage(RequestTalker(frees=False))
    monitor, scanner = LiveMonitor(plan_for(stage, headroom=100 * ROW_BYTES)), HeldBytes(stage, ["talker"])
    for i in range(3):
        stage.talker.start(f"r{i}")
        stage.talker.finish(f"r{i}")
    update = monitor.observe(sample(stage, scanner), running=0, finished_unfreed=0, completed=3, now=0.0)
    assert [(f.kind, f.bytes) for f in update.findings] == [("leak", 3 * ROW_BYTES)]
    assert monitor.state().ranks[0].owners[0].verdict == "leak"
    # Requests still waiting may legitimately hold rows: no leak then.
    fresh = LiveMonitor(plan_for(stage, headroom=100 * ROW_BYTES))
    update = fresh.observe(sample(stage, scanner), running=0, finished_unfreed=0, completed=3, now=0.0, waiting=2)
    assert update.findings == []


def test_a_declared_cache_that_never_holds_anything_is_reported_absent_after_enough_requests():
    stage = Stage(RequestTalker(allocates=False))
    monitor, scanner = LiveMonitor(plan_for(stage, headroom=100 * ROW_BYTES)), HeldBytes(stage, ["talker"])
    early = monitor.observe(sample(stage, scanner), running=4, finished_unfreed=0,
                            completed=DEAD_AFTER_COMPLETED - 1, now=0.0)
    assert early.findings == []
    late = monitor.observe(sample(stage, scanner), running=4, finished_unfreed=0,
                           completed=DEAD_AFTER_COMPLETED, now=1.0)
    assert [f.kind for f in late.findings] == ["declared-but-absent"]
    assert "'talker'" in late.findings[0].message


def test_invocation_scope_is_not_observable_between_steps():
    stage = Stage(RequestTalker())
    worker = budget_worker(collect_model_local_kv_specs(stage), headroom_override(10 * ROW_BYTES))
    line = worker.declarations[0].model_copy(update={"scope": Scope.INVOCATION})
    (expectation,) = owner_expectations(worker.model_copy(update={"declarations": [line]}))
    assert not expectation.retained and expectation.invocation_per_seq_bytes == ROW_BYTES


def test_sampling_is_due_by_interval_and_refuses_an_off_plan():
    stage = Stage(RequestTalker())
    monitor = LiveMonitor(plan_for(stage, headroom=10 * ROW_BYTES), sample_interval_s=2.0)
    assert monitor.due(100.0)
    monitor.observe([], running=0, finished_unfreed=0, completed=0, now=100.0)
    assert not monitor.due(101.5) and monitor.due(102.0)
    # A costly sample spaces the next one: at most MAX_SAMPLING_FRACTION of the time.
    monitor.note_cost(0.05)
    assert not monitor.due(102.0) and monitor.due(100.0 + 0.05 / MAX_SAMPLING_FRACTION)
    assert monitor.state().sample_seconds_total == 0.05
    assert not LiveMonitor(plan_for(stage, headroom=10 * ROW_BYTES), sample_interval_s=0).due(0.0)
    with pytest.raises(ValueError, match="sample_interval_s"):
        LiveMonitor(plan_for(stage, headroom=10 * ROW_BYTES), sample_interval_s=-1)
    with pytest.raises(ValueError, match="not off"):
        LiveMonitor(plan_for(stage, headroom=10 * ROW_BYTES).model_copy(update={"policy": Policy.OFF}))


def test_a_live_measurement_crosses_the_rpc_as_json_and_gives_the_monitor_its_sample():
    step = InStepPeaks(owners={"talker": ROW_BYTES}, undeclared={}, peak_bytes=ROW_BYTES, caches=1, updates=1,
                       seconds=0.01)
    answer = LiveMeasurement(rank=1, owners=[{"owner": "talker", "bytes": 2 * ROW_BYTES}], step=step,
                             free=DeviceFree(free_bytes=10, source="test device"), seconds=0.02).model_dump(mode="json")
    measured = LiveMeasurement.model_validate(answer)
    assert measured.sample(watched=True).step == step and measured.sample(watched=False).step is None
    assert measured.sample(watched=True).free.free_bytes == 10 and measured.label() == "rank 1"
    failed = LiveMeasurement(rank=None, error="the sampling RPC failed: OSError: gone")
    assert failed.label() == "rank ?"
    with pytest.raises(ValueError, match="no worker answered"):
        failed.sample(watched=False)


def _whisper_owner():
    from audit_models import WhisperDecoderOwner, whisper_config

    owner = WhisperDecoderOwner(whisper_config(), max_decoder_tokens=6)
    owner.run(batch=2)
    return owner


@pytest.mark.parametrize("build", [
    "sliding", "ming", "whisper",
], ids=["sliding-window cache", "static cache in a session", "encoder-decoder cache"])
def test_the_sampler_counts_exactly_what_the_audit_counts(build):
    """The sampler's lean counting must agree with the audit's per-layer
    report on every cache kind the audit knows, owner by owner."""
    from audit_models import build_ming_omni, build_sliding_declared_window_minus_one

    model = {"sliding": build_sliding_declared_window_minus_one, "ming": build_ming_omni,
             "whisper": _whisper_owner}[build]()
    if build == "ming":
        model.talker.run()
    audited = {o.owner: o.measured_bytes for o in audit_module(model).owners if o.declarations}
    assert audited and all(audited.values())
    assert HeldBytes(model, list(audited)).measure() == audited


def test_where_others_count_on_the_startup_figure_the_limit_follows_the_device_only_below_it():
    """A device ledger (later engines take this one's recorded reservation
    off what they measure) or a vLLM-Omni deployment split (the other
    stages' parts are planned around it): the limit still starts low and
    follows the device down, and never passes the startup cap."""
    stage = Stage(RequestTalker())
    plan = measured_plan(stage, MARGIN + 10 * ROW_BYTES)
    ledgered = LiveMonitor(plan, past_startup_cap=False)
    split = LiveMonitor(plan, resplit=lambda per_seq, fixed: None)
    for monitor in (ledgered, split):
        assert monitor.follows_device and monitor.limit == 1 and monitor.ceiling == 10
    assert LiveMonitor(plan).ceiling == 256


def _record(most_held: int, cost: int) -> CostRecord:
    return CostRecord(engine={"model": "m"}, ranks={0: HeldCost(most_held=most_held, cost_per_seq_bytes=cost)},
                      written_at=0.0)


def test_an_earlier_serve_of_this_engine_sets_the_first_bursts_cost():
    """The first burst is admitted at what an earlier serve measured (an
    average at the most it held), the part beyond the declared bytes
    charged twice (what the engine adds beyond them swings from serve to
    serve), each sequence past those at twice that or the guess where that
    is less, keeping the live margin free (here more than a quarter of the
    burst's growth), and only where that admits more than the guess; where
    the room holds fewer than were held, those given up are charged their
    declared bytes only; a record that measured more than the guess with as
    many held as the guess admits is taken as measured, and admits fewer."""
    stage = Stage(RequestTalker())
    free, live_margin = 300 * 1024**2, 64 * 1024**2
    plan = default_margin_plan(stage, free)
    guess = ROW_BYTES + (1024**3 - live_margin) // 256
    room = free - live_margin
    assert first_admission(plan, 256).limit == room // guess == 62
    assert int(free / (1 + BURST_SPREAD)) > room  # a quarter of what fits is less than the live margin
    measured = 1024**2
    charged = ROW_BYTES + RECORD_SWING_FACTOR * (measured - ROW_BYTES)
    past = min(BEYOND_RECORD_FACTOR * charged, guess)
    assert charged < guess == past  # twice the charge is more than the guess: the guess
    first = first_admission(plan, 256, _record(100, measured))
    assert first.limit == 100 + (room - 100 * charged) // past == 109
    assert first.cost_by_rank == {0: -(-(100 * charged + 9 * past) // 109)}
    assert (f"at {charged:,} B per sequence [{ROW_BYTES:,} B declared + 2 x what {measured:,} B measured by an "
            f"earlier serve of this engine with 100 held is beyond it], in {room:,} B [the live margin or 25% of the "
            f"burst's growth kept free, whichever is more: min({room:,} B, ({room:,} B + {live_margin:,} B) / 1.25)] "
            f"for 100, and {past:,} B for each past them: 100 + floor(({room:,} B - {100 * charged:,} B) / "
            f"{past:,} B) = 109") in first.how
    assert LiveMonitor(plan, remembered=_record(80, measured)).limit == 80 + (room - 80 * charged) // past == 100
    dear = first_admission(plan, 256, _record(100, 2 * measured))  # charged twice, 4 MiB is more than the guess
    assert dear.limit == 62 and dear.cost_by_rank == {0: guess}  # 0 fit at the charge: never fewer than the guess
    assert "the guess: 62 fit at it, 0 at " in dear.how
    over = 5 * 1024**2  # more than the guess, measured with more held than the guess admits
    short = first_admission(plan, 256, _record(200, over))
    deficit = 200 * over - room
    assert short.limit == max(200 - -(-deficit // ROW_BYTES), 1) == 1  # a 5,120 B sequence frees little
    assert (f"{over:,} B per sequence [measured by an earlier serve of this engine with 200 held, the guess "
            f"{guess:,} B is less]") in short.how
    assert f"so 200 - ceil({deficit:,} B short / {ROW_BYTES:,} B declared" in short.how
    light = first_admission(plan, 256, _record(10, 8 * 1024**2))  # ten held, the fixed growth over few
    assert light.limit == 62 and light.cost_by_rank == {0: guess}  # the guess
    assert "the guess: 62 fit at it, 14 at " in light.how
    assert first_admission(plan, 256, _record(10, measured)).limit == 10 + (room - 10 * charged) // guess == 67
    below = remembered_burst(room, guess, ROW_BYTES, HeldCost(most_held=100, cost_per_seq_bytes=1), live_margin)
    assert below[2].startswith(f"{ROW_BYTES:,} B per sequence [{ROW_BYTES:,} B declared + 2 x what {ROW_BYTES:,} B")
    assert below[0] == 100 + (room - 100 * ROW_BYTES) // (2 * ROW_BYTES)  # a record under the declared bytes is raised


@pytest.mark.parametrize("most_held", [20, 65, 85, 101, 125, 160])
@pytest.mark.parametrize("beyond", [0, 300_000, 1_320_000, 2_800_000])
def test_a_burst_priced_by_a_record_leaves_room_for_twice_what_that_serve_added_beyond_the_declared(most_held, beyond):
    """A burst a record admits above the guess fits the room kept free of
    the live margin and the spread with its sequences' declared bytes and
    twice what the recorded serve added beyond them, whether that growth
    stays fixed (fewer admitted than were held) or grows with the sequences
    (more): the next serve may add twice as much (the 1 MiB demo under a
    0.4 GB room: 1.3 to 3.1 MB per held sequence beyond its 1.1 MB)."""
    declared, live_margin, room = 1_114_112, 64 * 1024**2, 330_000_000
    guess = declared + (1024**3 - live_margin) // 256
    record = HeldCost(most_held=most_held, cost_per_seq_bytes=declared + beyond)
    fits, cost, how = remembered_burst(room, guess, declared, record, live_margin)
    kept = min(room, int((room + live_margin) / (1 + BURST_SPREAD)))
    if fits > kept // guess:  # the record priced it
        assert fits * declared + RECORD_SWING_FACTOR * beyond * max(most_held, fits) <= kept, how
    else:
        assert (fits, cost) == (kept // guess, guess), how


def test_a_large_burst_keeps_a_quarter_of_its_growth_free():
    """Where a quarter of the burst's growth is more than the live margin,
    that quarter is what stays free, whether a record or the guess prices
    the burst: the growth is at most what is free / 1.25 (8 MiB sequences
    under 2 GiB, as the demo's)."""
    free, live_margin = 2 * 1024**3, 128 * 1024**2
    declared, guess, measured = 8 * 1024**2, 12 * 1024**2, 9 * 1024**2
    charged = declared + RECORD_SWING_FACTOR * (measured - declared)  # 10 MiB
    room = free - live_margin
    spread = int(free / (1 + BURST_SPREAD))
    assert spread < room
    fits, cost, how = remembered_burst(room, guess, declared, HeldCost(most_held=150, cost_per_seq_bytes=measured),
                                       live_margin)
    assert fits == 150 + (spread - 150 * charged) // guess == 161  # twice 10 MiB is more than the guess
    growth = 150 * charged + 11 * guess
    assert cost == -(-growth // 161)
    assert free - growth >= growth * BURST_SPREAD > live_margin  # a quarter of the growth stays free
    assert fits < 150 + (room - 150 * charged) // guess  # where the live margin alone would admit more
    assert f"in {spread:,} B [the live margin or 25% of the burst's growth kept free" in how
    fewer, _, how = remembered_burst(room, guess, declared, HeldCost(most_held=190, cost_per_seq_bytes=measured),
                                     live_margin)  # the record held more than fits with a quarter free
    assert fewer == 190 - -(-(190 * charged - spread) // declared) == 157
    assert f"fewer than 190 fit in {spread:,} B" in how
    unrecorded, priced, how = remembered_burst(room, guess, declared, None, live_margin)
    assert (unrecorded, priced) == (spread // guess, guess) and unrecorded == 136  # the guess keeps it too
    assert free - unrecorded * guess >= unrecorded * guess * BURST_SPREAD
    assert how == (f"in {spread:,} B [the live margin or 25% of the burst's growth kept free, whichever is more: "
                   f"min({room:,} B, ({room:,} B + {live_margin:,} B) / 1.25)]")


def test_the_cost_worth_recording_is_the_one_at_the_most_held_or_a_lower_one():
    stage = Stage(RequestTalker())
    free = 400 * 1024**2
    plan = default_margin_plan(stage, free)
    monitor, scanner = LiveMonitor(plan), HeldBytes(stage, ["talker"])
    assert monitor.cost_to_record() is None  # nothing measured yet
    held(stage, 30)
    grown = 30 * 3 * 1024**2
    monitor.observe(device_sample(stage, scanner, free - grown), running=30, finished_unfreed=0, completed=0, now=0.0)
    assert monitor.cost_to_record() == {0: HeldCost(most_held=30, cost_per_seq_bytes=3 * 1024**2)}
    assert monitor.cost_to_record() is None  # unchanged since written
    lighter = LiveMonitor(plan, remembered=_record(60, 2 * 1024**2))
    lighter.observe(device_sample(stage, scanner, free - grown), running=30, finished_unfreed=0, completed=0, now=0.0)
    assert lighter.cost_to_record() is None  # 30 held at a higher cost does not replace a record of 60
    dearer = LiveMonitor(plan, remembered=_record(60, 4 * 1024**2))
    dearer.observe(device_sample(stage, scanner, free - grown), running=30, finished_unfreed=0, completed=0, now=0.0)
    assert dearer.cost_to_record() == {0: HeldCost(most_held=30, cost_per_seq_bytes=3 * 1024**2)}  # a lower cost does
    explicit = make_plan([budget_worker(collect_model_local_kv_specs(stage), headroom_override(free),
                                        max_num_seqs=256)], 256, "cap")
    exact = LiveMonitor(explicit, remembered=_record(60, 2 * 1024**2))
    assert exact.first is None and exact.limit == explicit.effective_max_num_seqs  # an exact headroom: no burst
    exact.observe(sample(stage, scanner), running=30, finished_unfreed=0, completed=0, now=0.0)
    assert exact.cost_to_record() is None
