"""The README and docs/ guides: short enough to read, and every link resolves (issue 49)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_CODE = re.compile(r"```.*?```", re.DOTALL)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = _CODE.sub("", path.read_text())
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, re.MULTILINE)}


def test_the_readme_is_read_in_minutes():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines < 300, f"README.md has {lines} lines: move detail to a guide in docs/"


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_link_resolves(doc: Path):
    broken = []
    for target in _LINK.findall(_CODE.sub("", doc.read_text())):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file_part, _, anchor = target.partition("#")
        path = (doc.parent / file_part).resolve() if file_part else doc
        unknown_anchor = anchor and path.suffix == ".md" and anchor not in _anchors(path)
        if not path.exists() or unknown_anchor:
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)}: broken links {broken}"
