"""``make demo``: the product as a user meets it, end to end.

Builds the demo checkpoint, starts a real vLLM api_server on 127.0.0.1 with
the plugin under ``--model-local-kv-policy cap``, sends 256 concurrent
requests, and prints the startup plan, how many requests completed, and the
peak model-local bytes the model really held against the plan's prediction
and the headroom.

On a machine without a GPU the headroom is an explicit override
(:data:`CPU_HEADROOM`) sized so the cap bites; on a CUDA machine it is
measured through NVML after startup.

Exit status: 0 when every request completed and the measured peak stayed
within the headroom; 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .demo_checkpoint import write_demo_checkpoint
from .planner import Plan
from .report import render_plan_table
from .serving import ApiServer, ServerStartError, send_completions
from .units import format_bytes

__all__ = ["CPU_HEADROOM", "STATS_DIR_ENV", "read_peak_stats", "main"]

CPU_HEADROOM = "96MiB"
"""Without a GPU the plan uses this explicit headroom: 90 of 256 sequences
of the demo talker (1,114,112 B each) fit, so the cap visibly bites."""

STATS_DIR_ENV = "KV_BUDGET_DEMO_STATS_DIR"
"""Where the demo model writes ``stats-rank{R}.json`` (peak bytes, peak
sequences): read back here because the model runs in a worker process."""


def read_peak_stats(directory: Path) -> dict[int, dict]:
    """rank -> {"peak_bytes", "peak_sequences", ...} from the demo model."""
    stats = {}
    for path in sorted(Path(directory).glob("stats-rank*.json")):
        data = json.loads(path.read_text())
        stats[int(data["rank"])] = data
    return stats


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kv_budget.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="demo-out", help="working directory (default demo-out)")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--headroom", default=None, help=f"explicit headroom (default: {CPU_HEADROOM} without a GPU, measured with one)")
    parser.add_argument("--talker-positions", type=int, default=None,
                        help="positions per talker row (default 256: 1 MiB per sequence); larger makes the "
                        "cap bite against a large measured GPU headroom")
    args = parser.parse_args(argv)

    out = Path(args.out).resolve()
    stats_dir = out / "stats"
    stats_dir.mkdir(parents=True, exist_ok=True)
    for old in stats_dir.glob("stats-rank*.json"):
        old.unlink()
    report_path = out / "startup-plan.json"
    report_path.unlink(missing_ok=True)

    print(f"[demo] writing the demo checkpoint to {out / 'checkpoint'}", flush=True)
    talker = {"positions": args.talker_positions} if args.talker_positions else None
    checkpoint = write_demo_checkpoint(out / "checkpoint", talker)
    headroom = args.headroom or (None if _has_cuda() else CPU_HEADROOM)
    flags = ["--model-local-kv-policy", "cap", "--model-local-kv-report", str(report_path)]
    if headroom is not None:
        flags += ["--model-local-kv-headroom", headroom]
    else:
        print("[demo] CUDA device found: headroom measured through NVML after startup", flush=True)
    # The talker's bookkeeping is Python that must run every step; a full
    # CUDA graph of the step would replay without it.
    flags.append("--enforce-eager")
    server = ApiServer(
        model=str(checkpoint), log_path=out / "server.log", max_num_seqs=args.max_num_seqs,
        extra_args=flags, env={STATS_DIR_ENV: str(stats_dir)},
    )
    print(f"[demo] starting vLLM api_server on {server.url} with: {' '.join(flags)}", flush=True)
    try:
        server.start()
    except ServerStartError as exc:
        print(f"[demo] {exc}; last lines of {server.log_path}:", file=sys.stderr)
        print("\n".join(exc.log.splitlines()[-25:]), file=sys.stderr)
        return 1
    try:
        print(f"[demo] server healthy after {server.startup_seconds:.1f} s; sending {args.requests} "
              "concurrent requests", flush=True)
        load = send_completions(server.url, str(checkpoint), requests=args.requests)
    finally:
        server.stop()

    plan = Plan.model_validate(json.loads(report_path.read_text()))
    stats = read_peak_stats(stats_dir)
    print("\n" + render_plan_table(plan))
    print(f"\n[demo] requests completed: {load.completed} of {load.requests} "
          f"({load.output_tokens} output tokens in {load.seconds:.1f} s, {load.output_tokens_per_second:.0f} tok/s)")
    for error in load.errors:
        print(f"[demo]   {error}")
    measured = max((s["peak_bytes"] for s in stats.values()), default=0)
    sequences = max((s["peak_sequences"] for s in stats.values()), default=0)
    print(f"[demo] peak model-local KV measured by the model: {format_bytes(measured)} "
          f"with {sequences} sequences at once")
    print(f"[demo] peak predicted by the plan:                {format_bytes(plan.predicted_peak_bytes)} "
          f"at max_num_seqs={plan.effective_max_num_seqs}")
    print(f"[demo] headroom:                                  {format_bytes(plan.headroom_bytes)} "
          f"({plan.headroom_source})")
    verdict = "within" if measured <= plan.headroom_bytes else "OVER"
    print(f"[demo] measured peak is {verdict} the headroom; measured == predicted: "
          f"{measured == plan.predicted_peak_bytes}")
    return 0 if load.failed == 0 and measured <= plan.headroom_bytes else 1


if __name__ == "__main__":
    sys.exit(main())
