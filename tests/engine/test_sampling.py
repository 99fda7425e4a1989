"""Sampling: each filter's support, log-probabilities, and seeded determinism.

A seeded request's token at output position p depends only on (seed, p,
logits): alone, inside a busy batch, after a restart and after a resume it
draws the same tokens.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import numpy as np
import pytest

from batchd.engine import EngineConfig, LLMEngine, SamplingParams
from batchd.engine.logits_processors import PenaltyTokens
from batchd.engine.models.loader import LoadedModel, load
from batchd.engine.sampler import SampleRow, position_uniform, sample

VOCAB = 50


def _logits(seed: int = 0, rows: int = 1) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=(rows, VOCAB)) * 3).astype(np.float32)


def _draws(logits: np.ndarray, params: SamplingParams, n: int = 600) -> Counter[int]:
    return Counter(sample(logits, [SampleRow(params, 11, p)]).token_ids[0] for p in range(n))


def test_greedy_logprobs_and_top_logprobs() -> None:
    logits = _logits(rows=3)
    rows = [SampleRow(SamplingParams(logprobs=i), 0, 0) for i in (0, 1, 5)]
    out = sample(logits, rows)
    log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    assert out.token_ids == logits.argmax(-1).tolist()
    np.testing.assert_allclose(out.logprobs, log_softmax.max(-1), rtol=1e-5)
    assert out.top_logprobs[0] is None
    top5 = out.top_logprobs[2]
    assert top5 is not None and [t for t, _ in top5] == np.argsort(-logits[2])[:5].tolist()
    np.testing.assert_allclose([lp for _, lp in top5], np.sort(log_softmax[2])[::-1][:5], rtol=1e-5)


def test_top_k_top_p_min_p_restrict_the_support() -> None:
    logits = _logits(1)
    order = np.argsort(-logits[0]).tolist()
    assert set(_draws(logits, SamplingParams(temperature=1.0, top_k=3))) <= set(order[:3])
    probs = np.exp(logits[0] - logits[0].max())
    probs /= probs.sum()
    nucleus = order[: int(np.searchsorted(np.cumsum(probs[order]), 0.6)) + 1]
    assert set(_draws(logits, SamplingParams(temperature=1.0, top_p=0.6))) <= set(nucleus)
    floor = [t for t in order if probs[t] >= 0.2 * probs[order[0]]]
    assert set(_draws(logits, SamplingParams(temperature=1.0, min_p=0.2))) <= set(floor)
    free = _draws(logits, SamplingParams(temperature=1.0), n=3000)
    # Unfiltered temperature-1 draws follow the softmax.
    for token in order[:3]:
        assert abs(free[token] / 3000 - probs[token]) < 0.04


def test_repetition_penalty_follows_mlx_lm() -> None:
    import mlx.core as mx
    from mlx_lm.sample_utils import make_repetition_penalty

    logits = _logits(2)
    recent = [int(np.argmax(logits[0])), int(np.argmin(logits[0])), 7]
    penalised = make_repetition_penalty(1.5, context_size=20)(mx.array(recent), mx.array(logits))
    params = SamplingParams(repetition_penalty=1.5, penalty_window=20)
    out = sample(logits, [SampleRow(params, 0, 0, PenaltyTokens.window(recent))])
    assert out.token_ids == [int(np.argmax(np.array(penalised)))]
    expected_lp = np.array(penalised)[0] - np.log(np.exp(np.array(penalised)[0]).sum())
    np.testing.assert_allclose(out.logprobs[0], expected_lp[out.token_ids[0]], rtol=1e-5)


def test_draws_depend_only_on_seed_and_position() -> None:
    logits = _logits(3, rows=4)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    alone = [sample(logits[1:2], [SampleRow(params, 5, p)]).token_ids[0] for p in range(20)]
    batched = [
        sample(
            logits,
            [
                SampleRow(SamplingParams(), 0, 0),
                SampleRow(params, 5, p),
                SampleRow(SamplingParams(temperature=1.0), 9, p + 3),
                SampleRow(SamplingParams(top_k=2, temperature=2.0), 1, 0),
            ],
        ).token_ids[1]
        for p in range(20)
    ]
    assert alone == batched
    assert position_uniform(5, 3) == position_uniform(5, 3) != position_uniform(5, 4)
    assert len(set(alone)) > 1


def _vllm_support(
    logits: np.ndarray,
    temperature: float,
    *,
    top_p: float = 1.0,
    min_p: float = 0.0,
    top_k: int = 0,
) -> set[int]:
    """vLLM's sampler by hand: temperature, then min-p, top-k, and top-p over the
    renormalised rest (a token stays while the mass ranked above it is below top_p)."""
    scaled = logits.astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    kept = np.flatnonzero(probs >= min_p * probs.max())
    kept = kept[np.argsort(-probs[kept], kind="stable")]
    if top_k:
        kept = kept[:top_k]
    mass = probs[kept] / probs[kept].sum()
    return {int(t) for t in kept[np.cumsum(mass) - mass < top_p]}


def _mlx_lm_support(
    logits: np.ndarray, *, top_p: float = 1.0, min_p: float = 0.0, top_k: int = 0
) -> set[int]:
    """What mlx-lm's make_sampler draws from: its own filters, in its order, on the
    temperature-1 log-probabilities (temperature scales what they leave)."""
    import mlx.core as mx
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    logprobs = mx.array(logits - np.log(np.exp(logits.astype(np.float64)).sum()))[None]
    if top_p < 1.0:
        logprobs = apply_top_p(logprobs, top_p)
    if min_p:
        logprobs = apply_min_p(logprobs, min_p)
    if top_k:
        logprobs = apply_top_k(logprobs, top_k)
    return {int(t) for t in np.flatnonzero(np.isfinite(np.array(logprobs[0])))}


@pytest.mark.parametrize(
    ("logits", "temperature", "filters"),
    [
        # The case: at temperature 1 the two best hold 0.72 of the mass, at
        # temperature 2 only 0.69, so top_p 0.7 keeps two before temperature, three after.
        (
            np.array([0.0, -0.2, -0.33] + [-20.0] * (VOCAB - 3), dtype=np.float32),
            2.0,
            {"top_p": 0.7},
        ),
        (_logits(1)[0] * 2 / 3, 1.5, {"top_p": 0.8, "min_p": 0.05, "top_k": 6}),
    ],
)
def test_sampling_order_support_equals_vllm_and_mlx_lm(
    logits: np.ndarray, temperature: float, filters: dict[str, Any]
) -> None:
    vllm = _vllm_support(logits, temperature, **filters)
    mlx_lm = _mlx_lm_support(logits, **filters)
    assert vllm != mlx_lm  # the case tells the two orders apart
    for order, expected in (("temperature_first", vllm), ("filters_first", mlx_lm)):
        params = SamplingParams(temperature=temperature, sampling_order=order, **filters)
        assert set(_draws(logits[None], params, n=4000)) == expected, order
    # The default is vLLM's order.
    default = SamplingParams(temperature=temperature, **filters)
    assert set(_draws(logits[None], default, n=4000)) == vllm


def test_filters_first_draws_follow_mlx_lm_sampler() -> None:
    """Within the support, filters_first draws with mlx-lm's make_sampler's weights: the
    survivors' probabilities at the temperature (4,000 draws each, within 0.03)."""
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    logits = np.array([0.0, -0.2, -0.33] + [-20.0] * (VOCAB - 3), dtype=np.float32)
    ours = _draws(
        logits[None],
        SamplingParams(temperature=2.0, top_p=0.7, sampling_order="filters_first"),
        n=4000,
    )
    mx.random.seed(0)
    sampler = make_sampler(temp=2.0, top_p=0.7)
    logprobs = mx.array(logits - np.log(np.exp(logits.astype(np.float64)).sum()))[None]
    theirs = Counter(int(sampler(logprobs).item()) for _ in range(4000))
    assert set(ours) == set(theirs) == {0, 1}
    assert abs(ours[0] - theirs[0]) / 4000 < 0.03


@pytest.fixture(scope="module")
def loaded(tiny_model: Path) -> LoadedModel:
    return load(tiny_model)


def _engine(loaded: LoadedModel, backend: str = "auto") -> LLMEngine:
    config = EngineConfig(
        max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=128, forward_backend=backend
    )
    return LLMEngine(loaded, config)


# Both forward backends: the C kernels sampling on the host (auto, on an x86 CPU) and MLX
# sampling on the device.
BACKENDS = pytest.mark.parametrize("backend", ["auto", "mlx"])


SEEDED = SamplingParams(temperature=0.8, seed=1234, max_tokens=24, ignore_eos=True)
PROMPT = list(range(40, 75))


def _run(eng: LLMEngine, rid: str) -> list[int]:
    tokens: list[int] = []
    while eng.has_unfinished():
        tokens.extend(o.token_id for o in eng.step() if o.request_id == rid)
    return tokens


@BACKENDS
def test_seeded_request_same_alone_in_busy_batch_and_after_restart(
    loaded: LoadedModel, backend: str
) -> None:
    eng = _engine(loaded, backend)
    eng.add_request("alone", prompt_token_ids=PROMPT, params=SEEDED)
    alone = _run(eng, "alone")
    busy = _engine(loaded, backend)
    rng = np.random.default_rng(0)
    for i in range(7):
        prompt = rng.integers(4, 1000, int(rng.integers(1, 120))).tolist()
        params = SamplingParams(max_tokens=int(rng.integers(1, 30)), temperature=float(i % 2))
        busy.add_request(f"other{i}", prompt_token_ids=prompt, params=params)
    busy.step()
    busy.add_request("seeded", prompt_token_ids=PROMPT, params=SEEDED)
    assert _run(busy, "seeded") == alone
    # A restart: a new engine (fresh pool and scheduler) over the same weights.
    restarted = _engine(loaded, backend)
    restarted.add_request("again", prompt_token_ids=PROMPT, params=SEEDED)
    assert _run(restarted, "again") == alone


@BACKENDS
def test_resume_continues_positions_and_max_tokens(loaded: LoadedModel, backend: str) -> None:
    eng = _engine(loaded, backend)
    eng.add_request("full", prompt_token_ids=PROMPT, params=SEEDED)
    full = _run(eng, "full")
    eng.add_request(
        "resumed",
        prompt_token_ids=PROMPT,
        params=SEEDED,
        resume_output_token_ids=full[:10],
    )
    outs = []
    while eng.has_unfinished():
        outs.extend(eng.step())
    assert [o.token_id for o in outs] == full[10:]
    assert [o.index for o in outs] == list(range(10, len(full)))
    assert outs[-1].finish_reason == "length"
