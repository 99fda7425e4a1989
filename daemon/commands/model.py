"""``batchd make-model``: write a random-weight fixture model directory."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from config import Settings


def register(sub: Any) -> None:
    p = sub.add_parser(
        "make-model",
        help="write a random-weight model (mlx-lm format, real BPE tokenizer)",
        description="Write a random-weight model directory that mlx_lm.load() loads "
        "like any downloaded model. Same seed, same bytes.",
    )
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--preset", default="tiny", choices=["tiny", "bench-small", "bench-1b"])
    p.add_argument("--arch", default="llama", choices=["llama", "qwen3"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantize", type=int, metavar="BITS", choices=[4, 8], default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace, settings: Settings) -> int:
    try:
        from engine.models.model_fixture import FixtureSpec, make_model
    except ImportError as exc:
        print(
            f"batchd make-model needs the daemon extra (pip install 'batchd[daemon]'): {exc}",
            file=sys.stderr,
        )
        return 2
    spec = FixtureSpec(
        preset=args.preset, arch=args.arch, seed=args.seed, quantize_bits=args.quantize
    )
    path = make_model(args.out_dir, spec)
    print(f"wrote {spec.preset} {spec.arch} model (seed {spec.seed}) to {path}")
    return 0
