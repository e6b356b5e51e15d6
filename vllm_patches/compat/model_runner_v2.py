"""vLLM's Model Runner V2: whether a worker keeps its model where kv-budget reads it."""

from __future__ import annotations

import ast
from typing import Any

from vllm_patches.compat.check import vllm_version
from vllm_patches.compat.hook_points import HookPoint, assignment_targets, hook_point_problems, self_attribute
from vllm_patches.compat.source import InstalledVllm, VllmSource

__all__ = [
    "MODEL_RUNNER_V2", "MODEL_RUNNER_V2_CLASS", "MODEL_RUNNER_V2_HOOK_POINTS", "model_runner_v2_problems",
    "runs_model_runner_v2", "model_runner_v2_problem",
]


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
        and any(self_attribute(target, "model") for target in assignment_targets(node))
    ]

    def loaded(value: ast.expr) -> bool:
        return any(_call_to(node, "load_model") for node in ast.walk(value))

    def with_lora(value: ast.expr) -> bool:
        return isinstance(value, ast.Call) and self_attribute(value.func, "load_lora_model")

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
        if node.value is None or not self_attribute(node.value, "model"):
            return f"returns {'None' if node.value is None else _shown(node.value)}, not self.model"
    return None


def _v2_runs_the_model(source: VllmSource) -> str | None:
    """``GPUModelRunner.execute_model`` (V2) runs ``self.model(...)`` (eager;
    the piecewise graphs get ``self.model`` too, the full graphs were
    captured from it): the model kv-budget plans on is the one that runs."""
    member = source.member(MODEL_RUNNER_V2, MODEL_RUNNER_V2_CLASS, "execute_model")
    if member is None:
        return "not found"
    if any(isinstance(node, ast.Call) and self_attribute(node.func, "model") for node in ast.walk(member.body)):
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
