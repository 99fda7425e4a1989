"""The logits processors: with ``penalty_window`` N they equal mlx-lm's
``make_logits_processors`` on the same logits, in the same order (logit_bias,
repetition, presence, frequency over the last N tokens of prompt + output); by default
the penalties follow OpenAI's formula over the whole output (prompt excluded) and vLLM's
repetition scope (prompt + output), checked against hand-computed values; the two
controls mlx-lm lacks (grammar mask, min_tokens) do what they say."""

from __future__ import annotations

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_logits_processors

from batchd.engine.logits_processors import PenaltyHistory, PenaltyTokens, process_row
from batchd.engine.sampler import SampleRow, sample
from batchd.engine.sampling_params import SamplingParams

VOCAB = 300


def _mlx_lm(logits: np.ndarray, tokens: list[int], **controls: object) -> np.ndarray:
    out = mx.array(logits[None])
    for processor in make_logits_processors(**controls):  # type: ignore[arg-type]
        out = processor(mx.array(tokens), out)
    return np.array(out[0])


@pytest.mark.parametrize(
    "controls",
    [
        {"logit_bias": {3: 5.0, 7: -2.5, 250: 100.0}},
        {"repetition_penalty": 1.3},
        {"presence_penalty": 0.7},
        {"frequency_penalty": 0.4},
        {"presence_penalty": -1.5, "frequency_penalty": 2.0},
        {
            "logit_bias": {5: 3.0, 9: -7.0},
            "repetition_penalty": 1.2,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.25,
        },
    ],
)
@pytest.mark.parametrize("window", [20, 7])
def test_windowed_processors_equal_mlx_lm(controls: dict[str, object], window: int) -> None:
    rng = np.random.default_rng(7)
    logits = (rng.normal(size=VOCAB) * 4).astype(np.float32)
    # Repeats (for frequency), over the window (only its last tokens count), biased ids
    # among them.
    tokens = [int(t) for t in rng.integers(0, 40, size=35)] + [5, 5, 9, 3, 3, 3]
    bias = controls.get("logit_bias", {})
    assert isinstance(bias, dict)
    params = SamplingParams(
        repetition_penalty=float(controls.get("repetition_penalty", 1.0)),  # type: ignore[arg-type]
        presence_penalty=float(controls.get("presence_penalty", 0.0)),  # type: ignore[arg-type]
        frequency_penalty=float(controls.get("frequency_penalty", 0.0)),  # type: ignore[arg-type]
        logit_bias=tuple(bias.items()),
        penalty_window=window,
    )
    sizes = {f"{k}_context_size": window for k in ("repetition", "presence", "frequency")}
    theirs = _mlx_lm(logits, tokens, **controls, **sizes)
    penalised = PenaltyTokens.window(tokens[-window:])
    ours = logits.copy()
    process_row(ours, params, penalised, (), None)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)
    # Greedy picks what mlx-lm's pipeline picks.
    greedy = sample(logits[None], [SampleRow(params, 0, 0, penalised)]).token_ids[0]
    assert greedy == int(np.argmax(theirs))


def _openai(
    logits: np.ndarray, generated: list[int], *, presence: float, frequency: float
) -> np.ndarray:
    """OpenAI's documented formula, by hand: mu[j] - c[j] * frequency - (c[j] > 0) *
    presence, c[j] counting token j in everything generated so far."""
    out = logits.astype(np.float64).copy()
    for j in set(generated):
        c = generated.count(j)
        out[j] -= c * frequency + presence
    return out


def _engine_row(
    logits: np.ndarray, params: SamplingParams, prompt: list[int], generated: list[int]
) -> np.ndarray:
    """One row processed as the engine does with the default scope: a PenaltyHistory fed
    the generated tokens one by one."""
    history = PenaltyHistory(prompt if params.repetition_penalty != 1.0 else None)
    for token in generated:
        history.add(token)
    row = logits.copy()
    process_row(row, params, history.tokens(), (), None)
    return row


def test_default_penalties_follow_openai_over_the_whole_output() -> None:
    rng = np.random.default_rng(3)
    logits = (rng.normal(size=VOCAB) * 4).astype(np.float32)
    # The prompt ends with a chat template's end token (299) and holds 7; the output
    # generated 42 once 25 steps back, 11 three times, then 21 other tokens.
    prompt = [100, 101, 7, 299, 120, 299]
    generated = [42, 11, 11, 11] + [int(t) for t in rng.integers(150, 250, size=21)]
    params = SamplingParams(presence_penalty=0.8, frequency_penalty=0.3)
    ours = _engine_row(logits, params, prompt, generated)
    np.testing.assert_allclose(
        ours,
        _openai(logits, generated, presence=0.8, frequency=0.3),
        rtol=1e-6,
        atol=1e-5,
    )
    # A token generated 25 steps back is penalised (mlx-lm's window of 20 misses it) ...
    assert len(generated) - generated.index(42) == 25
    assert ours[42] == pytest.approx(logits[42] - 0.8 - 0.3)
    assert ours[11] == pytest.approx(logits[11] - 0.8 - 3 * 0.3)
    # ... and the prompt's tokens (its end token included) are not.
    assert ours[299] == logits[299] and ours[7] == logits[7]
    windowed = _mlx_lm(logits, prompt + generated, presence_penalty=0.8, frequency_penalty=0.3)
    assert windowed[42] == logits[42]
    # Before any output, nothing is penalised at all (the gateway's first token).
    first = _engine_row(logits, params, prompt, [])
    np.testing.assert_array_equal(first, logits)


def test_default_repetition_penalty_scales_prompt_and_output_once_each() -> None:
    """vLLM's scope for the repetition penalty: every token of the prompt and of the
    output, each once, with mlx-lm's sign-aware arithmetic."""
    logits = np.linspace(-5, 5, VOCAB).astype(np.float32)
    prompt = [3, 3, 290, 150]
    generated = [10, 280, 10] + list(range(200, 230))
    ours = _engine_row(logits, SamplingParams(repetition_penalty=1.5), prompt, generated)
    expected = logits.astype(np.float64).copy()
    for j in set(prompt) | set(generated):
        expected[j] = expected[j] * 1.5 if expected[j] < 0 else expected[j] / 1.5
    np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=1e-6)


def test_grammar_mask_then_min_tokens_unless_nothing_else_is_left() -> None:
    logits = np.arange(VOCAB, dtype=np.float32)
    allowed = np.zeros(VOCAB, dtype=bool)
    allowed[[10, 20, 299]] = True
    row = logits.copy()
    process_row(row, SamplingParams(), (), (299,), allowed)
    assert np.flatnonzero(np.isfinite(row)).tolist() == [10, 20]
    only_end = np.zeros(VOCAB, dtype=bool)
    only_end[299] = True
    row = logits.copy()
    process_row(row, SamplingParams(), (), (299,), only_end)
    assert np.flatnonzero(np.isfinite(row)).tolist() == [299]


def test_sampled_rows_stay_inside_the_mask_and_seeded() -> None:
    logits = (np.random.default_rng(1).normal(size=(1, VOCAB)) * 3).astype(np.float32)
    allowed = np.zeros(VOCAB, dtype=bool)
    allowed[[1, 50, 51, 200]] = True
    params = SamplingParams(temperature=1.5, top_p=0.95)
    draws = [
        sample(logits, [SampleRow(params, 3, p, allowed=allowed)]).token_ids[0] for p in range(200)
    ]
    assert set(draws) <= {1, 50, 51, 200}
    again = [
        sample(logits, [SampleRow(params, 3, p, allowed=allowed)]).token_ids[0] for p in range(200)
    ]
    assert draws == again


def test_bad_values_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=2.5)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=((3, 101.0),))
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=-1)
    with pytest.raises(ValueError, match="penalty_window"):
        SamplingParams(penalty_window=0)
    with pytest.raises(ValueError, match="sampling_order"):
        SamplingParams(sampling_order="vllm")
