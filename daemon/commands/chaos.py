"""``batchd chaos``: the reliability proving ground (see batchd.daemon.chaos)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import Any

from batchd.config.settings import Settings
from batchd.daemon.chaos.options import (
    command_line_fields,
    from_command_line,
    option_name,
    problem,
)
from batchd.engine.models.registry import PRESET_NAMES
from batchd.producers.commands.subcommand import add_command


def register(sub: Any) -> None:
    p = add_command(sub, "chaos", run)
    for f in command_line_fields():
        extra = {k: v for k, v in f.metadata.items() if k not in ("help", "name")}
        p.add_argument(
            option_name(f),
            dest=f.name,
            type=type(f.default),
            default=f.default,
            help=f"{f.metadata['help']} (default {f.default})",
            **extra,
        )
    p.add_argument(
        "--preset",
        default="tiny",
        choices=PRESET_NAMES,
        help="model to serve (default tiny: random weights, fast steps)",
    )
    p.add_argument("--workdir", metavar="DIR", help="keep Redis data and daemon logs here")


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Run jobs through daemons while killing, pausing and partitioning them and Redis; check every
    job against a fault-free run.

    Starts its own redis-server (AOF, appendfsync everysec; with --deployment sentinel a
    master, a replica and three Sentinels) and D daemons, submits seeded jobs
    (client and bare XADD, duplicates, cancels, hostile entries) with subscribers that
    disconnect and resume, injects faults at seeded moments, then checks every job against an
    in-process run of the same requests. Prints one table; exits 1 if anything was lost,
    doubled, broken or different.
    """
    from batchd.daemon.chaos.report import render
    from batchd.daemon.chaos.run import run_chaos
    from batchd.engine.models.registry import ensure_preset

    options = from_command_line(args)
    if (refused := problem(options)) is not None:
        print(f"batchd chaos: {refused}", file=sys.stderr)
        return 2
    engine = dataclasses.replace(
        settings.engine, max_num_seqs=16, max_num_batched_tokens=128, num_kv_blocks=512
    )
    with tempfile.TemporaryDirectory(prefix="batchd-chaos-") as scratch:
        workdir = Path(args.workdir or scratch)
        model = ensure_preset(args.preset)
        result = run_chaos(
            options,
            model=model,
            engine=engine,
            workdir=workdir,
            progress=lambda line: print(f"chaos: {line}", file=sys.stderr, flush=True),
        )
        print(render(result, command=" ".join(["batchd", *sys.argv[1:]])))
    return 0 if result.passed else 1
