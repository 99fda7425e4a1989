"""The ``batchd`` command: one entry point, a subcommand per capability.

Each capability module exposes ``register(subparsers)``, adding its
subcommands with :func:`batchd.producers.commands.subcommand.add_command` (the
handler's docstring is the command's help); a handler takes the parsed
arguments and the loaded Settings and returns the exit code. Modules are
imported lazily by name so that a producer-only install (no MLX) still has
every producer subcommand.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Sequence

from batchd import __version__
from batchd.config.settings import Settings, SettingsError, load_settings
from batchd.producers.commands.extras import install_command
from batchd.producers.commands.redis_failure import REDIS_EXIT, REDIS_FAILURES, explain
from batchd.producers.telemetry import LOG_FORMATS, configure_logging

COMMAND_MODULES = (
    "batchd.producers.commands.jobs",
    "batchd.producers.commands.bulk",
    "batchd.producers.commands.top",
    "batchd.producers.commands.gateway",
    "batchd.producers.commands.dashboard",
    "batchd.daemon.commands.model",
    "batchd.daemon.commands.serve",
    "batchd.daemon.commands.demo",
    "batchd.daemon.commands.bench",
    "batchd.daemon.commands.chaos",
    "batchd.daemon.commands.doctor",
)

# The optional extras (pyproject.toml), each with the modules it installs that a command
# imports (by their import names); and what each command needs beyond the base install.
# A producer-only install lacks them: the command then says what to install instead of
# showing a traceback.
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "daemon": ("mlx", "mlx_lm", "numpy", "tokenizers"),
    "bench": ("matplotlib",),
    "gateway": ("starlette", "uvicorn", "multipart", "python_multipart", "jinja2"),
}
COMMAND_EXTRAS: dict[str, tuple[str, ...]] = {
    "serve": ("daemon",),
    "demo": ("daemon",),
    "bench": ("daemon", "bench"),
    "make-model": ("daemon",),
    "chaos": ("daemon",),
    "gateway": ("gateway",),
    "dashboard": ("gateway",),
}
# Checked before a command starts, so that a long run (bench writes its chart at the end)
# or one that starts other processes (chaos) fails at once; python-multipart is left to the
# import check, its import name having changed between releases.
_PREFLIGHT_SKIP = frozenset({"multipart", "python_multipart"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="batchd",
        description="Message-queue driven LLM generation on MLX.",
    )
    parser.add_argument("--version", action="version", version=f"batchd {__version__}")
    add_global_options(parser, default=None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    # People type `batchd serve --redis-url URL` as often as `batchd --redis-url URL serve`:
    # every subcommand takes the global options too. SUPPRESS keeps a value given before
    # the subcommand when none is given after it.
    for subparser in set(sub.choices.values()):
        add_global_options(subparser, default=argparse.SUPPRESS)
    return parser


def add_global_options(parser: argparse.ArgumentParser, *, default: str | None) -> None:
    """The options every command takes, before or after its name."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=default,
        help="TOML settings file (default: $BATCHD_CONFIG)",
    )
    parser.add_argument(
        "--redis-url",
        metavar="URL",
        default=default,
        help="Redis URL (default: $BATCHD_REDIS_URL or redis://127.0.0.1:6379/0)",
    )
    parser.add_argument(
        "--log-level", metavar="LEVEL", default=default, help="DEBUG, INFO, WARNING or ERROR"
    )
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=default,
        help="log lines as text (default) or one JSON object per line",
    )


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings with the global flags applied on top of env and config file."""
    return load_settings(
        args.config,
        redis_url=args.redis_url,
        log_level=args.log_level,
        log_format=args.log_format,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(args)
    except SettingsError as exc:
        print(f"batchd: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format)
    missing = _missing_module(args.command)
    if missing is not None:
        print(install_hint(args.command, missing), file=sys.stderr)
        return 2
    try:
        code: int = args.func(args, settings)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`batchd stream ID --json | head`)
        _silence_stdout()
        return 141  # as a shell reports a process ended by SIGPIPE
    except REDIS_FAILURES as exc:  # a command that let Redis's failure through
        print(f"batchd {args.command}: {explain(exc, settings.connection_url())}", file=sys.stderr)
        logging.getLogger(__name__).debug("redis failure", exc_info=exc)  # --log-level DEBUG
        return REDIS_EXIT
    except ModuleNotFoundError as exc:
        if _extra_of(exc.name) is None:
            raise  # not an optional module: a bug, whose traceback helps
        print(install_hint(args.command, exc.name or ""), file=sys.stderr)
        return 2
    return code


def _silence_stdout() -> None:
    """Point stdout at /dev/null: the interpreter flushes it at exit, and a flush into
    the closed pipe would print a second error (Python's documented SIGPIPE recipe)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def _extra_of(module: str | None) -> str | None:
    """The extra that installs ``module`` (a dotted name counts by its top level)."""
    top = (module or "").partition(".")[0]
    return next((extra for extra, names in EXTRA_MODULES.items() if top in names), None)


def _missing_module(command: str) -> str | None:
    """The first module of the command's extras that cannot be found (none is imported)."""
    for extra in COMMAND_EXTRAS.get(command, ()):
        for module in EXTRA_MODULES[extra]:
            if module in _PREFLIGHT_SKIP:
                continue
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):  # a finder that refuses it, a half-removed one
                found = False
            if not found:
                return module
    return None


def install_hint(command: str, module: str) -> str:
    """What to install for ``batchd COMMAND`` when ``module`` is missing: the command's
    extras, plus the module's own if the command was not known to need it."""
    extras = COMMAND_EXTRAS.get(command, ())
    extra = _extra_of(module)
    if extra is not None and extra not in extras:
        extras = (*extras, extra)
    names = " and ".join(extras)
    noun = "extra" if len(extras) == 1 else "extras"
    return (
        f"batchd {command} needs the {names} {noun}: {install_command(extras)}; "
        f"no module named {module!r}"
    )


if __name__ == "__main__":
    sys.exit(main())
