"""The samples of one request (the n sequences of a job) share its prompt's KV blocks.

A later sample is admitted once an earlier one has computed the full blocks of their
common prompt and takes them from the prefix cache: the prompt is prefilled once (plus
each later sample's last, partial block), the pool holds one copy of its full blocks,
and every sample still produces exactly what it would alone.
"""

from __future__ import annotations

from pathlib import Path

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import pytest

from batchd.engine import EngineConfig, LLMEngine, SamplingParams
from batchd.engine.models.loader import LoadedModel, load
from batchd.engine.outputs import FinishReason
from tests.engine.parity_harness import Reference, Req, check_parity

BLOCK = 16
PROMPT = [(37 * j) % 900 + 40 for j in range(70)]  # 4 full blocks + 6 tokens
N = 4
MAX_TOKENS = 10  # the tail (6 prompt tokens + outputs) stays in one block


@pytest.fixture(scope="module")
def loaded(tiny_model: Path) -> LoadedModel:
    return load(tiny_model)


def _engine(loaded: LoadedModel, *, prefix_caching: bool = True) -> LLMEngine:
    config = EngineConfig(
        max_num_seqs=16,
        max_num_batched_tokens=512,
        num_kv_blocks=256,
        block_size=BLOCK,
        enable_prefix_caching=prefix_caching,
    )
    return LLMEngine(loaded, config)


def _run(
    eng: LLMEngine, params: list[SamplingParams], *, samples: bool
) -> tuple[list[list[int]], int, int]:
    """Outputs of N sequences of PROMPT (the samples of one request, or N requests);
    prefill tokens computed; most blocks in use."""
    for i, p in enumerate(params):
        if samples:
            eng.add_request("r", prompt_token_ids=PROMPT, params=p, sample=i)
        else:
            eng.add_request(f"s{i}", prompt_token_ids=PROMPT, params=p)
    outputs: dict[tuple[str, int], list[int]] = {}
    prefill = peak = 0
    while eng.has_unfinished():
        for out in eng.step():
            outputs.setdefault((out.request_id, out.sample), []).append(out.token_id)
        stats = eng.last_step_stats
        prefill += stats.num_prefill_tokens
        peak = max(peak, stats.kv_blocks_used)
    keys = [("r", i) if samples else (f"s{i}", 0) for i in range(len(params))]
    return [outputs[key] for key in keys], prefill, peak


def test_samples_compute_the_prompt_once_and_share_its_blocks(loaded: LoadedModel) -> None:
    greedy = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)] * N
    shared, shared_prefill, shared_peak = _run(_engine(loaded), greedy, samples=True)
    alone, alone_prefill, alone_peak = _run(_engine(loaded), greedy, samples=False)

    full_blocks = len(PROMPT) // BLOCK
    partial = len(PROMPT) - full_blocks * BLOCK
    # Sample 0 prefills the whole prompt, each later one only its partial last block.
    assert shared_prefill == len(PROMPT) + (N - 1) * partial
    assert alone_prefill == N * len(PROMPT)
    # One copy of the full blocks, plus each sequence's own tail (prompt rest + outputs).
    tail = -(-(partial + MAX_TOKENS - 1) // BLOCK)
    assert shared_peak == full_blocks + N * tail
    assert alone_peak == N * (full_blocks + tail)
    # Greedy: all equal, and equal to mlx-lm's output for the prompt alone.
    assert shared == alone
    assert all(out == shared[0] for out in shared)
    check_parity(Reference(loaded.model), [Req(tuple(PROMPT), MAX_TOKENS)], shared[:1])


def test_seeded_samples_sample_as_they_would_alone(loaded: LoadedModel) -> None:
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=100 + i, ignore_eos=True)
        for i in range(N)
    ]
    shared, _, _ = _run(_engine(loaded), params, samples=True)
    for i, p in enumerate(params):
        alone, _, _ = _run(_engine(loaded), [p], samples=False)
        assert shared[i] == alone[0]
    assert len({tuple(out) for out in shared}) > 1


def test_a_sample_goes_on_alone_when_the_earlier_ones_ended_at_resume(
    loaded: LoadedModel,
) -> None:
    eng = _engine(loaded)
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    alone = eng.generate([PROMPT], greedy)[0]
    # Sample 0's delivered outputs already end it: nothing queued, sample 1 waits for none.
    ended = eng.add_request(
        "r", prompt_token_ids=PROMPT, params=greedy, resume_output_token_ids=alone
    )
    assert ended is FinishReason.length
    eng.add_request("r", prompt_token_ids=PROMPT, params=greedy, sample=1)
    outputs = []
    while eng.has_unfinished():
        outputs += [(o.sample, o.token_id) for o in eng.step()]
    assert outputs == [(1, t) for t in alone]


def test_abort_drops_every_sample_of_the_request(loaded: LoadedModel) -> None:
    eng = _engine(loaded)
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    for i in range(3):
        eng.add_request("r", prompt_token_ids=PROMPT, params=greedy, sample=i)
    with pytest.raises(ValueError, match="sample 1 is already running"):
        eng.add_request("r", prompt_token_ids=PROMPT, params=greedy, sample=1)
    eng.step()
    assert eng.num_unfinished == 1 and eng.abort("r") and not eng.has_unfinished()
    assert eng.scheduler.block_manager.num_used_blocks == 0
    assert eng.step() == [] and not eng.abort("r")


def test_samples_share_nothing_without_prefix_caching(loaded: LoadedModel) -> None:
    greedy = [SamplingParams(max_tokens=4, ignore_eos=True)] * 2
    eng = _engine(loaded, prefix_caching=False)
    outputs, prefill, _ = _run(eng, greedy, samples=True)
    assert prefill == 2 * len(PROMPT)
    assert outputs[0] == outputs[1]
