"""``make demo-limit``: under a real memory limit, stock vLLM against kv-budget.

The demo's api_server runs twice inside a memory cgroup made for it
(:mod:`kv_budget_demo.memory_limit`), the kernel's limit as a container
has it, and gets 256 concurrent completions each time; no headroom is
given, so kv-budget measures it from the cgroup:

* ``off``: stock vLLM. The group starts without a limit; once the server is
  healthy its working set is read (usage less the inactive page cache the
  kernel reclaims before it kills) and the limit is set ``--room`` above it
  (default 1.6 GB), then the load runs.
* ``cap``: the same limit from the start; kv-budget samples what the cgroup
  leaves, keeps its default margin, and caps ``max_num_seqs``; its live
  watch then follows the cgroup. Its first burst is admitted at the cost a
  held sequence had in its last serve where there was one (the cost record
  in kv-budget's runtime directory): a second ``make demo-limit`` shows it.

The demo checkpoint holds 8 MiB per sequence (2,048 positions per talker
row): 256 of them need 2 GiB more than the room. For each run it prints the
limit, the usage and working set after startup, the peak usage during the load, the OOM
kills and the requests completed. Where no memory cgroup can be made here
it says so in one line and runs ``make demo`` instead.

Exit status: 0 when kv-budget completed every request with no OOM kill and
its peak under the limit; 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kv_budget.units import format_bytes, parse_byte_size
from kv_budget_demo.checkpoint import write_demo_checkpoint
from kv_budget_demo.demo import DemoServer
from kv_budget_demo.demo import main as demo_main
from kv_budget_demo.memory_limit import MemoryCgroup, ProcessPeaks, cgroup_unavailable
from kv_budget_demo.serving import ServerStartError, send_completions

__all__ = ["DEFAULT_ROOM", "DEFAULT_POSITIONS", "demo_server_in_cgroup", "run_under_limit", "main"]

DEFAULT_ROOM = "1.6GB"
"""Above the server's working set after startup: 256 sequences of 8 MiB do not fit it, about 80 do with the margin."""
DEFAULT_POSITIONS = 2048
"""Positions per talker row: 8 MiB per sequence."""


@contextmanager
def demo_server_in_cgroup(name: str, limit: int | None, checkpoint: Path, run_dir: Path, flags: list[str],
                          max_num_seqs: int) -> Iterator[tuple[MemoryCgroup, DemoServer]]:
    """A memory cgroup made for one demo server, and the server set to start
    inside it (the caller starts it: a start that fails is the caller's
    figure); on leaving, the server is stopped and the group removed."""
    group = MemoryCgroup.create(name, limit)
    run = DemoServer.create(checkpoint, run_dir, flags, max_num_seqs=max_num_seqs)
    run.server.command_prefix = group.command_prefix()
    try:
        yield group, run
    finally:
        run.server.stop()
        group.remove()


def run_under_limit(policy: str, checkpoint: Path, run_dir: Path, requests: int, limit: int | None,
                    room: int, flags: tuple[str, ...] = (), max_num_seqs: int = 256) -> dict:
    """One api_server in its own memory cgroup, 256 requests, the figures.
    ``limit`` None: set ``room`` above the working set after startup (``off``);
    ``flags``: more plugin flags (``--model-local-kv-margin``);
    ``max_num_seqs``: the server's own (an operator's figure by hand).
    ``processes`` in the result: each process's growth during the load
    (:class:`~kv_budget_demo.memory_limit.ProcessPeaks`)."""
    flags = ["--model-local-kv-policy", policy, "--model-local-kv-ledger-dir", "off", *flags]
    result: dict = {"policy": policy}
    name = f"kv-budget-demo-{policy}"
    with demo_server_in_cgroup(name, limit, checkpoint, run_dir, flags, max_num_seqs) as (group, run):
        try:
            run.server.start()
        except ServerStartError as exc:
            result.update(started=False, error=str(exc), oom_kills=group.oom_kills(), completed=0,
                          requests=requests, log_tail=exc.log.splitlines()[-5:])
            return result
        startup_usage, working_set = group.usage(), group.working_set()
        if limit is None:
            limit = working_set + room
            group.set_limit(limit)
        group.reset_peak()
        processes = ProcessPeaks(group)
        processes.start()
        files_before = group.file_pages()
        load = send_completions(run.server.url, str(checkpoint), requests=requests)
        files_after = group.file_pages()
        result.update(started=True, limit_bytes=limit, startup_usage_bytes=startup_usage,
                      startup_working_set_bytes=working_set, peak_usage_bytes=group.peak(),
                      file_pages={"before_load": files_before, "after_load": files_after},
                      oom_kills=group.oom_kills(), requests=requests, completed=load.completed, failed=load.failed,
                      seconds=round(load.seconds, 1), errors=load.errors[:2], processes=processes.stop(),
                      server_max_num_seqs=max_num_seqs)
    # What kv-budget's live limit did (its log lines), and what the demo model really ran at once.
    log = run.server.log_text()
    limits = [int(n) for n in re.findall(r"kv-budget: live: Scheduler\.\w+ (\d+) \(live limit", log)]
    first = re.search(r"kv-budget: live: admission starts at (\d+) .*", log)
    if first is not None:  # where the limit started, and whether an earlier serve's measured cost set it
        result.update(first_admission=int(first.group(1)), first_from_record="(cost record " in first.group(0),
                      first_admission_line=first.group(0))
    result.update(live_limit_max=max([*limits, *([int(first.group(1))] if first else [])], default=None),
                  live_limit_changes=len(limits), peak_sequences=run.peak()[1])
    report = run.report()
    if report is not None:
        result.update(max_num_seqs=report["effective_max_num_seqs"], headroom_bytes=report["headroom_bytes"],
                      headroom_source=report["headroom_source"])
    return result


def _line(result: dict) -> str:
    if not result.get("started"):
        return (f"[demo-limit] {result['policy']}: did not start ({result.get('error')}), "
                f"OOM kills {result['oom_kills']}")
    capped = f", max_num_seqs {result['max_num_seqs']}" if "max_num_seqs" in result else ", max_num_seqs 256"
    if result.get("first_admission"):
        record = " priced on its last serve's cost record" if result.get("first_from_record") else ""
        capped += f", first burst {result['first_admission']}{record}"
    if result.get("live_limit_max"):
        capped += f", live limit up to {result['live_limit_max']}"
    peak = result["peak_usage_bytes"]
    return (f"[demo-limit] {result['policy']:>3}: limit {format_bytes(result['limit_bytes'])}, after startup "
            f"{format_bytes(result['startup_usage_bytes'])} (working set "
            f"{format_bytes(result['startup_working_set_bytes'])}), peak {format_bytes(peak) if peak else 'not kept'}"
            f"{capped}; OOM kills {result['oom_kills']}; {result['completed']} of {result['requests']} completed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kv_budget_demo.limit_demo", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="demo-out/limit", help="working directory (default demo-out/limit)")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--room", default=DEFAULT_ROOM, help=f"limit above the working set after startup ({DEFAULT_ROOM})")
    parser.add_argument("--talker-positions", type=int, default=DEFAULT_POSITIONS)
    parser.add_argument("--margin", default=None, help="kv-budget's margin (--model-local-kv-margin; default: its own)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    reason = cgroup_unavailable()
    if reason is not None:
        print(f"[demo-limit] {reason}: running make demo instead", flush=True)
        return demo_main([])
    out = Path(args.out).resolve()
    checkpoint = write_demo_checkpoint(out / "checkpoint", {"positions": args.talker_positions})
    room = parse_byte_size(args.room)
    print(f"[demo-limit] stock vLLM, then kv-budget (cap, headroom measured from the cgroup), {args.requests} "
          f"concurrent requests each, {args.talker_positions} positions per talker row; the limit "
          f"{format_bytes(room)} above the working set after startup", flush=True)
    off = run_under_limit("off", checkpoint, out / "off", args.requests, None, room)
    print(_line(off), flush=True)
    limit = off.get("limit_bytes")
    if limit is None:
        print("[demo-limit] stock vLLM did not start; nothing to compare", file=sys.stderr)
        return 1
    margin = ("--model-local-kv-margin", args.margin) if args.margin else ()
    cap = run_under_limit("cap", checkpoint, out / "cap", args.requests, limit, room, margin)
    print(_line(cap), flush=True)
    if "headroom_source" in cap:
        print(f"[demo-limit] kv-budget's headroom {format_bytes(cap['headroom_bytes'])}: {cap['headroom_source']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"off": off, "cap": cap}, indent=2))
    served = (cap.get("completed") == args.requests and cap.get("oom_kills") == 0
              and (cap.get("peak_usage_bytes") or 0) < limit)
    print(f"[demo-limit] kv-budget {'served every request under the limit' if served else 'did NOT hold the limit'}; "
          f"stock vLLM: {off['completed']} of {off['requests']} completed, {off['oom_kills']} OOM kill(s)")
    return 0 if served else 1


if __name__ == "__main__":
    raise SystemExit(main())
