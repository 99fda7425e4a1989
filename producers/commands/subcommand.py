"""Subcommands whose help text is their handler's docstring.

The text a developer reads above a handler is the text a user reads in
``batchd COMMAND --help``, so the two cannot drift apart, and every command
module adds its parser the same one-line way.
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from typing import Any

from batchd.config.settings import Settings

Handler = Callable[[argparse.Namespace, Settings], int]


def add_command(sub: Any, name: str, handler: Handler) -> argparse.ArgumentParser:
    """Add ``batchd NAME`` run by ``handler``.

    The docstring's first line is the one-line help in ``batchd --help``; the
    paragraphs after it, when there are any, are the command's description.
    """
    summary, _, details = inspect.cleandoc(handler.__doc__ or "").partition("\n\n")
    if not summary:
        raise ValueError(f"batchd {name}: handler {handler.__qualname__} needs a docstring")
    help_line = " ".join(summary.split()).rstrip(".")
    parser = sub.add_parser(
        name, help=help_line[:1].lower() + help_line[1:], description=details or summary
    )
    parser.set_defaults(func=handler)
    return parser
