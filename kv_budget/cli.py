"""The ``kv-budget`` command.

``kv-budget plan`` sizes a deployment before it starts (one engine from a
preset or spec file, or every stage of a vLLM-Omni deploy file with
``--deploy``, :mod:`kv_budget.plan.deploy`); ``kv-budget audit``
holds a warmed-up model's declarations to the caches it really holds.

Exit codes (documented in the README, stable for scripts):

* 0: the plan is ok, capped or warned; the audit found nothing dangerous.
* 2: bad input (a one-line message names the problem; never a traceback).
* 3: under ``--policy cap`` not even one sequence fits (with ``--deploy``:
  some device does not fit); under ``--policy reserve`` the pool left
  cannot hold one ``max_model_len`` sequence.
* 4: the audit found an under-declared or undeclared cache.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any
from collections.abc import Sequence

from kv_budget.collect.model import Collection
from kv_budget.collect.presets import PRESETS, preset_collection
from kv_budget.collect.specfile import SpecFileError, load_spec_file
from kv_budget.collect.supplied import SuppliedDeclarationsError, supplied_collection, supplied_source
from kv_budget.errors import KvBudgetError
from kv_budget.override import OverrideError, apply_overrides, declaration_label, parse_overrides, unmatched_message
from kv_budget.plan.deploy import StageDeclarations, plan_deploy
from kv_budget.plan.deploy_file import DeployError, load_deploy
from kv_budget.plan.planner import (
    Decision,
    WorkerBudget,
    budget_worker,
    headroom_outside_requested,
    headroom_override,
    make_plan,
)
from kv_budget.plan.reserve import plan_reserve, reserve_out_of_pool
from kv_budget.report import (
    deploy_infeasible_message,
    infeasible_message,
    render_choices,
    render_deploy_table,
    render_plan_table,
    render_reserve_table,
    reserve_infeasible_message,
)
from kv_budget.settings import Policy
from kv_budget.units import byte_size_argument, parse_byte_size, per_each, positive_int_argument

__all__ = ["main", "EXIT_OK", "EXIT_BAD_INPUT", "EXIT_INFEASIBLE", "EXIT_AUDIT_FAILED"]

EXIT_OK = 0
EXIT_BAD_INPUT = 2
"""Same code argparse uses for a usage error, so every bad input is 2."""
EXIT_INFEASIBLE = 3
EXIT_AUDIT_FAILED = 4


class _BadInput(KvBudgetError):
    """A problem with what the user typed; becomes one line and exit 2."""



def _utilization(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value} is not in (0, 1]")
    return value


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kv-budget",
        description="Admission control for model-local KV caches kept outside vLLM's paged KV pool.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{plan,audit}")
    plan = _add_plan_parser(sub)
    _add_plan_sources(plan)
    _add_plan_settings(plan)
    _add_pool_arguments(plan)
    _add_audit_parser(sub)
    return parser


def _add_plan_parser(sub: Any) -> argparse.ArgumentParser:
    return sub.add_parser(
        "plan",
        help="size max_num_seqs for a deployment before starting it",
        description="Plan max_num_seqs from declarations and a headroom, or every stage of a vLLM-Omni "
        "deploy file (--deploy). Exit 0 ok/capped/warned/reserved, 2 bad input, 3 infeasible under --policy cap "
        "or reserve.",
    )


def _add_plan_sources(plan: argparse.ArgumentParser) -> None:
    """What ``plan`` plans: declarations or a deploy file, and the room they get."""
    source = plan.add_mutually_exclusive_group()
    source.add_argument("--spec-file", help="JSON list of declarations (protocol field names)")
    source.add_argument("--preset", choices=sorted(PRESETS), help="published declarations of a model")
    source.add_argument("--list-presets", action="store_true", help="list presets and exit")
    source.add_argument(
        "--deploy", metavar="FILE",
        help="plan a vLLM-Omni deploy file (per-device ledger of all its stages; docs/deploy.md)",
    )
    room = plan.add_mutually_exclusive_group()
    room.add_argument(
        "--headroom-bytes", type=byte_size_argument,
        help="explicit headroom (14GiB, 512MiB or bytes), used as given: no margin is taken off "
        "(with --deploy: the room outside every pool on each device the file uses, as "
        "--model-local-kv-headroom gives a deployment)",
    )
    room.add_argument(
        "--device-memory", type=byte_size_argument,
        help="device size; headroom = what vLLM leaves outside its requested budget, minus the margin "
        "(with --deploy: the size of every device the file uses)",
    )
    plan.add_argument(
        "--device-memory-of", action="append", default=[], metavar="DEVICE=SIZE",
        help="with --deploy: the size of one device (repeatable; wins over --device-memory)",
    )
    plan.add_argument(
        "--stage-declarations", action="append", default=[], metavar="STAGE=PRESET_OR_SPEC_FILE",
        help="with --deploy: the declarations of one stage's model, a preset name or a spec file (repeatable)",
    )
    plan.add_argument(
        "--platform", metavar="NAME",
        help="with --deploy: apply the file's platforms.NAME overrides (cuda, rocm, npu, ...); default: none",
    )


def _add_plan_settings(plan: argparse.ArgumentParser) -> None:
    """The engine settings ``plan`` applies as the plugin would."""
    plan.add_argument(
        "--gpu-memory-utilization", type=_utilization, default=None,
        help="vLLM's gpu_memory_utilization, with --device-memory (default 0.9)",
    )
    plan.add_argument(
        "--margin-bytes", type=byte_size_argument,
        help="safety margin, with --device-memory (default 5%% of the device, at least 1GiB)",
    )
    plan.add_argument(
        "--override", action="append", default=[], metavar="OWNER/NAME:FIELD=VALUE",
        help="correct one field of one declaration before planning (repeatable, applied in order), "
        "e.g. decoder/codec_decoder_request:physical_capacity_positions=72",
    )
    plan.add_argument("--max-num-seqs", type=positive_int_argument, default=None,
                      help="configured max_num_seqs (default 256)")
    plan.add_argument("--policy", choices=[p.value for p in Policy], default=Policy.CAP.value,
                      help="cap (default), warn, off (reports like warn), or reserve (needs --kv-pool-bytes)")
    plan.add_argument("--json", action="store_true", help="print only the plan as JSON")


def _add_pool_arguments(plan: argparse.ArgumentParser) -> None:
    pool = plan.add_argument_group(
        "the paged KV pool (shows cap and reserve side by side; reserve needs them)")
    pool.add_argument("--kv-pool-bytes", type=byte_size_argument, metavar="SIZE",
                      help="what vLLM sizes the pool from: its startup line 'Available KV cache memory', or "
                      "--kv-cache-memory-bytes")
    pool.add_argument("--block-bytes", type=byte_size_argument, metavar="SIZE",
                      help="one pool block across every KV layer: 2 x layers x kv_heads x head_dim x block_size "
                      "x dtype bytes (per worker)")
    pool.add_argument("--block-size", type=positive_int_argument, default=16, metavar="TOKENS",
                      help="tokens per block (vLLM's --block-size; default 16)")
    pool.add_argument("--max-model-len", type=positive_int_argument, metavar="TOKENS",
                      help="vLLM's --max-model-len: one such sequence must still fit the pool")


def _add_audit_parser(sub: Any) -> None:
    audit = sub.add_parser(
        "audit",
        help="compare a warmed-up model's declarations with the caches it holds",
        description="Import MODULE:FACTORY, call it to get a module that has run, and audit it. "
        "Exit 4 on under-declared or undeclared caches.",
    )
    audit.add_argument("target", metavar="MODULE:FACTORY")
    audit.add_argument(
        "--max-num-seqs", type=positive_int_argument,
        help="live sequences the factory left (default: derived from the caches' batch rows)",
    )
    audit.add_argument("--json", action="store_true", help="print only the report as JSON")


_DEPLOY_ONLY = (
    ("--stage-declarations", "stage_declarations"),
    ("--device-memory-of", "device_memory_of"),
    ("--platform", "platform"),
)

_NOT_WITH_DEPLOY = (
    ("--margin-bytes", "margin_bytes", "the ledger uses vLLM-Omni's own 1 GiB margin and 1 GiB external reserve"),
    ("--gpu-memory-utilization", "gpu_memory_utilization", "each stage's comes from the deploy file"),
    ("--max-num-seqs", "max_num_seqs", "each stage's comes from the deploy file"),
    ("--kv-pool-bytes", "kv_pool_bytes", "reserve is planned per engine: plan the stage's engine without --deploy"),
    ("--override", "override",
     ("OWNER/NAME would not say which stage it corrects; put the corrected declarations in a spec file "
      "and pass it with --stage-declarations STAGE=FILE")),
)


def _run_plan(args: argparse.Namespace) -> int:
    if args.deploy is not None:
        return _run_deploy_plan(args)
    for flag, attr in _DEPLOY_ONLY:
        if getattr(args, attr):
            raise _BadInput(f"{flag} applies to --deploy FILE only")
    if args.gpu_memory_utilization is None:
        args.gpu_memory_utilization = 0.9
    if args.max_num_seqs is None:
        args.max_num_seqs = 256
    if args.list_presets:
        for name, preset in PRESETS.items():
            print(f"{name}: {preset.summary}")
            for override, why in preset.corrections:
                print(f"    correction: --override {override}\n        ({why})")
        return EXIT_OK
    if args.spec_file is None and args.preset is None:
        raise _BadInput("give --spec-file FILE or --preset NAME (see --list-presets)")
    pool_given = [args.kv_pool_bytes, args.block_bytes, args.max_model_len]
    if any(v is not None for v in pool_given) and any(v is None for v in pool_given):
        raise _BadInput("the pool needs all of --kv-pool-bytes SIZE, --block-bytes SIZE and --max-model-len TOKENS")
    if args.policy == Policy.RESERVE.value and args.kv_pool_bytes is None:
        raise _BadInput("--policy reserve takes model-local KV out of the paged pool: give --kv-pool-bytes SIZE, "
                        "--block-bytes SIZE and --max-model-len TOKENS")
    if args.policy == Policy.RESERVE.value and args.headroom_bytes is None and args.device_memory is None:
        return _run_reserve_plan(args, None)
    if args.headroom_bytes is None and args.device_memory is None:
        raise _BadInput("give --headroom-bytes SIZE or --device-memory SIZE")
    if args.headroom_bytes is not None and args.margin_bytes is not None:
        raise _BadInput("--margin-bytes applies to --device-memory; an explicit --headroom-bytes is used as given")
    try:
        collection = load_spec_file(args.spec_file) if args.spec_file else preset_collection(args.preset)
    except SpecFileError as exc:
        raise _BadInput(str(exc)) from None
    collection = _with_overrides(collection, args.override)
    if args.headroom_bytes is not None:
        headroom = headroom_override(args.headroom_bytes, "--headroom-bytes (operator override)")
    else:
        headroom = headroom_outside_requested(args.device_memory, args.gpu_memory_utilization, args.margin_bytes)
    worker = budget_worker(collection, headroom, rank=0, max_num_seqs=args.max_num_seqs)
    if args.kv_pool_bytes is not None:
        return _run_reserve_plan(args, worker)
    plan = make_plan([worker], args.max_num_seqs, args.policy)
    if args.json:
        print(plan.model_dump_json(indent=2))
    else:
        print(render_plan_table(plan))
    if plan.decision is Decision.INFEASIBLE:
        print(f"kv-budget: {infeasible_message(plan)}", file=sys.stderr)
        return EXIT_INFEASIBLE
    return EXIT_OK


def _run_reserve_plan(args: argparse.Namespace, worker: WorkerBudget | None) -> int:
    """Both choices at the given pool: what ``cap`` does to concurrency
    (when a headroom was given) and what ``reserve`` does to the pool."""
    if worker is None:
        try:
            collection = load_spec_file(args.spec_file) if args.spec_file else preset_collection(args.preset)
        except SpecFileError as exc:
            raise _BadInput(str(exc)) from None
        collection = _with_overrides(collection, args.override)
        worker = budget_worker(collection, headroom_override(0, "not used by reserve"), max_num_seqs=args.max_num_seqs)
        cap_plan = None
    else:
        cap_plan = make_plan([worker], args.max_num_seqs, Policy.CAP)
    blocks_per_sequence = per_each(args.max_model_len, args.block_size)
    reserve = plan_reserve(
        [reserve_out_of_pool(worker, args.max_num_seqs, args.kv_pool_bytes, args.block_bytes,
                             blocks_per_sequence * args.block_bytes)],
        args.max_num_seqs, args.max_model_len, pool_source="--kv-pool-bytes",
    )
    if args.json:
        print(json.dumps({"cap": cap_plan.model_dump(mode="json") if cap_plan else None,
                          "reserve": reserve.model_dump(mode="json")}, indent=2))
    else:
        if cap_plan is not None:
            print(render_plan_table(cap_plan))
        print(render_reserve_table(reserve, worker))
        print(render_choices(cap_plan, reserve))
    chosen_infeasible = (
        (args.policy == Policy.RESERVE.value and not reserve.feasible)
        or (args.policy == Policy.CAP.value and cap_plan is not None and cap_plan.decision is Decision.INFEASIBLE)
    )
    if chosen_infeasible:
        message = reserve_infeasible_message(reserve) if args.policy == Policy.RESERVE.value else (
            infeasible_message(cap_plan))
        print(f"kv-budget: {message}", file=sys.stderr)
        return EXIT_INFEASIBLE
    return EXIT_OK


def _split_assignment(flag: str, text: str) -> tuple[str, str]:
    key, equals, value = text.partition("=")
    if not equals or not key.strip() or not value.strip():
        raise _BadInput(f"{flag} {text!r}: expected KEY=VALUE, e.g. {flag} 0=80GiB")
    return key.strip(), value.strip()


def _device_sizes(texts: list[str]) -> dict[int, int]:
    sizes: dict[int, int] = {}
    for text in texts:
        key, value = _split_assignment("--device-memory-of", text)
        if not key.isdigit():
            raise _BadInput(f"--device-memory-of {text!r}: device {key!r} is not a device index")
        try:
            size = parse_byte_size(value)
        except ValueError as exc:
            raise _BadInput(f"--device-memory-of {text!r}: {exc}") from None
        if int(key) in sizes:
            raise _BadInput(f"--device-memory-of {text!r}: device {key} is given twice")
        sizes[int(key)] = size
    return sizes


def _stage_declarations(texts: list[str]) -> dict[int, StageDeclarations]:
    """``STAGE=PRESET_OR_SPEC_FILE`` -> the stage's declarations: a preset
    name when it is one, else a spec file path."""
    found: dict[int, StageDeclarations] = {}
    for text in texts:
        key, value = _split_assignment("--stage-declarations", text)
        try:
            stage = int(key)
        except ValueError:
            raise _BadInput(f"--stage-declarations {text!r}: stage {key!r} is not a stage_id (an integer)") from None
        if stage in found:
            raise _BadInput(f"--stage-declarations {text!r}: stage {stage} is given twice")
        try:
            found[stage] = StageDeclarations(stage, supplied_source(value), supplied_collection(value))
        except SuppliedDeclarationsError as exc:
            raise _BadInput(f"--stage-declarations {text!r}: {exc}") from None
    return found


def _run_deploy_plan(args: argparse.Namespace) -> int:
    """``plan --deploy``: the per-device accounts of a vLLM-Omni deploy file."""
    for flag, attr, why in _NOT_WITH_DEPLOY:
        if getattr(args, attr):
            raise _BadInput(f"{flag} does not apply to --deploy: {why}")
    if args.policy == Policy.RESERVE.value:
        raise _BadInput("--policy reserve does not apply to --deploy: a deploy file is planned against each device's "
                        "headroom; plan one stage's engine with --kv-pool-bytes to see what reserve would cost it")
    sizes = _device_sizes(args.device_memory_of)
    declarations = _stage_declarations(args.stage_declarations)
    try:
        deploy = load_deploy(args.deploy, platform=args.platform)
    except DeployError as exc:
        raise _BadInput(str(exc)) from None
    used = sorted({device for stage in deploy.stages for device in stage.devices})
    unused = sorted(set(sizes) - set(used))
    if unused:
        raise _BadInput(f"{deploy.where()}: --device-memory-of names device(s) {unused}; the stages use {used}")
    capacities, sources, headrooms = {}, {}, {}
    for device in used:
        if args.headroom_bytes is not None:
            # As a deployment started with --model-local-kv-headroom: the
            # operator's room outside the pools stands for the admission terms.
            headrooms[device] = (args.headroom_bytes, "--headroom-bytes (the operator's room outside the pools)")
        if device in sizes:
            capacities[device], sources[device] = sizes[device], f"--device-memory-of {device}"
        elif args.device_memory is not None:
            capacities[device], sources[device] = args.device_memory, "--device-memory"
        elif args.headroom_bytes is None:
            users = [s.stage_id for s in deploy.stages if device in s.devices]
            raise _BadInput(
                f"{deploy.where()}: device {device} (stages {users}) has no size: give --device-memory SIZE "
                f"or --device-memory-of {device}=SIZE"
            )
    try:
        plan = plan_deploy(deploy, capacities, declarations, args.policy, sources, headrooms)
    except DeployError as exc:
        raise _BadInput(str(exc)) from None
    print(plan.model_dump_json(indent=2) if args.json else render_deploy_table(plan))
    if plan.infeasible:
        print(f"kv-budget: {deploy_infeasible_message(plan)}", file=sys.stderr)
        return EXIT_INFEASIBLE
    return EXIT_OK


def _with_overrides(collection: Collection, texts: list[str]) -> Collection:
    """The declarations corrected by ``--override``; one that matches none
    is bad input naming the declarations that exist."""
    try:
        corrected, unmatched = apply_overrides(collection, parse_overrides(texts))
    except OverrideError as exc:
        raise _BadInput(str(exc)) from None
    if unmatched:
        labels = [declaration_label(owned.owner, owned.spec.name) for owned in collection.specs]
        raise _BadInput(unmatched_message(unmatched, labels))
    return corrected


def _run_audit(args: argparse.Namespace) -> int:
    from kv_budget.audit import audit_module, load_factory
    from kv_budget.sample.caches import UnsupportedCacheError

    # Like `python -m`, resolve MODULE from the working directory first, so
    # a project's own warm-up script is importable without installing it.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = load_factory(args.target)
        report = audit_module(module, max_num_seqs=args.max_num_seqs)
    except (ValueError, UnsupportedCacheError) as exc:
        raise _BadInput(str(exc)) from None
    print(report.model_dump_json(indent=2) if args.json else report.render_table())
    return EXIT_AUDIT_FAILED if report.failed else EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    runners = {"plan": _run_plan, "audit": _run_audit}
    try:
        return runners[args.command](args)
    except _BadInput as exc:
        # One line, whatever the message was built from (a parser's error
        # may span several): scripts read the first line only.
        message = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        print(f"kv-budget {args.command}: error: {message}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
