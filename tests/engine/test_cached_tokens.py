"""Each output says how many of its sequence's tokens came from the prefix cache: the
full blocks a second request with the same prompt shares with the first, and never the
last prompt token (it is computed to sample from)."""

from __future__ import annotations

import random
from pathlib import Path

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

from batchd.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams

BLOCK = 16


def _run(eng: LLMEngine, request_id: str, prompt: list[int]) -> list[RequestOutput]:
    eng.add_request(request_id, prompt_token_ids=prompt, params=SamplingParams(max_tokens=3))
    outputs: list[RequestOutput] = []
    while eng.has_unfinished():
        outputs += eng.step()
    return outputs


def test_a_repeated_prompt_reports_its_shared_full_blocks(tiny_model: Path) -> None:
    eng = LLMEngine.from_pretrained(tiny_model, EngineConfig(block_size=BLOCK, num_kv_blocks=64))
    rng = random.Random(5)
    prompt = [rng.randrange(3, 1000) for _ in range(5 * BLOCK)]  # ends on a block boundary
    first = _run(eng, "first", prompt)
    again = _run(eng, "again", prompt)
    forked = _run(eng, "forked", prompt[: 2 * BLOCK + 3] + [7, 8, 9])
    assert {o.cached_tokens for o in first} == {0}
    # A whole-block prompt keeps its last block to compute: 4 of its 5 blocks are shared.
    assert {o.cached_tokens for o in again} == {4 * BLOCK}
    assert {o.cached_tokens for o in forked} == {2 * BLOCK}
    assert [o.token_id for o in again] == [o.token_id for o in first]
