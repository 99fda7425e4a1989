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
import sys
from collections.abc import Sequence

from batchd.config.settings import Settings, SettingsError, load_settings
from batchd.producers.telemetry import LOG_FORMATS, configure_logging

COMMAND_MODULES = (
    "batchd.producers.commands.jobs",
    "batchd.producers.commands.bulk",
    "batchd.producers.commands.top",
    "batchd.producers.commands.gateway",
    "batchd.daemon.commands.model",
    "batchd.daemon.commands.serve",
    "batchd.daemon.commands.demo",
    "batchd.daemon.commands.bench",
    "batchd.daemon.commands.chaos",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="batchd",
        description="Message-queue driven LLM generation on MLX.",
    )
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
    try:
        code: int = args.func(args, settings)
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
