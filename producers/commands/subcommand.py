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


class _OneModel(argparse.Action):
    """``--model`` and ``--preset``: two spellings of one option, so that a command takes
    whichever a user types; naming two different models is a usage error, not a silent
    choice of the last one."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        given: tuple[str, str] | None = getattr(namespace, "_model_given", None)
        if given is not None and given[0] != option_string and given[1] != values:
            parser.error(
                f"{given[0]} {given[1]} and {option_string} {values} name different models: "
                "give one (both spellings take a preset, a .gguf file, a directory or a hub id)"
            )
        namespace._model_given = (option_string, values)
        setattr(namespace, self.dest, values)


def add_model_option(parser: argparse.ArgumentParser, *, help: str) -> None:
    """Add ``--model MODEL`` with ``--preset MODEL`` as its other spelling (to ``model``,
    default None); the command resolves the value through the engine's model registry."""
    parser.add_argument(
        "--model", "--preset", dest="model", action=_OneModel, metavar="MODEL", help=help
    )
