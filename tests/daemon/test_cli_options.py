"""The command line as people type it: global options on either side of the subcommand,
and every ``batchd`` command the README shows parses as written."""

from __future__ import annotations

import argparse
import inspect
import re
import shlex
from pathlib import Path

import pytest

from batchd.daemon.chaos.options import ChaosOptions, from_command_line
from batchd.daemon.cli import build_parser, settings_from_args
from batchd.producers.commands.subcommand import add_command

README = Path(__file__).resolve().parents[2] / "README.md"
# The README's placeholders, given a value of the right type.
PLACEHOLDERS = {"N": "8", "ID": "j1", "PATH": "/tmp/model", "FILE": "/tmp/batchd.toml"}


def readme_commands() -> list[str]:
    """``batchd ...`` lines of the README's code blocks and code spans (synopses with
    ``[...]`` or ``a|b`` alternatives left out), placeholders replaced."""
    found: list[str] = []
    in_block = False
    text = README.read_text()
    for line in text.splitlines():
        if line.startswith("```"):
            in_block = not in_block
        elif in_block and line.startswith("batchd "):
            found.append(line.split("  #")[0].strip())
    # A span of two words names a command in prose (`batchd bulk` enqueues...).
    found += [c for c in re.findall(r"`(batchd [^`]+)`", text) if len(c.split()) > 2]
    commands = [c for c in found if not re.search(r"\[|\||\.\.\.", c)]
    return sorted({shlex.join(PLACEHOLDERS.get(w, w) for w in shlex.split(c)) for c in commands})


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_parses(command: str) -> None:
    build_parser().parse_args(shlex.split(command)[1:])


def test_the_readme_shows_commands() -> None:
    assert len(readme_commands()) > 15


@pytest.mark.parametrize(
    "argv",
    [
        ["--redis-url", "redis://h:1/0", "--log-level", "debug", "serve", "--model", "m"],
        ["serve", "--model", "m", "--redis-url", "redis://h:1/0", "--log-level", "debug"],
        [
            "--redis-url",
            "redis://x:2/0",
            "serve",
            "--log-level",
            "debug",
            "--redis-url",
            "redis://h:1/0",
        ],
        ["--log-level", "debug", "serve", "--redis-url", "redis://h:1/0"],
    ],
)
def test_global_options_on_either_side(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    settings = settings_from_args(args)
    assert settings.redis_url == "redis://h:1/0"
    assert settings.log_level == "DEBUG"


def test_log_format_and_metrics_port(tmp_path: Path) -> None:
    config = tmp_path / "b.toml"
    config.write_text('log_format = "json"\n')
    args = build_parser().parse_args(["status", "j1", "--config", str(config)])
    assert settings_from_args(args).log_format == "json"
    args = build_parser().parse_args(["serve", "--log-format", "text", "--metrics-port", "9464"])
    assert args.log_format == "text" and args.metrics_port == 9464
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--log-format", "xml"])


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_command_has_a_help_line_and_runs_its_documented_handler() -> None:
    help_text = build_parser().format_help()
    for name, sub in _subcommands().items():
        handler = sub.get_default("func")
        summary = inspect.cleandoc(handler.__doc__).split("\n\n")[0]
        first_words = " ".join(summary.split()[:3]).lower()
        assert first_words in " ".join(help_text.split()).lower(), name
        assert sub.description, f"batchd {name} has no description"


def test_a_handler_without_docstring_is_refused() -> None:
    def undocumented(args: argparse.Namespace, settings: object) -> int:
        return 0

    sub = argparse.ArgumentParser().add_subparsers()
    with pytest.raises(ValueError, match="needs a docstring"):
        add_command(sub, "x", undocumented)


def test_chaos_options_are_its_fields() -> None:
    args = build_parser().parse_args(["chaos", "--jobs", "7", "--result-ttl", "5"])
    options = from_command_line(args)
    assert (options.jobs, options.result_ttl_s, options.kills) == (7, 5, ChaosOptions().kills)
    assert "(default 2000)" in " ".join(_subcommands()["chaos"].format_help().split())
