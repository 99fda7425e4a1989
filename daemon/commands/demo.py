"""``batchd demo``: watch jobs stream through the daemon (see daemon.demo.run)."""

from __future__ import annotations

import argparse
from typing import Any

from config import Settings


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="run a daemon on the tiny model and stream a few jobs through it",
        description="Uses the configured Redis if it answers, else a private redis-server, "
        "else fakeredis; builds .batchd/models/tiny if absent; submits jobs of different "
        "lengths from producer threads and shows their tokens arriving live.",
    )
    p.add_argument(
        "--show-steps",
        action="store_true",
        help="print every engine step: which job decodes, which prefills how many tokens",
    )
    p.add_argument(
        "--step-ms",
        type=float,
        default=25.0,
        metavar="MS",
        help="pause after each engine step so batching is watchable (default: 25)",
    )
    p.add_argument(
        "--model-dir",
        default=".batchd/models/tiny",
        metavar="DIR",
        help="where the tiny model is (built there if absent; default: .batchd/models/tiny)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace, settings: Settings) -> int:
    from pathlib import Path

    from daemon.demo.run import run_demo

    return run_demo(
        settings, show_steps=args.show_steps, step_ms=args.step_ms, model_dir=Path(args.model_dir)
    )
