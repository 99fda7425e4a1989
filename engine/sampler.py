"""Batched sampling on the host: every row of a step's logits with its own parameters.

Why NumPy: on Linux CPU, MLX's elementwise ``exp`` runs far slower than
NumPy's vectorised one, and a step's logits are ``[rows, vocab]``. The logits
have to come back to the host anyway.

Greedy rows take the argmax of the logits (mlx-lm takes it of ``logits -
logsumexp``: the same index unless rounding merges two logits within an ulp).
Every row first goes through its logits processors (logit_bias, penalties,
grammar mask, min_tokens: engine/logits_processors.py). Sampled rows then keep the
candidates their filters leave, in one of two orders (``sampling_order``, docs/jobs.md:
Sampling):

- ``temperature_first`` (the default, vLLM's): temperature, then min-p, top-k and
  top-p on the tempered distribution, top-p over the mass min-p and top-k left.
- ``filters_first`` (mlx-lm's ``make_sampler``): top-p, min-p and top-k each on the
  temperature-1 distribution (what survives is the tokens all three keep), then
  temperature over the survivors.

Either way the draw inverts the CDF at a uniform drawn from (seed, output position)
only: a request draws the same token whatever else is in the batch, and again after a
restart. Top logprobs list only tokens the row may produce: a token the grammar
forbids (logprob -inf) is left out, so fewer than asked can come back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from batchd.engine.logits_processors import PenaltyTokens, needs_processing, process_row
from batchd.engine.sampling_params import FILTERS_FIRST, SamplingParams

# top-p looks at this many best candidates first, sorting the whole row only if needed.
_TOP_P_CANDIDATES = 512
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SampleRow:
    """What one sampling row needs: its params, seed, output position, the tokens its
    penalties act on, the tokens it may not end with yet (min_tokens) and its grammar's
    allowed tokens."""

    params: SamplingParams
    seed: int
    position: int
    penalised: PenaltyTokens | None = None
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
        # A forbidden token (-inf: the grammar's mask) is no alternative, and JSON has no -inf.
        ids = ids[np.isfinite(logits[i, ids])]
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
        process_row(logits[i], r.params, r.penalised, r.banned, r.allowed)
    return logits


def _top(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values, largest first (ties by index)."""
    ids = np.argpartition(-values, k - 1)[:k] if k < values.shape[0] else np.arange(k)
    return ids[np.argsort(-values[ids], kind="stable")]


def _draw(shifted: np.ndarray, row: SampleRow) -> int:
    """The candidates of ``logits - max`` and their weights in ``row``'s sampling order;
    inverse CDF at a seeded uniform.

    Candidates stay in vocabulary order for the CDF; only top-p needs them ranked, and
    it ranks the best few hundred first, the rest only if needed.
    """
    params = row.params
    logits = shifted.astype(np.float64)
    if params.sampling_order == FILTERS_FIRST:
        cand = _filters_first(logits, params)
        weights = np.exp(logits[cand] / params.temperature)
    else:
        cand, weights = _temperature_first(logits / params.temperature, params)
    cdf = np.cumsum(weights)
    pick = int(np.searchsorted(cdf, position_uniform(row.seed, row.position) * cdf[-1], "right"))
    return int(cand[min(pick, len(cand) - 1)])


def _temperature_first(scaled: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's order on the tempered logits (``scaled``, whose maximum is 0): min-p, top-k,
    then top-p over what is left. min-p and top-k compare logits, so only the survivors
    are exponentiated."""
    cand = np.arange(scaled.shape[0])
    if params.min_p > 0.0:
        cand = np.flatnonzero(scaled >= np.log(params.min_p))  # p >= min_p * p_max
    if 0 < params.top_k < len(cand):
        best = np.argpartition(-scaled[cand], params.top_k - 1)[: params.top_k]
        cand = cand[np.sort(best)]
    weights = np.exp(scaled[cand])
    if params.top_p < 1.0:
        kept = _nucleus(weights, params.top_p)
        cand, weights = cand[kept], weights[kept]
    return cand, weights


def _filters_first(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """mlx-lm's filters on the temperature-1 distribution (``logits``, whose maximum is
    0): the tokens top-p, min-p and top-k all keep (each keeps a best-first prefix, so
    applying them in turn as mlx-lm does leaves their intersection)."""
    keep = np.ones(logits.shape[0], dtype=bool)
    if params.top_p < 1.0:
        keep[:] = False
        keep[_nucleus(np.exp(logits), params.top_p)] = True
    if params.min_p > 0.0:
        keep &= logits >= np.log(params.min_p)
    if 0 < params.top_k < logits.shape[0]:
        best = np.zeros_like(keep)
        best[np.argpartition(-logits, params.top_k - 1)[: params.top_k]] = True
        keep &= best
    return np.flatnonzero(keep)


def _nucleus(weights: np.ndarray, top_p: float) -> np.ndarray:
    """Indices (ascending) of the smallest best-first set of ``weights`` whose mass
    reaches ``top_p`` of the total: a token stays while the mass above it is below that."""
    bound = top_p * weights.sum()
    ranked = _top(weights, min(len(weights), _TOP_P_CANDIDATES))
    if weights[ranked].sum() < bound:
        ranked = _top(weights, len(weights))
    ranked_weights = weights[ranked]
    return np.sort(ranked[np.cumsum(ranked_weights) - ranked_weights < bound])
