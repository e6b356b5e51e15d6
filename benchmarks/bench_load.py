"""256 concurrent sequences against the demo model in a real vLLM api_server,
with and without the plugin's cap, across a sweep of headrooms.

Why: the claim of kv-budget is that under ``cap`` the model-local KV a model
really holds stays within the headroom (and fills it to within one row),
that the plan predicts it to the byte, that stock vLLM (policy ``off``)
over-commits wherever the cap bites, that the plugin costs nothing at
startup, and that the cap is as good as a careful operator who tunes
``--max-num-seqs`` by hand. Each of those is measured here on the same load.

Runs (each a fresh api_server, fresh stats dir and report path):

* ``off`` once at the configured ``max_num_seqs`` (stock vLLM: the plugin
  does nothing, so one run serves every headroom; its prediction is computed
  with the planner from the demo's own declarations);
* ``warn`` and ``cap`` at every headroom of the sweep;
* the careful operator: policy ``off``, bisecting ``--max-num-seqs`` over
  [1, configured] for the largest value whose measured peak stays within
  ``--operator-headroom``;
* the throughput comparison: the cap and the hand-tuned value, both servers
  up at once, loads interleaved (``--compare-rounds`` each), medians compared.

    .venv/bin/python benchmarks/bench_load.py --quick   # reduced sweep, to try it out
    .venv/bin/python benchmarks/bench_load.py           # full: JSON + PNG into benchmarks/results/
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from functools import lru_cache
from pathlib import Path

from machine import loadavg, machine_info

from kv_budget.collect.model import collect_model_local_kv_specs
from kv_budget.plan.planner import budget_worker, headroom_override, make_plan
from kv_budget.settings import Policy
from kv_budget.units import MiB, parse_byte_size
from kv_budget_demo.checkpoint import DEFAULT_TALKER, TALKER_KEY, talker_bytes_per_row, write_demo_checkpoint
from kv_budget_demo.demo import DemoServer
from kv_budget_demo.serving import ServerStartError, send_completions

HERE = Path(__file__).resolve().parent
FULL_HEADROOMS = "32MiB,64MiB,96MiB,160MiB,320MiB"
QUICK_HEADROOMS = "96MiB,320MiB"
PLUGIN_SHARE_TARGET = 0.005
THROUGHPUT_TARGET = 0.98
OFF_PREDICTION_SOURCE = (
    "computed with kv_budget.plan.planner (collect_model_local_kv_specs on the demo Talker, "
    "budget_worker, make_plan) at the configured max_num_seqs: policy off writes no report"
)


def log(message: str) -> None:
    print(f"[bench_load {time.strftime('%H:%M:%S')}] {message}", flush=True)


@lru_cache(maxsize=1)
def _demo_collection(checkpoint: str):
    """The demo model's declarations, from its real declarer (the Talker the
    served model builds), with the checkpoint's talker settings."""
    from kv_budget_demo.model import Talker

    settings = json.loads((Path(checkpoint) / "config.json").read_text())[TALKER_KEY]
    return collect_model_local_kv_specs(Talker(settings, tp_rank=0, tp_size=1))


def predicted_without_plugin(checkpoint: str, max_num_seqs: int, headroom_bytes: int) -> int:
    """What the plan predicts at ``max_num_seqs`` when nothing is capped."""
    budget = budget_worker(_demo_collection(checkpoint), headroom_override(headroom_bytes), 0, max_num_seqs)
    return make_plan([budget], max_num_seqs, Policy.WARN).required_bytes_at_configured


class Run:
    """One api_server with its own stats dir, report path and log: started,
    loaded any number of times, stopped, then summarised into ``record``."""

    def __init__(self, bench: Bench, label: str, policy: str, max_num_seqs: int, headroom: str | None) -> None:
        self.bench, self.loads = bench, []
        run_dir = bench.out / "runs" / label
        shutil.rmtree(run_dir, ignore_errors=True)
        flags = ["--model-local-kv-policy", policy]
        if headroom is not None:
            flags += ["--model-local-kv-headroom", headroom]
        self.run = DemoServer.create(bench.checkpoint, run_dir, flags, max_num_seqs=max_num_seqs)
        self.server = self.run.server
        self.index = len(bench.runs) + 1
        self.record: dict = {
            "label": label, "policy": policy, "configured_max_num_seqs": max_num_seqs,
            "headroom": headroom, "headroom_bytes": parse_byte_size(headroom) if headroom else None,
            "loadavg_start": loadavg(), "server_log": str(self.server.log_path), "error": None,
        }
        bench.runs.append(self.record)

    def start(self) -> bool:
        log(f"run {self.index} start: {self.record['label']} (policy {self.record['policy']}, "
            f"max_num_seqs {self.record['configured_max_num_seqs']}, headroom {self.record['headroom'] or '-'})")
        try:
            self.server.start(timeout=self.bench.args.start_timeout)
            return True
        except ServerStartError as exc:
            self.record["error"] = f"{exc}; log tail: " + " | ".join(exc.log.splitlines()[-8:])
            return False

    def load(self) -> None:
        args = self.bench.args
        self.loads.append(send_completions(
            self.server.url, self.bench.checkpoint, requests=args.requests, prompt_tokens=args.prompt_tokens,
            max_tokens=args.max_tokens, timeout=args.request_timeout,
        ))

    def stop(self, planned_rounds: int) -> dict:
        """Stop the server (idempotent) and fill the record from what the
        rounds, the model's stats and the plugin's report say."""
        self.server.stop()
        record, loads = self.record, self.loads
        record["loadavg_end"] = loadavg()
        report = self.run.report()
        configured = record["configured_max_num_seqs"]
        record["report_written"] = report is not None
        record["startup_seconds"] = self.server.startup_seconds
        record["requests"] = self.bench.args.requests
        record["rounds"] = [
            {"completed": load.completed, "failed": load.failed, "output_tokens": load.output_tokens,
             "seconds": round(load.seconds, 3), "output_tokens_per_second": round(load.output_tokens_per_second, 1),
             "errors": load.errors}
            for load in loads
        ]
        # The worst round counts; a round that never ran completed nothing.
        all_rounds = len(loads) == planned_rounds
        record["completed"] = min((load.completed for load in loads), default=0) if all_rounds else 0
        record["failed"] = record["requests"] - record["completed"]
        record["output_tokens_per_second"] = (
            round(statistics.median(load.output_tokens_per_second for load in loads), 1) if loads else 0.0
        )
        record["measured_peak_bytes"], record["measured_peak_sequences"] = self.run.peak()
        if report is not None:
            record["decision"] = report["decision"]
            record["effective_max_num_seqs"] = report["effective_max_num_seqs"]
            record["predicted_peak_bytes"] = report["predicted_peak_bytes"]
            record["predicted_source"] = "plugin report (--model-local-kv-report)"
            record["per_seq_bytes"] = report["per_seq_bytes"]
            record["plugin_seconds"] = report["plugin_seconds"]
        else:
            checkpoint = self.bench.checkpoint
            record["decision"] = None
            record["effective_max_num_seqs"] = configured
            record["predicted_peak_bytes"] = predicted_without_plugin(checkpoint, configured, 0)
            record["predicted_source"] = OFF_PREDICTION_SOURCE
            record["per_seq_bytes"] = sum(owned.spec.bytes_per_row for owned in _demo_collection(checkpoint).specs)
            record["plugin_seconds"] = None
        if record["headroom_bytes"]:
            record["over_commit"] = round(record["measured_peak_bytes"] / record["headroom_bytes"], 4)
        if record["plugin_seconds"] is not None and self.server.startup_seconds:
            record["plugin_share_of_startup"] = record["plugin_seconds"] / self.server.startup_seconds
        if record["error"]:
            log(f"run {self.index} FAILED: {record['label']}: {record['error'][:400]}")
        else:
            log(f"run {self.index} done: {record['label']}: "
                f"effective max_num_seqs {record['effective_max_num_seqs']}, "
                f"completed {record['completed']}/{record['requests']} x {len(loads)} round(s), "
                f"{record['output_tokens_per_second']:.0f} tok/s, measured peak {record['measured_peak_bytes']:,} B "
                f"({record['measured_peak_sequences']} seqs), predicted {record['predicted_peak_bytes']:,} B, "
                f"startup {record['startup_seconds']:.1f} s")
        return record


class Bench:
    """Starts servers and keeps every run it made, in order."""

    def __init__(self, args: argparse.Namespace, out: Path, checkpoint: Path) -> None:
        self.args = args
        self.out = out
        self.checkpoint = str(checkpoint)
        self.runs: list[dict] = []

    def run(self, label: str, policy: str, max_num_seqs: int, headroom: str | None) -> dict:
        """One server start, ``--rounds`` loads, one stop, always."""
        run = Run(self, label, policy, max_num_seqs, headroom)
        try:
            if run.start():
                for _ in range(self.args.rounds):
                    run.load()
        finally:
            record = run.stop(self.args.rounds)
        return record

    def hand_tune(self, headroom: str, known: dict[int, dict]) -> dict:
        """The careful operator: policy off, bisect ``--max-num-seqs`` over
        [1, configured] for the largest value whose measured peak stays
        within ``headroom`` with every request completed."""
        limit = parse_byte_size(headroom)
        tried = dict(known)

        def good(n: int) -> bool:
            if n not in tried:
                tried[n] = self.run(f"tune-{n}", "off", n, None)
            run = tried[n]
            return not run["error"] and run["failed"] == 0 and run["measured_peak_bytes"] <= limit

        steps = []
        lo, hi = 1, self.args.max_num_seqs
        if good(hi):
            lo = hi
        else:
            while hi - lo > 1 and len(steps) < self.args.bisect_steps:
                mid = (lo + hi) // 2
                ok = good(mid)
                steps.append({"max_num_seqs": mid, "measured_peak_bytes": tried[mid]["measured_peak_bytes"],
                              "within_headroom": ok})
                lo, hi = (mid, hi) if ok else (lo, mid)
            if lo not in tried and not good(lo):  # the bracket's low end was assumed, not measured
                lo = 0
        return {
            "headroom": headroom, "headroom_bytes": limit, "bracket": [lo, hi], "converged": hi - lo <= 1,
            "steps": steps, "best_max_num_seqs": lo or None,
        }

    def compare(self, headroom: str, tuned_max_num_seqs: int) -> dict:
        """Throughput of the cap against the hand-tuned value, measured side
        by side: both servers up at once (an idle one uses no CPU), rounds
        interleaved A B B A ..., so load from other jobs on this machine
        falls on both alike. The ratio is of the medians."""
        rounds = self.args.compare_rounds
        cap = Run(self, f"compare-cap-{headroom}", "cap", self.args.max_num_seqs, headroom)
        tuned = Run(self, f"compare-tuned-{tuned_max_num_seqs}", "off", tuned_max_num_seqs, None)
        try:
            if cap.start() and tuned.start():
                for i in range(rounds):
                    for run in ((cap, tuned) if i % 2 == 0 else (tuned, cap)):
                        run.load()
        finally:
            cap_record, tuned_record = cap.stop(rounds), tuned.stop(rounds)
        ok = not cap_record["error"] and not tuned_record["error"] and tuned_record["output_tokens_per_second"] > 0
        return {
            "rounds_each": rounds, "order": "interleaved, A B B A ...",
            "cap_run": cap_record["label"], "tuned_run": tuned_record["label"],
            "plugin_cap": cap_record.get("effective_max_num_seqs"),
            "hand_tuned_max_num_seqs": tuned_max_num_seqs,
            "cap_tokens_per_second_rounds": [r["output_tokens_per_second"] for r in cap_record["rounds"]],
            "tuned_tokens_per_second_rounds": [r["output_tokens_per_second"] for r in tuned_record["rounds"]],
            "cap_tokens_per_second_median": cap_record["output_tokens_per_second"],
            "tuned_tokens_per_second_median": tuned_record["output_tokens_per_second"],
            "throughput_ratio": round(
                cap_record["output_tokens_per_second"] / tuned_record["output_tokens_per_second"], 4
            ) if ok else None,
        }


def _checks(runs: list[dict], off: dict, sweep: list[dict], tuned: dict) -> list[dict]:
    """The issue's targets, each with what was measured, met or not."""
    checks = []

    def add(target: str, measured: str, passed: bool) -> None:
        checks.append({"target": target, "measured": measured, "passed": bool(passed)})

    caps = [r for r in runs if r["policy"] == "cap"]
    add("under cap every request completes (256/256)",
        "; ".join(f"{c['label']}: {c['completed']}/{c['requests']}" for c in caps),
        all(not c["error"] and c["failed"] == 0 and c["completed"] == c["requests"] for c in caps))
    add("under cap measured peak <= headroom",
        "; ".join(f"{c['label']}: {c['measured_peak_bytes']:,} <= {c['headroom_bytes']:,}" for c in caps),
        all(not c["error"] and c["measured_peak_bytes"] <= c["headroom_bytes"] for c in caps))
    saturated = [c for c in caps if c["decision"] == "capped"]
    add("under cap, where the load saturates (capped), measured peak within one row (per_seq_bytes) of headroom",
        "; ".join(f"{c['label']}: headroom - peak = {c['headroom_bytes'] - c['measured_peak_bytes']:,} B "
                  f"vs row {c['per_seq_bytes']:,} B" for c in saturated) or "no capped run",
        bool(saturated)
        and all(0 <= c["headroom_bytes"] - c["measured_peak_bytes"] < c["per_seq_bytes"] for c in saturated))
    ok_runs = [r for r in runs if not r["error"]]
    mismatched = [r for r in ok_runs if r["predicted_peak_bytes"] != r["measured_peak_bytes"]]
    add("predicted peak == measured peak, in bytes (every run)",
        f"{len(ok_runs) - len(mismatched)}/{len(ok_runs)} runs equal"
        + "".join(f"; {r['label']}: predicted {r['predicted_peak_bytes']:,} measured {r['measured_peak_bytes']:,}"
                  for r in mismatched),
        ok_runs and not mismatched)
    bites = [row for row in sweep if row["cap"]["decision"] == "capped"]
    add("without the plugin (off) over-commit > 1 wherever the cap bites",
        "; ".join(f"{row['headroom']}: {row.get('off_over_commit')}" for row in bites) or "cap never bit",
        bool(bites) and not off["error"] and all(row["off_over_commit"] > 1 for row in bites))
    shares = [r for r in ok_runs if r.get("plugin_share_of_startup") is not None]
    worst = max(shares, key=lambda r: r["plugin_share_of_startup"], default=None)
    add(f"plugin time < {PLUGIN_SHARE_TARGET:.1%} of engine startup (every run with the plugin)",
        f"worst {worst['plugin_seconds'] * 1000:.1f} ms of {worst['startup_seconds']:.1f} s = "
        f"{worst['plugin_share_of_startup']:.4%} ({worst['label']})" if worst else "no run with a report",
        worst is not None and worst["plugin_share_of_startup"] < PLUGIN_SHARE_TARGET)
    comparison = tuned.get("comparison")
    if comparison:
        ratio = comparison["throughput_ratio"]
        add(f"throughput under cap >= {THROUGHPUT_TARGET} x best hand-tuned ({tuned['headroom']})",
            f"cap {comparison['cap_tokens_per_second_median']:.1f} tok/s (max_num_seqs {comparison['plugin_cap']}) / "
            f"hand-tuned {comparison['tuned_tokens_per_second_median']:.1f} tok/s (max_num_seqs "
            f"{comparison['hand_tuned_max_num_seqs']}) = {ratio if ratio is None else f'{ratio:.3f}'}, medians of "
            f"{comparison['rounds_each']} interleaved rounds each",
            ratio is not None and ratio >= THROUGHPUT_TARGET)
    if tuned:
        cap = next((row["cap"] for row in sweep if row["headroom"] == tuned["headroom"]), None)
        plugin_cap = cap["effective_max_num_seqs"] if cap else (comparison or {}).get("plugin_cap")
        add(f"(extra) plugin cap == careful operator's bisection result ({tuned['headroom']})",
            f"cap {plugin_cap} vs hand-tuned {tuned['best_max_num_seqs']}"
            + ("" if tuned["converged"] else f" (bisection not converged: bracket {tuned['bracket']})"),
            tuned["converged"] and plugin_cap == tuned["best_max_num_seqs"])
    return checks


def plot(path: Path, sweep: list[dict], off: dict) -> None:
    """Measured peak, predicted peak and headroom across the sweep, with the
    cap (left) and without it (right: off, and warn which changes nothing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [row["headroom_bytes"] / MiB for row in sweep]
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), sharey=True)
    for ax in axes:
        ax.plot(x, x, "k--", label="headroom")
        ax.set_xlabel("headroom (MiB)")
        ax.set_xticks(x)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    left, right = axes
    left.plot(x, [row["cap"]["predicted_peak_bytes"] / MiB for row in sweep], "o-", label="predicted peak (plan)")
    left.plot(x, [row["cap"]["measured_peak_bytes"] / MiB for row in sweep], "x", ms=10, mew=2,
              label="measured peak (model)")
    for xi, row in zip(x, sweep):
        left.annotate(f"max_num_seqs {row['cap']['effective_max_num_seqs']}",
                      (xi, row["cap"]["measured_peak_bytes"] / MiB),
                      textcoords="offset points", xytext=(4, -14), fontsize=8)
    left.set_title("with the plugin: policy cap")
    left.set_ylabel("model-local KV at peak (MiB)")
    right.plot(x, [off["measured_peak_bytes"] / MiB] * len(x), "s-",
               label=f"measured peak, off (stock vLLM, max_num_seqs {off['configured_max_num_seqs']})")
    right.plot(x, [off["predicted_peak_bytes"] / MiB] * len(x), ":", lw=3, label="predicted peak, off (planner)")
    right.plot(x, [row["warn"]["measured_peak_bytes"] / MiB if row.get("warn") else float("nan") for row in sweep],
               "x", ms=10, mew=2, label="measured peak, warn")
    right.fill_between(x, x, [off["measured_peak_bytes"] / MiB] * len(x),
                       where=[off["measured_peak_bytes"] / MiB > xi for xi in x], interpolate=True,
                       color="red", alpha=0.12, label="over-commit (measured > headroom)")
    right.set_title("without the cap: policy off / warn")
    for ax in axes:
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"{off['requests']} concurrent requests, demo model, vLLM api_server (CPU)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _summary_table(runs: list[dict]) -> str:
    header = (f"{'run':<14} {'policy':<6} {'headroom':>9} {'conf':>5} {'eff':>5} {'done':>9} {'tok/s':>7} "
              f"{'measured peak B':>15} {'predicted peak B':>16} {'over-commit':>11} "
              f"{'startup s':>9} {'plugin ms':>9}")
    lines = [header]
    for r in runs:
        if r["error"]:
            lines.append(f"{r['label']:<14} {r['policy']:<6} ERROR {r['error'][:100]}")
            continue
        over = f"{r['over_commit']:.3f}" if r.get("over_commit") is not None else "-"
        plugin = f"{r['plugin_seconds'] * 1000:.1f}" if r["plugin_seconds"] is not None else "-"
        lines.append(
            f"{r['label']:<14} {r['policy']:<6} {r['headroom'] or '-':>9} {r['configured_max_num_seqs']:>5} "
            f"{r['effective_max_num_seqs']:>5} {r['completed']:>4}/{r['requests']:<4} "
            f"{r['output_tokens_per_second']:>7.1f} "
            f"{r['measured_peak_bytes']:>15,} {r['predicted_peak_bytes']:>16,} {over:>11} "
            f"{r['startup_seconds']:>9.1f} {plugin:>9}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"reduced sweep ({QUICK_HEADROOMS}), 2 bisection steps; output to benchmarks/out only")
    parser.add_argument("--headrooms", default=None, help=f"sweep, comma separated (default {FULL_HEADROOMS})")
    parser.add_argument("--policies", default="off,warn,cap",
                        help="which of off,warn,cap to run (cap is needed for the checks)")
    parser.add_argument("--operator-headroom", default="96MiB",
                        help="headroom of the hand-tuning comparison ('' to skip)")
    parser.add_argument("--bisect-steps", type=int, default=None, help="most bisection steps (default 9; quick 2)")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256, help="configured --max-num-seqs")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=None,
                        help="loads per server in the sweep and bisection; tok/s is their median (default 1)")
    parser.add_argument("--compare-rounds", type=int, default=None,
                        help="interleaved loads per server in the cap vs hand-tuned throughput comparison "
                        "(default 5; quick 2; 0 skips)")
    parser.add_argument("--start-timeout", type=float, default=300)
    parser.add_argument("--request-timeout", type=float, default=300)
    parser.add_argument("--out", default=str(HERE / "out"), help="working directory (default benchmarks/out)")
    parser.add_argument("--results", default=str(HERE / "results"), help="where a full run copies JSON and PNG")
    args = parser.parse_args(argv)
    args.headrooms = args.headrooms or (QUICK_HEADROOMS if args.quick else FULL_HEADROOMS)
    args.bisect_steps = args.bisect_steps if args.bisect_steps is not None else (2 if args.quick else 9)
    args.rounds = args.rounds if args.rounds is not None else 1
    args.compare_rounds = args.compare_rounds if args.compare_rounds is not None else (2 if args.quick else 5)
    policies = set(args.policies.split(","))
    headrooms = sorted(args.headrooms.split(","), key=parse_byte_size)

    began = time.monotonic()
    started_load = loadavg()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log(f"writing the demo checkpoint to {out / 'checkpoint'}")
    bench = Bench(args, out, write_demo_checkpoint(out / "checkpoint"))

    off = bench.run(f"off-{args.max_num_seqs}", "off", args.max_num_seqs, None) if "off" in policies else None
    sweep = []
    for headroom in headrooms:
        row = {"headroom": headroom, "headroom_bytes": parse_byte_size(headroom)}
        for policy in ("warn", "cap"):
            if policy in policies:
                row[policy] = bench.run(f"{policy}-{headroom}", policy, args.max_num_seqs, headroom)
        if off is not None and not off["error"]:
            row["off_over_commit"] = round(off["measured_peak_bytes"] / row["headroom_bytes"], 4)
        sweep.append(row)
    if off is not None:
        off["over_commit_by_headroom"] = {row["headroom"]: row.get("off_over_commit") for row in sweep}

    tuned = {}
    if args.operator_headroom:
        known = {off["configured_max_num_seqs"]: off} if off is not None else {}
        tuned = bench.hand_tune(args.operator_headroom, known)
        log(f"careful operator at {args.operator_headroom}: largest safe max_num_seqs "
            f"{tuned['best_max_num_seqs']} (bracket {tuned['bracket']}, converged {tuned['converged']})")
        if tuned["best_max_num_seqs"] and args.compare_rounds > 0:
            tuned["comparison"] = bench.compare(args.operator_headroom, tuned["best_max_num_seqs"])
            log(f"throughput, cap / hand-tuned: {tuned['comparison']['throughput_ratio']}")

    checks = _checks(bench.runs, off, sweep, tuned) if off is not None and "cap" in policies else []
    result = {
        "benchmark": "bench_load",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "quick": args.quick,
        "machine": machine_info(),
        "loadavg_start": started_load,
        "loadavg_end": loadavg(),
        "wall_seconds": round(time.monotonic() - began, 1),
        "settings": {
            "requests": args.requests, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
            "ignore_eos": True, "configured_max_num_seqs": args.max_num_seqs, "headrooms": headrooms,
            "rounds_per_server": args.rounds, "compare_rounds": args.compare_rounds,
            "operator_headroom": args.operator_headroom,
            "server_flags": "--enforce-eager, VLLM_CPU_KVCACHE_SPACE=1 (kv_budget_demo.serving.ApiServer)",
            "per_seq_bytes_by_hand": talker_bytes_per_row(DEFAULT_TALKER),
        },
        "off": off,
        "sweep": [{k: (v["label"] if isinstance(v, dict) else v) for k, v in row.items()} for row in sweep],
        "hand_tuned": tuned,
        "runs": bench.runs,
        "checks": checks,
    }
    name = "bench_load-quick" if args.quick else "bench_load"
    json_path = out / f"{name}.json"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    png_path = out / f"{name}.png"
    png_path.unlink(missing_ok=True)
    if off is not None and all("cap" in row for row in sweep) and not off["error"] and \
            not any(row["cap"]["error"] for row in sweep):
        plot(png_path, sweep, off)
    if not args.quick:
        results = Path(args.results)
        results.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(json_path, results / "bench_load.json")
        if png_path.exists():
            shutil.copyfile(png_path, results / "bench_load.png")

    print("\n" + _summary_table(bench.runs))
    if tuned:
        print(f"\ncareful operator ({tuned['headroom']}, policy off, bisection): largest safe max_num_seqs "
              f"{tuned['best_max_num_seqs']}, bracket {tuned['bracket']}, converged {tuned['converged']}, "
              f"steps {[s['max_num_seqs'] for s in tuned['steps']]}")
    print(f"\nloadavg start {started_load} end {result['loadavg_end']}; wall {result['wall_seconds']} s")
    for check in checks:
        print(f"{'PASS' if check['passed'] else 'FAIL'}: {check['target']}: {check['measured']}")
    print(f"\nwrote {json_path}" + (f" and {png_path}" if png_path.exists() else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
