"""The README stays a page an operator reads, not an inventory."""

from __future__ import annotations

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
