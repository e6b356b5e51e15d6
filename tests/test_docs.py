"""The README stays a page an operator reads, not an inventory."""

from __future__ import annotations

import ast
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
MOST_CHARACTERS = 10_000
"""What the README may hold; the details live in docs/."""


def test_the_readme_is_at_most_ten_thousand_characters():
    assert len(README.read_text()) <= MOST_CHARACTERS


def test_every_page_the_readme_links_to_exists():
    text = README.read_text()
    targets = {part.split(")")[0].split("#")[0] for part in text.split("](")[1:]}
    missing = sorted(t for t in targets if t and not t.startswith("http") and not (README.parent / t).exists())
    assert not missing, f"README links to missing pages: {missing}"


OPERATOR_PAGE = README.parent / "docs" / "operator.md"
PRODUCT = [path for package in ("kv_budget", "vllm_patches") for path in sorted((README.parent / package).rglob("*.py"))]
MOST_TELLING = 12
"""Characters a message's longest fixed fragment needs to name it; shorter ones ("live:") are generic."""


def _logged_fragments() -> list[tuple[str, str]]:
    """(where, the longest fixed text) of every warning and error line the product logs with a literal format."""
    found = []
    for path in PRODUCT:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in ("warning", "error") and getattr(
                    func.value, "id", None) == "logger":
                args = node.args
            elif isinstance(func, ast.Name) and func.id == "_warn_once":
                args = node.args[1:]
            else:
                continue
            if args and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str):
                text = re.sub(r"^kv-budget:? (live: )?", "", args[0].value)
                best = max((part.strip(" ;:,.()") for part in re.split(r"%[-\d.]*[sdrgf]", text)), key=len)
                if len(best) >= MOST_TELLING:
                    found.append((f"{path.name}:{node.lineno}", best))
    return found


def test_every_warning_the_product_logs_is_on_the_operator_page():
    page = " ".join(OPERATOR_PAGE.read_text().split())
    fragments = _logged_fragments()
    assert len(fragments) > 25  # the reader found the log calls
    missing = [f"{where}: {text!r}" for where, text in fragments if " ".join(text.split()) not in page]
    assert not missing, "docs/operator.md does not quote: " + "; ".join(missing)


def test_every_refusal_and_finding_kind_is_on_the_operator_page():
    page = OPERATOR_PAGE.read_text()
    errors = {node.name for path in PRODUCT for node in ast.walk(ast.parse(path.read_text()))
              if isinstance(node, ast.ClassDef) and node.name.endswith("Error") and node.name != "KvBudgetError"}
    assert len(errors) >= 12 and not [name for name in sorted(errors) if f"`{name}`" not in page]
    schema = (README.parent / "kv_budget" / "watch" / "live_state.py").read_text()
    kinds = re.search(r'kind: Literal\[([^\]]*)\]', schema).group(1)
    assert not [kind for kind in re.findall(r'"([a-z-]+)"', kinds) if f"| `{kind}` |" not in page]


def test_every_test_the_testing_index_names_exists():
    """The index in docs/testing.md names tests as ``file.py::name`` (``::name`` for another in the same file)."""
    text = (README.parent / "docs" / "testing.md").read_text()
    index = text[text.index("## Where each fault is tested"):]
    missing, current = [], None
    for file, name in re.findall(r"`(?:(test_\w+\.py))?::(\w+)", index):
        current = file or current
        source = (README.parent / "tests" / current).read_text()
        if f"def {name}(" not in source and f"class {name}" not in source:
            missing.append(f"{current}::{name}")
    assert len(re.findall(r"::\w+", index)) > 40 and not missing, missing


def test_every_test_file_the_testing_index_names_exists_and_every_file_is_indexed():
    """The part index in docs/testing.md names test files; each exists, and
    no test file of the suite is missing from it."""
    text = (README.parent / "docs" / "testing.md").read_text()
    index = text[text.index("## Where each part is tested"):text.index("## Where each fault is tested")]
    named = set(re.findall(r"`(test_\w+\.py)`", index))
    files = {path.name for path in (README.parent / "tests").glob("test_*.py")}
    assert sorted(named - files) == [] and sorted(files - named) == []
