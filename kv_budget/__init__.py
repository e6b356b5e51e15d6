"""kv-budget: admission control for model-local KV caches in vLLM.

Models declare the attention KV they keep outside vLLM's paged KV pool; the
planner, run after vLLM has measured memory and allocated its pool, caps
``max_num_seqs`` so that per-request KV cannot exceed device headroom.
This package is importable and testable without vLLM; everything that
touches vLLM lives in ``vllm_patches``.

vLLM-Omni's public declaration names (``ModelLocalKVSpec``,
``ModelLocalKVScope``, ``RowDriver``, ``spec_from_hf_config``,
``collect_model_local_kv_specs``, ``HasModelLocalKV``) are importable from
here with its semantics, so a declarer written for vLLM-Omni changes only
its import line.

Only the declaring surface is imported here, so that a model file that
declares pulls in torch and the standard library and nothing else (not
the planner's pydantic, the samplers' psutil, the deploy reader's yaml):
the planner, samplers and report are imported from their modules
(``kv_budget.plan.planner``, ``kv_budget.sample.device``, ``kv_budget.report``).
"""

from kv_budget.collect.model import collect_model_local_kv_specs
from kv_budget.declare.hf_config import spec_from_hf_config
from kv_budget.declare.spec import (
    HasModelLocalKV,
    InvalidDeclarationError,
    ModelLocalKVScope,
    ModelLocalKVSpec,
    RowDriver,
)

__version__ = "0.1.0"

__all__ = [
    "HasModelLocalKV",
    "InvalidDeclarationError",
    "ModelLocalKVScope",
    "ModelLocalKVSpec",
    "RowDriver",
    "collect_model_local_kv_specs",
    "spec_from_hf_config",
]
