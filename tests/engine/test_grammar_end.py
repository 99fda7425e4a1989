"""A grammar's end is enforced whatever ignore_eos says (security finding 8).

With ``ignore_eos`` an end token is no stop token; but under a grammar the mask allows an
end token exactly where the grammar may end, so a sampled one must end the row: before
the fix ``[0-9]{1,3}`` with ``ignore_eos`` gave ``23<|im_end|>`` (the end token's text in
the output, and generation went on past the grammar's end).
"""

from __future__ import annotations

import re
from pathlib import Path

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import pytest

from batchd.engine import EngineConfig, LLMEngine, SamplingParams
from batchd.engine.constraints import Constraint
from batchd.engine.models.loader import load

DIGITS = "[0-9]{1,3}"


@pytest.fixture(scope="module")
def eng(tiny_model: Path) -> LLMEngine:
    return LLMEngine(load(tiny_model), EngineConfig(max_num_seqs=64, num_kv_blocks=512))


def test_grammar_end_stops_the_row_even_with_ignore_eos(eng: LLMEngine) -> None:
    params = {
        f"r{seed}": SamplingParams(
            max_tokens=16,
            seed=seed,
            temperature=1.5,
            ignore_eos=True,
            constraint=Constraint("regex", DIGITS),
        )
        for seed in range(40)
    }
    for rid, p in params.items():
        eng.add_request(rid, prompt_token_ids=[5, 6, 7, int(rid[1:]) + 10], params=p)
    texts = dict.fromkeys(params, "")
    ends: dict[str, str | None] = dict.fromkeys(params)
    tokens: dict[str, list[int]] = {rid: [] for rid in params}
    while eng.has_unfinished():
        for out in eng.step():
            texts[out.request_id] += out.text
            tokens[out.request_id].append(out.token_id)
            if out.finish_reason is not None:
                ends[out.request_id] = out.finish_reason.value
    for rid in params:
        assert re.fullmatch(DIGITS, texts[rid]), (rid, texts[rid], tokens[rid])
        assert ends[rid] == "stop", (rid, ends[rid])
    # The rows that ended on an end token (not on a third digit) did so at once.
    ended_on_eos = [rid for rid in params if tokens[rid][-1] in eng.eos_token_ids]
    assert ended_on_eos, "no row sampled an end token: the test proves nothing"
    assert all(len(tokens[rid]) <= 4 for rid in params)
