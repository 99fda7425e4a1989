"""Code comments keep a decision and when to revisit it; the figures behind it live in the
measurement log (docs/bench/HISTORY.md), where a rerun can replace them.

A figure is a number with a unit of time, speed or ratio (``3.1 ms``, ``30 us``,
``1.65x``, ``9%``, ``117 tok/s``, ``219 GFLOP/s``) inside a comment or docstring of the
product's Python or C sources.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("engine", "daemon", "producers", "config")
FIGURE = re.compile(
    r"\b\d+(?:\.\d+)?\s?(?:ms|us|µs|tok/s|GFLOP/s|GB/s)\b"
    r"|\b\d+(?:\.\d+)?x\b"
    r"|\b\d+(?:\.\d+)?%"
)
C_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
# A code literal in a docstring (an output format's example, ``<0x..>``) is no figure.
LITERAL = re.compile(r"``.*?``", re.S)


def python_comments(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring-like string statement in ``source``."""
    found = []
    previous = tokenize.NEWLINE
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found.append((token.start[0], token.string))
        elif token.type == tokenize.STRING and previous in (
            tokenize.NEWLINE,
            tokenize.INDENT,
            tokenize.DEDENT,
            tokenize.NL,
        ):
            found.append((token.start[0], token.string))
        if token.type not in (tokenize.COMMENT, tokenize.NL):
            previous = token.type
    return found


def c_comments(source: str) -> list[tuple[int, str]]:
    return [(source.count("\n", 0, m.start()) + 1, m.group()) for m in C_COMMENT.finditer(source)]


def figures_in_text(text: str) -> list[str]:
    return [match.group() for match in FIGURE.finditer(LITERAL.sub("", text))]


def figures_in(path: Path) -> list[str]:
    source = path.read_text(encoding="utf-8")
    comments = python_comments(source) if path.suffix == ".py" else c_comments(source)
    return [
        f"{path.relative_to(ROOT)}:{line}: {figure}"
        for line, text in comments
        for figure in figures_in_text(text)
    ]


def product_sources() -> list[Path]:
    return sorted(
        path
        for folder in PRODUCT
        for pattern in ("*.py", "*.c", "*.h")
        for path in (ROOT / folder).rglob(pattern)
    )


def test_product_comments_carry_no_measured_figures() -> None:
    sources = product_sources()
    assert len(sources) > 100  # the scan sees the product
    found = [hit for path in sources for hit in figures_in(path)]
    assert not found, "figures belong in docs/bench/HISTORY.md:\n" + "\n".join(found)


def test_the_scan_finds_a_figure_in_a_comment_and_a_docstring(tmp_path: Path) -> None:
    code = '"""Doc: 12 rows took 3.1 ms."""\nx = 1  # 1.65x faster\ny = "9% in a string value"\n'
    hits = [m.group() for _, text in python_comments(code) for m in FIGURE.finditer(text)]
    assert hits == ["3.1 ms", "1.65x"]
    assert figures_in_text("An example: ``mixed 1.62x``; measured 2.5x.") == ["2.5x"]
    c = "/* 30 us per row */ int x = 2; // 9% slower\nint y = 5;"
    assert [m.group() for _, t in c_comments(c) for m in FIGURE.finditer(t)] == ["30 us", "9%"]
