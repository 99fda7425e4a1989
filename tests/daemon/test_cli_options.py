"""The command line as people type it: global options on either side of the subcommand,
and every ``batchd`` command the README shows parses as written."""

from __future__ import annotations

import argparse
import inspect
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import batchd
from batchd.daemon.chaos.options import ChaosOptions, from_command_line
from batchd.daemon.cli import build_parser, main, settings_from_args
from batchd.daemon.commands.bench import resolve_model as bench_model
from batchd.daemon.commands.serve import apply_args
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
            # Comments cut; a trailing "&" (run in the background) is the shell's.
            found.append(line.split("  #")[0].strip().rstrip("&").strip())
    # A span of two words names a command in prose (`batchd bulk` enqueues...).
    found += [c for c in re.findall(r"`(batchd [^`]+)`", text) if len(c.split()) > 2]
    commands = [c for c in found if not re.search(r"\[|\||\.\.\.", c)]
    return sorted({shlex.join(PLACEHOLDERS.get(w, w) for w in shlex.split(c)) for c in commands})


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_parses(command: str) -> None:
    build_parser().parse_args(shlex.split(command)[1:])


def test_the_readme_shows_commands() -> None:
    """The README keeps each kind of user's quickstart; every other command moved to the
    docs pages, whose commands tests/docs/test_docs_commands.py parses the same way."""
    commands = readme_commands()
    for expected in (
        "batchd serve --model smollm2",
        "batchd submit",
        "batchd gateway",
        "batchd bulk-worker",
        "batchd bulk ",
    ):
        assert any(c.startswith(expected) for c in commands), expected


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


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(["--version"])
    assert stopped.value.code == 0
    assert capsys.readouterr().out == f"batchd {batchd.__version__}\n"
    done = subprocess.run(
        [sys.executable, "-m", "batchd.daemon.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout == f"batchd {batchd.__version__}\n" != "batchd 0+unknown\n"


# Every command that names a model, with the arguments it needs besides.
MODEL_COMMANDS = {"serve": [], "demo": [], "bench": [], "make-model": ["out"]}


@pytest.mark.parametrize("command", MODEL_COMMANDS)
def test_model_and_preset_are_one_option(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [command, *MODEL_COMMANDS[command]]
    both = ["--preset", "tiny", "--model", "tiny"]
    for given in (["--preset", "tiny"], ["--model", "tiny"], both):
        assert build_parser().parse_args([*argv, *given]).model == "tiny"
    # Any model the registry resolves, under either spelling (not only the preset names).
    gguf = "/models/m.gguf"
    assert build_parser().parse_args([*argv, "--preset", gguf]).model == gguf
    assert build_parser().parse_args(argv).model is None
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args([*argv, "--preset", "tiny", "--model", "smollm2"])
    assert stopped.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"batchd {command}: error: --preset tiny and --model smollm2 name different" in err


def test_serve_takes_the_preset_as_its_model() -> None:
    args = build_parser().parse_args(["serve", "--preset", "tiny"])
    assert apply_args(settings_from_args(args), args).model == "tiny"


def test_bench_resolves_either_spelling_through_the_registry(tiny_model: Path) -> None:
    for flag in ("--model", "--preset"):
        args = build_parser().parse_args(["bench", flag, str(tiny_model)])
        assert bench_model(args) == (tiny_model, "tiny")


def test_demo_builds_a_preset_and_loads_anything_else(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from batchd.daemon.demo import run as demo_run

    calls: list[dict[str, Any]] = []

    def run_demo(settings: object, **options: Any) -> int:
        calls.append(options)
        return 0

    monkeypatch.setattr(demo_run, "run_demo", run_demo)
    for argv in (["--preset", "tiny"], ["--model", "tiny"], ["--preset", str(tmp_path)], []):
        args = build_parser().parse_args(["demo", *argv])
        assert args.func(args, settings_from_args(args)) == 0
    given = [(kw["preset"], kw["model"]) for kw in calls]
    assert given == [("tiny", None), ("tiny", None), (None, str(tmp_path)), (None, None)]


def test_make_model_writes_a_preset_under_either_spelling(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["make-model", str(tmp_path / "a"), "--preset", "tiny"]) == 0
    assert main(["make-model", str(tmp_path / "b"), "--model", "tiny"]) == 0
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (
        tmp_path / "b" / "model.safetensors"
    ).read_bytes()
    capsys.readouterr()
    # A directory is a model already: nothing to write, and the command says what to run.
    assert main(["make-model", str(tmp_path / "c"), "--model", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "make-model writes a preset" in err and f"batchd serve --model {tmp_path / 'a'}" in err
    assert main(["make-model", str(tmp_path / "d"), "--model", str(tmp_path / "none.gguf")]) == 2
    assert "none.gguf" in capsys.readouterr().err
    argv = ["make-model", str(tmp_path / "e"), "--from-gguf", "x.gguf", "--model", "y.gguf"]
    assert main(argv) == 2
    assert "--from-gguf x.gguf and --model y.gguf name different sources" in capsys.readouterr().err


def test_make_model_asks_for_dense_or_quantized_gguf_weights_either_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On Metal a GGUF keeps its quantized weights unless --no-keep-quantized asks for
    dense ones; on a CPU or CUDA (whose quantized products build kernels per row tile) it
    is dense unless --keep-quantized."""
    import json

    from batchd.engine.models import gguf_convert

    def quantized(folder: str) -> bool:
        config = json.loads((tmp_path / folder / "config.json").read_text())
        return "quantization" in config

    monkeypatch.setattr(gguf_convert, "keeps_quantized", lambda: True)
    assert main(["make-model", str(tmp_path / "gpu"), "--model", "smollm2"]) == 0
    assert (
        main(["make-model", str(tmp_path / "dense"), "--model", "smollm2", "--no-keep-quantized"])
        == 0
    )
    monkeypatch.setattr(gguf_convert, "keeps_quantized", lambda: False)
    assert main(["make-model", str(tmp_path / "cpu"), "--model", "smollm2"]) == 0
    assert (
        main(["make-model", str(tmp_path / "kept"), "--model", "smollm2", "--keep-quantized"]) == 0
    )
    capsys.readouterr()
    assert [quantized(f) for f in ("gpu", "dense", "cpu", "kept")] == [True, False, False, True]
