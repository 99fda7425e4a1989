"""``python -m batchd.daemon.docs [--check] [--out DIR]``: write the generated pages.

``--out`` defaults to the repository's docs/reference; ``--check`` writes nothing and
exits 1 naming each page that differs from what the code gives (tests/docs runs it).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from batchd.daemon.docs import cli_page, protocol_page, settings_page

# The repository's docs/reference, for a checkout (the package folders live at its root).
DEFAULT_OUT = Path(__file__).resolve().parents[2] / "docs" / "reference"
PAGES: dict[str, Callable[[], str]] = {
    "cli.md": cli_page.render,
    "configuration.md": settings_page.render,
    "protocol.md": protocol_page.render,
    "protocol.schema.json": lambda: protocol_page.SCHEMA_FILE.read_text(),
}


def stale_pages(out: Path) -> list[str]:
    """Names of the pages under ``out`` that differ from what the code gives now."""
    return [
        name
        for name, render in PAGES.items()
        if not (out / name).is_file() or (out / name).read_text() != render()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchd.daemon.docs", description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder of the pages")
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_pages(args.out)
        for name in stale:
            print(f"{args.out / name} is out of date: run python -m batchd.daemon.docs")
        return 1 if stale else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, render in PAGES.items():
        (args.out / name).write_text(render())
        print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
