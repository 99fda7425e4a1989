"""The options every engine measurement takes: one model, rounds of a request mix."""

from __future__ import annotations

import argparse
from pathlib import Path


def engine_parser(
    name: str, description: str | None, *, requests: int, max_tokens: int
) -> argparse.ArgumentParser:
    """``python -m measure.NAME``'s parser with --model, --rounds, --requests,
    --max-tokens and --max-num-seqs (add the measurement's own after)."""
    p = argparse.ArgumentParser(prog=f"python -m measure.{name}", description=description)
    p.add_argument("--model", type=Path, help="model directory (default: bench-small fixture)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=requests)
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--max-num-seqs", type=int, default=16)
    return p
