"""``batchd make-model``: write a model directory (preset, fixture or GGUF import)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from batchd.config.settings import Settings
from batchd.engine.models.registry import PACKAGED, PRESET_NAMES
from batchd.producers.commands.subcommand import add_command


def register(sub: Any) -> None:
    p = add_command(sub, "make-model", run)
    p.add_argument("out_dir", metavar="OUT_DIR")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--preset", default="tiny", choices=PRESET_NAMES)
    source.add_argument("--from-gguf", metavar="FILE", help="a llama-family GGUF file")
    p.add_argument(
        "--keep-quantized",
        action="store_true",
        default=None,
        help="GGUF: keep quantized weights (default: only where MLX has a GPU; on CPU "
        "float32 decodes 2-3x faster)",
    )
    p.add_argument("--arch", default="llama", choices=["llama", "qwen3"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantize", type=int, metavar="BITS", choices=[4, 8], default=None)


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Write a model directory: a preset (random-weight or smollm2) or a GGUF import.

    Write an mlx-lm model directory. Random-weight presets (tiny, bench-small, bench-1b): same
    seed, same bytes. smollm2: the packaged SmolLM2-135M-Instruct. --from-gguf FILE: convert a
    llama-family GGUF (F32, F16, Q4_0, Q4_1, Q8_0 tensors; byte-level BPE tokenizer).
    """
    try:
        from batchd.engine.models.gguf_convert import convert_gguf
        from batchd.engine.models.gguf_header import GGUFError
        from batchd.engine.models.model_fixture import FixtureSpec, make_model
        from batchd.engine.models.registry import packaged_gguf
    except ImportError as exc:
        print(
            f"batchd make-model needs the daemon extra (pip install 'batchd[daemon]'): {exc}",
            file=sys.stderr,
        )
        return 2
    gguf = args.from_gguf
    try:
        if gguf is None and args.preset in PACKAGED:
            gguf = packaged_gguf(args.preset)
        if gguf is not None:
            path = convert_gguf(gguf, Path(args.out_dir), keep_quantized=args.keep_quantized)
            print(f"converted {gguf} to {path}")
            return 0
    except (OSError, GGUFError) as exc:
        print(f"batchd make-model: {exc}", file=sys.stderr)
        return 2
    spec = FixtureSpec(
        preset=args.preset, arch=args.arch, seed=args.seed, quantize_bits=args.quantize
    )
    path = make_model(args.out_dir, spec)
    print(f"wrote {spec.preset} {spec.arch} model (seed {spec.seed}) to {path}")
    return 0
