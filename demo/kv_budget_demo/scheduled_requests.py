"""The demo architecture's request lifetimes on plain vLLM.

vLLM-Omni's model runners tell a model which requests finished
(``on_requests_finished``) and which a step carries; plain vLLM's runner
tells a model neither. The demo talker stands in for vLLM-Omni's models, and
with ``lifetime: request`` it keeps rows per request, so it needs both. This
patch passes them to a model of the demo architecture, and to no other,
before each step: ``Worker.execute_model(self, scheduler_output, ...)``
(checked by ``compat.check_vllm``) is where a worker first sees a step's
``SchedulerOutput``. It lives apart from :mod:`.model` so that
registering it does not import the demo model (and vLLM's Qwen2) into every
process.
"""

from __future__ import annotations

from typing import Any

from kv_budget_demo.checkpoint import ARCHITECTURE
from vllm_patches.patching import patch_method


def _demo_talker(worker: Any) -> Any | None:
    """The demo model's talker when this worker serves the demo
    architecture with request lifetimes (and holds the talker: the last
    pipeline rank); else None."""
    model = getattr(getattr(worker, "model_runner", None), "model", None)
    unwrap = getattr(model, "unwrap", None)
    model = unwrap() if callable(unwrap) else model
    if type(model).__name__ != ARCHITECTURE:
        return None
    talker = model.talker
    return talker if talker is not None and talker.lifetime == "request" else None


def patch_worker_for_demo(worker_cls) -> None:
    """Wrap ``execute_model``; the model is looked up once per worker."""

    def wrap(original):
        def execute_model(self, scheduler_output, *args, **kwargs):
            if not hasattr(self, "_kv_budget_demo_talker"):
                self._kv_budget_demo_talker = _demo_talker(self)
            talker = self._kv_budget_demo_talker
            if talker is not None:
                talker.begin_step(list(scheduler_output.num_scheduled_tokens), scheduler_output.finished_req_ids)
            return original(self, scheduler_output, *args, **kwargs)
        return execute_model

    patch_method(worker_cls, "execute_model", wrap)
