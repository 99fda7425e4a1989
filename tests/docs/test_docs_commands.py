"""Every shell block of the documentation is valid shell, and every ``batchd`` command in
it parses as written (the README's commands have the same check: tests/daemon/
test_cli_options.py). The measurement log (docs/bench/) is a record of past runs,
written against the commands of its day, and is left out."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from batchd.daemon.cli import build_parser
from support.daemon_harness import ROOT

DOCS = ROOT / "docs"
SHELL_BLOCK = re.compile(r"^```(sh|bash|shell)\n(.*?)^```$", re.M | re.S)
# Placeholders the pages use, given a value of the right type (as the README's test does).
PLACEHOLDERS = {"N": "8", "ID": "j1", "PATH": "/tmp/model", "FILE": "/tmp/batchd.toml"}
# VAR=value before a command: the environment it runs with.
ASSIGNMENT = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*=(?:'[^']*'|\"[^\"]*\"|\S*)\s+)+")


def pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if "bench" not in p.relative_to(DOCS).parts)


def shell_blocks() -> list[tuple[str, str]]:
    """(page:line, text) of every sh/bash block of the pages."""
    found = []
    for page in pages():
        text = page.read_text()
        for match in SHELL_BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append((f"{page.relative_to(DOCS)}:{line}", match.group(2)))
    return found


def batchd_commands() -> list[str]:
    """``batchd ...`` lines of the shell blocks (after any VAR=value), comments cut,
    synopses with ``[...]`` or ``a|b`` alternatives left out, placeholders replaced."""
    commands = set()
    for _, block in shell_blocks():
        for line in block.splitlines():
            line = ASSIGNMENT.sub("", line.strip())
            if not line.startswith("batchd "):
                continue
            command = line.split("  #")[0].split(" # ")[0].strip().rstrip("&").strip()
            if re.search(r"\[|\||\.\.\.", command):
                continue
            commands.add(shlex.join(PLACEHOLDERS.get(w, w) for w in shlex.split(command)))
    return sorted(commands)


@pytest.mark.parametrize("command", batchd_commands())
def test_docs_command_parses(command: str) -> None:
    build_parser().parse_args(shlex.split(command)[1:])


@pytest.mark.parametrize(("where", "block"), shell_blocks(), ids=[w for w, _ in shell_blocks()])
def test_shell_block_is_valid_shell(where: str, block: str) -> None:
    done = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True)
    assert done.returncode == 0, f"{where}: {done.stderr}"


def test_the_docs_show_commands() -> None:
    commands = batchd_commands()
    assert len(commands) >= 25
    # Each kind of user's quickstart is among them.
    for expected in ("batchd serve --model smollm2", "batchd gateway", "batchd bulk "):
        assert any(c.startswith(expected) for c in commands), expected


def test_the_shell_example_is_valid_shell() -> None:
    done = subprocess.run(
        ["bash", "-n", str(DOCS / "examples" / "produce.sh")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
