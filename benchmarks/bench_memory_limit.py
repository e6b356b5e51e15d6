"""Under a real memory limit: how close to it does kv-budget serve, against an operator's figure by hand?

For each configuration (talker positions per row, room above the server's
usage after startup), the demo's api_server runs inside a memory cgroup of
its own (``kv_budget_demo.limit_demo.run_under_limit``: the kernel's limit
and OOM killer, as in a container), each run serving 256 concurrent
completions:

1. ``off`` with ``max_num_seqs`` 256: stock vLLM; its usage after startup
   plus the room is the limit, the same absolute figure for every run of
   the configuration;
2. ``cap`` with default settings (headroom measured from the cgroup, the
   default margin, live watch on), then with an operator's small margin
   (``--small-margin``, 128 MiB);
3. the operator: stock vLLM with ``--max-num-seqs N``, bisected between the
   largest figure known to survive (kv-budget's startup cap where it served
   every request: the same sequences in flight on the same engine) and the
   smallest known to fail (256 where ``off`` failed). A run survives when
   all 256 requests complete with no OOM kill.

It prints, per configuration, the limit, each run's peak usage, OOM kills
and requests completed, where the memory went (each process's growth
during the load), and kv-budget's limit (the largest live limit it applied,
else its startup cap) against the operator's figure.

    .venv/bin/python benchmarks/bench_memory_limit.py                      # JSON into benchmarks/results/
    .venv/bin/python benchmarks/bench_memory_limit.py --configs 2048:1.6GB --bisect-steps 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from machine import loadavg, write_results

from kv_budget.units import format_bytes, parse_byte_size
from kv_budget_demo.checkpoint import DEFAULT_TALKER, talker_bytes_per_row, write_demo_checkpoint
from kv_budget_demo.limit_demo import run_under_limit
from kv_budget_demo.memory_limit import cgroup_unavailable

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIGS = "2048:1.6GB,2048:2.4GB,256:0.4GB"
"""8 MiB per sequence with two rooms (about 190 and 285 sequences' worth of model-local KV), and 1 MiB per
sequence with a room about 1.4 times what 256 of them take: the case where the worker's own growth decides."""


def survived(run: dict, requests: int) -> bool:
    return bool(run.get("started")) and run.get("oom_kills") == 0 and run.get("completed") == requests


def _line(label: str, run: dict) -> str:
    if not run.get("started"):
        return f"  {label:<22} did not start ({run.get('error', '')[:120]}); OOM kills {run.get('oom_kills')}"
    seqs = run.get("max_num_seqs", run.get("server_max_num_seqs"))
    live = f" (live limit up to {run['live_limit_max']}, {run['peak_sequences']} at once)" if run.get(
        "live_limit_max") else f" ({run.get('peak_sequences')} at once)"
    growth = ", ".join(f"{name} +{format_bytes(p['growth_bytes'])}" for name, p in run["processes"].items()
                       if p["growth_bytes"] > 16 << 20)
    return (f"  {label:<22} max_num_seqs {seqs:>3}{live}: peak {format_bytes(run['peak_usage_bytes'] or 0):>10} of "
            f"{format_bytes(run['limit_bytes'])}, OOM kills {run['oom_kills']}, {run['completed']}/{run['requests']} "
            f"completed, {run['seconds']} s; grew: {growth or 'nothing over 16 MiB'}")


def kv_budget_figure(run: dict) -> int | None:
    """kv-budget's limit in a run: the largest live limit it applied, else its startup cap."""
    return run.get("live_limit_max") or run.get("max_num_seqs")


def run_config(work: Path, positions: int, room: int, requests: int, bisect_steps: int,
               small_margin: str | None) -> dict:
    """One configuration: stock, kv-budget (default settings, then an
    operator's small margin), then the operator's bisection."""
    name = f"p{positions}-r{room}"
    checkpoint = write_demo_checkpoint(work / name / "checkpoint", {"positions": positions})
    per_seq = talker_bytes_per_row({**DEFAULT_TALKER, "positions": positions})
    print(f"[bench_memory_limit] {positions} positions ({format_bytes(per_seq)} per sequence), room "
          f"{format_bytes(room)} above the usage after startup", flush=True)
    off = run_under_limit("off", checkpoint, work / name / "off", requests, None, room)
    print(_line("stock, 256", off), flush=True)
    result = {"talker_positions": positions, "per_sequence_bytes": per_seq, "room_bytes": room, "off": off}
    if not off.get("started"):
        return result
    limit = off["limit_bytes"]
    cap = run_under_limit("cap", checkpoint, work / name / "cap", requests, limit, room)
    print(_line("kv-budget cap", cap), flush=True)
    result["cap"] = cap
    if small_margin:
        small = run_under_limit("cap", checkpoint, work / name / "cap-small-margin", requests, limit, room,
                                ("--model-local-kv-margin", small_margin))
        print(_line(f"kv-budget, {small_margin}", small), flush=True)
        result["cap_small_margin"] = {"margin": small_margin, **small}
    good = (cap.get("max_num_seqs") or 0) if survived(cap, requests) else 0
    bad = requests if not survived(off, requests) else None
    probes = []
    if bad is not None:
        for _ in range(bisect_steps):
            if bad - (good or 0) <= 1:
                break
            trial = ((good or 0) + bad) // 2
            probe = run_under_limit("off", checkpoint, work / name / f"operator-{trial}", requests, limit, room,
                                    max_num_seqs=trial)
            print(_line(f"operator, {trial}", probe), flush=True)
            probes.append(probe)
            if survived(probe, requests):
                good = trial
            else:
                bad = trial
    figure = kv_budget_figure(cap) if survived(cap, requests) else 0
    result.update(operator_probes=probes, operator_max_num_seqs=good, operator_first_failing=bad,
                  kv_budget_max_num_seqs=figure, kv_budget_served=survived(cap, requests))
    if good:
        result["kv_budget_of_operator"] = round((figure or 0) / good, 3)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help=f"positions:room pairs, comma separated (default {DEFAULT_CONFIGS})")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--bisect-steps", type=int, default=4)
    parser.add_argument("--small-margin", default="128MiB",
                        help="also run kv-budget with this --model-local-kv-margin ('' skips it; default 128MiB)")
    parser.add_argument("--out", default=str(HERE / "out" / "memory_limit"))
    parser.add_argument("--results", default=str(HERE / "results" / "memory_limit.json"))
    args = parser.parse_args(argv)
    reason = cgroup_unavailable()
    if reason is not None:
        print(f"[bench_memory_limit] {reason}: nothing to measure", file=sys.stderr)
        return 2
    work = Path(args.out).resolve()
    document = {"benchmark": "bench_memory_limit", "requests": args.requests, "loadavg_before": loadavg(),
                "configs": []}
    for text in args.configs.split(","):
        positions, _, room = text.partition(":")
        config = run_config(work, int(positions), parse_byte_size(room), args.requests, args.bisect_steps,
                            args.small_margin or None)
        document["configs"].append(config)
        if "operator_max_num_seqs" in config:
            print(f"  kv-budget {config['kv_budget_max_num_seqs']} (served every request: "
                  f"{config['kv_budget_served']}) against the operator's {config['operator_max_num_seqs']} "
                  f"(first failing {config['operator_first_failing']}): "
                  f"{config.get('kv_budget_of_operator', 'n/a')}", flush=True)
    write_results(args.results, document)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
