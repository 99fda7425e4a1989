"""LLMEngine's API: inputs, streaming text, stop conditions, abort, figures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchd.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams
from batchd.engine.detokenizer import IncrementalDetokenizer, StopStringFilter, special_token_ids
from batchd.engine.exceptions import InvalidRequest
from batchd.engine.models.loader import LoadedModel, load

PROMPT = list(range(100, 160))


@pytest.fixture(scope="module")
def loaded(tiny_model: Path) -> LoadedModel:
    return load(tiny_model)


def _engine(loaded: LoadedModel, **options: int) -> LLMEngine:
    config = {"max_num_seqs": 8, "max_num_batched_tokens": 128, "num_kv_blocks": 128}
    config.update(options)
    return LLMEngine(loaded, EngineConfig(**config))


def _drain(eng: LLMEngine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    while eng.has_unfinished():
        for out in eng.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def _greedy(loaded: LoadedModel, prompt: list[int], max_tokens: int) -> list[int]:
    eng = _engine(loaded)
    eng.add_request("g", prompt_token_ids=prompt, params=SamplingParams(max_tokens=max_tokens))
    return [o.token_id for o in _drain(eng)["g"]]


def test_bad_requests_raise_clear_errors(loaded: LoadedModel) -> None:
    eng = _engine(loaded, max_model_len=64)
    eng.add_request("a", prompt_token_ids=[5, 6])
    with pytest.raises(ValueError, match="already running") as caught:
        eng.add_request("a", prompt_token_ids=[5, 6])
    assert not isinstance(caught.value, InvalidRequest)  # a caller's bug rejects no job
    with pytest.raises(ValueError, match="exactly one"):
        eng.add_request("b", prompt="x", prompt_token_ids=[1])
    with pytest.raises(ValueError, match="exactly one"):
        eng.add_request("b")
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("b", prompt_token_ids=[])
    with pytest.raises(ValueError, match="max_model_len 64"):
        eng.add_request("b", prompt_token_ids=list(range(64)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request("b", prompt_token_ids=[5, 10**6])
    assert eng.num_unfinished == 1


def test_text_prompt_and_chat_messages_use_the_tokenizer(loaded: LoadedModel) -> None:
    eng = _engine(loaded)
    tok = eng.tokenizer
    messages = [{"role": "user", "content": "Hello there"}]
    eng.add_request("text", prompt="Hello there", params=SamplingParams(max_tokens=3))
    eng.add_request("chat", messages=messages, params=SamplingParams(max_tokens=3))
    streamed = {rid: [o.token_id for o in outs] for rid, outs in _drain(eng).items()}
    chat_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    generated = eng.generate([tok.encode("Hello there"), chat_ids], SamplingParams(max_tokens=3))
    assert generated == [streamed["text"], streamed["chat"]]


def test_streamed_text_equals_decode_of_tokens(loaded: LoadedModel) -> None:
    eng = _engine(loaded)
    prompts = [[4 + (7 * i + 13 * j) % 1000 for j in range(1 + 9 * i)] for i in range(6)]
    for i, p in enumerate(prompts):
        eng.add_request(
            str(i), prompt_token_ids=p, params=SamplingParams(max_tokens=48, ignore_eos=True)
        )
    for outs in _drain(eng).values():
        tokens = [o.token_id for o in outs]
        # Special tokens are left out of the text by default (vLLM's skip_special_tokens).
        text = eng.tokenizer.decode(tokens, skip_special_tokens=True)
        assert "".join(o.text for o in outs) == text
        assert [o.index for o in outs] == list(range(48))
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert all(not o.finished for o in outs[:-1])


def test_stop_string_cuts_text_exactly(loaded: LoadedModel) -> None:
    tokens = _greedy(loaded, PROMPT, 40)
    full = _engine(loaded).tokenizer.decode(tokens)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = full.index(stop)
    eng = _engine(loaded)
    eng.add_request(
        "s", prompt_token_ids=PROMPT, params=SamplingParams(max_tokens=40, stop=(stop,))
    )
    outs = _drain(eng)["s"]
    assert "".join(o.text for o in outs) == full[:cut]
    assert outs[-1].finish_reason == "stop"
    assert eng.tokenizer.decode([o.token_id for o in outs]).startswith(full[:cut] + stop)


def test_min_tokens_holds_back_a_stop_string(loaded: LoadedModel) -> None:
    """vLLM's min_tokens: a stop string met before min_tokens outputs stays in the text and
    the job goes on; only one completed after them stops it."""
    tokens = _greedy(loaded, PROMPT, 40)
    full = _engine(loaded).tokenizer.decode(tokens)
    early = _engine(loaded).tokenizer.decode(tokens[:4])
    stop = early[-3:]  # what the 4th output completes: it ends the job after 4 tokens
    assert stop.strip() and full.index(stop) == len(early) - 3
    eng = _engine(loaded)
    eng.add_request(
        "plain", prompt_token_ids=PROMPT, params=SamplingParams(max_tokens=40, stop=(stop,))
    )
    eng.add_request(
        "held",
        prompt_token_ids=PROMPT,
        params=SamplingParams(max_tokens=40, stop=(stop,), min_tokens=20, ignore_eos=True),
    )
    outs = _drain(eng)
    assert len(outs["plain"]) <= 4 and outs["plain"][-1].finish_reason == "stop"
    held = outs["held"]
    text = "".join(o.text for o in held)
    assert len(held) > 20
    assert [o.token_id for o in held] == tokens[: len(held)]
    assert text.startswith(early)  # the early stop string is text
    # It stops at the first occurrence that ends past the 20th output's text, if any.
    held_back = len(_engine(loaded).tokenizer.decode(tokens[:20]))
    found = [i for i in range(len(full)) if full.startswith(stop, i)]
    later = [i for i in found if i + len(stop) > held_back]
    assert len(found) > len(later)  # some were held back
    if held[-1].finish_reason == "stop":
        assert text == full[: later[0]]
    else:
        assert not later and held[-1].finish_reason == "length" and len(held) == 40


def test_special_tokens_are_skipped_unless_asked(loaded: LoadedModel) -> None:
    """The issue's text ('...<|im_end|>\n<|im_end|><|im_start|>system'): special tokens are
    not in the text by default, and are with skip_special_tokens=False."""
    tok = loaded.tokenizer
    end, start = tok.convert_tokens_to_ids(["<|im_end|>", "<|im_start|>"])
    # Forced outputs: an end token (ignored), a start token, then the model's own text.
    bias = ((end, 100.0), (start, 50.0))
    eng = _engine(loaded)
    runs = {
        "default": SamplingParams(max_tokens=6, ignore_eos=True, logit_bias=bias),
        "kept": SamplingParams(
            max_tokens=6,
            ignore_eos=True,
            logit_bias=bias,
            skip_special_tokens=False,
            spaces_between_special_tokens=False,
        ),
        "spaced": SamplingParams(
            max_tokens=6, ignore_eos=True, logit_bias=bias, skip_special_tokens=False
        ),
    }
    for rid, params in runs.items():
        eng.add_request(rid, prompt_token_ids=PROMPT, params=params)
    outs = _drain(eng)
    tokens = [o.token_id for o in outs["default"]]
    assert end in tokens
    texts = {rid: "".join(o.text for o in outs[rid]) for rid in runs}
    assert "<|im_end|>" not in texts["default"] and "<|im_start|>" not in texts["default"]
    assert texts["default"] == tok.decode(tokens, skip_special_tokens=True)
    assert texts["kept"] == tok.decode(tokens) and "<|im_end|>" in texts["kept"]
    assert texts["spaced"] == " ".join(["<|im_end|>"] * len(tokens))


def test_stop_token_and_eos_end_without_text(loaded: LoadedModel) -> None:
    tokens = _greedy(loaded, PROMPT, 12)
    stop_at = tokens.index(tokens[5])
    eng = _engine(loaded)
    eng.add_request(
        "t",
        prompt_token_ids=PROMPT,
        params=SamplingParams(max_tokens=12, stop_token_ids=(tokens[5],)),
    )
    outs = _drain(eng)["t"]
    assert [o.token_id for o in outs] == tokens[: stop_at + 1]
    assert outs[-1].finish_reason == "stop" and outs[-1].text == ""
    assert "".join(o.text for o in outs) == eng.tokenizer.decode(tokens[:stop_at])
    eng.eos_token_ids = frozenset({tokens[5]})
    eng.add_request("eos", prompt_token_ids=PROMPT, params=SamplingParams(max_tokens=12))
    eng.add_request(
        "ignored", prompt_token_ids=PROMPT, params=SamplingParams(max_tokens=12, ignore_eos=True)
    )
    outs_by_id = _drain(eng)
    assert [o.token_id for o in outs_by_id["eos"]] == tokens[: stop_at + 1]
    assert [o.token_id for o in outs_by_id["ignored"]] == tokens


def test_generation_stops_at_the_context_length(loaded: LoadedModel) -> None:
    eng = _engine(loaded, max_model_len=64)
    eng.add_request("c", prompt_token_ids=PROMPT, params=SamplingParams(max_tokens=50))
    outs = _drain(eng)["c"]
    assert len(outs) == 64 - len(PROMPT) and outs[-1].finish_reason == "length"


def test_abort_frees_blocks_at_once(loaded: LoadedModel) -> None:
    eng = _engine(loaded, num_kv_blocks=64)
    eng.add_request("x", prompt_token_ids=PROMPT, params=SamplingParams(max_tokens=30))
    eng.add_request("y", prompt_token_ids=[9, 8, 7], params=SamplingParams(max_tokens=30))
    for _ in range(3):
        eng.step()
    bm = eng.scheduler.block_manager
    used = bm.num_used_blocks
    assert eng.abort("x") is True
    assert bm.num_used_blocks == used - 4  # 60 prompt + 3 outputs: 4 blocks of 16
    assert eng.abort("x") is False and eng.num_unfinished == 1
    assert all(o.request_id == "y" for o in eng.step())


def test_step_stats_describe_the_packed_batch(loaded: LoadedModel) -> None:
    eng = _engine(loaded, max_num_batched_tokens=32)
    # The one capacity rule: running slots plus the queue asked for, less what is held.
    assert eng.config.room(held=0, queue=4) == 12 and eng.config.room(held=13, queue=4) == -1
    eng.add_request("long", prompt_token_ids=PROMPT, params=SamplingParams(max_tokens=2))
    eng.add_request("short", prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=2))
    eng.step()
    stats = eng.last_step_stats
    assert [(c.request_id, c.kind, c.start, c.num_tokens) for c in stats.chunks] == [
        ("long", "prefill", 0, 32)
    ]
    eng.step()
    stats = eng.last_step_stats
    assert stats.num_scheduled_tokens == 31 and stats.num_prefill_tokens == 31
    assert stats.kv_blocks_total == 128 and stats.kv_blocks_used == 5
    eng.step()
    stats = eng.last_step_stats
    assert stats.num_decode_tokens == 2 and stats.num_outputs == 2 and stats.num_seqs == 2
    assert stats.step_time_s >= stats.forward_time_s > 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 1023), max_size=30))
def test_detokenizer_deltas_join_to_decode(tiny_model: Path, ids: list[int]) -> None:
    tokenizer = _tokenizer(tiny_model)
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(detok.add(t) for t in ids) + detok.flush()
    assert text == tokenizer.decode(ids)


def _vllm_join(tokenizer: Any, ids: list[int], special: frozenset[int]) -> str:
    """vLLM's Python detokenizer with spaces_between_special_tokens: the text between
    special tokens decoded per segment, every segment joined with a space."""
    parts: list[str] = []
    run: list[int] = []
    for token in ids:
        if token in special:
            if run:
                parts.append(tokenizer.decode(run))
                run = []
            parts.append(tokenizer.decode([token]))
        else:
            run.append(token)
    if run:
        parts.append(tokenizer.decode(run))
    return " ".join(p for p in parts if p)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 1023), max_size=30))
def test_detokenizer_special_tokens_as_vllm(tiny_model: Path, ids: list[int]) -> None:
    tokenizer: Any = _tokenizer(tiny_model)
    special = special_token_ids(tokenizer)
    assert {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|im_start|>")} <= special

    def detokenize(**options: bool) -> str:
        detok = IncrementalDetokenizer(tokenizer, special_ids=special, **options)
        return "".join(detok.add(t) for t in ids) + detok.flush()

    skipped = detokenize(skip_special_tokens=True)
    assert skipped == tokenizer.decode(ids, skip_special_tokens=True)
    kept = detokenize(skip_special_tokens=False, spaces_between_special_tokens=False)
    assert kept == tokenizer.decode(ids)
    spaced = detokenize(skip_special_tokens=False, spaces_between_special_tokens=True)
    assert spaced == _vllm_join(tokenizer, ids, special)


_TOKENIZERS: dict[Path, object] = {}


def _tokenizer(path: Path) -> object:
    from mlx_lm.utils import load_tokenizer

    if path not in _TOKENIZERS:
        _TOKENIZERS[path] = load_tokenizer(path)
    return _TOKENIZERS[path]


@given(st.lists(st.text("ab\u00e9", max_size=4), max_size=12))
def test_stop_filter_never_emits_a_stop_string(pieces: list[str]) -> None:
    stops = ("ab", "b\u00e9a")
    flt = StopStringFilter(stops)
    emitted = "".join(flt.push(p) for p in pieces) + flt.flush()
    whole = "".join(pieces)
    cuts = [whole.find(s) for s in stops if s in whole]
    assert emitted == (whole[: min(cuts)] if cuts else whole)
    assert flt.stopped == bool(cuts)
