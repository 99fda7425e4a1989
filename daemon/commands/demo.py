"""``batchd demo``: watch jobs stream through the daemon (see batchd.daemon.demo.run)."""

from __future__ import annotations

import argparse
from typing import Any

from batchd.config.settings import Settings
from batchd.engine.cache import model_cache
from batchd.engine.models.registry import PRESET_NAMES
from batchd.producers.commands.subcommand import add_command, add_model_option


def register(sub: Any) -> None:
    p = add_command(sub, "demo", run)
    add_model_option(
        p,
        help="smollm2 (default): the real SmolLM2-135M-Instruct; tiny, bench-small, bench-1b: "
        "random weights; or any model: an mlx-lm directory, hub id or .gguf file; --preset is "
        "the same option",
    )
    p.add_argument(
        "--show-steps",
        action="store_true",
        help="print every engine step: which job decodes, which prefills how many tokens",
    )
    p.add_argument(
        "--step-ms",
        type=float,
        default=None,
        metavar="MS",
        help="pause after each engine step so batching is watchable (default: 25 for "
        "random weights, 0 for a real model)",
    )
    p.add_argument(
        "--model-dir",
        default=None,
        metavar="DIR",
        help="where the preset's model is (prepared there if absent; "
        f"default: {model_cache()}/NAME)",
    )


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Run a daemon on SmolLM2 and stream answers to a few chat questions.

    Uses the configured Redis if it answers, else a private redis-server, else fakeredis;
    prepares the model in the model cache (see batchd doctor) if absent; submits chat
    questions of different lengths from producer threads and shows the answers arriving
    live. --preset tiny: random weights, gibberish text, fast steps.
    """
    from pathlib import Path

    from batchd.daemon.demo.run import run_demo

    return run_demo(
        settings,
        show_steps=args.show_steps,
        step_ms=args.step_ms,
        # A preset name is built (or converted) into --model-dir; anything else is loaded as
        # the registry resolves it.
        preset=args.model if args.model in PRESET_NAMES else None,
        model=None if args.model in PRESET_NAMES else args.model,
        model_dir=Path(args.model_dir) if args.model_dir else None,
    )
