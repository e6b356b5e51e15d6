"""What a fresh engine's first load costs, by how its burst arrives.

Stock vLLM (``off``) serves the demo checkpoint (8 MiB per sequence) with
``--max-num-seqs N`` inside a memory cgroup whose limit does not bind (its
peak usage is read, ``kv_budget_demo.memory_limit``), a fresh server for each
run, two loads of 256 completions each:

* ``whole``: the 256 requests fired together (the scheduler's first step
  takes those that arrived by then: often the whole burst, not always);
* ``split``: 16 requests, then 240 a moment later, so the first step holds
  16 and the next the rest of the burst.

For each load it prints the peak usage above the usage before the load, the
most sequences the model held at once since the server started (both loads
fill ``--max-num-seqs``: 256 requests), and the peak per sequence held: what
kv-budget's first burst must keep room for (``BURST_SPREAD`` in
``kv_budget.watch.live``). The second load on the same server shows whether
the cost is the first load's alone.

With ``--room``, the limit binds instead: it is set that far above the
server's working set after startup (as ``bench_memory_limit.py`` sets it),
and each fresh server gets one load, killed or not: whether an operator's
figure survives a first load of either kind.

    .venv/bin/python benchmarks/bench_first_load.py                 # JSON into benchmarks/results/
    .venv/bin/python benchmarks/bench_first_load.py --room 1.6GB --max-num-seqs 137 --results /tmp/edge.json
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

from machine import loadavg, write_results

from kv_budget.units import format_bytes, parse_byte_size
from kv_budget_demo.checkpoint import write_demo_checkpoint
from kv_budget_demo.limit_demo import demo_server_in_cgroup
from kv_budget_demo.memory_limit import cgroup_unavailable
from kv_budget_demo.serving import LoadResult, send_completions

HERE = Path(__file__).resolve().parent
UNBINDING_LIMIT = 16 * 10**9
"""The group's limit: far above what the load takes, so the peak is read, not capped."""
SPLIT_FIRST = 16
"""Requests in a split load's first step."""


def load(server_url: str, model: str, arrival: str, requests: int) -> LoadResult:
    """One load of ``requests`` completions, ``whole`` or ``split``."""
    if arrival == "whole":
        return send_completions(server_url, model, requests=requests)
    first: list[LoadResult] = []
    thread = threading.Thread(target=lambda: first.append(send_completions(server_url, model, requests=SPLIT_FIRST)))
    thread.start()
    time.sleep(0.4)  # the first requests are running before the rest arrive
    rest = send_completions(server_url, model, requests=requests - SPLIT_FIRST)
    thread.join()
    return LoadResult(requests=requests, completed=first[0].completed + rest.completed,
                      failed=first[0].failed + rest.failed, output_tokens=first[0].output_tokens + rest.output_tokens,
                      seconds=rest.seconds, errors=[*first[0].errors, *rest.errors][:2])


def one_server(checkpoint: Path, run_dir: Path, arrival: str, max_num_seqs: int, requests: int,
               room: int | None) -> list[dict]:
    """A fresh stock server in its own cgroup, loads of one kind (two, or
    one under ``room``): each load's peak above the usage before it, and
    the most held at once."""
    loads = []
    with demo_server_in_cgroup("kv-budget-first-load", UNBINDING_LIMIT, checkpoint, run_dir,
                               ["--model-local-kv-policy", "off"], max_num_seqs) as (group, run):
        if group.version != "v1":
            raise SystemExit("[bench_first_load] a load's peak needs cgroup v1's resettable memory.max_usage_in_bytes")
        run.server.start()
        if room is not None:
            group.set_limit(group.working_set() + room)
        for index in range(2 if room is None else 1):
            time.sleep(3)
            before = group.usage()
            group.reset_peak()
            result = load(run.server.url, str(checkpoint), arrival, requests)
            held = run.peak()[1]  # the most the model held at once since the server started
            above = group.peak() - before
            loads.append({"arrival": arrival, "load": "first" if index == 0 else "second", "held": held,
                          "peak_above_bytes": above, "per_held_sequence_bytes": above // max(held, 1),
                          "completed": result.completed, "oom_kills": group.oom_kills(),
                          "limit_bytes": group.limit()})
    return loads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-num-seqs", type=int, default=138)
    parser.add_argument("--runs", type=int, default=2, help="fresh servers per arrival (default 2)")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--room", default=None,
                        help="set the limit this far above the working set after startup (e.g. 1.6GB); default none")
    parser.add_argument("--out", default="/tmp/kv-budget-bench-first-load")
    parser.add_argument("--results", default=str(HERE / "results" / "first_load.json"))
    args = parser.parse_args(argv)
    reason = cgroup_unavailable()
    if reason is not None:
        print(f"[bench_first_load] {reason}: nothing to measure")
        return 1
    out = Path(args.out)
    checkpoint = write_demo_checkpoint(out / "checkpoint", {"positions": 2048})
    room = parse_byte_size(args.room) if args.room else None
    document = {"benchmark": "bench_first_load", "max_num_seqs": args.max_num_seqs, "requests": args.requests,
                "room_bytes": room,
                "split_first": SPLIT_FIRST, "loadavg_before": loadavg(), "loads": []}
    for run_index in range(args.runs):
        for arrival in ("split", "whole"):
            for row in one_server(checkpoint, out / f"{arrival}-{run_index}", arrival, args.max_num_seqs,
                                  args.requests, room):
                document["loads"].append(row)
                print(f"  {arrival:5} run {run_index}, {row['load']:6} load: {row['held']} held at once, peak "
                      f"{format_bytes(row['peak_above_bytes'])} above the usage before it, "
                      f"{format_bytes(row['per_held_sequence_bytes'])} per held sequence, "
                      f"{row['completed']}/{args.requests} completed, OOM kills {row['oom_kills']}", flush=True)
    document["loadavg_after"] = loadavg()
    write_results(args.results, document)
    print(f"[bench_first_load] results: {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
