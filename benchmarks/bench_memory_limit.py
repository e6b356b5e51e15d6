"""Under a real memory limit: how close to it does kv-budget serve, against an operator's figure by hand?

For each configuration (talker positions per row, room above the server's
working set after startup), the demo's api_server runs inside a memory cgroup of
its own (``kv_budget_demo.limit_demo.run_under_limit``: the kernel's limit
and OOM killer, as in a container), each run serving 256 concurrent
completions:

1. ``off`` with ``max_num_seqs`` 256: stock vLLM; its working set after startup
   plus the room is the limit, the same absolute figure for every run of
   the configuration (after a warm-up server has served one request, so
   the page cache a cold host charges to its first server does not raise
   it);
2. ``cap`` with default settings (headroom measured from the cgroup, the
   default margin, live watch on), ``--serves`` times with one cost record
   directory made fresh for the configuration: the first serve admits its
   first burst at the declared bytes and the margin, each later one at the
   cost the serve before measured (``kv_budget.watch.cost_record``); then
   once with an operator's small margin (``--small-margin``, 128 MiB, its
   cost record off);
3. the operator: stock vLLM with ``--max-num-seqs N``, bisected between the
   largest figure known to survive (kv-budget's startup cap where it served
   every request: the same sequences in flight on the same engine) and the
   smallest known to fail (256 where ``off`` failed; where it survived,
   256 is the operator's figure and nothing is bisected). A run survives when
   all 256 requests complete with no OOM kill; a figure survives when
   ``--operator-repeats`` runs of it do (a careful operator tries a figure
   more than once: the edge is noisy, and a figure that survived one run
   was killed in another of the same server), and the figures that survived
   a run and then failed one are printed. With ``--operator-confirm N``
   the operator's figure is loaded N more times after the bisection, and
   how many of those stock survived is printed: how safe the answer by
   hand is. Where one of those loads fails, the careful operator steps
   down to the next figure below that survived the bisection and loads it
   N times, until one survives all N: the confirmed figure, the one an
   operator who saw the kill would deploy. kv-budget is printed against
   both figures.

It prints, per configuration, the limit, each run's peak usage, OOM kills
and requests completed, where the memory went (each process's growth
during the load), and kv-budget's limit (the largest live limit it applied,
its first admission included, else its startup cap, never more than the
most sequences the model held at once) in its first and its last serve
against the operator's figure.

    .venv/bin/python benchmarks/bench_memory_limit.py                      # JSON into benchmarks/results/
    .venv/bin/python benchmarks/bench_memory_limit.py --configs 2048:1.6GB --bisect-steps 3 --serves 2
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import dataclass, field
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
    first = (f"first burst {run['first_admission']}{' (cost record)' if run.get('first_from_record') else ''}, "
             if run.get("first_admission") else "")
    live = f" ({first}live limit up to {run['live_limit_max']}, {run['peak_sequences']} at once)" if run.get(
        "live_limit_max") else f" ({run.get('peak_sequences')} at once)"
    growth = ", ".join(f"{name} +{format_bytes(p['growth_bytes'])}" for name, p in run["processes"].items()
                       if p["growth_bytes"] > 16 << 20)
    return (f"  {label:<22} max_num_seqs {seqs:>3}{live}: peak {format_bytes(run['peak_usage_bytes'] or 0):>10} of "
            f"{format_bytes(run['limit_bytes'])}, OOM kills {run['oom_kills']}, {run['completed']}/{run['requests']} "
            f"completed, {run['seconds']} s; grew: {growth or 'nothing over 16 MiB'}; {_file_pages(run)}")


def _file_pages(run: dict) -> str:
    """What the kernel took back from the group's page cache during the load."""
    before, after = run["file_pages"]["before_load"], run["file_pages"]["after_load"]
    cache = sum(before[k] - after[k] for k in ("active_file_bytes", "inactive_file_bytes"))
    return (f"page cache {'-' if cache >= 0 else '+'}{format_bytes(abs(cache))} "
            f"(active {format_bytes(before['active_file_bytes'])} -> {format_bytes(after['active_file_bytes'])}), "
            f"{after['major_faults'] - before['major_faults']} major faults")


def kv_budget_figure(run: dict) -> int | None:
    """kv-budget's limit in a run: the largest live limit it applied, else its startup cap, never more
    than the most sequences the model held at once (a limit no wave filled has not been shown to hold)."""
    limit = run.get("live_limit_max") or run.get("max_num_seqs")
    held = run.get("peak_sequences")
    return min(limit, held) if limit and held else limit


def run_config(work: Path, positions: int, room: int, requests: int, bisect_steps: int,
               small_margin: str | None, serves: int, operator_repeats: int, operator_confirm: int = 0) -> dict:
    """One configuration: stock, kv-budget (default settings, ``serves``
    times on one cost record, then an operator's small margin), then the
    operator's figures (:func:`operator_figures`)."""
    name = f"p{positions}-r{room}"
    checkpoint = write_demo_checkpoint(work / name / "checkpoint", {"positions": positions})
    per_seq = talker_bytes_per_row({**DEFAULT_TALKER, "positions": positions})
    print(f"[bench_memory_limit] {positions} positions ({format_bytes(per_seq)} per sequence), room "
          f"{format_bytes(room)} above the working set after startup", flush=True)
    # What a server reads on a cold host (libraries, the new checkpoint) is charged to its cgroup as page
    # cache, and the active part counts in the working set the limit is set from: a configuration run first
    # after the host idled set its limit 55 MB higher. One request served first warms the host.
    warm = run_under_limit("off", checkpoint, work / name / "warm-up", 1, None, room)
    warm_up = {key: warm.get(key) for key in ("started", "startup_working_set_bytes", "file_pages")}
    working_set = warm.get("startup_working_set_bytes")
    print(f"{_line('warm-up, 1 request', warm)}; working set after startup "
          f"{format_bytes(working_set) if working_set else 'not read'}", flush=True)
    off = run_under_limit("off", checkpoint, work / name / "off", requests, None, room)
    print(_line("stock, 256", off), flush=True)
    result = {"talker_positions": positions, "per_sequence_bytes": per_seq, "room_bytes": room, "warm_up": warm_up,
              "off": off}
    if not off.get("started"):
        return result
    limit = off["limit_bytes"]
    record = work / name / "cost-record"
    shutil.rmtree(record, ignore_errors=True)
    caps = []
    for serve in range(1, serves + 1):
        cap = run_under_limit("cap", checkpoint, work / name / f"cap-{serve}", requests, limit, room,
                              ("--model-local-kv-cost-record", str(record)))
        print(_line(f"kv-budget cap, serve {serve}", cap), flush=True)
        caps.append(cap)
    result["cap_serves"] = caps
    if small_margin:
        small = run_under_limit("cap", checkpoint, work / name / "cap-small-margin", requests, limit, room,
                                ("--model-local-kv-margin", small_margin, "--model-local-kv-cost-record", "off"))
        print(_line(f"kv-budget, {small_margin}", small), flush=True)
        result["cap_small_margin"] = {"margin": small_margin, **small}
    first, last = caps[0], caps[-1]
    # From kv-budget's startup cap (where its first serve survived) up to the 256 stock failed at.
    start = (first.get("max_num_seqs") or 0) if survived(first, requests) else 0
    result.update(operator_figures(checkpoint, work / name, limit, room, requests, off, start, bisect_steps,
                                   operator_repeats, operator_confirm))
    good = result["operator_max_num_seqs"]
    served = all(survived(cap, requests) for cap in caps)
    result.update(kv_budget_first_max_num_seqs=kv_budget_figure(first) if survived(first, requests) else 0,
                  kv_budget_max_num_seqs=kv_budget_figure(last) if survived(last, requests) else 0,
                  kv_budget_served=served,
                  kv_budget_oom_kills=sum(cap.get("oom_kills") or 0 for cap in caps))
    for figure, suffix in ((good, "operator"), (result.get("operator_confirmed_max_num_seqs"), "confirmed")):
        if figure:
            result[f"kv_budget_first_of_{suffix}"] = round((result["kv_budget_first_max_num_seqs"] or 0) / figure, 3)
            result[f"kv_budget_of_{suffix}"] = round((result["kv_budget_max_num_seqs"] or 0) / figure, 3)
    return result


def operator_figures(checkpoint: Path, work: Path, limit: int, room: int, requests: int, off: dict, start: int,
                     steps: int, repeats: int, confirm: int) -> dict:
    """The operator's figures: where stock at 256 (``off``) survived, 256;
    else bisected up from ``start``; then, with ``confirm`` loads, the
    figure that survived them all (:func:`confirm_operator`)."""
    if survived(off, requests):
        bisection = Bisection(good=off["server_max_num_seqs"], bad=None)
    else:
        bisection = bisect_operator(checkpoint, work, limit, room, requests, start, steps, repeats)
    good = bisection.good
    figures = {"operator_probes": bisection.probes, "operator_max_num_seqs": good,
               "operator_first_failing": bisection.bad, "operator_repeats": repeats,
               "operator_survived_then_failed": list(bisection.flaky)}
    if confirm and good:
        confirmed, again = confirm_operator(checkpoint, work, limit, room, requests,
                                            [good, *bisection.survivors_below(good)], confirm)
        figures["operator_survived_then_failed"] += sorted(
            {run["operator_figure"] for run in again if not survived(run, requests)}, reverse=True)
        figures.update(operator_again=again, operator_confirmed_max_num_seqs=confirmed,
                       operator_again_survived=sum(survived(run, requests) for run in again
                                                   if run["operator_figure"] == good))
    return figures


@dataclass
class Bisection:
    """The operator's bisection: the largest figure that survived every load
    of it, the smallest that failed one (None where nothing failed)."""

    good: int
    bad: int | None
    probes: list[dict] = field(default_factory=list)
    survivors: list[int] = field(default_factory=list)
    """Each figure that survived all its loads, in the order tried (each once: a bisection tries a figure once)."""
    flaky: list[int] = field(default_factory=list)
    """The figures that survived a load and then failed one."""

    def survivors_below(self, figure: int) -> list[int]:
        """The figures under ``figure`` that survived, largest first: where a
        careful operator steps down to."""
        return sorted((n for n in self.survivors if n < figure), reverse=True)


def bisect_operator(checkpoint: Path, work: Path, limit: int, room: int, requests: int, good: int, steps: int,
                    repeats: int) -> Bisection:
    """A careful operator's figure by hand: bisect ``max_num_seqs`` between
    ``good`` (survived, or 0) and ``requests`` (failed), each trial loaded
    up to ``repeats`` times and kept only if it survived every load."""
    bisection = Bisection(good=good, bad=requests)
    for _ in range(steps):
        if bisection.bad - bisection.good <= 1:
            break
        trial = (bisection.good + bisection.bad) // 2
        for repeat in range(1, repeats + 1):
            probe = run_under_limit("off", checkpoint, work / f"operator-{trial}-{repeat}", requests, limit, room,
                                    max_num_seqs=trial)
            print(_line(f"operator, {trial} ({repeat})", probe), flush=True)
            bisection.probes.append(probe)
            if not survived(probe, requests):
                break
        if survived(probe, requests):
            bisection.good = trial
            bisection.survivors.append(trial)
        else:
            bisection.bad = trial
            if repeat > 1:  # it survived before: a single run would have taken it
                bisection.flaky.append(trial)
    return bisection


def confirm_operator(checkpoint: Path, work: Path, limit: int, room: int, requests: int, figures: list[int],
                     loads: int) -> tuple[int | None, list[dict]]:
    """Load each of ``figures`` (largest first) ``loads`` more times, every
    load run so the count says how often stock survives it, and stop at the
    first figure that survived them all: what an operator who saw a kill
    deploys. Returns that figure (None where none did) and every load, each
    with the figure it loaded (``operator_figure``)."""
    again: list[dict] = []
    for figure in figures:
        runs = []
        for repeat in range(1, loads + 1):
            run = {"operator_figure": figure, **run_under_limit(
                "off", checkpoint, work / f"operator-{figure}-again-{repeat}", requests, limit, room,
                max_num_seqs=figure)}
            print(_line(f"operator, {figure} again ({repeat})", run), flush=True)
            runs.append(run)
        again += runs
        if all(survived(run, requests) for run in runs):
            return figure, again
    return None, again


def _flaky(config: dict) -> str:
    flaky = config["operator_survived_then_failed"]
    return f"; survived a run, then failed one: {', '.join(map(str, flaky))}" if flaky else ""


def _again(config: dict) -> str:
    """The loads after the bisection, per figure, and the figure they confirmed."""
    runs = config.get("operator_again")
    if not runs:
        return ""
    loads = []
    for figure in dict.fromkeys(run["operator_figure"] for run in runs):
        of_figure = [run for run in runs if run["operator_figure"] == figure]
        kept = sum(survived(run, run["requests"]) for run in of_figure)
        loads.append(f"{figure} loaded {len(of_figure)} more times: survived {kept}")
    return f"; {'; '.join(loads)}; confirmed {config['operator_confirmed_max_num_seqs']}"


def _of_confirmed(config: dict) -> str:
    if not config.get("operator_confirmed_max_num_seqs"):
        return ""
    return (f"; against the confirmed {config['operator_confirmed_max_num_seqs']}: "
            f"{config['kv_budget_first_of_confirmed']}, {config['kv_budget_of_confirmed']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help=f"positions:room pairs, comma separated (default {DEFAULT_CONFIGS})")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--bisect-steps", type=int, default=4)
    parser.add_argument("--small-margin", default="128MiB",
                        help="also run kv-budget with this --model-local-kv-margin ('' skips it; default 128MiB)")
    parser.add_argument("--operator-repeats", type=int, default=2,
                        help="runs of each figure the operator tries; it survives when every one does (default 2)")
    parser.add_argument("--operator-confirm", type=int, default=0,
                        help="loads of the operator's figure after the bisection, to show how often stock survives "
                             "it (default 0)")
    parser.add_argument("--serves", type=int, default=3,
                        help="kv-budget serves per configuration on one cost record (default 3)")
    parser.add_argument("--out", default=str(HERE / "out" / "memory_limit"))
    parser.add_argument("--results", default=str(HERE / "results" / "memory_limit.json"))
    args = parser.parse_args(argv)
    reason = cgroup_unavailable()
    if reason is not None:
        print(f"[bench_memory_limit] {reason}: nothing to measure", file=sys.stderr)
        return 2
    work = Path(args.out).resolve()
    # glibc's allocator settings reach every server (they inherit this environment) and move what a load costs.
    allocator = {key: value for key, value in os.environ.items() if key.startswith("MALLOC_")}
    if allocator:
        print(f"[bench_memory_limit] every server runs with {allocator}", flush=True)
    document = {"benchmark": "bench_memory_limit", "requests": args.requests, "loadavg_before": loadavg(),
                "allocator_environment": allocator, "configs": []}
    for text in args.configs.split(","):
        positions, _, room = text.partition(":")
        config = run_config(work, int(positions), parse_byte_size(room), args.requests, args.bisect_steps,
                            args.small_margin or None, args.serves, args.operator_repeats, args.operator_confirm)
        document["configs"].append(config)
        if "operator_max_num_seqs" in config:
            print(f"  kv-budget {config['kv_budget_first_max_num_seqs']} in its first serve, "
                  f"{config['kv_budget_max_num_seqs']} in its last ({args.serves}; every request served in each: "
                  f"{config['kv_budget_served']}, OOM kills {config['kv_budget_oom_kills']}) against the operator's "
                  f"{config['operator_max_num_seqs']} (first failing {config['operator_first_failing']}"
                  f"{_flaky(config)}{_again(config)}): "
                  f"{config.get('kv_budget_first_of_operator', 'n/a')}, "
                  f"{config.get('kv_budget_of_operator', 'n/a')}{_of_confirmed(config)}", flush=True)
    write_results(args.results, document)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
