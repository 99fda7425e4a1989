"""The ``batchd`` command: one entry point, a subcommand per capability.

Each capability module exposes ``register(subparsers)``, adding its
subcommands with ``set_defaults(func=handler)``; a handler takes the parsed
arguments and the loaded Settings and returns the exit code. Modules are
imported lazily by name so that a producer-only install (no MLX) still has
every producer subcommand.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from config import Settings, SettingsError, load_settings

COMMAND_MODULES = (
    "producers.commands.jobs",
    "producers.commands.bulk",
    "producers.commands.top",
    "producers.commands.gateway",
    "daemon.commands.model",
    "daemon.commands.serve",
    "daemon.commands.demo",
    "daemon.commands.bench",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="batchd",
        description="Message-queue driven LLM generation on MLX.",
    )
    parser.add_argument(
        "--config", metavar="FILE", help="TOML settings file (default: $BATCHD_CONFIG)"
    )
    parser.add_argument(
        "--redis-url",
        metavar="URL",
        help="Redis URL (default: $BATCHD_REDIS_URL or redis://127.0.0.1:6379/0)",
    )
    parser.add_argument("--log-level", metavar="LEVEL", help="DEBUG, INFO, WARNING or ERROR")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings with the global flags applied on top of env and config file."""
    return load_settings(args.config, redis_url=args.redis_url, log_level=args.log_level)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(args)
    except SettingsError as exc:
        print(f"batchd: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        code: int = args.func(args, settings)
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
