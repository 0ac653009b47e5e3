"""The docs hold together: every relative link of the README and of docs/ names a file that
exists (and a heading there, for a link with an anchor), and no page outgrows a ten-minute read.

docs/architecture.md is a map into docs/design/ and docs/benchmarks/; pages move and split, and
a link left behind is found here rather than by a reader."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
#: The longest a page of docs/ may grow, in lines (issue 23: a newcomer reads the map in ten
#: minutes, and each topic's page in a few).
MAX_LINES = 300


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as '-'."""
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.*)$", page.read_text(), re.MULTILINE)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        name, _, anchor = target.partition("#")
        linked = (page.parent / name).resolve() if name else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


@pytest.mark.parametrize("page", [p for p in PAGES if p.parent != ROOT],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_stay_short(page: Path) -> None:
    assert len(page.read_text().splitlines()) <= MAX_LINES
