"""The README stays short and leads into the docs: every relative link it has reaches a
file of the repository (a docs page, an image, a folder), and every ``#anchor`` a
heading of that page, as a code host renders them, so the links work there as on the
site. The docs pages' own links are checked by the strict site build
(tests/docs/test_docs_site.py)."""

from __future__ import annotations

import re
from pathlib import Path

from support.daemon_harness import ROOT

README = ROOT / "README.md"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.M)
FENCE = re.compile(r"^```.*?^```$", re.M | re.S)
MAX_LINES = 250


def slug(heading: str) -> str:
    """A heading's anchor as GitHub (and mkdocs' toc) makes it: lower case, punctuation
    dropped, spaces to hyphens."""
    text = re.sub(r"[`*]|\{#[^}]*\}", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(h) for h in HEADING.findall(text)}


def relative_links() -> list[str]:
    text = FENCE.sub("", README.read_text())
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_the_readme_is_short() -> None:
    lines = README.read_text().count("\n")
    assert lines < MAX_LINES, f"README.md has {lines} lines: move detail into docs/"


def test_every_relative_link_of_the_readme_resolves() -> None:
    links = relative_links()
    assert len(links) > 20
    for link in links:
        path, _, anchor = link.partition("#")
        target = (README.parent / path) if path else README
        assert target.exists(), f"README links {link}: no such file"
        if anchor:
            assert target.suffix == ".md", link
            assert anchor in anchors(target), f"README links {link}: no such heading"


def test_the_readme_leads_to_every_docs_page() -> None:
    linked = {(README.parent / link.partition("#")[0]).resolve() for link in relative_links()}
    pages = {
        p.resolve()
        for p in (ROOT / "docs").rglob("*.md")
        if "bench" not in p.relative_to(ROOT / "docs").parts or p.name == "HISTORY.md"
    }
    missing = sorted(str(p.relative_to(ROOT)) for p in pages - linked)
    assert not missing, f"docs pages the README does not link: {missing}"
