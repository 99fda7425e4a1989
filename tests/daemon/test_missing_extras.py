"""A command whose extra is not installed says what to install, and exits 2.

Each run is a fresh interpreter in which the extra's modules cannot be imported: a
meta-path finder placed first raises ModuleNotFoundError for them, as Python does for a
module that is not installed. ``mlx`` itself blocked is a producer-only install (the
dispatcher's check before the command starts); ``mlx.*`` blocked lets that check pass and
fails the command's own import, which the dispatcher catches.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchd.daemon import cli
from support.daemon_harness import ROOT

SHIM = """
import sys

BLOCKED = {blocked!r}


class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if any(name == b or (b.endswith(".") and name.startswith(b)) for b in BLOCKED):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
from batchd.daemon.cli import main

sys.exit(main(sys.argv[1:]))
"""
DAEMON_MODULES = ["mlx", "mlx_lm", "numpy", "tokenizers"]
DAEMON_HINT = 'needs the daemon extra: pip install "$(ls dist/batchd-*.whl)[daemon]"'


def run_without(blocked: list[str], *argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHD_")}
    return subprocess.run(
        [sys.executable, "-c", SHIM.format(blocked=blocked), *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["serve", "--preset", "tiny"], f"batchd serve {DAEMON_HINT}"),
        (["demo"], f"batchd demo {DAEMON_HINT}"),
        (["make-model", "out"], f"batchd make-model {DAEMON_HINT}"),
        (["chaos"], f"batchd chaos {DAEMON_HINT}"),
        (
            ["bench", "--preset", "tiny"],
            "batchd bench needs the daemon and bench extras: "
            'pip install "$(ls dist/batchd-*.whl)[daemon,bench]"',
        ),
    ],
    ids=lambda value: value[0] if isinstance(value, list) else "",
)
def test_a_producer_install_names_the_daemon_extra(argv: list[str], hint: str) -> None:
    done = run_without(DAEMON_MODULES, *argv)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(hint), done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_the_producer_commands_still_run_without_the_daemon_extra() -> None:
    done = run_without(DAEMON_MODULES, "schema")
    assert done.returncode == 0, done.stderr
    assert '"JobRequest"' in done.stdout


def test_the_gateway_names_its_extra() -> None:
    done = run_without(["starlette", "uvicorn"], "gateway")
    assert done.returncode == 2, done.stderr
    assert 'pip install "$(ls dist/batchd-*.whl)[gateway]"' in done.stderr
    assert "Traceback" not in done.stderr


def test_the_bench_extra_is_checked_before_a_long_run() -> None:
    """bench draws its chart after the run: without matplotlib it must stop first."""
    done = run_without(["matplotlib"], "bench", "--preset", "tiny")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("batchd bench needs the daemon and bench extras"), done.stderr
    assert "; no module named 'matplotlib'" in done.stderr


@pytest.mark.parametrize("command", ["serve", "make-model"])
def test_an_import_that_fails_inside_a_command_is_caught_too(command: str, tmp_path: Path) -> None:
    """``mlx`` is found, ``mlx.core`` is not: past the check, into the command's imports."""
    argv = ["serve", "--model", str(tmp_path)] if command == "serve" else [command, str(tmp_path)]
    done = run_without(["mlx."], *argv)
    assert done.returncode == 2, done.stderr
    assert f"batchd {command} {DAEMON_HINT}" in done.stderr
    assert "; no module named 'mlx.core'" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_missing_module_of_no_extra_is_a_bug_with_its_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(args: argparse.Namespace, settings: object) -> int:
        """Fail as a bug would."""
        raise ModuleNotFoundError("No module named 'batchd.nothing'", name="batchd.nothing")

    monkeypatch.setattr("batchd.producers.commands.jobs.schema", broken)
    with pytest.raises(ModuleNotFoundError, match="batchd.nothing"):
        cli.main(["schema"])


def test_the_hint_names_an_extra_the_command_was_not_known_to_need() -> None:
    assert cli.install_hint("submit", "uvicorn") == (
        'batchd submit needs the gateway extra: pip install "$(ls dist/batchd-*.whl)[gateway]" '
        "(in a clone: pip install -e '.[gateway]'); no module named 'uvicorn'"
    )
    assert cli.install_hint("serve", "matplotlib.pyplot").startswith(
        "batchd serve needs the daemon and bench extras: "
        'pip install "$(ls dist/batchd-*.whl)[daemon,bench]"'
    )
