"""What watching costs the worker's memory: the same load at the same
``max_num_seqs``, stock and under kv-budget's live sampling.

Each run is the demo's api_server in a memory cgroup of its own
(``kv_budget_demo.limit_demo.run_under_limit``) with a limit far above what
it needs, so nothing is reclaimed or killed, serving 256 concurrent
completions at ``--max-num-seqs`` (all held at once):

1. ``stock``: policy ``off``;
2. ``watched``: ``cap`` with a headroom that holds every sequence (the
   startup cap is the configured value), live sampling with the sampled
   steps watched inside (the default);
3. ``between steps``: the same, ``--model-local-kv-step-peaks off``;
4. ``no sampling``: the same, ``--model-local-kv-sample-interval 0``.

It prints, per run, what the worker process grew during the load (its
anonymous resident bytes at their largest less at the start,
``kv_budget_demo.memory_limit.ProcessPeaks``) per sequence held. Live
protection must not make the engine hold more than it would unwatched:
the four figures should agree within the run-to-run noise.

With ``--following PAIRS`` the load runs instead under a limit the live
watch follows (``--room`` above the working set after startup,
``--model-local-kv-margin 128MiB``, the cost record off, so every serve
starts from the same guess), ``PAIRS`` times with the sampled steps
watched inside and without (``--model-local-kv-step-peaks off``),
alternating: per serve, the first burst, the most held at once, the
worker's growth per sequence held, OOM kills and requests completed.

    .venv/bin/python benchmarks/bench_watch_memory.py     # JSON into benchmarks/results/watch_memory.json
    .venv/bin/python benchmarks/bench_watch_memory.py --following 6 --results benchmarks/results/watch_following.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from machine import loadavg, write_results

from kv_budget.units import format_bytes
from kv_budget_demo.checkpoint import DEFAULT_TALKER, talker_bytes_per_row, write_demo_checkpoint
from kv_budget_demo.limit_demo import run_under_limit
from kv_budget_demo.memory_limit import cgroup_unavailable

HERE = Path(__file__).resolve().parent
ROOM = 6_000_000_000
"""The limit above the working set after startup: far more than 256 sequences take, so nothing is reclaimed."""
HEADROOM = ("--model-local-kv-headroom", "8GiB")
FOLLOWING = ("--model-local-kv-margin", "128MiB", "--model-local-kv-cost-record", "off")
FOLLOWING_VARIANTS = {"watched": FOLLOWING, "between steps": (*FOLLOWING, "--model-local-kv-step-peaks", "off")}
VARIANTS = {
    "stock": ("off", ()),
    "watched": ("cap", HEADROOM),
    "between steps": ("cap", (*HEADROOM, "--model-local-kv-step-peaks", "off")),
    "no sampling": ("cap", (*HEADROOM, "--model-local-kv-sample-interval", "0")),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-num-seqs", type=int, default=186)
    parser.add_argument("--talker-positions", type=int, default=2048, help="per talker row (default 2048: 8 MiB)")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--following", type=int, default=0, metavar="PAIRS",
                        help="serve under a limit the live watch follows, PAIRS times each way (see above)")
    parser.add_argument("--room", type=float, default=2.4e9, help="with --following: bytes above the working set")
    parser.add_argument("--out", default=str(HERE / "out" / "watch_memory"))
    parser.add_argument("--results", default=str(HERE / "results" / "watch_memory.json"))
    args = parser.parse_args(argv)
    reason = cgroup_unavailable()
    if reason is not None:  # ProcessPeaks finds the server's processes through their cgroup
        print(f"[bench_watch_memory] {reason}: nothing to measure", file=sys.stderr)
        return 2
    work = Path(args.out).resolve()
    checkpoint = write_demo_checkpoint(work / "checkpoint", {"positions": args.talker_positions})
    per_seq = talker_bytes_per_row({**DEFAULT_TALKER, "positions": args.talker_positions})
    at = "under a limit the live watch follows" if args.following else f"at max_num_seqs {args.max_num_seqs}"
    print(f"[bench_watch_memory] {args.requests} requests {at}, {format_bytes(per_seq)} declared per sequence",
          flush=True)
    document = {"benchmark": "bench_watch_memory", "requests": args.requests, "max_num_seqs": args.max_num_seqs,
                "per_sequence_bytes": per_seq, "loadavg_before": loadavg(), "runs": {}}
    if args.following:
        document.update(max_num_seqs=None, room_bytes=int(args.room), serves=following(args, checkpoint, work))
        write_results(args.results, document)
        return 0
    for name, (policy, flags) in VARIANTS.items():
        run = run_under_limit(policy, checkpoint, work / name.replace(" ", "-"), args.requests, None, ROOM, flags,
                              max_num_seqs=args.max_num_seqs)
        worker = sum(p["growth_bytes"] for label, p in run.get("processes", {}).items() if "Worker" in label)
        held = run.get("peak_sequences") or 0
        figures = {"completed": run.get("completed"), "held": held, "worker_growth_bytes": worker,
                   "worker_growth_per_sequence_bytes": worker // held if held else None}
        document["runs"][name] = figures
        print(f"  {name:<14} {held} held, {run.get('completed')}/{args.requests} completed: the worker grew "
              f"{format_bytes(worker)}, {format_bytes(figures['worker_growth_per_sequence_bytes'] or 0)} per sequence",
              flush=True)
    write_results(args.results, document)
    return 0


def following(args: argparse.Namespace, checkpoint: Path, work: Path) -> list[dict]:
    """``--following``: the serves, alternating the two variants, under one
    limit: the working set after a stock start (one request) plus the room."""
    stock = run_under_limit("off", checkpoint, work / "limit", 1, None, int(args.room))
    limit = stock["limit_bytes"]
    print(f"  limit {format_bytes(limit)}: {format_bytes(stock['startup_working_set_bytes'])} working set after "
          f"startup + {format_bytes(int(args.room))}", flush=True)
    serves = []
    for index in range(args.following):
        for name, flags in FOLLOWING_VARIANTS.items():
            run = run_under_limit("cap", checkpoint, work / f"{name.replace(' ', '-')}-{index}", args.requests, limit,
                                  int(args.room), flags)
            worker = sum(p["growth_bytes"] for label, p in run.get("processes", {}).items() if "Worker" in label)
            held = run.get("peak_sequences") or 0
            serve = {"variant": name, "first_admission": run.get("first_admission"), "held": held,
                     "worker_growth_bytes": worker,
                     "worker_growth_per_sequence_bytes": worker // held if held else None,
                     "oom_kills": run.get("oom_kills"), "completed": run.get("completed")}
            serves.append(serve)
            print(f"  {name:<14} first burst {serve['first_admission']}, {held} held at most, "
                  f"{format_bytes(serve['worker_growth_per_sequence_bytes'] or 0)} per sequence, "
                  f"OOM kills {serve['oom_kills']}, {serve['completed']}/{args.requests} completed", flush=True)
    return serves


if __name__ == "__main__":
    raise SystemExit(main())
