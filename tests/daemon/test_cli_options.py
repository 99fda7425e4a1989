"""The command line as people type it: global options on either side of the subcommand,
and every ``batchd`` command the README shows parses as written."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from daemon.cli import build_parser, settings_from_args

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
