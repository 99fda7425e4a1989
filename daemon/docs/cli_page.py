"""docs/reference/cli.md: every ``batchd`` subcommand and option, from the parsers.

The page is what ``batchd COMMAND --help`` says, laid out for reading: each command's
description (its handler's docstring), a synopsis, and a table of its arguments and
options with their defaults. Options hidden from ``--help`` are left out here too.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection, Iterator
from dataclasses import dataclass

from batchd.daemon.cli import COMMAND_EXTRAS, build_parser
from batchd.daemon.docs.markdown import cell, code, generated_note, prose, table
from batchd.producers.commands.extras import install_command

SOURCE = "the argument parsers (`batchd.daemon.cli.build_parser`)"


@dataclass(frozen=True)
class Argument:
    """One documented argument of one command (``command`` is "" for the globals)."""

    command: str
    names: tuple[str, ...]  # option strings, or the positional's metavar
    metavar: str  # what follows an option ("" for a flag)
    default: str  # as shown on the page ("" for none)
    help: str  # expanded help text ("" when the parser has none)

    @property
    def label(self) -> str:
        return " ".join(self.names) if self.command else self.names[0]


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """NAME -> parser of each subcommand, in the order ``batchd --help`` lists them."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def summaries(parser: argparse.ArgumentParser) -> dict[str, str]:
    """NAME -> the one-line help ``batchd --help`` shows for each subcommand."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {choice.dest: choice.help or "" for choice in action._choices_actions}


def global_dests(parser: argparse.ArgumentParser) -> set[str]:
    """The options every command takes (``--config``, ``--redis-url``, ...)."""
    skip = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)
    return {a.dest for a in parser._actions if not isinstance(a, skip)}


def arguments(
    parser: argparse.ArgumentParser, command: str, *, skip: Collection[str] = ()
) -> Iterator[Argument]:
    """The documented arguments of ``parser`` (help and hidden ones left out)."""
    formatter = argparse.HelpFormatter(parser.prog)
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if action.dest in skip or action.help == argparse.SUPPRESS:
            continue
        help_text = formatter._expand_help(action) if action.help else ""
        if action.option_strings:
            names = tuple(action.option_strings)
            metavar = "" if action.nargs == 0 else _metavar(formatter, action, optional=True)
        else:
            names = (_metavar(formatter, action, optional=False),)
            metavar = ""
        yield Argument(command, names, metavar, _default(action), help_text)


def every_argument() -> list[Argument]:
    """The global options, then each subcommand's arguments: what the page documents."""
    parser = build_parser()
    globals_ = global_dests(parser)
    found = list(arguments(parser, ""))
    for name, sub in subcommands(parser).items():
        found += arguments(sub, name, skip=globals_)
    return found


def render() -> str:
    """The whole page."""
    parser = build_parser()
    globals_ = global_dests(parser)
    lines = [
        generated_note(SOURCE),
        "",
        "# Command line reference",
        "",
        "Every subcommand of `batchd`, with each of its options and their defaults: the "
        "text of `batchd COMMAND --help`. Options left unset take their value from the "
        "settings (see the [configuration reference](configuration.md)). A producer-only "
        "install (`pip install batchd`) has every command; the ones that need an extra say "
        "which.",
        "",
        "```text",
        "batchd [GLOBAL OPTIONS] COMMAND [OPTIONS] [ARGUMENTS]",
        "```",
        "",
        "## Commands",
        "",
    ]
    subs = subcommands(parser)
    helps = summaries(parser)
    rows = [(f"[{code('batchd ' + name)}](#{name})", cell(helps.get(name, ""))) for name in subs]
    lines += table(["Command", "What it does"], rows)
    lines += [
        "",
        "## Global options",
        "",
        "Every command takes these, before or after its name: `batchd --redis-url URL "
        "serve` and `batchd serve --redis-url URL` are the same (given on both sides, "
        "the one after the command wins).",
        "",
    ]
    lines += _options_table([a for a in arguments(parser, "") if a.names[0].startswith("-")])
    lines += [""]
    for name, sub in subs.items():
        lines += _command_section(name, sub, globals_)
    return "\n".join(lines).rstrip() + "\n"


def _command_section(name: str, sub: argparse.ArgumentParser, globals_: set[str]) -> list[str]:
    documented = list(arguments(sub, name, skip=globals_))
    positionals = [a for a in documented if not a.names[0].startswith("-")]
    options = [a for a in documented if a.names[0].startswith("-")]
    synopsis = " ".join(["batchd", name, *(["[OPTIONS]"] if options else [])])
    synopsis += "".join(f" {a.names[0]}" for a in positionals)
    lines = [f"## batchd {name} {{#{name}}}", ""]
    extras = COMMAND_EXTRAS.get(name, ())
    if extras:
        needs = " and ".join(f"*{extra} extra*" for extra in extras)
        install = code(install_command(extras))
        lines += [f"Needs the {needs}: {install}.", ""]
    lines += ["```text", synopsis, "```", "", prose(sub.description or ""), ""]
    if positionals:
        rows = [(code(a.names[0]), cell(a.help)) for a in positionals]
        lines += table(["Argument", "Meaning"], rows) + [""]
    if options:
        lines += _options_table(options) + [""]
    return lines


def _options_table(options: list[Argument]) -> list[str]:
    rows = []
    for arg in options:
        spelled = "<br>".join(code(f"{n} {arg.metavar}".strip()) for n in arg.names)
        rows.append((spelled, code(arg.default) if arg.default else "", cell(arg.help)))
    return table(["Option", "Default", "Meaning"], rows)


def _metavar(formatter: argparse.HelpFormatter, action: argparse.Action, *, optional: bool) -> str:
    if optional:
        default = formatter._get_default_metavar_for_optional(action)
    else:
        default = formatter._get_default_metavar_for_positional(action)
    return formatter._format_args(action, default)


def _default(action: argparse.Action) -> str:
    """The default as the page shows it: "" for none, a flag's False, an empty list."""
    value = action.default
    if value in (None, argparse.SUPPRESS, [], ()) or action.nargs == 0:
        return ""
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    return str(value)
