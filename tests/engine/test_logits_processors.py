"""The logits processors equal mlx-lm's ``make_logits_processors`` on the same logits, in
the same order (logit_bias, repetition, presence, frequency over the last 20 tokens), and
the two controls mlx-lm lacks (grammar mask, min_tokens) do what they say."""

from __future__ import annotations

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_logits_processors

from batchd.engine.logits_processors import process_row
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
def test_processors_equal_mlx_lm(controls: dict[str, object]) -> None:
    rng = np.random.default_rng(7)
    logits = (rng.normal(size=VOCAB) * 4).astype(np.float32)
    # Repeats (for frequency), over 20 tokens (only the last 20 count), biased ids among them.
    tokens = [int(t) for t in rng.integers(0, 40, size=35)] + [5, 5, 9, 3, 3, 3]
    bias = controls.get("logit_bias", {})
    assert isinstance(bias, dict)
    params = SamplingParams(
        repetition_penalty=float(controls.get("repetition_penalty", 1.0)),  # type: ignore[arg-type]
        presence_penalty=float(controls.get("presence_penalty", 0.0)),  # type: ignore[arg-type]
        frequency_penalty=float(controls.get("frequency_penalty", 0.0)),  # type: ignore[arg-type]
        logit_bias=tuple(bias.items()),
    )
    ours = logits.copy()
    process_row(ours, params, tokens, (), None)
    np.testing.assert_allclose(ours, _mlx_lm(logits, tokens, **controls), rtol=1e-6, atol=1e-6)
    # Greedy picks what mlx-lm's pipeline picks.
    greedy = sample(logits[None], [SampleRow(params, 0, 0, tokens)]).token_ids[0]
    assert greedy == int(np.argmax(_mlx_lm(logits, tokens, **controls)))


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
