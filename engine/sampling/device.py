"""Batched sampling as MLX ops: every row of a step's logits with its own parameters,
on the device that computed them (Metal, CUDA or the CPU), with nothing read back but
what the step hands out.

The NumPy sampler (batchd.engine.sampler) copies a step's ``[rows, vocab]`` logits to
the host and samples there: the device waits while the host works. Here the logits
processors and the draw are ops of the step's graph; the host builds only small index
arrays (which tokens a penalty touches, each row's seeded uniform) while the forward
runs, and reads back a few bytes per row: the chosen ids and their logprobs, and the
top-N of the rows that asked for them.

The arithmetic is the NumPy sampler's, in the same order (docs/jobs.md: Sampling):
logit_bias, repetition, presence and frequency penalties (float32, as in
batchd.engine.logits_processors), the grammar's mask, the min_tokens ban; greedy rows
take the argmax; sampled rows keep the candidates of their ``sampling_order`` and
invert the CDF, in vocabulary order, at the uniform drawn from (seed, output position)
only (:func:`batchd.engine.sampler.position_uniform`, computed on the host: it depends
on no logit), so a draw is independent of the batch and the same after a restart.
What differs: the sums (the CDF, top-p's mass) are float32 (a GPU has no float64), in
two levels (:func:`_cumsum`), not NumPy's float64, and tokens tied at a top-k or top-p
boundary are all kept where NumPy keeps one; top-k and top-p look at each row's best
RANKED logits only (``mx.topk``, no sort of the whole vocabulary), so a nucleus wider
than that (a near-flat distribution) is cut to them. Where top-p's boundary falls among
many near-equal probabilities the two samplers can keep a slightly different nucleus,
and a seeded row then draws another token than the host sampler would; greedy rows
never differ. Either sampler alone is a function of (seed, position).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import numpy as np

from batchd.engine.forward import fast_math
from batchd.engine.sampler import SampleRow, position_uniform
from batchd.engine.sampling_params import FILTERS_FIRST

# Candidates top-p ranks at least (NumPy's sampler ranks 512 first, then all if needed).
RANKED = 4096


@dataclass(frozen=True)
class _Scatter:
    """Flat ``rows * vocab + token`` indices and float32 values, one padded list per row."""

    index: mx.array
    values: mx.array


@dataclass(frozen=True)
class DeviceBatch:
    """One step's sampling rows as MLX arrays, built on the host before the logits are
    needed (so while the forward runs)."""

    rows: int
    # The sampled (not greedy) rows, and their parameters, by sampled row; None: all greedy.
    sampled: mx.array | None  # int32 [sampled rows]
    temperature: mx.array  # float32 [sampled rows, 1]
    uniform: mx.array  # float32 [sampled rows]
    top_k: mx.array  # int32 [sampled rows, 1]; vocab where off
    top_p: mx.array  # float32 [sampled rows, 1]
    log_min_p: mx.array  # float32 [sampled rows, 1]; -inf where off
    filters_first: mx.array  # bool [sampled rows, 1]
    # Candidates ranked for top-k and top-p (0: no sampled row has either): each row's
    # best ``ranked`` tokens, found without sorting the whole vocabulary.
    ranked: int
    bias: _Scatter | None
    repetition: tuple[mx.array, mx.array] | None  # flat index, per-entry penalty
    presence: _Scatter | None
    frequency: _Scatter | None
    allowed: mx.array | None  # bool [rows, vocab]
    banned: tuple[mx.array, mx.array] | None  # flat index, bool [rows, 1]: row has a ban
    top_rows: list[int]  # rows that asked for top logprobs
    top_n: list[int]  # how many, by top row


@dataclass(frozen=True)
class DeviceDraw:
    """A step's draw, still lazy: evaluate it with :func:`read` (the one sync)."""

    token_ids: mx.array  # int32 [rows]
    logprobs: mx.array  # float32 [rows]
    top_ids: mx.array | None  # int32 [top rows, max n]
    top_logprobs: mx.array | None  # float32 [top rows, max n]
    batch: DeviceBatch


def prepare(rows: Sequence[SampleRow], vocab: int) -> DeviceBatch:
    """The host's part: every row's parameters and controls as small MLX arrays."""
    n = len(rows)
    picked = [i for i, r in enumerate(rows) if not r.params.greedy]
    params = [rows[i].params for i in picked]
    top_k = np.array([p.top_k if 0 < p.top_k < vocab else vocab for p in params], np.int32)
    top_p = np.array([p.top_p for p in params], np.float32)
    min_p = np.array([p.min_p for p in params], np.float64)
    with np.errstate(divide="ignore"):
        log_min_p = np.where(min_p > 0.0, np.log(np.maximum(min_p, 1e-300)), -np.inf)
    uniform = [position_uniform(rows[i].seed, rows[i].position) for i in picked]
    asked = [i for i, r in enumerate(rows) if r.params.logprobs]
    return DeviceBatch(
        rows=n,
        sampled=mx.array(np.asarray(picked, np.int32)) if picked else None,
        temperature=mx.array(np.array([p.temperature for p in params], np.float32)[:, None]),
        uniform=mx.array(np.asarray(uniform, np.float32)),
        top_k=mx.array(top_k[:, None]),
        top_p=mx.array(top_p[:, None]),
        log_min_p=mx.array(log_min_p.astype(np.float32)[:, None]),
        filters_first=mx.array(
            np.array([p.sampling_order == FILTERS_FIRST for p in params], bool)[:, None]
        ),
        ranked=_ranked(top_k, top_p, vocab),
        bias=_additive(
            [np.array([t for t, _ in r.params.logit_bias], np.int64) for r in rows],
            [np.array([b for _, b in r.params.logit_bias], np.float32) for r in rows],
            vocab,
        ),
        repetition=_repetition(rows, vocab),
        presence=_additive(
            [_ids(r) if r.params.presence_penalty else _NONE for r in rows],
            [
                np.full(_ids(r).size, -np.float32(r.params.presence_penalty), np.float32)
                if r.params.presence_penalty
                else _NO_VALUES
                for r in rows
            ],
            vocab,
        ),
        frequency=_additive(
            [_ids(r) if r.params.frequency_penalty else _NONE for r in rows],
            [
                -(np.float32(r.params.frequency_penalty) * r.penalised.counts)
                if r.params.frequency_penalty and r.penalised is not None
                else _NO_VALUES
                for r in rows
            ],
            vocab,
        ),
        allowed=_allowed(rows, vocab),
        banned=_banned(rows, vocab),
        top_rows=asked,
        top_n=[rows[i].params.logprobs for i in asked],
    )


def draw(logits: mx.array, batch: DeviceBatch) -> DeviceDraw:
    """The device's part: process, choose and score every row (lazy)."""
    if logits.shape[0] != batch.rows:
        raise ValueError(f"{logits.shape[0]} logit rows for {batch.rows} sample rows")
    x = _process(logits.astype(mx.float32), batch)
    row_max = mx.max(x, axis=-1, keepdims=True)
    shifted = x - row_max
    lse = mx.log(mx.sum(_exp(shifted), axis=-1))  # of the shifted row
    tokens = mx.argmax(x, axis=-1).astype(mx.int32)
    if batch.sampled is not None:
        # Only the sampled rows pay for the draw (the sort of top-k/top-p above all).
        tokens[batch.sampled] = _inverse_cdf(shifted[batch.sampled], batch)
    chosen = mx.take_along_axis(shifted, tokens[:, None], axis=-1)[:, 0] - lse
    top_ids = top_values = None
    if batch.top_rows:
        picked = mx.array(np.asarray(batch.top_rows, np.int32))
        rows = shifted[picked]
        width = max(batch.top_n)
        top_ids = mx.argsort(-rows, axis=-1)[:, :width].astype(mx.int32)
        top_values = mx.take_along_axis(rows, top_ids, axis=-1) - lse[picked][:, None]
    return DeviceDraw(tokens, chosen, top_ids, top_values, batch)


def launch(draw: DeviceDraw, *extra: mx.array) -> None:
    """Start computing the draw (and ``extra``) without waiting for it."""
    mx.async_eval(*_arrays(draw), *extra)  # type: ignore[no-untyped-call]


def read(
    draw: DeviceDraw, *extra: mx.array
) -> tuple[list[int], list[float], list[list[tuple[int, float]] | None]]:
    """The step's one synchronisation: the chosen ids, their logprobs and the asked-for
    top logprobs (a top token the grammar forbids, -inf, is left out), with ``extra``
    (the prompt logprobs of the step) evaluated in the same wait."""
    mx.eval(*_arrays(draw), *extra)
    tokens = np.asarray(draw.token_ids).tolist()
    logprobs = np.asarray(draw.logprobs).tolist()
    top: list[list[tuple[int, float]] | None] = [None] * draw.batch.rows
    if draw.top_ids is not None and draw.top_logprobs is not None:
        ids, values = np.asarray(draw.top_ids), np.asarray(draw.top_logprobs)
        for j, (row, n) in enumerate(zip(draw.batch.top_rows, draw.batch.top_n, strict=True)):
            top[row] = [
                (int(t), float(v))
                for t, v in zip(ids[j, :n], values[j, :n], strict=True)
                if np.isfinite(v)
            ]
    return tokens, logprobs, top


# -- the host's index arrays -------------------------------------------------------------

_NONE = np.zeros(0, dtype=np.int64)
_NO_VALUES = np.zeros(0, dtype=np.float32)


def _ids(row: SampleRow) -> np.ndarray:
    return row.penalised.ids if row.penalised is not None else _NONE


def _padded(ids: Sequence[np.ndarray], vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Flat indices ``[rows, width]`` of each row's ids, padded with the row's first id
    (or token 0); and the mask of the real entries."""
    width = max(len(i) for i in ids)
    flat = np.zeros((len(ids), width), dtype=np.int64)
    real = np.zeros((len(ids), width), dtype=bool)
    for r, row_ids in enumerate(ids):
        flat[r, :] = r * vocab + (row_ids[0] if len(row_ids) else 0)
        flat[r, : len(row_ids)] = r * vocab + row_ids
        real[r, : len(row_ids)] = True
    return flat, real


def _additive(
    ids: Sequence[np.ndarray], values: Sequence[np.ndarray], vocab: int
) -> _Scatter | None:
    """Values added at ids, per row (padding adds 0); None when no row has any."""
    if not any(len(i) for i in ids):
        return None
    flat, real = _padded(ids, vocab)
    padded = np.zeros(flat.shape, dtype=np.float32)
    for r, row_values in enumerate(values):
        padded[r, : len(row_values)] = row_values
    return _Scatter(mx.array(flat.reshape(-1).astype(np.int32)), mx.array(padded.reshape(-1)))


def _repetition(rows: Sequence[SampleRow], vocab: int) -> tuple[mx.array, mx.array] | None:
    """Each row's repetition-scaled tokens and its penalty per entry: padding repeats the
    row's first entry (the same value written twice), or token 0 with penalty 1."""
    seen = [
        r.penalised.seen
        if r.penalised is not None and r.params.repetition_penalty != 1.0
        else _NONE
        for r in rows
    ]
    if not any(s.size for s in seen):
        return None
    flat, _ = _padded(seen, vocab)
    penalty = np.array(
        [r.params.repetition_penalty if s.size else 1.0 for r, s in zip(rows, seen, strict=True)],
        np.float32,
    )
    entries = np.broadcast_to(penalty[:, None], flat.shape).reshape(-1)
    return mx.array(flat.reshape(-1).astype(np.int32)), mx.array(entries)


def _allowed(rows: Sequence[SampleRow], vocab: int) -> mx.array | None:
    if all(r.allowed is None for r in rows):
        return None
    mask = np.ones((len(rows), vocab), dtype=bool)
    for i, r in enumerate(rows):
        if r.allowed is not None:
            mask[i] = r.allowed[:vocab]
    return mx.array(mask)


def _banned(rows: Sequence[SampleRow], vocab: int) -> tuple[mx.array, mx.array] | None:
    if not any(r.banned for r in rows):
        return None
    ids = [np.fromiter(sorted(r.banned), dtype=np.int64) for r in rows]
    flat, _ = _padded(ids, vocab)
    has = np.array([bool(r.banned) for r in rows], dtype=bool)[:, None]
    return mx.array(flat.reshape(-1).astype(np.int32)), mx.array(has)


# -- the device's ops ----------------------------------------------------------------------


def _exp(x: mx.array) -> mx.array:
    """MLX's exp, or on a CPU the engine's faster one (batchd.engine.forward.fast_math)."""
    return fast_math.exp(x) if fast_math.enabled() else mx.exp(x)


def _process(x: mx.array, batch: DeviceBatch) -> mx.array:
    """The logits processors in NumPy's order (batchd.engine.logits_processors)."""
    shape = x.shape
    if batch.bias is not None:
        x = x.reshape(-1).at[batch.bias.index].add(batch.bias.values).reshape(shape)
    if batch.repetition is not None:
        index, penalty = batch.repetition
        flat = x.reshape(-1)
        selected = flat[index]
        flat[index] = mx.where(selected < 0, selected * penalty, selected / penalty)
        x = flat.reshape(shape)
    for add in (batch.presence, batch.frequency):
        if add is not None:
            x = x.reshape(-1).at[add.index].add(add.values).reshape(shape)
    if batch.allowed is not None:
        x = mx.where(batch.allowed, x, -mx.inf)
    if batch.banned is not None:
        index, has = batch.banned
        flat = x.reshape(-1)
        flat[index] = mx.array(-mx.inf, dtype=mx.float32)
        kept = flat.reshape(shape)
        # A ban gives way when nothing else is left (a grammar that can only end).
        left = mx.any(kept > -mx.inf, axis=-1, keepdims=True)
        x = mx.where(has & left, kept, x)
    return x


def _inverse_cdf(shifted: mx.array, batch: DeviceBatch) -> mx.array:
    """Each sampled row's token: its candidates weighted by ``exp(shifted / T)``, the CDF
    in vocabulary order inverted at the row's uniform."""
    scaled = shifted / batch.temperature
    tempered = _exp(scaled)
    # min-p on the tempered logits (temperature_first) or the temperature-1 ones.
    floor = mx.where(batch.filters_first, shifted, scaled)
    keep = floor >= batch.log_min_p
    if batch.ranked:
        keep = keep & _ranked_keep(shifted, tempered, keep, batch)
    weights = mx.where(keep, tempered, 0.0)
    cdf = _cumsum(weights)
    target = batch.uniform[:, None] * cdf[:, -1:]
    pick = mx.sum(cdf <= target, axis=-1).astype(mx.int32)
    # Rounding can put the target past the last step of the CDF: the last candidate.
    vocab = shifted.shape[-1]
    last = (vocab - 1 - mx.argmax(keep[:, ::-1], axis=-1)).astype(mx.int32)
    return mx.where(pick >= vocab, last, mx.minimum(pick, vocab - 1))


def _ranked(top_k: np.ndarray, top_p: np.ndarray, vocab: int) -> int:
    """How many best candidates the sampled rows' top-k and top-p look at: every top-k,
    and at least RANKED for top-p (0 when no row has either)."""
    k_rows = top_k[top_k < vocab]
    if not k_rows.size and not np.any(top_p < 1.0):
        return 0
    return int(min(vocab, max(RANKED, int(k_rows.max()) if k_rows.size else 0)))


def _ranked_keep(
    shifted: mx.array, tempered: mx.array, min_p_keep: mx.array, batch: DeviceBatch
) -> mx.array:
    """top-k and top-p as value thresholds, from each row's best ``batch.ranked`` logits
    sorted (``mx.topk``: no sort of the whole vocabulary). Every filter keeps a best-first
    prefix, so each is "at least the value of its last kept token".

    temperature_first: top-p over the mass min-p and top-k leave, tempered;
    filters_first: top-p over the whole temperature-1 distribution. A nucleus wider than
    the ranked candidates is cut to them (a near-flat distribution; NumPy sorts on)."""
    n = batch.ranked
    best = mx.sort(mx.topk(shifted, n, axis=-1), axis=-1)[:, ::-1]  # [rows, n], best first
    kth = mx.take_along_axis(best, mx.minimum(batch.top_k, n) - 1, axis=-1)
    in_k = mx.where(batch.top_k < shifted.shape[-1], shifted >= kth, True)
    # The candidates' weights, best first, and the mass top-p takes its share of.
    rank = mx.arange(n, dtype=mx.int32)[None, :]
    best_tempered = _exp(best / batch.temperature)
    best_plain = _exp(best)
    best_min_p = mx.where(batch.filters_first, best, best / batch.temperature) >= batch.log_min_p
    first_weights = mx.where((rank < batch.top_k) & best_min_p, best_tempered, 0.0)
    weights = mx.where(batch.filters_first, best_plain, first_weights)
    plain_total = mx.sum(_exp(shifted), axis=-1, keepdims=True)
    first_total = mx.sum(mx.where(min_p_keep & in_k, tempered, 0.0), axis=-1, keepdims=True)
    total = mx.where(batch.filters_first, plain_total, first_total)
    above = _cumsum(weights) - weights
    in_p = (above < batch.top_p * total) & (weights > 0)
    # The smallest kept candidate; every candidate kept (a nucleus wider): the last one.
    floor = mx.min(mx.where(in_p, best, mx.inf), axis=-1, keepdims=True)
    floor = mx.where(batch.top_p < 1.0, floor, -mx.inf)
    return in_k & (shifted >= floor)


def _cumsum(weights: mx.array, block: int = 256) -> mx.array:
    """Running sums along each row in two levels (within blocks, then of the blocks'
    totals): each sum adds a few hundred float32 terms, not up to a whole vocabulary,
    so the CDF stays within a few ulps of NumPy's float64 one."""
    rows, width = weights.shape
    pad = -width % block
    if pad:
        weights = mx.pad(weights, [(0, 0), (0, pad)])
    inner = mx.cumsum(weights.reshape(rows, -1, block), axis=-1)
    totals = inner[:, :, -1]
    before = mx.cumsum(totals, axis=-1) - totals
    return (inner + before[:, :, None]).reshape(rows, -1)[:, :width]


def _arrays(draw: DeviceDraw) -> list[mx.array]:
    arrays = [draw.token_ids, draw.logprobs]
    if draw.top_ids is not None and draw.top_logprobs is not None:
        arrays += [draw.top_ids, draw.top_logprobs]
    return arrays
