"""Cost of collecting declarations and planning, on large module trees.

The engine hook walks every module of the loaded model at startup
(``collect_model_local_kv_specs``) and then budgets and plans
(``budget_worker`` + ``make_plan``). This measures both on synthetic
``torch.nn.Module`` trees of 1e3, 1e4 and 1e5 modules, shaped like a
transformer (model -> ModuleList of layers -> blocks -> Sequentials ->
leaves), with 0, 1, 10 and 100 declarers spread through the tree. Declarers
build real ``ModelLocalKVSpec`` objects on every call, as the real ones do.
Beside them, the bare ``named_modules()`` walk: the floor any collector that
visits every module pays on this machine.

Target: collecting over 1e5 modules takes < 100 ms (median).

    .venv/bin/python benchmarks/bench_collect.py            # full
    .venv/bin/python benchmarks/bench_collect.py --quick    # 1e3 and 1e4 only
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch
from machine import loadavg, machine_info

from kv_budget.collect.model import collect_model_local_kv_specs
from kv_budget.declare.spec import ModelLocalKVSpec
from kv_budget.plan.planner import budget_worker, headroom_override, make_plan
from kv_budget.settings import Policy
from kv_budget.units import GiB

HERE = Path(__file__).resolve().parent
TARGET_MODULES = 100_000
TARGET_MS = 100.0
DEPTH = 5
"""Levels below the root: model body, layer list, layer, block, leaf."""


class _Declares:
    """Mixin: a module that owns a cache and declares it. Which kind is
    picked by position so the planner sees every charge (per sequence,
    uncharged fixed, already charged)."""

    kv_kind = 0

    def model_local_kv_specs(self) -> list[ModelLocalKVSpec]:
        if self.kv_kind == 0:
            return [ModelLocalKVSpec(
                name="step_kv", layers=4, kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                physical_capacity_positions=71, capacity_source="sliding_window - 1",
                scope="request", rows="max_num_seqs")]
        if self.kv_kind == 1:
            return [ModelLocalKVSpec(
                name="session_kv", layers=2, kv_heads=8, head_dim=64, dtype=torch.float16,
                physical_capacity_positions=1500, capacity_source="embed_positions rows",
                scope="session", rows="fixed", rows_fixed=1, rows_reason="one streaming session")]
        return [ModelLocalKVSpec(
            name="graph_pool_kv", layers=4, kv_heads=2, head_dim=64, dtype=torch.bfloat16,
            physical_capacity_positions=11, capacity_source="group_size + max(delay_pattern)",
            scope="model", rows="fixed", rows_fixed=261, rows_reason="sum of captured buckets")]


class Body(torch.nn.Module):
    pass


class Layer(torch.nn.Module):
    pass


class DeclaringBody(_Declares, Body):
    pass


class DeclaringModuleList(_Declares, torch.nn.ModuleList):
    pass


class DeclaringLayer(_Declares, Layer):
    pass


class DeclaringSequential(_Declares, torch.nn.Sequential):
    pass


class DeclaringIdentity(_Declares, torch.nn.Identity):
    pass


# Per level below the root: (plain class, declaring class, how children are attached)
_LEVELS = [
    (Body, DeclaringBody, "attr"),
    (torch.nn.ModuleList, DeclaringModuleList, "list"),
    (Layer, DeclaringLayer, "attr"),
    (torch.nn.Sequential, DeclaringSequential, "list"),
    (torch.nn.Identity, DeclaringIdentity, None),
]


def _fanout(n_modules: int) -> int:
    """Smallest fan-out whose full tree of DEPTH levels holds n_modules."""
    fanout = 1
    while sum(fanout**level for level in range(DEPTH + 1)) < n_modules:
        fanout += 1
    return fanout


def build_tree(n_modules: int, n_declarers: int) -> torch.nn.Module:
    """A tree of exactly ``n_modules`` modules (root included), built
    breadth first with the same fan-out at every level; ``n_declarers`` of
    the non-root modules, evenly spaced in that order (so at every depth in
    proportion), declare a cache."""
    if n_declarers > n_modules - 1:
        raise ValueError(f"{n_declarers} declarers do not fit in {n_modules - 1} non-root modules")
    fanout = _fanout(n_modules)
    step = (n_modules - 1) / n_declarers if n_declarers else 0
    declaring = {1 + int(i * step) for i in range(n_declarers)}
    root = torch.nn.Module()
    frontier = [(root, "attr")]
    created = 1
    for level, (plain, declaring_cls, attach) in enumerate(_LEVELS):
        next_frontier = []
        for parent, parent_attach in frontier:
            children = []
            for _ in range(fanout):
                if created >= n_modules:
                    break
                cls = declaring_cls if created in declaring else plain
                child = cls()
                if cls is declaring_cls:
                    child.kv_kind = created % 3
                children.append(child)
                created += 1
            for index, child in enumerate(children):
                name = str(index) if parent_attach == "list" else f"{plain.__name__.lower()}{index}"
                parent.add_module(name, child)
            next_frontier += [(child, attach) for child in children]
        frontier = next_frontier
        if created >= n_modules:
            break
    return root


def _time_ms(function, repeats: int) -> tuple[list[float], object]:
    times, result = [], None
    for _ in range(repeats):
        gc.collect()
        began = time.perf_counter()
        result = function()
        times.append((time.perf_counter() - began) * 1000)
    return times, result


def measure(n_modules: int, n_declarers: int, repeats: int) -> dict:
    tree = build_tree(n_modules, n_declarers)
    counted = sum(1 for _ in tree.named_modules())
    assert counted == n_modules, (counted, n_modules)
    # The floor any collector over named_modules() pays: the walk alone.
    walk_ms, _ = _time_ms(lambda: sum(1 for _ in tree.named_modules()), repeats)
    collect_ms, collection = _time_ms(lambda: collect_model_local_kv_specs(tree), repeats)
    assert len(collection.specs) == n_declarers and not collection.failures, collection
    headroom = headroom_override(80 * GiB)

    def plan():
        return make_plan([budget_worker(collection, headroom, rank=0, max_num_seqs=256)], 256, Policy.CAP)

    plan_ms, result = _time_ms(plan, repeats)
    return {
        "modules": n_modules,
        "declarers": n_declarers,
        "fanout": _fanout(n_modules),
        "depth": DEPTH,
        "specs_collected": len(collection.specs),
        "effective_max_num_seqs": result.effective_max_num_seqs,
        "repeats": repeats,
        "walk_ms_median": round(statistics.median(walk_ms), 3),
        "collect_ms_median": round(statistics.median(collect_ms), 3),
        "collect_ms_min": round(min(collect_ms), 3),
        "plan_ms_median": round(statistics.median(plan_ms), 3),
        "plan_ms_min": round(min(plan_ms), 3),
        "walk_ms_all": [round(t, 3) for t in walk_ms],
        "collect_ms_all": [round(t, 3) for t in collect_ms],
        "plan_ms_all": [round(t, 3) for t in plan_ms],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000", help="module counts, comma separated")
    parser.add_argument("--declarers", default="0,1,10,100", help="declarer counts, comma separated")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="sizes 1e3 and 1e4, 3 repeats, output to benchmarks/out")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/bench_collect.json)")
    args = parser.parse_args(argv)
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    declarers = [int(d) for d in args.declarers.split(",")]
    repeats = args.repeats
    out = Path(args.out) if args.out else HERE / "results" / "bench_collect.json"
    if args.quick:
        sizes, repeats = [s for s in sizes if s <= 10_000], 3
        out = Path(args.out) if args.out else HERE / "out" / "bench_collect-quick.json"

    started = loadavg()
    rows = []
    print(f"{'modules':>8} {'declarers':>9} {'walk median ms':>15} {'collect median ms':>18} {'collect min ms':>15} "
          f"{'plan median ms':>15} {'plan min ms':>12}", flush=True)
    for n_modules in sizes:
        for n_declarers in declarers:
            row = measure(n_modules, n_declarers, repeats)
            rows.append(row)
            print(f"{n_modules:>8} {n_declarers:>9} {row['walk_ms_median']:>15.2f} "
                  f"{row['collect_ms_median']:>18.2f} {row['collect_ms_min']:>15.2f} "
                  f"{row['plan_ms_median']:>15.2f} {row['plan_ms_min']:>12.2f}", flush=True)

    checks = []
    at_target = [row for row in rows if row["modules"] == TARGET_MODULES]
    if at_target:
        worst = max(row["collect_ms_median"] for row in at_target)
        checks.append({
            "target": f"collecting over {TARGET_MODULES:,} modules < {TARGET_MS:.0f} ms "
                      "(median, every declarer count)",
            "measured": f"worst median {worst:.2f} ms",
            "passed": worst < TARGET_MS,
        })
    result = {
        "benchmark": "bench_collect",
        "machine": machine_info(),
        "loadavg_start": started,
        "loadavg_end": loadavg(),
        "timer": "time.perf_counter, gc.collect() before each repeat",
        "walk": "sum(1 for _ in tree.named_modules()): the walk alone, no declarer lookup",
        "rows": rows,
        "checks": checks,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"loadavg start {started} end {result['loadavg_end']}")
    for check in checks:
        print(f"{'PASS' if check['passed'] else 'FAIL'}: {check['target']}: {check['measured']}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
