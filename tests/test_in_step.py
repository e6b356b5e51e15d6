"""In-step peaks without an engine: real transformers caches filled by real
forward passes inside a module's forward, counted by
:class:`kv_budget.sample.in_step.InStepTracker` through the glue's
``Cache.update`` hook, judged by :class:`kv_budget.watch.live.LiveMonitor`.
Every expected figure is the model's own count of its caches at their
largest (:func:`measure_cache_bytes`), or the declaration's arithmetic."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from audit_models import small_qwen2_config, tiny_lm
from transformers import DynamicCache

from kv_budget.collect.model import Collection, collect_model_local_kv_specs
from kv_budget.declare.hf_config import spec_from_hf_config
from kv_budget.declare.spec import RowDriver, Scope
from kv_budget.plan.planner import budget_worker, headroom_override, make_plan
from kv_budget.plan.reserve import plan_reserve, reserve_out_of_pool, watch_plan
from kv_budget.sample.caches import HeldBytes, measure_cache_bytes
from kv_budget.sample.in_step import InStepTracker
from kv_budget.watch.live import LiveMonitor, WorkerSample
from vllm_patches import cache_updates

CONFIG = small_qwen2_config()
PROMPT = 8
ROW_BYTES = 2 * CONFIG.num_hidden_layers * CONFIG.num_key_value_heads * 16 * PROMPT * 4
"""One row of PROMPT positions: K and V, every layer, float32."""


@pytest.fixture(autouse=True, scope="module")
def installed():
    assert cache_updates.install() is None


def _forward(lm, cache, rows: int, positions: int = PROMPT) -> None:
    ids = torch.randint(3, CONFIG.vocab_size, (rows, positions), generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        lm.model(input_ids=ids, past_key_values=cache, use_cache=True)


class StepTalker(torch.nn.Module):
    """Builds one row per sequence of the step in a local cache, frees it on
    return: the demo talker's ``lifetime: step``, with a real forward."""

    def __init__(self, declared_positions: int = PROMPT) -> None:
        super().__init__()
        self.lm = tiny_lm(CONFIG)
        self.declared_positions = declared_positions
        self.largest = 0

    def forward(self, rows: int) -> None:
        work = DynamicCache()
        _forward(self.lm, work, rows)
        self.largest = max(self.largest, measure_cache_bytes(work))

    def model_local_kv_specs(self):
        return [spec_from_hf_config(
            CONFIG, name="talker_step_kv", dtype=torch.float32, physical_capacity_positions=self.declared_positions,
            capacity_source="test", scope=Scope.INVOCATION, rows=RowDriver.MAX_NUM_SEQS)]


class CopyingDecoder(torch.nn.Module):
    """Keeps a cache per request and runs each step on a deep copy of it:
    the shape of vLLM-Omni's Qwen3-TTS working copy."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = tiny_lm(CONFIG)
        self.kept: dict[str, DynamicCache] = {}
        self.largest = 0

    def forward(self, request: str) -> None:
        if request not in self.kept:
            self.kept[request] = DynamicCache()
            _forward(self.lm, self.kept[request], 1)
        working_cache = copy.deepcopy(self.kept[request])
        _forward(self.lm, working_cache, 1, positions=4)
        self.largest = max(self.largest, measure_cache_bytes(working_cache) + sum(
            measure_cache_bytes(cache) for cache in self.kept.values()))


class Model(torch.nn.Module):
    def __init__(self, talker: torch.nn.Module) -> None:
        super().__init__()
        self.talker = talker
        self.other = tiny_lm(CONFIG)
        self.other_largest = 0

    def forward(self, *args, undeclared: bool = False) -> None:
        self.talker(*args)
        if undeclared:
            scratch = DynamicCache()
            _forward(self.other, scratch, 2)
            self.other_largest = measure_cache_bytes(scratch)


def _watch(model: Model, owners: list[str], *calls) -> tuple[InStepTracker, object]:
    tracker = InStepTracker(model, owners)
    with cache_updates.tracking(tracker):
        for args, kwargs in calls:
            model(*args, **kwargs)
    return tracker, tracker.end()


def test_a_per_step_cache_is_counted_at_its_peak_inside_the_forward():
    model = Model(StepTalker())
    _, peaks = _watch(model, ["talker"], ((4,), {}))
    assert model.talker.largest == 4 * ROW_BYTES  # what the declaration says, per row
    assert peaks.owners == {"talker": 4 * ROW_BYTES}
    assert peaks.undeclared == {} and peaks.peak_bytes == 4 * ROW_BYTES
    assert peaks.caches == 1 and peaks.updates == CONFIG.num_hidden_layers


def test_a_freed_cache_leaves_the_count_so_two_steps_are_not_added():
    model = Model(StepTalker())
    _, peaks = _watch(model, ["talker"], ((3,), {}), ((5,), {}), ((2,), {}))
    assert peaks.owners == {"talker": 5 * ROW_BYTES} and peaks.caches == 3


def test_a_working_copy_counts_with_the_caches_it_was_copied_from_each_storage_once():
    model = Model(CopyingDecoder())
    _, peaks = _watch(model, ["talker"], (("a",), {}), (("b",), {}))
    assert peaks.owners == {"talker": model.talker.largest}
    # At its largest: two kept caches of PROMPT positions and one copy of PROMPT + 4.
    assert model.talker.largest == 2 * ROW_BYTES + ROW_BYTES * (PROMPT + 4) // PROMPT


def test_caches_no_declaration_covers_are_reported_under_their_holding_module():
    model = Model(StepTalker())
    _, peaks = _watch(model, ["talker"], ((1,), {"undeclared": True}))
    assert peaks.owners == {"talker": ROW_BYTES}
    assert peaks.undeclared == {"": model.other_largest} and model.other_largest == 2 * ROW_BYTES
    assert peaks.peak_bytes == 2 * ROW_BYTES  # the talker's cache was freed before the scratch one grew


def test_caches_updated_outside_the_model_and_outside_a_window_are_not_counted():
    model = Model(StepTalker())
    tracker = InStepTracker(model, ["talker"])
    with cache_updates.tracking(tracker):
        _forward(tiny_lm(CONFIG), DynamicCache(), 3)  # not under this model's forward
    outside = tracker.end()
    assert (outside.peak_bytes, outside.caches, outside.updates) == (0, 0, CONFIG.num_hidden_layers)
    model(2)  # no window open
    assert tracker.end() == outside


def test_caches_that_never_go_through_update_are_met_from_the_frames_that_hold_them():
    """A's and b's caches are not updated in the window (only c's is built):
    the talker's frame reaches them through its attributes, so they count
    from c's first update on."""
    model = Model(CopyingDecoder())
    model("a")
    model("b")
    _, peaks = _watch(model, ["talker"], (("c",), {}))
    assert peaks.owners == {"talker": model.talker.largest} and peaks.caches == 4
    assert model.talker.largest == 3 * ROW_BYTES + ROW_BYTES * (PROMPT + 4) // PROMPT


def test_retained_caches_off_the_stack_are_added_from_the_sample_after_the_window():
    model = Model(CopyingDecoder())
    model.keeper = torch.nn.Module()  # declares elsewhere; does not run in the window
    model.keeper.cache = DynamicCache()
    _forward(model.talker.lm, model.keeper.cache, 2)
    tracker, peaks = _watch(model, ["talker", "keeper"], (("a",), {}))
    held, untouched = HeldBytes(model, ["talker", "keeper"]).measure_apart(tracker.touched())
    assert held == {"talker": ROW_BYTES, "keeper": 2 * ROW_BYTES}
    assert untouched == {"talker": 0, "keeper": 2 * ROW_BYTES}
    whole = peaks.with_untouched(untouched)
    assert whole.owners == {"talker": model.talker.largest, "keeper": 2 * ROW_BYTES}
    assert whole.peak_bytes == model.talker.largest + 2 * ROW_BYTES


class LayerFillingTalker(StepTalker):
    """Fills its step cache layer by layer from a tensor it makes per layer
    and rebinds (the demo talker's way), and notes, once every layer is in,
    whether the first layer's tensor is still alive."""

    def forward(self, rows: int) -> None:
        work = DynamicCache()
        _forward(self.lm, work, rows)
        postnet = DynamicCache()  # met at its first update, while `keys` is the first layer's
        first = None
        for layer in range(CONFIG.num_hidden_layers):
            keys = torch.ones(rows, CONFIG.num_key_value_heads, 2, 16)
            first = first or weakref.ref(keys)
            postnet.update(keys, torch.ones_like(keys), layer)
        self.first_layer_kept = first() is not None


def test_watching_a_step_keeps_nothing_alive_the_model_let_go():
    """Reading a frame's locals leaves a snapshot on it (CPython before
    3.13) that would keep the first layer's tensor, already copied into the
    cache, alive until the forward returns: the step would hold more
    because it is watched."""
    model = Model(LayerFillingTalker())
    model(2)
    assert model.talker.first_layer_kept is False  # unwatched: rebinding frees it
    _, peaks = _watch(model, ["talker"], ((2,), {}))
    assert peaks.caches == 2 and peaks.owners["talker"] > 0  # the window met both caches
    assert model.talker.first_layer_kept is False


def test_a_closed_window_keeps_no_cache_it_met():
    """The caches a window reached through module attributes are let go
    when it closes: a request's cache the model drops after the window is
    freed then, not at the next window."""
    model = Model(CopyingDecoder())
    model("a")
    _watch(model, ["talker"], (("b",), {}))
    kept = weakref.ref(model.talker.kept.pop("a"))
    gc.collect()
    assert kept() is None


# --- the verdicts ---

def _sample(peaks, held: dict[str, int] | None = None) -> list[WorkerSample]:
    owners = [{"owner": o, "bytes": b} for o, b in (held or {"talker": 0}).items()]
    return [WorkerSample(rank=0, owners=owners, seconds=0.0, step=peaks)]


def _plan(model: Model, headroom: int, policy: str = "cap"):
    worker = budget_worker(collect_model_local_kv_specs(model), headroom_override(headroom), max_num_seqs=256)
    return make_plan([worker], 256, policy)


def test_an_under_declared_per_step_cache_lowers_the_limit_under_cap():
    model = Model(StepTalker(declared_positions=PROMPT // 4))
    declared_row = ROW_BYTES // 4
    plan = _plan(model, headroom=64 * declared_row)
    assert plan.effective_max_num_seqs == 64
    _, peaks = _watch(model, ["talker"], ((8,), {}))
    monitor = LiveMonitor(plan, step_peaks=True)
    update = monitor.observe(_sample(peaks), running=8, finished_unfreed=0, completed=0, now=0.0)
    assert [f.kind for f in update.findings] == ["under-declared", "limit-lowered"]
    assert update.findings[0].bytes == ROW_BYTES - declared_row
    assert f"held {8 * ROW_BYTES:,} B at once inside the step with 8 sequence(s) held" in update.findings[0].message
    assert update.limit == 64 * declared_row // ROW_BYTES == 16
    owner = monitor.state().ranks[0].owners[0]
    assert (owner.verdict, owner.step_bytes, owner.step_allowed_bytes) == (
        "under-declared", 8 * ROW_BYTES, 8 * declared_row)


def test_without_step_peaks_a_per_step_owner_is_not_observable():
    model = Model(StepTalker(declared_positions=PROMPT // 4))
    monitor = LiveMonitor(_plan(model, headroom=64 * ROW_BYTES), step_peaks=False)
    update = monitor.observe(_sample(None), running=8, finished_unfreed=0, completed=0, now=0.0)
    assert update.findings == [] and monitor.state().ranks[0].owners[0].verdict == "not-observable"


def test_what_an_undeclared_module_adds_inside_a_step_is_charged_fixed_beside_per_sequence_caches():
    """The declared talker scales with sequences; the root's caches built
    inside the step, kept by nobody after it, are charged once at their
    largest (as a decode group's working copies are), not per sequence."""
    model = Model(StepTalker())
    plan = _plan(model, headroom=40 * ROW_BYTES)
    assert plan.effective_max_num_seqs == 40
    _, peaks = _watch(model, ["talker"], ((1,), {"undeclared": True}))
    monitor = LiveMonitor(plan, step_peaks=True)
    update = monitor.observe(_sample(peaks), running=1, finished_unfreed=0, completed=0, now=0.0)
    assert [f.kind for f in update.findings] == ["undeclared", "limit-lowered"]
    assert "module '<root>' held" in update.findings[0].message
    assert (monitor.rank_per_seq_bytes(0), monitor.rank_fixed_bytes(0)) == (ROW_BYTES, 2 * ROW_BYTES)
    assert update.limit == (40 - 2) * ROW_BYTES // ROW_BYTES
    verdicts = {o.owner: o.verdict for o in monitor.state().ranks[0].owners}
    assert verdicts == {"talker": "ok", "": "undeclared"}


def test_when_nothing_else_scales_what_an_undeclared_module_adds_inside_a_step_is_charged_per_sequence():
    """With no declared and no kept per-sequence bytes, a per-step
    allocation nobody declared is the only figure: charged per sequence
    held, so it is never left unbounded."""
    model = Model(StepTalker())
    worker = budget_worker(Collection(specs=(), failures=()), headroom_override(40 * ROW_BYTES), max_num_seqs=64)
    monitor = LiveMonitor(make_plan([worker], 64, "cap"), step_peaks=True)
    _, peaks = _watch(model, [], ((1,), {"undeclared": True}))
    update = monitor.observe(_sample(peaks), running=2, finished_unfreed=0, completed=0, now=0.0)
    assert set(peaks.undeclared) == {"", "talker"}  # nothing declares here: the talker's step caches too
    per_seq = sum(-(-added // 2) for added in peaks.undeclared.values())  # each holder's, per sequence held
    assert (monitor.rank_per_seq_bytes(0), monitor.rank_fixed_bytes(0)) == (per_seq, 0)
    assert update.limit == 40 * ROW_BYTES // per_seq


def test_a_short_reservation_lowers_the_live_limit_to_what_fits_the_reserved_bytes():
    model = Model(StepTalker(declared_positions=PROMPT // 2))
    worker = budget_worker(collect_model_local_kv_specs(model), headroom_override(0), max_num_seqs=32)
    reservation = plan_reserve([reserve_out_of_pool(worker, 32, 10**9, 4096, 8192)], 32, 256)
    plan = watch_plan(reservation, [worker])
    assert (plan.policy.value, plan.decision.value, plan.headroom_bytes) == ("reserve", "ok", 32 * ROW_BYTES // 2)
    _, peaks = _watch(model, ["talker"], ((4,), {}))
    monitor = LiveMonitor(plan, step_peaks=True)
    update = monitor.observe(_sample(peaks), running=4, finished_unfreed=0, completed=0, now=0.0)
    assert update.limit == 16  # 32 half rows reserved hold 16 whole ones
    assert "max_num_seqs 32 -> 16 (rank 0: floor((reserved " in update.findings[-1].message


# --- what it refuses ---

class OddTalker(StepTalker):
    """Puts a tensor the audit cannot classify on a layer between two updates."""

    def forward(self, rows: int) -> None:
        work = DynamicCache()
        _forward(self.lm, work, rows)
        work.layers[0].odd = torch.zeros(3)
        _forward(self.lm, work, rows)


def test_a_cache_it_cannot_count_ends_the_window_with_the_reason_not_a_partial_figure():
    _, peaks = _watch(Model(OddTalker()), ["talker"], ((2,), {}))
    assert peaks.error is not None and "'odd'" in peaks.error


def test_a_cache_class_that_overrides_update_is_named_and_nothing_is_wrapped_for_it():
    import gc

    class Rewritten(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    try:
        problem = cache_updates.check_cache_update()
        assert problem is not None and "Rewritten override Cache.update" in problem
        assert cache_updates.install() == problem
    finally:
        del Rewritten
        gc.collect()
    assert cache_updates.check_cache_update() is None
