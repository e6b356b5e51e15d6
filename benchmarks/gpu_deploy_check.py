"""GPU check: two stages on one CUDA device split it by kv-budget's deployment split.

Run by ``benchmarks/gpu_check.sh`` (step 5); needs a CUDA GPU, torch and
pynvml, not vLLM or vLLM-Omni. It plays a serial vLLM-Omni start on device
0 with real CUDA memory and kv-budget's real record and NVML sampler:

1. a deploy of two stages at ``gpu_memory_utilization`` 0.3 each, both
   declaring 128 MiB of model-local KV per sequence, configured for 512
   and 256 sequences; the capacity is NVML's total for device 0;
2. stage 0 (a child process) allocates its share (int(capacity x 0.3)),
   samples free memory with kv-budget's NVML sampler, records itself and
   plans provisionally; then stage 1 does the same (stage 0's memory is
   held: it keeps running);
3. each stage's final split must equal ``plan_deploy`` (what ``kv-budget
   plan --deploy`` prints) for the same deploy, capacity and declarations;
4. each stage then allocates its model-local KV at its final max_num_seqs
   (per-sequence bytes x max_num_seqs, real CUDA tensors): no allocation
   may fail, and NVML's free memory afterwards is printed beside the 2 GiB
   vLLM-Omni's admission keeps out (external reserve + margin).

Prints the figures and writes ``OUT/deploy_split.json``; exit 0 when every
check holds.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
import textwrap
from pathlib import Path

PER_SEQ = 128 * 2**20
CONFIGURED = (512, 256)
UTILIZATION = 0.3
SPEC = [{"owner": "talker", "name": "step_kv", "layers": 8, "kv_heads": 8, "head_dim": 128, "dtype": "float16",
         "physical_capacity_positions": 8192, "capacity_source": "gpu check", "scope": "request",
         "rows": "max_num_seqs"}]
"""2 x 8 x 8 x 128 x 8192 x 2 B = 128 MiB per sequence."""


def stage_process(stage_id: int, record_path: str, spec_path: str, ready, go, done) -> None:
    import torch

    from kv_budget.collect.specfile import load_spec_file
    from kv_budget.deployment import read_deployment, record_stage, split_for, split_max_num_seqs
    from kv_budget.plan.planner import budget_worker, headroom_override
    from kv_budget.sample.device import sample_memory
    from kv_budget.stage import Stage

    total = sample_memory("cuda", 0).total_bytes
    pool = torch.empty(int(total * UTILIZATION), dtype=torch.uint8, device="cuda:0")  # its share
    sample = sample_memory("cuda", 0)
    budget = budget_worker(load_spec_file(spec_path), headroom_override(0), max_num_seqs=CONFIGURED[stage_id])
    stage = Stage(stage_id=stage_id, replica=0)
    measured = max(sample.free_bytes - 2**30, 0)
    record_stage(Path(record_path), stage, budget, {0: measured}, f"{sample.source} free minus 1 GiB", "cap",
                 CONFIGURED[stage_id])
    ready.set()
    go.wait()
    record = read_deployment(Path(record_path))
    part = split_for(record, stage).devices[0]
    final = split_max_num_seqs(record, stage)
    rows, error = [], None
    try:
        rows = [torch.empty(PER_SEQ, dtype=torch.uint8, device="cuda:0") for _ in range(final)]
    except torch.cuda.OutOfMemoryError as exc:
        error = str(exc)
    done.put({"stage": stage_id, "measured_free_bytes": sample.free_bytes, "final_max_num_seqs": final,
              "binding": part.binding, "room_bytes": part.room_bytes, "allocated_rows": len(rows), "oom": error,
              "free_after_bytes": sample_memory("cuda", 0).free_bytes})
    go.wait()  # hold everything until the parent has read both
    del pool, rows


def main(out: Path) -> int:
    from kv_budget.collect.specfile import load_spec_file
    from kv_budget.deployment import DeploymentRecord, create_deployment
    from kv_budget.ledger import this_process
    from kv_budget.plan.deploy import StageDeclarations, plan_deploy
    from kv_budget.plan.deploy_file import load_deploy
    from kv_budget.sample.device import sample_memory
    from kv_budget.stage import Stage

    out.mkdir(parents=True, exist_ok=True)
    spec = out / "spec.json"
    spec.write_text(json.dumps(SPEC))
    (out / "deploy.yaml").write_text("stages:\n" + "".join(textwrap.dedent(f"""\
          - stage_id: {sid}
            devices: "0"
            gpu_memory_utilization: {UTILIZATION}
            max_num_seqs: {CONFIGURED[sid]}
            enforce_eager: true
        """) for sid in (0, 1)))
    deploy = load_deploy(out / "deploy.yaml")
    capacity = sample_memory("cuda", 0).total_bytes
    pid, start = this_process()
    record = create_deployment(out / "deployment.json", DeploymentRecord(
        driver_pid=pid, driver_start=start, stages=deploy.stages,
        planning=[Stage(stage_id=0, replica=0), Stage(stage_id=1, replica=0)],
        capacities={0: capacity}, capacity_sources={0: "NVML total"}, headrooms={}))
    collection = load_spec_file(spec)
    expected = plan_deploy(deploy, {0: capacity}, {sid: StageDeclarations(sid, "spec", collection) for sid in (0, 1)})
    want = {s.stage_id: s.effective_max_num_seqs for s in expected.stages}

    ctx = mp.get_context("spawn")
    go, done = ctx.Event(), ctx.Queue()
    procs = []
    for sid in (0, 1):  # serial: stage 1 starts once stage 0 is ready, as vLLM-Omni's device lock orders them
        ready = ctx.Event()
        proc = ctx.Process(target=stage_process, args=(sid, str(record), str(spec), ready, go, done))
        proc.start()
        procs.append(proc)
        ready.wait(timeout=300)
    go.set()
    results = sorted((done.get(timeout=300) for _ in procs), key=lambda r: r["stage"])
    for proc in procs:
        proc.join(timeout=60)
    ok = all(r["final_max_num_seqs"] == want[r["stage"]] and r["oom"] is None for r in results)
    report = {"capacity_bytes": capacity, "plan_deploy": want, "stages": results, "ok": ok,
              "left_for_per_seq_bytes": expected.devices[0].left_for_per_seq_bytes}
    (out / "deploy_split.json").write_text(json.dumps(report, indent=2))
    for r in results:
        print(f"[gpu-deploy] stage {r['stage']}: final max_num_seqs {r['final_max_num_seqs']} (plan --deploy "
              f"{want[r['stage']]}), bound {r['binding']}, room {r['room_bytes']:,} B, allocated "
              f"{r['allocated_rows']} x {PER_SEQ:,} B, OOM: {r['oom'] or 'none'}, NVML free after "
              f"{r['free_after_bytes']:,} B")
    print(f"[gpu-deploy] capacity {capacity:,} B (NVML), left for per-sequence KV "
          f"{report['left_for_per_seq_bytes']:,} B; {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "gpu-check-out") / "deploy"))
