"""The hook points: what each patch assumes of vLLM, checked through a
:class:`~vllm_patches.compat.source.VllmSource`, and the per-version
features the patches branch on."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Callable

from vllm_patches.compat.source import VllmSource

__all__ = [
    "ARG_UTILS", "ENGINE_CORE", "SCHEDULER_CONFIG", "SCHEDULER", "EXECUTOR", "KV_CACHE_INTERFACE", "CORE_CLIENT",
    "ASYNC_LLM", "ENGINE_MESSAGES", "METRICS_LOGGERS", "HookPoint", "self_attribute", "assignment_targets",
    "ADMISSION_LIMITS", "admission_limit", "HOOK_POINTS", "VllmFeatures", "detect_features", "hook_point_problems",
]


ARG_UTILS = "vllm.engine.arg_utils"
ENGINE_CORE = "vllm.v1.engine.core"
SCHEDULER_CONFIG = "vllm.config.scheduler"
SCHEDULER = "vllm.v1.core.sched.scheduler"
EXECUTOR = "vllm.v1.executor.abstract"
KV_CACHE_INTERFACE = "vllm.v1.kv_cache_interface"
CORE_CLIENT = "vllm.v1.engine.core_client"
ASYNC_LLM = "vllm.v1.engine.async_llm"
ENGINE_MESSAGES = "vllm.v1.engine"
METRICS_LOGGERS = "vllm.v1.metrics.loggers"


@dataclass(frozen=True)
class HookPoint:
    """One thing a patch relies on."""

    name: str
    """How a refusal names it."""
    used_by: str
    """The patch that relies on it, so a refusal says what would break."""
    check: Callable[[VllmSource], str | None]
    """None when it holds, else what is wrong, in words."""


def _method(module: str, cls: str, name: str, kind: str, leading: tuple[str, ...], needs: tuple[str, ...] = ()):
    """A method of ``kind`` whose parameters start with ``leading`` (the
    wrapper passes them positionally) and include ``needs`` (passed by name)."""

    def check(source: VllmSource) -> str | None:
        member = source.member(module, cls, name)
        if member is None:
            return "not found"
        if member.kind != kind:
            return f"is a {member.kind}, not a {kind}"
        if member.parameters[: len(leading)] != leading:
            return f"takes ({', '.join(member.parameters)}), not ({', '.join(leading)}, ...)"
        missing = [p for p in needs if p not in member.parameters]
        if missing:
            return f"takes ({', '.join(member.parameters)}): no {', '.join(missing)} parameter"
        return None

    return check


def _exact_signature(module: str, cls: str, name: str, parameters: tuple[str, ...]):
    """A plain method taking exactly ``parameters``: the wrapper has that signature."""

    def check(source: VllmSource) -> str | None:
        member = source.member(module, cls, name)
        if member is None:
            return "not found"
        if member.kind != "function" or member.parameters != parameters:
            return f"is {member.kind} ({', '.join(member.parameters)}), not ({', '.join(parameters)})"
        return None

    return check


def _field(module: str, cls: str, name: str):
    def check(source: VllmSource) -> str | None:
        return None if source.has_field(module, cls, name) else "no such field"

    return check


def self_attribute(node: ast.AST, attribute: str) -> bool:
    return (
        isinstance(node, ast.Attribute) and node.attr == attribute
        and isinstance(node.value, ast.Name) and node.value.id == "self"
    )


def assignment_targets(node: ast.Assign | ast.AnnAssign) -> list[ast.expr]:
    return node.targets if isinstance(node, ast.Assign) else [node.target]


def _first_line(body: ast.AST, matches: Callable[[ast.AST], bool]) -> int | None:
    lines = [node.lineno for node in ast.walk(body) if matches(node)]
    return min(lines) if lines else None


def _scheduler_built_after_kv_caches(source: VllmSource) -> str | None:
    """``EngineCore.__init__`` calls ``self._initialize_kv_caches``, then
    takes the Scheduler class from ``scheduler_config.get_scheduler_cls()``
    and assigns ``self.scheduler``: a ``max_num_seqs`` lowered in the hook is
    the one the Scheduler is built with."""
    member = source.member(ENGINE_CORE, "EngineCore", "__init__")
    if member is None:
        return "not found"
    kv_caches = _first_line(member.body, lambda n: isinstance(n, ast.Call) and self_attribute(
        n.func, "_initialize_kv_caches"))
    class_lookup = _first_line(member.body, lambda n: isinstance(n, ast.Call) and isinstance(
        n.func, ast.Attribute) and n.func.attr == "get_scheduler_cls")
    built = _first_line(member.body, lambda n: isinstance(n, (ast.Assign, ast.AnnAssign)) and isinstance(
        n.value, ast.Call) and any(self_attribute(t, "scheduler") for t in assignment_targets(n)))
    if kv_caches is None:
        return "does not call self._initialize_kv_caches"
    if class_lookup is None or built is None:
        return "does not build self.scheduler from scheduler_config.get_scheduler_cls()"
    if not kv_caches < class_lookup <= built:
        return (
            f"builds the Scheduler (line {built}) before self._initialize_kv_caches returns "
            f"(line {kv_caches})"
        )
    return None


def _pool_sized_from_available_memory(source: VllmSource) -> str | None:
    """``_initialize_kv_caches`` takes the pool's memory figure from
    ``model_executor.determine_available_memory()`` and only then hands the
    pool to ``model_executor.initialize_from_config``: what ``reserve``
    takes off the figure is what the pool is sized from."""
    member = source.member(ENGINE_CORE, "EngineCore", "_initialize_kv_caches")
    if member is None:
        return "not found"

    def executor_call(name: str) -> Callable[[ast.AST], bool]:
        return lambda n: isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == name and (
            self_attribute(n.func.value, "model_executor"))

    measured = _first_line(member.body, executor_call("determine_available_memory"))
    allocated = _first_line(member.body, executor_call("initialize_from_config"))
    if measured is None or allocated is None:
        return "does not call model_executor.determine_available_memory() and initialize_from_config()"
    if measured > allocated:
        return "allocates the pool before determine_available_memory returns"
    return None


def _scheduler_copies_max_num_seqs(source: VllmSource) -> str | None:
    """``Scheduler.__init__`` sets ``max_num_running_reqs`` from
    ``self.scheduler_config.max_num_seqs``: the only place the cap takes
    effect, and what the patched ``__init__`` confirms once it returns."""
    member = source.member(SCHEDULER, "Scheduler", "__init__")
    if member is None:
        return "not found"
    for node in ast.walk(member.body):
        if (
            isinstance(node, ast.Assign)
            and any(self_attribute(t, "max_num_running_reqs") for t in node.targets)
            and isinstance(node.value, ast.Attribute) and node.value.attr == "max_num_seqs"
            and self_attribute(node.value.value, "scheduler_config")
        ):
            return None
    return "does not set self.max_num_running_reqs from self.scheduler_config.max_num_seqs"


ADMISSION_LIMITS = ("max_num_active_reqs", "max_num_running_reqs")
"""The Scheduler attributes the admission check of ``schedule()`` may
compare against, newest first: 0.31 added ``max_num_active_reqs`` (admission
into RUNNING) beside ``max_num_running_reqs`` (the model runner's slots)."""


def admission_limit(source: VllmSource) -> str | None:
    """The attribute ``Scheduler.schedule`` stops admitting at, with
    ``len(running) >= self.<attribute>`` (a ``>=``: a limit lowered below
    what already runs stops admission and drops nobody), or None."""
    member = source.member(SCHEDULER, "Scheduler", "schedule")
    if member is None:
        return None
    compared = {
        comparator.attr
        for node in ast.walk(member.body) if isinstance(node, ast.Compare)
        for op, comparator in zip(node.ops, node.comparators)
        if isinstance(op, ast.GtE) and self_attribute(comparator, comparator.attr if isinstance(
            comparator, ast.Attribute) else "")
    }
    return next((name for name in ADMISSION_LIMITS if name in compared), None)


def _admission_compares_a_limit(source: VllmSource) -> str | None:
    if admission_limit(source) is None:
        return f"does not stop admitting with a '>= self.<limit>' check on any of {', '.join(ADMISSION_LIMITS)}"
    return None


def _scheduler_tracks_requests(source: VllmSource) -> str | None:
    """``Scheduler.__init__`` sets ``self.running`` (what runs) and
    ``self.finished_req_ids`` (finished, not yet told to the workers): the
    live monitor counts the sequences the workers may hold from them."""
    member = source.member(SCHEDULER, "Scheduler", "__init__")
    if member is None:
        return "not found"
    assigned = {
        target.attr for node in ast.walk(member.body) if isinstance(node, (ast.Assign, ast.AnnAssign))
        for target in assignment_targets(node)
        if isinstance(target, ast.Attribute) and self_attribute(target, target.attr)
    }
    missing = [name for name in ("running", "finished_req_ids") if name not in assigned]
    return f"does not set self.{', self.'.join(missing)}" if missing else None


HOOK_POINTS = (
    HookPoint("EngineArgs.add_cli_args(parser)", "the --model-local-kv-* flags",
              _method(ARG_UTILS, "EngineArgs", "add_cli_args", "staticmethod", ("parser",))),
    HookPoint("EngineArgs.from_cli_args(cls, args)", "the --model-local-kv-* flags",
              _method(ARG_UTILS, "EngineArgs", "from_cli_args", "classmethod", ("cls", "args"))),
    HookPoint("EngineArgs.additional_config", "the settings reaching every process",
              _field(ARG_UTILS, "EngineArgs", "additional_config")),
    HookPoint("EngineArgs.create_engine_config(self, ...)", "validating settings where the config is built",
              _method(ARG_UTILS, "EngineArgs", "create_engine_config", "function", ("self",))),
    HookPoint("EngineCore._initialize_kv_caches(self, vllm_config)", "the startup plan",
              _exact_signature(ENGINE_CORE, "EngineCore", "_initialize_kv_caches", ("self", "vllm_config"))),
    HookPoint("EngineCore.collective_rpc(self, method, ..., args=...)", "budgeting every worker",
              _method(ENGINE_CORE, "EngineCore", "collective_rpc", "function", ("self", "method"), ("args",))),
    HookPoint("EngineCore.__init__ builds the Scheduler after _initialize_kv_caches", "the cap",
              _scheduler_built_after_kv_caches),
    HookPoint("SchedulerConfig.max_num_seqs", "the cap", _field(SCHEDULER_CONFIG, "SchedulerConfig", "max_num_seqs")),
    HookPoint("SchedulerConfig.get_scheduler_cls(self)", "refusing a Scheduler the cap cannot reach",
              _method(SCHEDULER_CONFIG, "SchedulerConfig", "get_scheduler_cls", "function", ("self",))),
    HookPoint("Scheduler.__init__ copies max_num_seqs into max_num_running_reqs", "the cap",
              _scheduler_copies_max_num_seqs),
    HookPoint("Executor.determine_available_memory(self)", "policy reserve",
              _exact_signature(EXECUTOR, "Executor", "determine_available_memory", ("self",))),
    HookPoint("Executor.initialize_from_config(self, kv_cache_configs)", "policy reserve",
              _exact_signature(EXECUTOR, "Executor", "initialize_from_config", ("self", "kv_cache_configs"))),
    HookPoint("Executor.get_kv_cache_specs(self)", "policy reserve",
              _exact_signature(EXECUTOR, "Executor", "get_kv_cache_specs", ("self",))),
    HookPoint("Executor.collective_rpc(self, method, ..., args=...)", "policy reserve",
              _method(EXECUTOR, "Executor", "collective_rpc", "function", ("self", "method"), ("args",))),
    HookPoint("KVCacheSpec.max_memory_usage_bytes(self, vllm_config)", "policy reserve",
              _exact_signature(KV_CACHE_INTERFACE, "KVCacheSpec", "max_memory_usage_bytes",
                               ("self", "vllm_config"))),
    HookPoint("EngineCore._initialize_kv_caches sizes the pool from determine_available_memory()",
              "policy reserve", _pool_sized_from_available_memory),
    HookPoint("EngineCore.step(self)", "live sampling",
              _exact_signature(ENGINE_CORE, "EngineCore", "step", ("self",))),
    HookPoint("EngineCore.step_with_batch_queue(self)", "live sampling",
              _exact_signature(ENGINE_CORE, "EngineCore", "step_with_batch_queue", ("self",))),
    HookPoint("Scheduler.__init__ sets running and finished_req_ids", "live sampling",
              _scheduler_tracks_requests),
    HookPoint("Scheduler.schedule stops admitting at a '>=' limit", "the live correction",
              _admission_compares_a_limit),
    HookPoint("MPClient._apply_ready_response(self, payload)", "the frontend learning the cap",
              _exact_signature(CORE_CLIENT, "MPClient", "_apply_ready_response", ("self", "payload"))),
    HookPoint("EngineCoreReadyResponse.max_num_seqs", "the frontend learning the cap",
              _field(ENGINE_MESSAGES, "EngineCoreReadyResponse", "max_num_seqs")),
    HookPoint("AsyncLLM.__init__(self, vllm_config, executor_class, log_stats, ..., stat_loggers=...)",
              "the figures on /metrics", _method(ASYNC_LLM, "AsyncLLM", "__init__", "function",
                                                 ("self", "vllm_config", "executor_class", "log_stats"),
                                                 ("stat_loggers",))),
    HookPoint("StatLoggerBase.__init__(self, vllm_config, engine_index)", "the figures on /metrics",
              _method(METRICS_LOGGERS, "StatLoggerBase", "__init__", "function",
                      ("self", "vllm_config", "engine_index"))),
    HookPoint("StatLoggerBase.record(self, scheduler_stats, iteration_stats, ...)", "the figures on /metrics",
              _method(METRICS_LOGGERS, "StatLoggerBase", "record", "function",
                      ("self", "scheduler_stats", "iteration_stats"))),
)
"""Everything :mod:`vllm_patches` relies on, in the order it patches."""


@dataclass(frozen=True)
class VllmFeatures:
    """What differs between supported versions. Patches branch on these."""

    max_num_active_seqs: bool
    """``SchedulerConfig.max_num_active_seqs`` (0.31 and later): must stay
    <= ``max_num_seqs``, which vLLM checks only when the config is built,
    so the cap lowers it too. 0.30 has no such field."""
    admission_limit: str
    """The Scheduler attribute admission stops at (:func:`admission_limit`):
    ``max_num_active_reqs`` from 0.31, ``max_num_running_reqs`` on 0.30,
    where ``schedule()`` also asserts ``len(running) <= max_num_running_reqs``:
    the live correction lowers that one step by step, never below what runs."""


def detect_features(source: VllmSource) -> VllmFeatures:
    return VllmFeatures(
        max_num_active_seqs=source.has_field(SCHEDULER_CONFIG, "SchedulerConfig", "max_num_active_seqs"),
        admission_limit=admission_limit(source) or "",
    )


def hook_point_problems(source: VllmSource, points: tuple[HookPoint, ...] = HOOK_POINTS) -> list[str]:
    """``name (used by ...): what is wrong`` for each hook point that does not hold."""
    problems = []
    for point in points:
        problem = point.check(source)
        if problem:
            problems.append(f"{point.name} (used by {point.used_by}): {problem}")
    return problems
