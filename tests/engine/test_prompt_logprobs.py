"""Prompt logprobs: each prompt token's log-probability given the ones before it, equal
(within float32 tolerance) to a log-softmax over mlx-lm's own forward of the prompt; in
chunks, in a mixed batch, and with the prompt's blocks already in the prefix cache
(which such a request does not use)."""

from __future__ import annotations

from pathlib import Path

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import numpy as np
import pytest

from batchd.engine import EngineConfig, LLMEngine, SamplingParams
from batchd.engine.models.loader import LoadedModel, load
from tests.engine.parity_harness import prompt_logprobs_reference

PROMPT = [(53 * j) % 900 + 30 for j in range(75)]


@pytest.fixture(scope="module")
def loaded(tiny_model: Path) -> LoadedModel:
    return load(tiny_model)


def _run(eng: LLMEngine, requests: dict[str, SamplingParams]) -> dict[str, list[float] | None]:
    for rid, params in requests.items():
        eng.add_request(rid, prompt_token_ids=PROMPT, params=params)
    got: dict[str, list[float] | None] = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id not in got:
                got[out.request_id] = out.prompt_logprobs
    return got


def test_prompt_logprobs_equal_mlx_lm_in_chunks_and_past_the_prefix_cache(
    loaded: LoadedModel,
) -> None:
    eng = LLMEngine(
        loaded, EngineConfig(max_num_seqs=8, max_num_batched_tokens=32, num_kv_blocks=128)
    )
    want = prompt_logprobs_reference(loaded.model, PROMPT)
    plain = SamplingParams(max_tokens=3)
    scored = SamplingParams(max_tokens=3, prompt_logprobs=True)
    # Warm the prefix cache with the prompt, then ask for its logprobs alongside a plain one.
    assert _run(eng, {"warm": plain}) == {"warm": None}
    prefill = 0
    for rid, params in {"scored": scored, "plain": plain}.items():
        eng.add_request(rid, prompt_token_ids=PROMPT, params=params)
    got: dict[str, list[float] | None] = {}
    while eng.has_unfinished():
        for out in eng.step():
            got.setdefault(out.request_id, out.prompt_logprobs)
        prefill += eng.last_step_stats.num_prefill_tokens
    scores = got["scored"]
    assert scores is not None and got["plain"] is None
    np.testing.assert_allclose(scores, want, atol=1e-4)
    # The scored request computed its whole prompt (32-token chunks); the plain one hit
    # the cache for its 4 full blocks and computed the rest.
    assert prefill == len(PROMPT) + (len(PROMPT) - 64)


def test_asking_changes_no_output(loaded: LoadedModel) -> None:
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=128)
    greedy = SamplingParams(max_tokens=6)
    without = LLMEngine(loaded, config).generate([PROMPT], greedy)
    with_scores = LLMEngine(loaded, config).generate(
        [PROMPT], SamplingParams(max_tokens=6, prompt_logprobs=True)
    )
    assert with_scores == without
