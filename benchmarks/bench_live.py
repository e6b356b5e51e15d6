"""What live sampling costs a serving engine at 256 running sequences.

Two api_servers on the demo model with request-lifetime caches (each of the
256 running requests keeps its own ``DynamicCache`` rows, so every sample
walks 256 caches), one after the other, the same load on each: live
sampling on (``--model-local-kv-sample-interval``, default the plugin's
default) and off (``0``). Policy ``warn`` with a headroom that fits 256
sequences, so neither server caps and both run all 256 at once.

Two figures:

* **direct**: the engine with sampling on times its own steps and the live
  hook after each (samples included) and writes both to its status file;
  overhead = hook time / step time. Exact, and free of the noise of a
  shared machine.
* **side by side**: median per-step wall time (load seconds x running
  sequences / output tokens) on each server, over ``--rounds`` loads of
  256 requests x ``--max-tokens`` tokens. On a shared 2-core machine this
  difference is noisier than the target; it is printed beside the direct
  figure so the reader can judge.

    .venv/bin/python benchmarks/bench_live.py              # JSON into benchmarks/results/live.json
    .venv/bin/python benchmarks/bench_live.py --interval 0.1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from machine import write_results

from kv_budget.settings import DEFAULT_SAMPLE_INTERVAL_S
from kv_budget.units import MiB
from kv_budget.watch.status import STATUS_DIR_ENV, read_status, status_path
from kv_budget_demo.checkpoint import DEFAULT_TALKER, write_demo_checkpoint
from kv_budget_demo.demo import DemoServer
from kv_budget_demo.serving import send_completions

HERE = Path(__file__).resolve().parent
REQUESTS = 256


def run_server(checkpoint: Path, work: Path, interval: float, rounds: int, max_tokens: int) -> dict:
    label = "off" if interval == 0 else f"on ({interval:g} s)"
    status_dir = work / "status"
    flags = ["--model-local-kv-policy", "warn", "--model-local-kv-headroom", str(512 * MiB),
             "--model-local-kv-ledger-dir", "off", "--model-local-kv-sample-interval", str(interval)]
    run = DemoServer.create(checkpoint, work, flags)
    run.server.env[STATUS_DIR_ENV] = str(status_dir)
    loads = []
    with run.server:
        send_completions(run.server.url, str(checkpoint), requests=REQUESTS, max_tokens=4)  # warm-up
        for _ in range(rounds):
            loads.append(send_completions(run.server.url, str(checkpoint), requests=REQUESTS, max_tokens=max_tokens))
    status = read_status(status_path(status_dir, str(checkpoint), 0))
    live = status.live if status else None
    per_step = [load.seconds * REQUESTS / load.output_tokens for load in loads if load.output_tokens]
    _, peak_sequences = run.peak()
    result = {
        "label": label,
        "interval_s": interval,
        "completed": [load.completed for load in loads],
        "failed": [load.failed for load in loads],
        "seconds_per_step_by_load": per_step,
        "median_seconds_per_step": statistics.median(per_step),
        "peak_sequences": peak_sequences,
    }
    if live is not None:
        result.update({
            "samples": live.samples,
            "steps": live.steps,
            "step_seconds_total": live.step_seconds_total,
            "hook_seconds_total": live.hook_seconds_total,
            "sample_seconds_total": live.sample_seconds_total,
            "seconds_per_sample": live.sample_seconds_total / live.samples if live.samples else None,
            "direct_overhead_fraction": live.hook_seconds_total / live.step_seconds_total,
        })
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=DEFAULT_SAMPLE_INTERVAL_S,
                        help=f"sample interval of the 'on' server in seconds (default {DEFAULT_SAMPLE_INTERVAL_S:g})")
    parser.add_argument("--rounds", type=int, default=3, help="loads of 256 requests per server (default 3)")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default 64)")
    parser.add_argument("--work", default="benchmarks/out/live", help="working directory")
    parser.add_argument("--json", default=str(HERE / "results" / "live.json"), help="where to write the figures")
    args = parser.parse_args(argv)
    work = Path(args.work)
    checkpoint = write_demo_checkpoint(work / "checkpoint", {**DEFAULT_TALKER, "lifetime": "request"})
    start = time.time()
    on = run_server(checkpoint, work / "on", args.interval, args.rounds, args.max_tokens)
    off = run_server(checkpoint, work / "off", 0, args.rounds, args.max_tokens)
    side_by_side = on["median_seconds_per_step"] / off["median_seconds_per_step"] - 1
    print(f"{REQUESTS} concurrent requests x {args.max_tokens} tokens, {args.rounds} round(s) per server; "
          f"demo talker keeps one DynamicCache per request")
    print(f"{'live sampling':16} {'completed':>10} {'s/step (median)':>16} {'max running':>12}")
    for r in (on, off):
        print(f"{r['label']:16} {sum(r['completed']):>6}/{REQUESTS * args.rounds:<3} "
              f"{r['median_seconds_per_step']:>16.4f} {r['peak_sequences']:>12}")
    print(f"direct: {on['samples']} samples, {on['seconds_per_sample'] * 1e3:.2f} ms each; hook "
          f"{on['hook_seconds_total']:.3f} s over {on['steps']} steps of {on['step_seconds_total']:.1f} s: "
          f"{on['direct_overhead_fraction']:.3%} overhead")
    print(f"side by side: per-step time {side_by_side:+.2%} with sampling on (noise of this machine included)")
    document = {
        "benchmark": "live sampling overhead at 256 running sequences",
        "requests": REQUESTS,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "on": on,
        "off": off,
        "direct_overhead_fraction": on["direct_overhead_fraction"],
        "side_by_side_step_time_change": side_by_side,
        "target_overhead_fraction": 0.01,
        "seconds": time.time() - start,
    }
    write_results(args.json, document)
    return 0


if __name__ == "__main__":
    sys.exit(main())
