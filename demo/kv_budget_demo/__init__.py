"""kv-budget's demo: a small model that keeps model-local KV, served by a
real vLLM with the kv-budget plugin (``make demo``, and the engine tests).

It is a distribution of its own (``demo/pyproject.toml``), installed only
into the development venvs, so a production install of kv-budget registers
no demo architecture and patches nothing for it. Its ``register`` is a
vLLM general plugin of its own, called in every vLLM process of a venv that
has it:

1. checks the one vLLM hook point the demo needs,
   ``Worker.execute_model(self, scheduler_output, ...)``, and refuses to
   start otherwise;
2. :func:`.scheduled_requests.patch_worker_for_demo`: plain vLLM's worker
   tells the demo architecture which requests are scheduled and finished,
   as vLLM-Omni's runners tell its models;
3. registers the architecture ``KvBudgetDemoForCausalLM`` (lazily: its
   module is imported only when a checkpoint names it).
"""

from __future__ import annotations

import inspect

MODEL_CLASS = "kv_budget_demo.model:KvBudgetDemoForCausalLM"
"""Where vLLM's registry finds the demo architecture, imported on first use."""

_registered = False


def check_worker(worker_cls: type) -> None:
    """Raise RuntimeError unless ``worker_cls.execute_model`` takes the
    step's ``scheduler_output`` first, where the demo learns its requests."""
    parameters = list(inspect.signature(worker_cls.execute_model).parameters)
    if parameters[:2] != ["self", "scheduler_output"]:
        raise RuntimeError(
            f"kv-budget demo: {worker_cls.__module__}.{worker_cls.__qualname__}.execute_model takes {parameters}, "
            "expected (self, scheduler_output, ...): the demo cannot tell its model which requests a step carries "
            "on this vLLM; uninstall kv-budget-demo (kv-budget itself does not need it)"
        )


def register() -> None:
    """vLLM general-plugin entry point of the demo; safe to call any number of times."""
    global _registered
    if _registered:
        return
    from vllm import ModelRegistry
    from vllm.v1.worker.gpu_worker import Worker

    from kv_budget_demo.checkpoint import ARCHITECTURE
    from kv_budget_demo.scheduled_requests import patch_worker_for_demo

    check_worker(Worker)
    patch_worker_for_demo(Worker)
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    _registered = True
