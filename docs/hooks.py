"""mkdocs hooks: the measurement log's links, made to work on the site.

docs/bench/ is the benchmark's own record (HISTORY.md and results/), written to be read
in the repository as well: it links the site's pages by relative path
(``../performance.md``), which both a code host and mkdocs resolve, and the results
folder (``results/``), which on the site is an index page generated here, listing every
report. A link into the README from those pages is a build warning (strict builds fail
on it): the README is no page of the site; link the page that holds the section.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.plugins.batchd")

RESULTS_INDEX = "bench/results/index.md"
_README_LINK = re.compile(r"\]\((?:\.\./)+README\.md[^)]*\)")
_HEADING = re.compile(r"^#\s+(.+)$", re.M)


def on_files(files: Files, config: Any) -> Files:
    """Add bench/results/index.md: every report of the results folder, newest name last."""
    reports = sorted(
        (f for f in files if f.src_uri.startswith("bench/results/") and f.src_uri.endswith(".md")),
        key=lambda f: f.src_uri,
    )
    lines = [
        "# Benchmark reports",
        "",
        "Every report `batchd bench` wrote for the [measurement log](../HISTORY.md), by name "
        "(each with its `.png` chart, where it has one).",
        "",
    ]
    for report in reports:
        match = _HEADING.search(report.content_string)
        title = match.group(1).strip() if match else report.name
        name = report.src_uri.rsplit("/", 1)[-1]
        lines.append(f"- [{name}]({name}): {title}")
    files.append(File.generated(config, RESULTS_INDEX, content="\n".join(lines) + "\n"))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """In the measurement log's pages: no README link; the results folder is its index."""
    if not page.file.src_uri.startswith("bench/"):
        return markdown
    for match in _README_LINK.finditer(markdown):
        log.warning(
            f"{page.file.src_uri}: links the README ({match.group(0)}): "
            "link the docs page that holds that section"
        )
    return markdown.replace("](results/)", "](results/index.md)")
