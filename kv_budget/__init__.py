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
"""

from .memory import CpuSampler, MemorySample, MemorySamplingError, NvmlSampler, sample_memory
from .planner import (
    Decision,
    Headroom,
    Plan,
    Policy,
    WorkerBudget,
    budget_worker,
    default_margin_bytes,
    headroom_from_free,
    headroom_override,
    make_plan,
)
from .protocol import (
    Collection,
    DeclarerFailure,
    HasModelLocalKV,
    InvalidDeclarationError,
    ModelLocalKVScope,
    ModelLocalKVSpec,
    OwnedSpec,
    RowDriver,
    Scope,
    collect_model_local_kv_specs,
    normalize_spec,
    spec_from_hf_config,
)
from .report import render_plan_table

__version__ = "0.1.0"

__all__ = [
    "Collection",
    "CpuSampler",
    "Decision",
    "DeclarerFailure",
    "HasModelLocalKV",
    "Headroom",
    "InvalidDeclarationError",
    "MemorySample",
    "MemorySamplingError",
    "ModelLocalKVScope",
    "ModelLocalKVSpec",
    "NvmlSampler",
    "OwnedSpec",
    "Plan",
    "Policy",
    "RowDriver",
    "Scope",
    "WorkerBudget",
    "budget_worker",
    "collect_model_local_kv_specs",
    "default_margin_bytes",
    "headroom_from_free",
    "headroom_override",
    "make_plan",
    "normalize_spec",
    "render_plan_table",
    "sample_memory",
    "spec_from_hf_config",
]
