"""GPU check, step 7: kv-budget on vLLM's Ray executor, and pipeline parallel 2 on GPUs.

vLLM's CPU build has no Ray executor (its platform names no Ray device:
"current platform cpu does not support ray"), so this runs only where CUDA
is. The demo checkpoint goes through ``tests/engine_llm_run.py``
(``vllm.LLM`` in a process of its own, 256 requests) with:

1. ``--distributed-executor-backend ray``, tensor parallel 2 where two GPUs
   are visible, else 1: a Ray cluster vLLM starts on this host. The plan
   must hold one worker budget per Ray worker, each sampled by NVML inside
   that worker (the plugin loaded in the Ray actor), the cap their minimum,
   and every request must complete.
2. With two GPUs, pipeline parallel 2 on the multiprocess executor: the
   demo's talker lives on the last rank, so the one headroom constraint is
   rank 1's.

    .venv-gpu/bin/python benchmarks/gpu_ray_check.py OUT_DIR
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from kv_budget_demo.checkpoint import write_demo_checkpoint

RUNNER = Path(__file__).resolve().parent.parent / "tests" / "engine_llm_run.py"


def run(out: Path, name: str, checkpoint: Path, llm_kwargs: dict) -> tuple[dict | None, dict | None, str]:
    """(the runner's result, kv-budget's report, the output) of one engine."""
    work = out / name
    (work / "stats").mkdir(parents=True, exist_ok=True)
    spec = {"model": str(checkpoint), "stats_dir": str(work / "stats"), "requests": 256, "max_tokens": 4,
            "additional_config": {"model_local_kv": {"policy": "cap", "report_path": str(work / "report.json")}},
            "llm_kwargs": llm_kwargs}
    proc = subprocess.run([sys.executable, str(RUNNER), json.dumps(spec)], capture_output=True, text=True,
                          timeout=600)
    output = proc.stdout + proc.stderr
    (work / "output.log").write_text(output)
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    result = json.loads(results[-1][len("RESULT "):]) if results else None
    report_path = work / "report.json"
    return result, json.loads(report_path.read_text()) if report_path.exists() else None, output


def check(label: str, ok: bool, detail: str) -> bool:
    print(f"[gpu-check] step 7: {label}: {'PASS' if ok else 'FAIL'} ({detail})", flush=True)
    return ok


def main(out: Path) -> int:
    gpus = torch.cuda.device_count()
    checkpoint = write_demo_checkpoint(out / "checkpoint", {"positions": 32768})
    tp = 2 if gpus >= 2 else 1
    result, report, output = run(out, "ray", checkpoint, {"tensor_parallel_size": tp,
                                                          "distributed_executor_backend": "ray"})
    workers = (report or {}).get("workers") or []
    sampled = [w for w in workers if "NVML" in (w.get("headroom", {}).get("source") or "")]
    ok = check(
        f"Ray executor, tensor parallel {tp}",
        result is not None and result.get("completed") == 256 and len(workers) == tp == len(sampled)
        and report["effective_max_num_seqs"] == min(w["safe_max_num_seqs"] for w in workers),
        f"completed {result and result.get('completed')}, {len(workers)} worker budget(s), {len(sampled)} "
        f"sampled by NVML, cap {report and report.get('effective_max_num_seqs')}",
    )
    if not ok:
        print("\n".join(line for line in output.splitlines() if "kv-budget" in line or "Error" in line)[-4000:])
    if gpus >= 2:
        result, report, output = run(out, "pp2", checkpoint, {"pipeline_parallel_size": 2,
                                                              "distributed_executor_backend": "mp"})
        names = [c["name"] for c in (report or {}).get("constraints", [])]
        ok &= check(
            "pipeline parallel 2",
            result is not None and result.get("completed") == 256
            and [n for n in names if n.startswith("model-local KV fits headroom")]
            == ["model-local KV fits headroom on rank 1"],
            f"completed {result and result.get('completed')}, constraints {names}",
        )
    else:
        print("[gpu-check] step 7: pipeline parallel 2 SKIPPED: one GPU visible", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("gpu-check-out")))
