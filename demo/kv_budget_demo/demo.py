"""``make demo``: the product as a user meets it, end to end.

Builds the demo checkpoint, starts a real vLLM api_server on 127.0.0.1 with
the plugin under ``--model-local-kv-policy cap``, sends 256 concurrent
requests, and prints the startup plan, how many requests completed, and the
peak model-local bytes the model really held against the plan's prediction
and the headroom, beside the peak kv-budget measured live inside the
sampled steps, as ``/metrics`` showed it during the load.

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
import threading
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kv_budget.plan.planner import Plan
from kv_budget.report import render_plan_table
from kv_budget.units import format_bytes
from kv_budget_demo.checkpoint import write_demo_checkpoint
from kv_budget_demo.serving import ApiServer, ServerStartError, send_completions

__all__ = ["CPU_HEADROOM", "STATS_DIR_ENV", "DemoServer", "read_peak_stats", "main"]

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


@dataclass
class DemoServer:
    """An api_server on the demo checkpoint whose plan report and model
    stats land in one run directory: what ``make demo``, the end-to-end tests
    and the load benchmark each start, so all three measure the same way."""

    server: ApiServer
    stats_dir: Path
    report_path: Path

    @classmethod
    def create(cls, checkpoint: Path | str, run_dir: Path, flags: list[str], max_num_seqs: int = 256) -> DemoServer:
        """``flags`` are the plugin flags of this run; the report path, the
        stats directory (emptied) and ``--enforce-eager`` are added here.
        Eager because the talker's bookkeeping is Python that must run every
        step; a full CUDA graph of the step would replay without it."""
        stats_dir = run_dir / "stats"
        stats_dir.mkdir(parents=True, exist_ok=True)
        for old in stats_dir.glob("stats-rank*.json"):
            old.unlink()
        report_path = run_dir / "startup-plan.json"
        report_path.unlink(missing_ok=True)
        server = ApiServer(
            model=str(checkpoint), log_path=run_dir / "server.log", max_num_seqs=max_num_seqs,
            extra_args=["--enforce-eager", "--model-local-kv-report", str(report_path), *flags],
            env={STATS_DIR_ENV: str(stats_dir)},
        )
        return cls(server, stats_dir, report_path)

    def report(self) -> dict | None:
        """The plugin's startup plan; None when it wrote none (policy off)."""
        return json.loads(self.report_path.read_text()) if self.report_path.exists() else None

    def peak(self) -> tuple[int, int]:
        """(bytes, sequences): the most the demo model held at once on any rank."""
        stats = read_peak_stats(self.stats_dir).values()
        return (max((s["peak_bytes"] for s in stats), default=0),
                max((s["peak_sequences"] for s in stats), default=0))


LIVE_PEAK = "kv_budget:live_peak_bytes"
"""The series that shows what the model held at once in the sampled steps."""


@dataclass
class MetricsWatch:
    """Reads ``/metrics`` every half second while the load runs: the
    largest :data:`LIVE_PEAK` it showed, and how many bodies were read."""

    url: str
    peak_bytes: int = 0
    scrapes: int = 0
    _done: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def read(self) -> None:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as response:
            body = response.read().decode()
        self.scrapes += 1
        for line in body.splitlines():
            if line.startswith(LIVE_PEAK + "{"):
                self.peak_bytes = max(self.peak_bytes, int(float(line.rsplit(" ", 1)[1])))

    def __enter__(self) -> MetricsWatch:
        def loop() -> None:
            while not self._done.wait(0.5):
                self.read()

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(timeout=30)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kv_budget_demo", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="demo-out", help="working directory (default demo-out)")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--headroom", default=None, help=f"explicit headroom (default: {CPU_HEADROOM} without a GPU, measured with one)")
    parser.add_argument("--talker-positions", type=int, default=None,
                        help="positions per talker row (default 256: 1 MiB per sequence); larger makes the "
                        "cap bite against a large measured GPU headroom")
    args = parser.parse_args(argv)

    out = Path(args.out).resolve()
    print(f"[demo] writing the demo checkpoint to {out / 'checkpoint'}", flush=True)
    talker = {"positions": args.talker_positions} if args.talker_positions else None
    checkpoint = write_demo_checkpoint(out / "checkpoint", talker)
    headroom = args.headroom or (None if _has_cuda() else CPU_HEADROOM)
    flags = ["--model-local-kv-policy", "cap"]
    if headroom is not None:
        flags += ["--model-local-kv-headroom", headroom]
    else:
        print("[demo] CUDA device found: headroom measured through NVML after startup", flush=True)
    run = DemoServer.create(checkpoint, out, flags, max_num_seqs=args.max_num_seqs)
    server = run.server
    print(f"[demo] starting vLLM api_server on {server.url} with: {' '.join(server.extra_args)}", flush=True)
    try:
        server.start()
    except ServerStartError as exc:
        print(f"[demo] {exc}; last lines of {server.log_path}:", file=sys.stderr)
        print("\n".join(exc.log.splitlines()[-25:]), file=sys.stderr)
        return 1
    try:
        print(f"[demo] server healthy after {server.startup_seconds:.1f} s; sending {args.requests} "
              "concurrent requests", flush=True)
        with MetricsWatch(server.url) as watch:
            load = send_completions(server.url, str(checkpoint), requests=args.requests)
        watch.read()  # after the load: the last sample is in
    finally:
        server.stop()

    plan = Plan.model_validate(run.report())
    print("\n" + render_plan_table(plan))
    print(f"\n[demo] requests completed: {load.completed} of {load.requests} "
          f"({load.output_tokens} output tokens in {load.seconds:.1f} s, {load.output_tokens_per_second:.0f} tok/s)")
    for error in load.errors:
        print(f"[demo]   {error}")
    measured, sequences = run.peak()
    print(f"[demo] peak model-local KV measured by the model: {format_bytes(measured)} "
          f"with {sequences} sequences at once")
    print(f"[demo] peak measured live by kv-budget:           {format_bytes(watch.peak_bytes)} "
          f"(/metrics {LIVE_PEAK}, inside the sampled steps; {watch.scrapes} scrapes)")
    print(f"[demo] peak predicted by the plan:                {format_bytes(plan.predicted_peak_bytes)} "
          f"at max_num_seqs={plan.effective_max_num_seqs}")
    print(f"[demo] headroom:                                  {format_bytes(plan.headroom_bytes)} "
          f"({plan.headroom_source})")
    verdict = "within" if max(measured, watch.peak_bytes) <= plan.headroom_bytes else "OVER"
    print(f"[demo] measured peak is {verdict} the headroom; measured == predicted: "
          f"{measured == plan.predicted_peak_bytes}; live == measured: {watch.peak_bytes == measured}")
    return 0 if load.failed == 0 and max(measured, watch.peak_bytes) <= plan.headroom_bytes else 1

