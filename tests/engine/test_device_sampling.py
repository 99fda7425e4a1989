"""Sampling as MLX ops (batchd.engine.sampling.device) against the NumPy sampler, and the
MLX backend's step: one host synchronisation a decode step, never a host sampler.

The device sampler must choose the NumPy sampler's tokens for every control (logit_bias,
penalties, grammar masks, min_tokens, both sampling orders, top-k/p, min-p) and the same
seeded draws (a uniform of (seed, position) only); its logprobs within float32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import numpy as np
import pytest

from batchd.engine import EngineConfig, LLMEngine, SamplingParams
from batchd.engine.logits_processors import PenaltyHistory, PenaltyTokens
from batchd.engine.models.loader import LoadedModel, load
from batchd.engine.sampler import SampleRow, Samples, sample
from batchd.engine.sampling import samplers
from batchd.engine.sampling.samplers import DeviceSampler

VOCAB = 300


def _device(logits: np.ndarray, rows: list[SampleRow]) -> Samples:
    sampler = DeviceSampler()
    sampler.begin(mx.array(logits), [])
    sampler.prepare(rows)
    return sampler.sample()


def _history(tokens: list[int], prompt: list[int] | None = None) -> PenaltyTokens:
    history = PenaltyHistory(prompt)
    for t in tokens:
        history.add(t)
    return history.tokens()


def _cases(rng: np.random.Generator) -> list[SampleRow]:
    """Rows covering every control, greedy and seeded, in both orders."""
    recent = rng.integers(0, VOCAB, 30).tolist()
    allowed = np.zeros(VOCAB, dtype=bool)
    allowed[rng.choice(VOCAB, 40, replace=False)] = True
    only_end = np.zeros(VOCAB, dtype=bool)
    only_end[[2, 3]] = True
    bias = ((5, 4.0), (17, -30.0), (250, 2.5))
    rows = []
    for order in ("temperature_first", "filters_first"):
        for i, extra in enumerate(
            [
                {},
                {"top_k": 5},
                {"top_p": 0.8},
                {"min_p": 0.1},
                {"top_k": 20, "top_p": 0.9, "min_p": 0.02},
                {"logit_bias": bias, "top_p": 0.95},
            ]
        ):
            params = SamplingParams(
                temperature=0.7 + 0.2 * i, seed=i, sampling_order=order, logprobs=i % 3, **extra
            )
            rows.append(SampleRow(params, 1000 + i, int(rng.integers(0, 500))))
    windowed = SamplingParams(
        temperature=0.9,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.4,
        penalty_window=20,
    )
    rows.append(SampleRow(windowed, 7, 3, PenaltyTokens.window(recent[-20:])))
    whole = SamplingParams(repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.2)
    rows.append(SampleRow(whole, 8, 4, _history(recent, prompt=[1, 2, 3, 9])))
    rows.append(SampleRow(SamplingParams(temperature=1.0, top_k=3), 9, 5, allowed=allowed))
    rows.append(SampleRow(SamplingParams(logprobs=5), 10, 0, banned=(int(np.argmax(recent)),)))
    # The grammar can only end: the min_tokens ban gives way.
    rows.append(SampleRow(SamplingParams(), 11, 0, banned=(2, 3), allowed=only_end))
    rows.append(SampleRow(SamplingParams(logit_bias=bias, logprobs=3), 12, 0))
    return rows


def _logits(rng: np.random.Generator, rows: int) -> np.ndarray:
    return (rng.normal(size=(rows, VOCAB)) * 3).astype(np.float32)


@pytest.mark.parametrize("seed", range(6))
def test_device_sampler_chooses_the_host_samplers_tokens(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows = _cases(rng)
    logits = _logits(rng, len(rows))
    host, dev = sample(logits, rows), _device(logits, rows)
    assert dev.token_ids == host.token_ids
    np.testing.assert_allclose(dev.logprobs, host.logprobs, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(dev.top_logprobs, host.top_logprobs, strict=True):
        assert (ours is None) == (theirs is None)
        if ours is not None and theirs is not None:
            assert [t for t, _ in ours] == [t for t, _ in theirs]
            np.testing.assert_allclose([v for _, v in ours], [v for _, v in theirs], atol=1e-5)


def test_seeded_draws_match_the_host_sampler_over_many_positions() -> None:
    """A seeded row's draws at 400 positions, alone and amid other rows: the device's
    equal the host's, so a draw is a function of (seed, position) on both."""
    rng = np.random.default_rng(1)
    logits = _logits(rng, 3)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=3)
    other = SampleRow(SamplingParams(temperature=2.0, top_k=4), 5, 0)
    for position in range(400):
        row = SampleRow(params, 3, position)
        alone = _device(logits[1:2], [row]).token_ids[0]
        batched = _device(logits, [other, row, SampleRow(SamplingParams(), 0, 0)]).token_ids[1]
        assert alone == batched == sample(logits[1:2], [row]).token_ids[0], position


# -- the engine's step on the MLX backend --------------------------------------------------


@pytest.fixture(scope="module")
def loaded(tiny_model: Path) -> LoadedModel:
    return load(tiny_model)


def _engine(loaded: LoadedModel, **options: Any) -> LLMEngine:
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=128, **options)
    return LLMEngine(loaded, config)


@pytest.fixture
def counted_syncs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every blocking read of an MLX array, by kind; the host sampler refuses to run."""
    calls: list[str] = []
    real_eval = mx.eval

    def counting(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return real(*args, **kwargs)

        return wrapper

    def host_sampler(*args: Any, **kwargs: Any) -> Samples:
        raise AssertionError("the MLX backend sampled on the host")

    monkeypatch.setattr(mx, "eval", counting("eval", real_eval))
    monkeypatch.setattr(mx.array, "item", counting("item", mx.array.item))
    monkeypatch.setattr(mx.array, "tolist", counting("tolist", mx.array.tolist))
    monkeypatch.setattr(samplers, "sample", host_sampler)
    yield calls


def _mixed_requests(eng: LLMEngine) -> None:
    bias = ((11, 3.0),)
    for i, params in enumerate(
        [
            SamplingParams(max_tokens=12, ignore_eos=True),
            SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=4),
            SamplingParams(
                max_tokens=12, ignore_eos=True, temperature=1.0, top_p=0.9, top_k=8, seed=5
            ),
            SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3, logit_bias=bias),
            SamplingParams(max_tokens=12, ignore_eos=True, presence_penalty=0.5, min_tokens=4),
            SamplingParams(
                max_tokens=12,
                ignore_eos=True,
                temperature=0.9,
                repetition_penalty=1.2,
                seed=6,
                penalty_window=8,
                sampling_order="filters_first",
                min_p=0.05,
            ),
        ]
    ):
        eng.add_request(f"r{i}", prompt_token_ids=list(range(30 + i, 50 + 2 * i)), params=params)


def test_mlx_backend_syncs_once_per_decode_step_and_samples_on_the_device(
    loaded: LoadedModel, counted_syncs: list[str]
) -> None:
    eng = _engine(loaded, forward_backend="mlx")
    assert (eng.backend.name, eng.backend.sampler) == ("mlx", "device")
    _mixed_requests(eng)
    decode_steps = 0
    while eng.has_unfinished():
        counted_syncs.clear()
        outputs = eng.step()
        stats = eng.last_step_stats
        assert outputs
        if stats.num_decode_tokens and not stats.num_prefill_tokens:
            decode_steps += 1
            assert counted_syncs == ["eval"], stats.step
    assert decode_steps >= 10


def test_the_sync_count_fails_when_the_mlx_backend_samples_on_the_host(
    loaded: LoadedModel, counted_syncs: list[str]
) -> None:
    """The check above has teeth: the host sampler on the MLX backend is caught."""
    eng = _engine(loaded, forward_backend="mlx", sampler="host")
    _mixed_requests(eng)
    with pytest.raises(AssertionError, match="sampled on the host"):
        eng.step()


def test_device_and_host_samplers_give_one_run_on_the_mlx_backend(loaded: LoadedModel) -> None:
    """The whole engine, seeded and controlled rows together: the same tokens either way."""
    runs = []
    for sampler in ("device", "host"):
        eng = _engine(loaded, forward_backend="mlx", sampler=sampler)
        _mixed_requests(eng)
        tokens: dict[str, list[int]] = {}
        while eng.has_unfinished():
            for out in eng.step():
                tokens.setdefault(out.request_id, []).append(out.token_id)
        runs.append(tokens)
    assert runs[0] == runs[1]


def test_top_p_on_a_real_vocabulary_ranks_only_the_best_candidates() -> None:
    """A 49152-token row whose nucleus is a few hundred tokens (a trained model's shape):
    the device's top-p from its best RANKED candidates draws the host's tokens, in both
    sampling orders, with top-k and min-p beside it."""
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(2, 49152)).astype(np.float32)
    logits[:, rng.choice(49152, 300, replace=False)] += 9.0
    for order in ("temperature_first", "filters_first"):
        for extra in ({"top_p": 0.9}, {"top_p": 0.95, "top_k": 200, "min_p": 0.001}):
            params = SamplingParams(temperature=0.8, sampling_order=order, **extra)
            for position in range(0, 60, 2):
                rows = [SampleRow(params, 21, position), SampleRow(params, 22, position + 1)]
                assert _device(logits, rows).token_ids == sample(logits, rows).token_ids
