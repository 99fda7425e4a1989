"""What changes a row's logits before sampling, in mlx-lm's order, on the host.

First ``logit_bias``, then the repetition, presence and frequency penalties
(mlx-lm's ``make_logits_processors`` order and arithmetic, in float32 NumPy), over
the tokens a :class:`PenaltyTokens` names. Which tokens those are is the request's
``penalty_window`` (docs/jobs.md: Penalties):

- None (the default): vLLM's scope, which is OpenAI's for the two additive ones:
  presence and frequency count every token generated so far, the prompt excluded
  (OpenAI: ``mu[j] - c[j] * frequency - (c[j] > 0) * presence``); repetition scales
  every token of the prompt and of the output. A :class:`PenaltyHistory` keeps the
  counts as tokens arrive.
- N: mlx-lm's, all three over the last N tokens of prompt + output (its default N is
  20); tests/engine/test_logits_processors.py compares with mlx-lm on the same logits.

Then come two controls mlx-lm does not have: a grammar masks every token it does
not allow, then ``min_tokens`` forbids the end tokens unless nothing else is left (a
complete JSON value can only end). Penalties keep -inf as -inf, so masking after them
loses nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from batchd.engine.sampling_params import SamplingParams

_NO_IDS = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class PenaltyTokens:
    """The tokens one row's penalties act on: ``seen`` are scaled by the repetition
    penalty (each once), ``ids`` (distinct) lose the presence penalty once and the
    frequency penalty ``counts`` times."""

    seen: np.ndarray
    ids: np.ndarray
    counts: np.ndarray

    @classmethod
    def window(cls, tokens: Sequence[int]) -> PenaltyTokens:
        """mlx-lm's form: all three penalties over these tokens (the last N of prompt +
        output)."""
        window = np.asarray(tokens, dtype=np.int64)
        ids, counts = np.unique(window, return_counts=True)
        return cls(window, ids, counts.astype(np.float32))


class PenaltyHistory:
    """One request's generated-token counts, and its prompt's distinct tokens when the
    repetition penalty needs them (vLLM's and OpenAI's scope), kept as tokens arrive."""

    def __init__(self, prompt: Sequence[int] | None) -> None:
        self._prompt = _NO_IDS if prompt is None else np.unique(np.asarray(prompt, np.int64))
        self._counts: dict[int, int] = {}
        self._tokens: PenaltyTokens | None = None

    @classmethod
    def of_request(cls, params: SamplingParams, prompt: Sequence[int]) -> PenaltyHistory | None:
        """The counts a request penalised over its whole output keeps (the prompt's tokens
        too when its repetition penalty scales them); None when it needs none."""
        if not params.penalises_recent or params.penalty_window is not None:
            return None
        return cls(prompt if params.repetition_penalty != 1.0 else None)

    def add(self, token_id: int) -> None:
        self._counts[token_id] = self._counts.get(token_id, 0) + 1
        self._tokens = None

    def tokens(self) -> PenaltyTokens:
        """What the penalties act on now (built once per new token)."""
        if self._tokens is None:
            n = len(self._counts)
            ids = np.fromiter(self._counts.keys(), dtype=np.int64, count=n)
            counts = np.fromiter(self._counts.values(), dtype=np.float32, count=n)
            seen = np.union1d(self._prompt, ids) if self._prompt.size else ids
            self._tokens = PenaltyTokens(seen, ids, counts)
        return self._tokens


def needs_processing(
    params: SamplingParams, banned: Sequence[int], allowed: np.ndarray | None
) -> bool:
    """True when a row's logits change before sampling (else they are used as they are)."""
    return bool(params.logit_bias) or params.penalises_recent or bool(banned) or allowed is not None


def process_row(
    row: np.ndarray,
    params: SamplingParams,
    penalised: PenaltyTokens | None,
    banned: Sequence[int],
    allowed: np.ndarray | None,
) -> None:
    """Apply every control of ``params`` to one row of float32 logits, in place;
    ``penalised`` is what the penalties act on (None: nothing yet)."""
    if params.logit_bias:
        ids = np.fromiter((t for t, _ in params.logit_bias), dtype=np.int64)
        row[ids] += np.fromiter((b for _, b in params.logit_bias), dtype=np.float32)
    if penalised is not None:
        if params.repetition_penalty != 1.0 and penalised.seen.size:
            p = np.float32(params.repetition_penalty)
            selected = row[penalised.seen]
            row[penalised.seen] = np.where(selected < 0, selected * p, selected / p)
        if params.presence_penalty != 0.0:
            row[penalised.ids] -= np.float32(params.presence_penalty)
        if params.frequency_penalty != 0.0:
            row[penalised.ids] -= np.float32(params.frequency_penalty) * penalised.counts
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
