"""Live sampling in a serving engine: measure, compare, correct, publish.

After the startup plan (:mod:`.startup_hook`), an engine under ``cap``,
``warn`` or ``reserve`` gets a :class:`LiveHook`. ``EngineCore.step`` and
``step_with_batch_queue`` are wrapped: after each step the hook counts the
requests that completed and, every ``sample_interval_s`` (and once more
when the engine goes idle, which is when a leak shows), asks every worker
through ``collective_rpc`` for the bytes its declaring owners hold
(:func:`measure_on_worker`, :class:`kv_budget.sample.caches.HeldBytes`). The
comparison and the decision are :class:`kv_budget.watch.live.LiveMonitor`'s; this
module only feeds it and applies what it returns:

* a lower live limit goes to the running Scheduler's admission limit
  (``compat.VllmFeatures.admission_limit``). From 0.31 that is
  ``max_num_active_reqs``, which only stops admission, so it is set at
  once. On 0.30 it is ``max_num_running_reqs``, which ``schedule()`` also
  asserts ``len(running)`` against: it is lowered step by step, never below
  what already runs, until it reaches the limit. No running request is
  preempted, dropped or failed; new ones wait.
* every sample rewrites the engine's status file (:mod:`kv_budget.watch.status`)
  for the API-server processes' metrics.

A vLLM-Omni stage that planned before the other stages on its devices
(:mod:`kv_budget.deployment`) gets a :class:`PendingSplit`: before its first
step it waits until every stage there has recorded, then applies the final
split's limit the same way, before any request is scheduled (vLLM-Omni
serves only once every stage is ready, so the wait is over by then).

The cost is one RPC round trip, a walk of the declaring owners' caches and
a status file per sample, bounded to ``kv_budget.watch.live.MAX_SAMPLING_FRACTION``
of the engine's time; ``benchmarks/bench_live.py`` measures it against the
same load with sampling off.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any

from kv_budget import __version__ as kv_budget_version
from kv_budget.deployment import DeploymentError, DeploymentPlanning
from kv_budget.log import logger
from kv_budget.plan.planner import Decision, Plan, WorkerBudget
from kv_budget.runtime_files import UnsafeRuntimeDirError
from kv_budget.sample.caches import HeldBytes, UnsupportedCacheError
from kv_budget.sample.device import MemorySamplingError, ProcessPeak, return_free_heap, sample_memory
from kv_budget.sample.in_step import InStepTracker
from kv_budget.settings import COST_RECORD_OFF, LEDGER_OFF, Policy
from kv_budget.stage import Stage
from kv_budget.startup import EngineContext, final_deployment_plan
from kv_budget.watch.cost_record import cost_record_directory, cost_record_path, read_cost_record, write_cost_record
from kv_budget.watch.live import (
    WATCHED_POLICIES,
    DeviceFree,
    LiveMeasurement,
    LiveMonitor,
    OwnerBytes,
    WindowOpening,
    device_following,
)
from kv_budget.watch.status import STATUS_DIR_ENV, EngineStatus, write_status
import vllm_patches.cache_updates as cache_updates
from vllm_patches.compat import checked_vllm
from vllm_patches.engine import attached_state, lower_max_num_seqs
from vllm_patches.omni_chunks import count_parked_in_scheduler, parked_requests, parks_requests
from vllm_patches.patching import patch_method


@dataclass
class WorkerState:
    """kv-budget's live state on one vLLM worker, built on first use."""

    scanner: tuple[tuple, HeldBytes] | None = None
    """((the model's id, the owners it was built for), the scanner), from the first sample."""
    tracker: tuple[tuple, InStepTracker] | None = None
    """((the model's id, the owners it was built for), the in-step tracker), from the first watched step."""
    peak: ProcessPeak | None = None
    """The process's peak on its device, started by :func:`start_peak_on_worker`."""


def _process_peak(worker: Any) -> ProcessPeak:
    state = attached_state(worker, WorkerState)
    if state.peak is None:
        device = worker.device
        state.peak = ProcessPeak(device.type, device.index or 0)
    return state.peak


def _built_for(kept: tuple[tuple, Any] | None, cls: type, model: Any, *owners: list[str]) -> tuple[tuple, Any]:
    """The kept scanner or tracker, rebuilt when the model or the owners
    (declaring owners, and for a scanner the undeclared holders) change."""
    built_for = (id(model), owners)
    if kept is None or kept[0] != built_for:
        return built_for, cls(model, *owners)
    return kept


def rpc_on_workers(core: Any, method: Any, args: tuple = ()) -> tuple[list[Any], float]:
    """``core.collective_rpc(method, args=args)``'s answers, and the engine
    core's CPU time spent waiting for them. Why apart: vLLM's message queue
    polls while the engine core waits (a busy loop that yields), so that
    time follows the workers' wall time (a worker another process preempted,
    a collection in its garbage collector), not the engine core's own work;
    each worker reports its own CPU time in its answer."""
    before = time.thread_time()
    answers = core.collective_rpc(method, args=args)
    return answers, time.thread_time() - before


def start_peak_on_worker(worker: Any) -> None:
    """Runs in every worker (``collective_rpc``) when live sampling begins:
    count this process's peak from now, so startup's own (weights, the
    profile run) is not read as the first step's."""
    _process_peak(worker).read()


def watch_step_on_worker(worker: Any, owners_by_rank: dict[int, list[str]]) -> dict:
    """Runs in every worker (``collective_rpc``) before a sampled step:
    open the in-step window (:mod:`vllm_patches.cache_updates`) that the
    next :func:`measure_on_worker` closes. A :class:`WindowOpening`'s JSON;
    ``error`` says why it cannot."""
    start, cpu = time.perf_counter(), time.thread_time()
    result = WindowOpening(rank=worker.rank)
    try:
        result.error = cache_updates.install()
        if result.error is None:
            model = worker.model_runner.model
            state = attached_state(worker, WorkerState)
            state.tracker = _built_for(state.tracker, InStepTracker, model, owners_by_rank.get(worker.rank, []))
            cache_updates.start(state.tracker[1])
    except Exception as exc:  # noqa: BLE001 - a sample must never take the engine down
        result.error = f"{type(exc).__name__}: {exc}"
    result.seconds = time.perf_counter() - start
    result.cpu_seconds = time.thread_time() - cpu
    return result.model_dump(mode="json")


def measure_on_worker(worker: Any, owners_by_rank: dict[int, list[str]],
                      holders_by_rank: dict[int, list[str]] | None = None, watch_device: bool = False) -> dict:
    """Runs in every worker (``collective_rpc``): the bytes each of this
    rank's declaring owners, and each module an earlier window saw holding
    caches it does not declare (``holders_by_rank``), holds now and, when a
    window was open, the step's peaks (caches the window counted are not
    counted twice), and with ``watch_device`` the device's free memory
    as the startup sampler reads it (``free``; None when it cannot be
    read: the watch skips that sample), on CPU once the allocator has
    handed its free heap pages back (:func:`return_free_heap`). A :class:`LiveMeasurement`'s JSON;
    a cache the audit cannot count is reported in ``error`` (sampling stops
    on that rank rather than publish a partial figure), a window that could
    not count one in ``step_error``."""
    start, cpu = time.perf_counter(), time.thread_time()
    owners = owners_by_rank.get(worker.rank, [])
    model = worker.model_runner.model
    result = LiveMeasurement(rank=worker.rank)
    tracker = cache_updates.stop()
    window = tracker.end() if tracker is not None else None
    try:
        # The holders this window met are measured after the step at once: what they keep between
        # steps is their per-sequence part, what the step added on top is not.
        holders = [*(holders_by_rank or {}).get(worker.rank, []), *(window.undeclared if window is not None else ())]
        state = attached_state(worker, WorkerState)
        state.scanner = _built_for(state.scanner, HeldBytes, model, owners, list(dict.fromkeys(holders)))
        scanner = state.scanner[1]
        held, untouched = scanner.measure_apart(tracker.touched() if tracker is not None else set())
        result.owners = [OwnerBytes(owner=owner, bytes=size) for owner, size in held.items()]
        if window is not None and window.error is not None:
            result.step_error = window.error
        elif window is not None:
            result.step = window.with_untouched(untouched)
        if watch_device:
            device = worker.device
            # On CPU the allocator's free heap pages are handed back first: they are used memory the kernel
            # cannot reclaim, and a later step's larger tensors would be mapped on top of them.
            returned = return_free_heap() if device.type == "cpu" else None
            with contextlib.suppress(MemorySamplingError):
                sampled = sample_memory(device.type, device.index or 0)
                source = sampled.source if not returned else (
                    f"{sampled.source}, after malloc_trim returned {returned:,} B of the worker's free heap")
                result.free = DeviceFree(free_bytes=sampled.free_bytes, source=source,
                                         peak_excess_bytes=_process_peak(worker).read())
    except UnsupportedCacheError as exc:
        result.error = str(exc)
    except Exception as exc:  # noqa: BLE001 - a sample must never take the engine down
        result.error = f"{type(exc).__name__}: {exc}"
    tracking = window.seconds if window is not None else 0.0
    result.seconds = time.perf_counter() - start + tracking
    result.cpu_seconds = time.thread_time() - cpu + tracking
    return result.model_dump(mode="json")


def apply_limit(scheduler: Any, limit: int) -> int:
    """Bring the Scheduler's admission limit down towards ``limit``; return
    the value it has now. Never raises it."""
    attribute = checked_vllm().features.admission_limit
    current = getattr(scheduler, attribute)
    if attribute == "max_num_running_reqs":
        # schedule() asserts len(running) <= max_num_running_reqs: stop at what runs.
        target = max(limit, len(scheduler.running))
    else:
        target = limit
    if target < current:
        setattr(scheduler, attribute, target)
        return target
    return current


def restore_limit(scheduler: Any, limit: int, ceiling: int) -> int:
    """Raise the Scheduler's admission limit up to ``limit``, never above
    ``ceiling`` (:attr:`kv_budget.watch.live.LiveMonitor.ceiling`: at most
    the configured ``max_num_seqs`` the workers' batches were sized for);
    return the value it has now."""
    attribute = checked_vllm().features.admission_limit
    target = min(limit, ceiling)
    if attribute != "max_num_running_reqs" and target > scheduler.max_num_running_reqs:
        # Built from the capped config, and schedule() asserts len(running) <= max_num_running_reqs.
        scheduler.max_num_running_reqs = target
    if target > getattr(scheduler, attribute):
        setattr(scheduler, attribute, target)
    return getattr(scheduler, attribute)


@dataclass
class LiveStart:
    """What the startup plan hands live sampling, as one: the plan, the
    engine it was made for, and what the status file reports beside it."""

    plan: Plan
    engine: EngineContext
    overrides: list[str] = field(default_factory=list)
    """The overrides that applied here, as the workers filtered them for the stage."""
    unmatched_overrides: list[str] = field(default_factory=list)
    """Overrides that matched no declaration on any worker (checked across stages by the driver)."""
    planning: DeploymentPlanning | None = None
    """This stage's side of its vLLM-Omni deployment; None in plain vLLM and under ``reserve``."""


def engine_fingerprint(vllm_config: Any, plan: Plan, stage: Stage | None) -> dict[str, str]:
    """What makes a sequence cost this engine's device what it does, as the
    cost record keys it (:mod:`kv_budget.watch.cost_record`): the model and
    its dtype, the lengths and batch limits vLLM sized its buffers for, the
    parallel layout, the declared bytes per sequence on each rank, the
    stage, and the versions of vLLM and kv-budget. Not the device's free
    memory: the cost per sequence does not depend on the room."""
    model, scheduler, parallel = vllm_config.model_config, vllm_config.scheduler_config, vllm_config.parallel_config
    return {
        "model": str(model.model),
        "revision": str(getattr(model, "revision", None)),
        "dtype": str(model.dtype),
        "max_model_len": str(model.max_model_len),
        "max_num_seqs": str(plan.configured_max_num_seqs),
        "max_num_batched_tokens": str(scheduler.max_num_batched_tokens),
        "tensor_parallel_size": str(parallel.tensor_parallel_size),
        "pipeline_parallel_size": str(parallel.pipeline_parallel_size),
        "declared_per_seq_bytes": " ".join(f"rank {w.rank}: {w.per_seq_bytes}" for w in plan.workers),
        "stage": stage.label() if stage is not None else "",
        "vllm": checked_vllm().version,
        "kv_budget": kv_budget_version,
    }


class LiveHook:
    """One engine core's live sampling, between its steps."""

    def __init__(self, core: Any, vllm_config: Any, start: LiveStart) -> None:
        plan, settings, planning = start.plan, start.engine.settings, start.planning
        self.planning = planning
        follows, _ = device_following(plan, False)
        if not follows and settings.cost_record_dir not in (None, COST_RECORD_OFF):
            logger.warning("cost_record_dir (--model-local-kv-cost-record) applies where the live limit follows the "
                           "device (cap with a measured headroom); this engine ignores it")
        self.cost_record_dir = cost_record_directory(settings.cost_record_dir) if follows else None
        """Where this engine's measured cost per sequence is kept for its next start; None: off, or the
        limit does not follow the device (an operator's exact headroom, ``warn``, ``reserve``)."""
        self.fingerprint = engine_fingerprint(vllm_config, plan, start.engine.stage) if self.cost_record_dir else {}
        remembered = read_cost_record(self.cost_record_dir, self.fingerprint) if self.cost_record_dir else None
        self.monitor = LiveMonitor(plan, settings.sample_interval_s, settings.step_peaks,
                                   self._resplit if planning is not None else None,
                                   past_startup_cap=settings.ledger_dir == LEDGER_OFF, remembered=remembered)
        self.remembered_from = "" if remembered is None else (
            f" (cost record {cost_record_path(self.cost_record_dir, self.fingerprint)}, written "
            f"{time.strftime('%Y-%m-%d %H:%M:%S %Z', time.localtime(remembered.written_at))})")
        """Where the first burst's measured cost came from, for the log; empty where it is the guess."""
        self.stage = start.engine.stage
        self.overrides = list(start.overrides)
        """The overrides that applied here, as the workers filtered them for the stage."""
        self.unmatched_overrides = list(start.unmatched_overrides)
        self.owners_by_rank = {
            worker.rank: list(dict.fromkeys(line.owner for line in worker.declarations)) for worker in plan.workers
        }
        self.deployment = planning.split if planning is not None else None
        """The stage's part of its vLLM-Omni deployment, for the status file."""
        self.watch_device = plan.policy is not Policy.RESERVE and any(w.headroom.margin_bytes for w in plan.workers)
        """Whether samples read the device's free memory: where the plan kept a margin of a measured headroom."""
        self.parks_requests = parks_requests(vllm_config)
        """A vLLM-Omni async-chunk stage whose Scheduler may not count requests parked between chunks yet."""
        self.engine_index = int(getattr(core, "engine_index", 0) or 0)
        self.model = str(vllm_config.model_config.model)
        self.status_dir = os.environ.get(STATUS_DIR_ENV)
        self.completed = 0
        self.limit_applied: int | None = None
        self.was_idle = True
        self.stopped: str | None = None
        self.watching = False
        """Whether the workers' in-step windows are open for the coming step."""
        self.started = False
        """Whether the first step came: the limit a device-following monitor starts at is applied then."""
        self.most_held = 0
        """The most held (running, parked and finished but not yet freed) after any step since the last sample,
        counted where the device is watched: :attr:`kv_budget.watch.live.LiveMonitor.held_at_peak`."""
        self.watch_seconds = 0.0
        """The CPU time opening them took (the engine core's and the slowest worker's), added to the sample's cost."""
        self.write_status()

    def _resplit(self, per_seq_bytes: int, fixed_bytes: int) -> list[WorkerBudget] | None:
        """The monitor's :data:`~kv_budget.watch.live.Resplit`: this stage's
        measured excess into the deployment's record, its workers' room back.
        A record that cannot be read or split logs one warning and keeps
        the room: a sample must never take the engine down."""
        try:
            placed = self.planning.with_live_excess(per_seq_bytes, fixed_bytes)
        except Exception as exc:  # noqa: BLE001 - DeploymentError, or a defect: the room stays as it is
            why = str(exc) if isinstance(exc, DeploymentError) else f"the re-split failed: {type(exc).__name__}: {exc}"
            logger.warning("live: %s; %s keeps its current room and stops re-splitting", why,
                           self.planning.stage.label())
            self.monitor.resplit = None
            return None
        self.deployment = self.planning.split
        return placed

    def before_step(self, core: Any) -> None:
        """Open the workers' in-step windows when a sample is due and
        requests are in the engine: the sample after the step closes them."""
        if not self.started:
            self._start(core)
        if self.stopped is not None or not self.monitor.step_peaks or self.watching:
            return
        scheduler = core.scheduler
        if scheduler.get_num_unfinished_requests() == 0 or not self.monitor.due(time.monotonic()):
            return
        cpu, waited = time.thread_time(), 0.0
        try:
            answers, waited = rpc_on_workers(core, watch_step_on_worker, (self.owners_by_rank,))
            results = [WindowOpening.model_validate(answer) for answer in answers]
        except Exception as exc:  # noqa: BLE001 - a sample must never take the engine down
            results = [WindowOpening(rank=None, error=f"the RPC failed: {type(exc).__name__}: {exc}")]
        errors = [f"{r.label()}: {r.error}" for r in results if r.error]
        if errors:
            self._stop_step_peaks("; ".join(errors))
            try:  # close any window that did open, on the ranks where it did
                core.collective_rpc(measure_on_worker, args=(self.owners_by_rank,))
            except Exception:  # noqa: BLE001 - the warning above says in-step measurement is off
                pass
            return
        self.watching = True
        self.watch_seconds = time.thread_time() - cpu - waited + max(r.cpu_seconds for r in results)

    def _start(self, core: Any) -> None:
        """Before the first step: the workers count their peak from here,
        and a monitor that follows the device starts its limit at the first
        burst the device holds (:func:`kv_budget.watch.live.first_admission`)."""
        self.started = True
        if self.watch_device:
            try:
                core.collective_rpc(start_peak_on_worker)
            except Exception as exc:  # noqa: BLE001 - the watch then reads each first peak from startup on
                logger.warning("live: the workers could not start counting their peaks: %s", exc)
        monitor = self.monitor
        if not monitor.follows_device:
            return
        cap = monitor.plan.effective_max_num_seqs
        if monitor.limit < cap:
            self.limit_applied = apply_limit(core.scheduler, monitor.limit)
        elif monitor.limit > cap:
            self.limit_applied = restore_limit(core.scheduler, monitor.limit, monitor.ceiling)
        logger.warning(
            "live: admission starts at %d (startup cap %d), the first burst the device holds [%s]%s, and follows "
            "the device from the first sample, up to %d (Scheduler.%s %d)",
            monitor.limit, cap, monitor.first.how, self.remembered_from, monitor.ceiling,
            checked_vllm().features.admission_limit, getattr(core.scheduler, checked_vllm().features.admission_limit))

    def _stop_step_peaks(self, why: str) -> None:
        self.monitor.step_peaks = False
        logger.warning("live: in-step measurement off (caches kept between steps are still sampled): %s",
                       why)

    def after_step(self, core: Any, outputs: Any) -> None:
        """Count completions, keep the limit applied, sample when due."""
        for engine_outputs in (outputs or {}).values():
            for output in getattr(engine_outputs, "outputs", ()):
                if output.finish_reason is not None:
                    self.completed += 1
        scheduler = core.scheduler
        if self.watch_device:  # only what the device holds is read against it
            held = len(scheduler.running) + len(scheduler.finished_req_ids) + parked_requests(scheduler)
            self.most_held = max(self.most_held, held)
        if self.limit_applied is not None and self.limit_applied > self.monitor.limit:
            self.limit_applied = apply_limit(scheduler, self.monitor.limit)
        idle = scheduler.get_num_unfinished_requests() == 0 and not scheduler.finished_req_ids
        became_idle = idle and not self.was_idle
        self.was_idle = idle
        now = time.monotonic()
        watched = self.watching
        # With step peaks on, a due sample waits for the next step, whose window before_step opens.
        due = not idle and not self.monitor.step_peaks and self.monitor.due(now)
        if self.stopped is None and (watched or became_idle or due):
            self.sample(core, now)

    def sample(self, core: Any, now: float) -> None:
        """One sample of every worker. A failure stops sampling with one
        warning; it never fails the step (the startup cap stays in force)."""
        cpu, waited = time.thread_time(), 0.0
        opening, self.watching, self.watch_seconds = self.watch_seconds, False, 0.0
        try:
            answers, waited = rpc_on_workers(
                core, measure_on_worker, (self.owners_by_rank, self.monitor.undeclared_holders(), self.watch_device))
            results = [LiveMeasurement.model_validate(answer) for answer in answers]
        except Exception as exc:  # noqa: BLE001 - see the docstring
            results = [LiveMeasurement(rank=None, error=f"the sampling RPC failed: {type(exc).__name__}: {exc}")]
        errors = [f"{r.label()}: {r.error}" for r in results if r.error]
        if errors:
            self.stopped = "; ".join(errors)
            logger.warning(
                "live sampling stopped (the startup limit %d stays in force): %s",
                self.monitor.limit, self.stopped)
            return
        step_errors = [f"{r.label()}: {r.step_error}" for r in results if r.step_error]
        if step_errors:
            self._stop_step_peaks("; ".join(step_errors))
        scheduler = core.scheduler
        watched = not step_errors and all(r.step is not None for r in results)
        samples = [r.sample(watched) for r in results]
        parked = parked_requests(scheduler)
        update = self.monitor.observe(
            samples,
            running=len(scheduler.running),
            finished_unfreed=len(scheduler.finished_req_ids),
            waiting=scheduler.get_num_unfinished_requests() - len(scheduler.running) - parked,
            completed=self.completed,
            now=now,
            parked=parked,
            most_held=self.most_held,
        )
        self.most_held = 0
        for finding in update.findings:
            logger.warning("live: %s", finding.message)
        self.record_cost()
        if self.parks_requests and (kept := self.monitor.kept_by_undeclared()):
            self.parks_requests = False  # one switch, one line
            count_parked_in_scheduler(scheduler, self.monitor.plan.policy, kept, self.stage)
        if update.limit is not None:
            current = getattr(scheduler, checked_vllm().features.admission_limit)
            if update.limit < current:
                self.limit_applied = apply_limit(scheduler, update.limit)
            else:
                self.limit_applied = restore_limit(scheduler, update.limit, self.monitor.ceiling)
            logger.warning(
                "live: Scheduler.%s %d (live limit %d)",
                checked_vllm().features.admission_limit, self.limit_applied, update.limit,
            )
        # What the sample cost, in CPU time (a busy machine's waits are not its cost): opening the
        # windows, the slowest worker's measuring (tracking inside the step included), the engine core's own
        # part (not its wait for the answers: rpc_on_workers).
        workers = max((r.cpu_seconds for r in results), default=0.0)
        self.monitor.note_cost(time.thread_time() - cpu - waited + opening + workers)
        if watched:
            self.monitor.tracking_seconds_total += max(r.step.seconds for r in results)
        self.write_status()

    def record_cost(self) -> None:
        """Keep what a held sequence cost, where it is worth keeping
        (:meth:`kv_budget.watch.live.LiveMonitor.cost_to_record`), for this
        engine's next start; a record that cannot be written turns the
        record off with one warning, and sampling goes on."""
        if self.cost_record_dir is None or (costs := self.monitor.cost_to_record()) is None:
            return
        try:
            write_cost_record(self.cost_record_dir, self.fingerprint, costs)
        except (OSError, UnsafeRuntimeDirError) as exc:
            logger.warning("live: the cost record in %s cannot be written (%s); the next start admits its first "
                           "burst at the declared bytes and the margin", self.cost_record_dir, exc)
            self.cost_record_dir = None

    def write_status(self) -> None:
        """Rewrite the status file; one that cannot be written turns the
        metrics off with one warning, and sampling goes on."""
        if not self.status_dir:
            return
        status = EngineStatus(
            engine_index=self.engine_index, model=self.model, pid=os.getpid(), updated_unix_s=time.time(),
            plan=self.monitor.plan, live=self.monitor.state() if self.monitor.samples else None,
            stage=self.stage, overrides=self.overrides, unmatched_overrides=self.unmatched_overrides,
            deployment=self.deployment,
        )
        try:
            write_status(self.status_dir, status)
        except (OSError, UnsafeRuntimeDirError) as exc:
            logger.warning("cannot write the status file in %s (%s); /metrics will not show this "
                           "engine's figures", self.status_dir, exc)
            self.status_dir = None


def start_live(core: Any, vllm_config: Any, start: LiveStart) -> LiveHook | None:
    """Attach a :class:`LiveHook` to ``core`` (policy cap, warn or reserve:
    :data:`~kv_budget.watch.live.WATCHED_POLICIES`, sampling on), or only
    publish the startup plan when sampling is off or nothing is declared;
    return it (None under ``off``)."""
    if start.plan.policy not in WATCHED_POLICIES:
        return None
    settings = start.engine.settings
    hook = LiveHook(core, vllm_config, start)  # writes the status
    if settings.sample_interval_s == 0:
        logger.info("live sampling off (--model-local-kv-sample-interval 0)")
        return hook
    if not any(hook.owners_by_rank.values()) and not settings.step_peaks:
        return hook
    attached_state(core, CoreState).live = hook
    logger.info(
        "live sampling every %.3g s of %d declaring owner(s)%s; status in %s",
        settings.sample_interval_s, sum(len(o) for o in hook.owners_by_rank.values()),
        ", sampled steps watched inside (--model-local-kv-step-peaks on)" if settings.step_peaks else "",
        hook.status_dir or "(no status directory: metrics off)",
    )
    return hook


class PendingSplit:
    """A vLLM-Omni stage whose deployment split was provisional when it
    planned: before its first step, the final one (lowering only)."""

    POLL_S = 0.05

    def __init__(self, deployment: DeploymentPlanning, engine: EngineContext, live: LiveHook | None) -> None:
        self.deployment = deployment
        self.engine = engine
        self.live = live

    def before_step(self, core: Any) -> None:
        """Wait for the final split (every stage on the devices recorded),
        then apply it; runs once, before the stage's first step."""
        logged = False
        while (plan := final_deployment_plan(self.deployment, self.engine)) is None:
            if not logged:
                logger.warning("a request arrived before %s planned: waiting for the final split",
                               ", ".join(s.label() for s in self.deployment.split.waiting_for))
                logged = True
            time.sleep(self.POLL_S)
        attached_state(core, CoreState).pending_split = None
        if plan.decision is Decision.INFEASIBLE:
            # The stage that completed the record refuses on this (kv_budget.deployment.DeploymentPlanning);
            # reaching it means a stage recorded since: say so, keep what runs.
            logger.error("the final deployment split leaves this stage no sequence (%s); it keeps "
                         "max_num_seqs %d", plan.headroom_source,
                         self.live.monitor.limit if self.live else self.engine.configured_max_num_seqs)
            return
        if self.engine.settings.policy is Policy.CAP:

            applied = apply_limit(core.scheduler, plan.effective_max_num_seqs)
            lower_max_num_seqs(core.scheduler.scheduler_config, plan.effective_max_num_seqs)
            logger.warning("final deployment split: max_num_seqs %d (Scheduler.%s %d), before the first "
                           "request", plan.effective_max_num_seqs, checked_vllm().features.admission_limit, applied)
        else:
            logger.warning("final deployment split: safe max_num_seqs %s (policy warn: left at %d)",
                           plan.safe_max_num_seqs, self.engine.configured_max_num_seqs)
        if self.live is not None:
            self.live.monitor.plan = plan
            if plan.policy is Policy.CAP:
                self.live.monitor.hold_to(plan.effective_max_num_seqs)
            self.live.deployment = self.deployment.split
            self.live.write_status()


@dataclass
class CoreState:
    """kv-budget's state on a vLLM engine core."""

    live: LiveHook | None = None
    """Live sampling around its steps; None where it is off or nothing is watched."""
    pending_split: PendingSplit | None = None
    """A vLLM-Omni stage's provisional deployment split, made final before its first step."""


def _wrap_step(original):
    def step(self):
        state = attached_state(self, CoreState)
        if state.pending_split is not None:
            state.pending_split.before_step(self)
        hook = state.live
        if hook is None:
            return original(self)
        before = time.perf_counter()
        hook.before_step(self)
        watched = hook.watching
        began = time.perf_counter()
        result = original(self)
        stepped = time.perf_counter()
        hook.after_step(self, result[0])
        monitor = hook.monitor
        monitor.steps += 1
        monitor.step_seconds_total += stepped - began
        monitor.hook_seconds_total += began - before + time.perf_counter() - stepped
        if watched:
            monitor.watched_steps += 1
            monitor.watched_step_seconds_total += stepped - began
        return result

    return step


def patch_engine_steps(engine_core_cls) -> None:
    """Wrap ``step`` and ``step_with_batch_queue`` (whichever the engine
    runs); idempotent. ``EngineCore.__init__`` binds ``self.step_fn`` to
    one of them by attribute lookup, so the wrappers are what it binds."""
    for name in ("step", "step_with_batch_queue"):
        patch_method(engine_core_cls, name, _wrap_step)
