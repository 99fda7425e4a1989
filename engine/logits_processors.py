"""What changes a row's logits before sampling, in mlx-lm's order, on the host.

mlx-lm's ``make_logits_processors`` runs logit_bias, then the repetition,
presence and frequency penalties, each penalty over the last 20 tokens of
prompt + output (its default context size). The same arithmetic here, in
float32 NumPy, gives the same logits (tests/engine/test_logits_processors.py
compares them on the same input). Then come two controls mlx-lm does not
have: a grammar masks every token it does not allow, then ``min_tokens``
forbids the end tokens unless nothing else is left (a complete JSON value
can only end). Penalties keep -inf as -inf, so masking after them loses
nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from batchd.engine.sampling_params import SamplingParams

# mlx-lm's penalties look at this many most recent tokens.
PENALTY_CONTEXT = 20


def needs_processing(
    params: SamplingParams, banned: Sequence[int], allowed: np.ndarray | None
) -> bool:
    """True when a row's logits change before sampling (else they are used as they are)."""
    return bool(params.logit_bias) or params.penalises_recent or bool(banned) or allowed is not None


def process_row(
    row: np.ndarray,
    params: SamplingParams,
    recent: Sequence[int],
    banned: Sequence[int],
    allowed: np.ndarray | None,
) -> None:
    """Apply every control of ``params`` to one row of float32 logits, in place."""
    if params.logit_bias:
        ids = np.fromiter((t for t, _ in params.logit_bias), dtype=np.int64)
        row[ids] += np.fromiter((b for _, b in params.logit_bias), dtype=np.float32)
    window = np.asarray(recent[-PENALTY_CONTEXT:], dtype=np.int64)
    if window.size:
        if params.repetition_penalty != 1.0:
            p = np.float32(params.repetition_penalty)
            selected = row[window]
            row[window] = np.where(selected < 0, selected * p, selected / p)
        if params.presence_penalty != 0.0:
            row[window] -= np.float32(params.presence_penalty)
        if params.frequency_penalty != 0.0:
            np.subtract.at(row, window, np.float32(params.frequency_penalty))
    if allowed is not None:
        row[~allowed] = -np.inf
    if banned:
        _ban(row, banned)


def _ban(row: np.ndarray, banned: Sequence[int]) -> None:
    """Forbid ``banned`` unless nothing else is left (a grammar that can only end wins)."""
    kept = row.copy()
    kept[list(banned)] = -np.inf
    if np.isfinite(kept).any():
        row[:] = kept
