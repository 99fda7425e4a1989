"""Prompt logprobs: each prompt token's log-probability given the ones before it, equal
(within float32 tolerance) to a log-softmax over mlx-lm's own forward of the prompt; in
chunks, in a mixed batch, and with the prompt's blocks already in the prefix cache
(which such a request does not use).

And how outputs name the tokens logprobs list, on SmolLM2's own tokenizer: a stop token
is marked (none of its text is output), and a token that is only part of a character
carries its own bytes, so joined they give the text."""

from __future__ import annotations

from pathlib import Path

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import numpy as np
import pytest

from batchd.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams
from batchd.engine.detokenizer import TokenTexts
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


def _token_bytes(out: RequestOutput, token_id: int) -> bytes:
    """A token's bytes as an output tells them: its own where it carries them, else its
    text's."""
    assert out.token_texts is not None
    return (out.token_bytes or {}).get(token_id, out.token_texts[token_id].encode())


def test_outputs_mark_stop_tokens_and_carry_partial_characters_bytes(
    smollm2_model: Path,
) -> None:
    loaded = load(smollm2_model)
    eng = LLMEngine(
        loaded, EngineConfig(max_num_seqs=4, max_num_batched_tokens=256, num_kv_blocks=64)
    )
    tokenizer = eng.tokenizer
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode("東京 😀 café")
    assert b"".join(texts.bytes_of([i]).get(i, texts.of([i])[i].encode()) for i in ids) == (
        "東京 😀 café".encode()
    )
    asks = {"capital": "What is the capital of France?", "japanese": "Translate to Japanese: Tokyo"}
    for rid, ask in asks.items():
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": ask}], add_generation_prompt=True
        )
        params = SamplingParams(
            max_tokens=40 if rid == "capital" else 8, temperature=0, logprobs=3, token_texts=True
        )
        eng.add_request(rid, prompt_token_ids=prompt, params=params)
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in asks}
    while eng.has_unfinished():
        for out in eng.step():
            outs[out.request_id].append(out)
    *answer, end = outs["capital"]
    assert end.finish_reason == "stop" and end.stop_token and end.token_id in eng.eos_token_ids
    assert not any(out.stop_token for out in answer + outs["japanese"])
    text = "".join(out.text for out in outs["capital"])
    assert (
        "Paris" in text and b"".join(_token_bytes(o, o.token_id) for o in answer) == text.encode()
    )
    japanese = outs["japanese"]
    assert any(out.token_bytes for out in japanese)  # pieces of characters
    joined = b"".join(_token_bytes(o, o.token_id) for o in japanese)
    assert joined.decode() == "".join(out.text for out in japanese)
    for out in japanese:
        for token_id, _ in out.top_logprobs or []:
            raw = _token_bytes(out, token_id)
            assert raw.decode("utf-8", "replace") == out.token_texts[token_id]  # type: ignore[index]
            assert raw != "\ufffd".encode()
