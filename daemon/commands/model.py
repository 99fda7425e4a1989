"""``batchd make-model``: write a model directory (preset, fixture or GGUF import)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from batchd.config.settings import Settings
from batchd.daemon.commands.load_failure import LOAD_FAILURES, explain
from batchd.engine.models.registry import (
    ARCH_PRESETS,
    FIXTURE_PRESETS,
    PACKAGED,
    PRESET_NAMES,
)
from batchd.producers.commands.subcommand import add_command, add_model_option


def register(sub: Any) -> None:
    p = add_command(sub, "make-model", run)
    p.add_argument("out_dir", metavar="OUT_DIR", help="the model folder to write")
    add_model_option(
        p,
        help="what to write: a preset (" + ", ".join(PRESET_NAMES) + ") or a llama-family "
        ".gguf file to convert; --preset is the same option (default: tiny)",
    )
    p.add_argument("--from-gguf", metavar="FILE", help="a llama-family GGUF file to convert")
    p.add_argument(
        "--keep-quantized",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="GGUF: keep quantized weights, or (--no-keep-quantized) write dense ones "
        "(default: keep them on Metal only; on CPU float32 decodes 2-3x faster; on CUDA "
        "MLX builds a kernel for each new tile of rows of a quantized product, for tens of "
        "seconds each)",
    )
    p.add_argument(
        "--arch",
        default="llama",
        choices=["llama", "qwen3"],
        help="architecture of a random-weight model (default: llama)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument(
        "--quantize",
        type=int,
        metavar="BITS",
        choices=[4, 8],
        default=None,
        help="quantize the written weights to 4 or 8 bits (default: keep float)",
    )


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Write a model directory: a preset (random-weight or smollm2) or a GGUF import.

    Write an mlx-lm model directory. Random-weight presets (tiny, bench-small, bench-1b): same
    seed, same bytes. smollm2: the packaged SmolLM2-135M-Instruct. A .gguf file (--model FILE
    or --from-gguf FILE): convert a llama-family GGUF (F32, F16, Q4_0, Q4_1, Q8_0 tensors;
    byte-level BPE tokenizer).
    """
    # Without the daemon extra these raise ModuleNotFoundError, which the dispatcher
    # (batchd.daemon.cli) turns into the install command.
    from batchd.engine.models.gguf_convert import convert_gguf
    from batchd.engine.models.model_fixture import FixtureSpec, make_model
    from batchd.engine.models.registry import ensure_preset, packaged_gguf

    try:
        source = _source(args)
        _check_out_dir(Path(args.out_dir))
    except ValueError as exc:
        print(f"batchd make-model: {exc}", file=sys.stderr)
        return 2
    try:
        if source in ARCH_PRESETS:
            path = ensure_preset(source, path=Path(args.out_dir))
            print(f"wrote {source} model to {path}")
            return 0
        if source not in FIXTURE_PRESETS:
            gguf = packaged_gguf(source) if source in PACKAGED else Path(source)
            path = convert_gguf(gguf, Path(args.out_dir), keep_quantized=args.keep_quantized)
            print(f"converted {gguf} to {path}")
            return 0
    except LOAD_FAILURES as exc:
        print(f"batchd make-model: {explain(source, exc)}", file=sys.stderr)
        return 2
    spec = FixtureSpec(preset=source, arch=args.arch, seed=args.seed, quantize_bits=args.quantize)
    path = make_model(args.out_dir, spec)
    print(f"wrote {spec.preset} {spec.arch} model (seed {spec.seed}) to {path}")
    return 0


def _check_out_dir(out_dir: Path) -> None:
    """ValueError when writing a model to ``out_dir`` would mix it with other files: a
    file, or a folder with files but no model (a model folder is rewritten in place)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir} is a file: give a folder to write the model to")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / "config.json").exists():
        raise ValueError(
            f"{out_dir} is not empty and holds no model (no config.json): give a new or empty "
            "folder, so that the model's files are not mixed with others"
        )


def _source(args: argparse.Namespace) -> str:
    """What to write, as the model registry names it: a preset or a .gguf file.

    ValueError for anything else (a model directory or hub id is served as it is, there is
    nothing to write) and for --from-gguf beside a different --model."""
    if args.from_gguf is not None:
        if args.model is not None and args.model != args.from_gguf:
            raise ValueError(
                f"--from-gguf {args.from_gguf} and --model {args.model} name different "
                "sources: give one"
            )
        return str(args.from_gguf)
    source = args.model or "tiny"
    if source in PRESET_NAMES or source.lower().endswith(".gguf"):
        return source
    raise ValueError(
        f"--model {source}: make-model writes a preset ({', '.join(PRESET_NAMES)}) or converts "
        "a .gguf file; a model directory or hub id needs no writing (batchd serve --model "
        f"{source} loads it)"
    )
