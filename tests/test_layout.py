"""The layout follows the data flow, and the product stands alone.

kv-budget's core runs declare -> collect -> override -> settings -> stage -> sample
-> ledger -> plan -> watch -> report; the entry points (the offline audit,
the startup call, the command) sit on top, and the vLLM glue on top of
them. A module imports only its own step or earlier ones: one that must
reach back against the flow sits in the wrong place. The vLLM glue is a
package of its own, ``vllm_patches``, in layers (patching and compat; what
an engine knows about itself; what runs in a worker, the flags and the chunk
scheduling; the hooks; the vLLM-Omni driver; ``plugin``, whose
``register`` applies them), with no circle among its modules and no glue
import inside a function. Only the glue imports vLLM; nothing installed
imports the demo, the peers' code or the tests; no ``_private`` name
crosses a module boundary. Read from the source (imports inside functions
count), so the test needs no vLLM. The wheel, built from a copy of the
checkout, holds kv_budget/ and vllm_patches/ only.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kv_budget", "vllm_patches")

FLOW = (
    ("kv_budget.units", "kv_budget.errors", "kv_budget.log", "kv_budget.runtime_files"),
    ("kv_budget.declare",),
    ("kv_budget.collect",),
    ("kv_budget",),  # the package itself: the declaring surface, from declare and collect
    ("kv_budget.override",),
    ("kv_budget.settings",),
    ("kv_budget.stage",),
    ("kv_budget.sample",),
    ("kv_budget.ledger",),
    ("kv_budget.plan",),
    ("kv_budget.deployment",),
    ("kv_budget.watch",),
    ("kv_budget.report",),
    ("kv_budget.audit", "kv_budget.startup", "kv_budget.cli"),
    ("vllm_patches", "vllm_patches.patching", "vllm_patches.compat"),  # the package itself imports nothing
    ("vllm_patches.engine",),
    ("vllm_patches.workers", "vllm_patches.cache_updates", "vllm_patches.flags", "vllm_patches.omni_chunks"),
    ("vllm_patches.frontend", "vllm_patches.pool_hook", "vllm_patches.live_hook"),
    ("vllm_patches.startup_hook",),
    ("vllm_patches.omni_deployment",),
    ("vllm_patches.omni",),
    ("vllm_patches.plugin",),  # register: every patch, in order
)
"""The steps in order; a module belongs to the longest prefix that names it."""

GLUE = "vllm_patches"
NOT_THE_PRODUCT = ("kv_budget_demo", "peers", "tests", "engine_support", "benchmarks")


def step_of(module: str) -> int:
    matches = [(len(prefix), index) for index, step in enumerate(FLOW) for prefix in step
               if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} is in no step of FLOW: add it where the flow puts it"
    return max(matches)[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) for every import, relative ones resolved."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.extend((alias.name, [], node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            found.append((module, [alias.name for alias in node.names], node.lineno))
    return found


def is_glue(module: str) -> bool:
    return module == GLUE or module.startswith(GLUE + ".")


MODULES = sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))


def test_the_layout_is_read_from_every_module():
    names = {module_name(path) for path in MODULES}
    assert {"kv_budget.declare.spec", "kv_budget.collect.model", "kv_budget.plan.planner", "vllm_patches.startup_hook",
            "kv_budget.watch.live", "kv_budget.startup"} <= names


@pytest.mark.parametrize("path", MODULES, ids=module_name)
def test_a_module_imports_only_its_own_step_or_earlier_ones(path):
    here = module_name(path)
    against = [
        f"line {line}: {module} ({FLOW[step_of(module)][0]}) is later in the flow than {FLOW[step_of(here)][0]}"
        for module, _, line in imports_of(path)
        if module.split(".")[0] in PACKAGES and step_of(module) > step_of(here)
    ]
    assert not against, f"{here}: " + "; ".join(against)


@pytest.mark.parametrize("path", MODULES, ids=module_name)
def test_only_the_glue_imports_vllm_and_nothing_imports_what_is_not_installed(path):
    here = module_name(path)
    for module, _, line in imports_of(path):
        top = module.split(".")[0]
        if top in ("vllm", "vllm_omni"):
            assert is_glue(here), f"{here} line {line} imports {module}"
        assert top not in NOT_THE_PRODUCT, f"{here} line {line} imports {module}, which is not installed"


@pytest.mark.parametrize("path", MODULES, ids=module_name)
def test_no_private_name_crosses_a_module_boundary(path):
    here = module_name(path)
    crossing = [f"line {line}: {name} from {module}" for module, names, line in imports_of(path)
                if module.split(".")[0] in PACKAGES and module != here
                for name in names if name.startswith("_") and not name.startswith("__")]
    assert not crossing, f"{here}: " + "; ".join(crossing)


@pytest.mark.parametrize("path", MODULES, ids=module_name)
def test_every_error_kv_budget_raises_derives_from_one_base(path):
    """An operator catches everything kv-budget refuses with as ``KvBudgetError``."""
    own = [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
           and (node.name.endswith("Error") or any(getattr(b, "id", "") in ("Exception", "ValueError", "RuntimeError",
                                                                         "TypeError") for b in node.bases))]
    apart = [node.name for node in own
             if node.name != "KvBudgetError" and not any(getattr(b, "id", "") == "KvBudgetError" for b in node.bases)
             and not any(getattr(b, "id", "").endswith("Error") and getattr(b, "id", "") not in (
                 "ValueError", "RuntimeError", "TypeError") for b in node.bases)]
    assert not apart, f"{module_name(path)}: {apart} do not derive from kv_budget.errors.KvBudgetError"


MOST_LINES = 60
"""The longest a function of the product may be, docstring included."""


@pytest.mark.parametrize("path", MODULES, ids=module_name)
def test_no_function_is_longer_than_sixty_lines(path):
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= MOST_LINES]
    assert not long, f"{module_name(path)}: " + "; ".join(long)


def test_the_glue_has_no_import_circle():
    graph = {module_name(p): {m for m, _, _ in imports_of(p) if is_glue(m) and m != module_name(p)}
             for p in MODULES if is_glue(module_name(p))}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})) for nxt in graph.get(start, ()))

    circles = sorted(module for module in graph if reaches(module, module, {module}))
    assert not circles, f"modules on an import circle: {circles}"


def imports_inside_functions(path: Path) -> list[tuple[str, int]]:
    """(module, line) for every import written inside a function body,
    resolved as :func:`imports_of` resolves it."""
    lines = {node.lineno for function in ast.walk(ast.parse(path.read_text()))
             if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
             for node in ast.walk(function) if isinstance(node, (ast.Import, ast.ImportFrom))}
    return [(module, line) for module, _, line in imports_of(path) if line in lines]


@pytest.mark.parametrize("path", [p for p in MODULES if is_glue(module_name(p))], ids=module_name)
def test_the_glue_imports_its_own_modules_at_the_top(path):
    """An import inside a function is how a circle hides: the layers hold
    only where every glue module names the ones it needs at import time."""
    inside = [f"line {line}: {module}" for module, line in imports_inside_functions(path) if is_glue(module)]
    assert not inside, f"{module_name(path)} imports glue inside a function: " + "; ".join(inside)


def test_the_wheel_carries_the_product_only(tmp_path):
    """``pip wheel --no-deps .`` holds kv_budget/ (core and command),
    vllm_patches/ (the glue) and the plugin entry point; the demo and peers/
    stay in the checkout."""
    root = ROOT
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.cfg", "README.md"):
        shutil.copy(root / name, source / name)
    for name in ("kv_budget", "vllm_patches", "demo", "peers"):
        shutil.copytree(root / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(source),
         "-w", str(tmp_path / "wheel")], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp_path / "wheel").glob("kv_budget-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"kv_budget", "vllm_patches", next(top for top in tops if top.endswith(".dist-info"))}
    assert {"vllm_patches/__init__.py", "kv_budget/cli.py", "kv_budget/startup.py"} <= set(names)
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "kv_budget = vllm_patches.plugin:register" in entry_points
    assert "kv-budget = kv_budget.cli:main" in entry_points
    assert "kv_budget_demo" not in entry_points and "stat_logger_plugins" not in entry_points
