"""Batched sampling on the host: every row of a step's logits with its own parameters.

Why NumPy: on Linux CPU, MLX's elementwise ``exp`` runs far slower than
NumPy's vectorised one, and a step's logits are ``[rows, vocab]``. The logits
have to come back to the host anyway.

Greedy rows take the argmax of the logits (mlx-lm takes it of ``logits -
logsumexp``: the same index unless rounding merges two logits within an ulp).
Every row first goes through its logits processors (logit_bias, penalties,
grammar mask, min_tokens: engine/logits_processors.py). Sampled rows then
apply temperature, top-k, top-p and min-p (vLLM's order), and invert the
CDF at a uniform drawn from (seed, output position) only: a request draws
the same token whatever else is in the batch, and again after a restart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from batchd.engine.logits_processors import needs_processing, process_row
from batchd.engine.sampling_params import SamplingParams

# top-p looks at this many best candidates first, sorting the whole row only if needed.
_TOP_P_CANDIDATES = 512
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SampleRow:
    """What one sampling row needs: its params, seed, output position and recent tokens,
    the tokens it may not end with yet (min_tokens) and its grammar's allowed tokens."""

    params: SamplingParams
    seed: int
    position: int
    recent_tokens: Sequence[int] = ()
    banned: Sequence[int] = ()
    allowed: np.ndarray | None = None


@dataclass(frozen=True)
class Samples:
    """Per row: the chosen id, its log-probability, and the top-N (id, logprob) if asked."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]] | None]


def position_uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1) that depends only on (seed, position) (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def sample(logits: np.ndarray, rows: Sequence[SampleRow]) -> Samples:
    """Pick one token per row of ``logits`` ``[len(rows), vocab]`` (float32)."""
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sample rows")
    logits = _process(logits, rows)
    row_max = logits.max(axis=-1, keepdims=True)
    shifted = np.exp(logits - row_max)
    lse = row_max[:, 0] + np.log(shifted.sum(axis=-1))
    tokens = logits.argmax(axis=-1)
    for i, r in enumerate(rows):
        if not r.params.greedy:
            tokens[i] = _draw(logits[i] - row_max[i], r)
    chosen = logits[np.arange(len(rows)), tokens] - lse
    top: list[list[tuple[int, float]] | None] = []
    for i, r in enumerate(rows):
        n = r.params.logprobs
        if not n:
            top.append(None)
            continue
        ids = np.argpartition(-logits[i], n - 1)[:n]
        ids = ids[np.argsort(-logits[i, ids], kind="stable")]
        top.append([(int(t), float(logits[i, t] - lse[i])) for t in ids])
    return Samples(token_ids=tokens.tolist(), logprobs=chosen.tolist(), top_logprobs=top)


def _process(logits: np.ndarray, rows: Sequence[SampleRow]) -> np.ndarray:
    """Each row through its logits processors (a copy; rows without any are left as they are)."""
    todo = [i for i, r in enumerate(rows) if needs_processing(r.params, r.banned, r.allowed)]
    if not todo:
        return logits
    logits = logits.copy()
    for i in todo:
        r = rows[i]
        process_row(logits[i], r.params, r.recent_tokens, r.banned, r.allowed)
    return logits


def _top(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values, largest first (ties by index)."""
    ids = np.argpartition(-values, k - 1)[:k] if k < values.shape[0] else np.arange(k)
    return ids[np.argsort(-values[ids], kind="stable")]


def _draw(shifted: np.ndarray, row: SampleRow) -> int:
    """Temperature, top-k, top-p, min-p over ``logits - max``; inverse CDF at a seeded uniform.

    Candidates stay in vocabulary order for the CDF; only top-p needs them
    ranked, and it ranks the best few hundred first, the rest only if needed.
    """
    params = row.params
    scaled = shifted.astype(np.float64) / params.temperature
    vocab = scaled.shape[0]
    cand = np.arange(vocab)
    if 0 < params.top_k < vocab:
        cand = np.sort(np.argpartition(-scaled, params.top_k - 1)[: params.top_k])
    weights = np.exp(scaled[cand])
    if params.top_p < 1.0:
        bound = params.top_p * weights.sum()
        ranked = _top(weights, min(len(cand), _TOP_P_CANDIDATES))
        if weights[ranked].sum() < bound:
            ranked = _top(weights, len(cand))
        ranked_weights = weights[ranked]
        kept = np.sort(ranked[np.cumsum(ranked_weights) - ranked_weights < bound])
        cand, weights = cand[kept], weights[kept]
    if params.min_p > 0.0:
        keep = weights >= params.min_p * weights.max()
        cand, weights = cand[keep], weights[keep]
    cdf = np.cumsum(weights)
    pick = int(np.searchsorted(cdf, position_uniform(row.seed, row.position) * cdf[-1], "right"))
    return int(cand[min(pick, len(cand) - 1)])
