"""Controls that behave as their references do, end to end: the official ``openai``
package through the real gateway and daemon (tiny model), and the batchd client on the
same daemon.

- Penalties are OpenAI's: nothing generated yet, nothing penalised (the chat template's
  end token in the prompt is not).
- ``top_logprobs`` (chat) and ``logprobs`` / ``echo`` (completions) as OpenAI's API
  reference describes them.
- A job with ``response_format`` and ``logprobs`` publishes only finite numbers, so
  ``Client.result()`` and the gateway read it.
- Lenient JSON-schema keywords: refused clearly unless ``lenient``.
- OpenAI's shapes on the wire (read with httpx, not through the SDK's lenient models):
  every stream chunk of one request shares its id, created and model; with
  ``stream_options.include_usage`` every chunk carries ``usage: null`` but the last,
  whose choices are empty; the last delta is empty; usage counts the tokenized prompt
  and every generated token, streamed or not.
- OpenAI's refusals: ``max_tokens`` with ``max_completion_tokens``, more than 4 stop
  sequences, a seed outside int64, a non-string ``user``, a body sent as another
  content type; a negative seed (an int64 may be) samples reproducibly.
- Logprobs of a real model (SmolLM2, its own daemon and gateway): they list the content's
  tokens, the end token not among them though usage counts it, and each entry's
  ``bytes`` are the token's own, so joined they rebuild a character split over tokens.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from batchd.producers.client import Client
from batchd.producers.errors import ValidationError

MODEL = "tiny"
HELLO = [{"role": "user", "content": "Hello there"}]
PROMPT = "Once upon a time"
UNIQUE = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 4}
SMOL = "smollm2"
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
JAPANESE = [{"role": "user", "content": "Translate to Japanese: Tokyo"}]


def test_presence_penalty_does_not_touch_the_prompt(oai: openai.OpenAI) -> None:
    """OpenAI's presence and frequency penalties count generated tokens only: the first
    token's logprob is the same with presence_penalty 2 (mlx-lm's window of 20 would
    penalise the prompt's tail, the template's end token among it)."""

    def first(window: int | None = None, **penalty: float) -> tuple[str, float]:
        reply = oai.chat.completions.create(
            model=MODEL,
            messages=HELLO,
            max_tokens=1,
            temperature=0,
            logprobs=True,
            extra_body={} if window is None else {"penalty_window": window},
            **penalty,
        )
        content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
        assert content is not None
        return content[0].token, content[0].logprob

    assert first(presence_penalty=2.0) == first() == first(frequency_penalty=2.0)
    # mlx-lm's form (what the gateway did before) penalises the prompt's last 20 tokens.
    assert first(20, presence_penalty=2.0)[1] != first()[1]


def test_chat_top_logprobs(oai: openai.OpenAI) -> None:
    reply = oai.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 6
    for item in content:
        assert item.bytes == list(item.token.encode())
        assert len(item.top_logprobs) == 3
        values = [alt.logprob for alt in item.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert all(alt.bytes == list(alt.token.encode()) for alt in item.top_logprobs)
        # Greedy: the chosen token is the best alternative.
        assert (item.token, item.logprob) == (item.top_logprobs[0].token, values[0])
    # Without top_logprobs, no alternatives (OpenAI's default 0).
    plain = oai.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=2, temperature=0, logprobs=True
    )
    assert all(not i.top_logprobs for i in plain.choices[0].logprobs.content or [])  # type: ignore[union-attr]


def test_completion_logprobs_name_the_alternatives_and_the_sampled_token(
    oai: openai.OpenAI,
) -> None:
    reply = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0.9, seed=3, logprobs=2
    )
    choice = reply.choices[0]
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert len(logprobs.tokens) == 5 and logprobs.top_logprobs is not None
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]
    for token, lp, top in zip(
        logprobs.tokens, logprobs.token_logprobs or [], logprobs.top_logprobs, strict=True
    ):
        assert top[token] == lp and 2 <= len(top) <= 3  # the sampled token always among them


def test_echo_puts_the_prompt_before_the_completion(oai: openai.OpenAI) -> None:
    plain = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    echoed = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True
    )
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert echoed.usage == plain.usage  # usage counts as without echo
    stream = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True, stream=True
    )
    chunks = [c.choices[0].text for c in stream if c.choices]
    assert chunks[0].startswith(PROMPT) and "".join(chunks) == echoed.choices[0].text


def test_echo_with_logprobs_scores_the_prompt(oai: openai.OpenAI) -> None:
    reply = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=1
    )
    assert reply.usage is not None
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    prompt_tokens = reply.usage.prompt_tokens
    assert len(logprobs.tokens) == prompt_tokens + 3
    # The first prompt token has no logprob (nothing before it), the others one each.
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(isinstance(lp, float) and lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert "".join(logprobs.tokens[:prompt_tokens]).endswith(PROMPT)
    offsets = logprobs.text_offset or []
    assert offsets[0] == 0 and offsets == sorted(offsets)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": [5, 6, 7], "echo": True}, "echo"),  # no tokenizer to write the prompt
        ({"prompt": PROMPT, "echo": True, "logprobs": 1, "stream": True}, "echo"),
        ({"prompt": PROMPT, "logprobs": 6}, "logprobs"),  # OpenAI's bound: 5
        ({"prompt": PROMPT, "echo": "yes"}, "echo"),
    ],
)
def test_echo_and_logprobs_refusals(oai: openai.OpenAI, body: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.completions.create(model=MODEL, max_tokens=2, **body)
    assert caught.value.param == param


def test_grammar_with_logprobs_is_readable(gateway: Any, oai: openai.OpenAI) -> None:
    """Tokens the grammar forbids are no alternatives: never a -inf (JSON null) on the
    wire, so the client's result() and the gateway read the job (before: ProtocolError
    'undecodable event 0')."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    job = {
        "messages": HELLO,
        "max_tokens": 12,
        "temperature": 0.0,
        "logprobs": 5,
        "response_format": {"type": "json_schema", "json_schema": schema},
    }
    with Client(gateway.redis_url) as client:
        handle = client.submit(**job)
        result = handle.result(timeout=60)
        events = [e for e in handle.stream(timeout=30) if not e.final]
    assert result.text.startswith('{"a":')
    tops = [e.top_logprobs for e in events]
    assert all(top is not None and 1 <= len(top) <= 5 for top in tops)
    assert any(len(top or []) < 5 for top in tops)  # the grammar left fewer than asked
    assert all(math.isfinite(lp) for top in tops for _, lp in top or [])
    reply = oai.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    assert reply.choices[0].message.content == result.text


def test_lenient_schema_keywords_are_an_opt_in(gateway: Any, oai: openai.OpenAI) -> None:
    with Client(gateway.redis_url) as client:
        with pytest.raises(ValidationError, match="uniqueItems.*lenient"):
            client.submit(
                prompt=PROMPT, response_format={"type": "json_schema", "json_schema": UNIQUE}
            )
        text = client.submit(
            prompt=PROMPT,
            max_tokens=24,
            response_format={"type": "json_schema", "json_schema": UNIQUE, "lenient": True},
        ).result(timeout=60)
    assert text.text.startswith("[")
    strict = {"type": "json_schema", "json_schema": {"name": "u", "schema": UNIQUE}}
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model=MODEL, messages=HELLO, response_format=strict)  # type: ignore[arg-type]
    assert caught.value.param == "response_format" and "lenient" in str(caught.value)
    reply = oai.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        max_tokens=24,
        response_format={**strict, "lenient": True},  # type: ignore[typeddict-unknown-key]
    )
    assert (reply.choices[0].message.content or "").startswith("[")


def _sse(gateway: Any, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The data lines of a streamed request, read raw; the last must be ``[DONE]``."""
    headers = {"Authorization": f"Bearer {gateway.options.api_keys[0]}"}
    with httpx.stream(
        "POST", f"{gateway.base_url}{path}", json=body, headers=headers, timeout=60
    ) as reply:
        assert reply.status_code == 200
        lines = [line[len("data: ") :] for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [orjson.loads(line) for line in lines[:-1]]


def test_streams_are_openai_shaped_and_usage_counts_every_token(
    gateway: Any, oai: openai.OpenAI, tiny_model: Path
) -> None:
    tokenizer = load_tokenizer(tiny_model)
    chat_prompt = len(tokenizer.apply_chat_template(HELLO, add_generation_prompt=True))
    text_prompt = len(tokenizer.encode(PROMPT))
    body = {"model": MODEL, "max_tokens": 6, "seed": 4, "logprobs": True, "n": 2}
    chat = {**body, "messages": HELLO, "stream": True, "stream_options": {"include_usage": True}}
    chunks = _sse(gateway, "/chat/completions", chat)
    *tokens, usage = chunks
    assert {(c["id"], c["created"], c["model"]) for c in chunks} == {
        (chunks[0]["id"], chunks[0]["created"], chunks[0]["model"])
    }
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert all("usage" in c and c["usage"] is None for c in tokens)  # present, and null
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == chat_prompt
    firsts = {}
    for chunk in tokens:
        for choice in chunk["choices"]:
            firsts.setdefault(choice["index"], choice["delta"])
    assert [d.get("role") for d in firsts.values()] == ["assistant", "assistant"]
    ends = [ch for ch in tokens[-1]["choices"]]
    assert [(ch["delta"], ch["finish_reason"]) for ch in ends] == [({}, "length")] * 2
    generated = sum(len(ch["logprobs"]["content"]) for c in tokens[:-1] for ch in c["choices"])
    assert usage["usage"]["completion_tokens"] == generated == 12
    assert usage["usage"]["total_tokens"] == chat_prompt + 12
    whole = oai.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=HELLO,
        max_tokens=6,
        seed=4,
        n=2,  # type: ignore[arg-type]
    ).http_response.json()
    assert [c["message"]["refusal"] for c in whole["choices"]] == [None, None]
    assert whole["usage"]["prompt_tokens"] == chat_prompt
    assert whole["usage"]["completion_tokens"] == 12
    text = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": True}
    text_chunks = _sse(gateway, "/completions", {**text, "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in text_chunks[:-1])
    assert text_chunks[-1]["usage"]["prompt_tokens"] == text_prompt
    assert text_chunks[-1]["usage"]["completion_tokens"] == 5
    assert all("usage" not in c for c in _sse(gateway, "/completions", text))


def test_stop_text_is_excluded_whole_and_streamed(oai: openai.OpenAI) -> None:
    """A stop sequence ends the choice with ``stop`` and is not in its text, also when it
    spans tokens; a list of up to 4 is OpenAI's."""
    full = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    text = full.choices[0].text
    # Three letters past the first token, read from the greedy text: a stop it meets.
    start = next(i for i in range(3, len(text) - 3) if text[i : i + 3].isalpha())
    stop = text[start : start + 3]
    before = text[: text.index(stop)]
    for stops in (stop, ["<never-1>", "<never-2>", "<never-3>", stop]):
        reply = oai.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=stops
        )
        assert (reply.choices[0].text, reply.choices[0].finish_reason) == (before, "stop")
        streamed = list(
            oai.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=stops, stream=True
            )
        )
        assert "".join(c.choices[0].text for c in streamed) == before
        assert streamed[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        (
            {"max_tokens": 4, "max_completion_tokens": 3},
            "max_tokens",
            "invalid_parameter_combination",
        ),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
        ({"seed": 2**63}, "seed", "invalid_value"),
        ({"seed": -(2**63) - 1}, "seed", "invalid_value"),
        ({"user": 7}, "user", "invalid_value"),
        ({"prompt_cache_key": 5}, "prompt_cache_key", "unsupported_parameter"),
        ({"modalities": ["text", "audio"]}, "modalities", "unsupported_parameter"),
        ({"reasoning_effort": "low"}, "reasoning_effort", "unsupported_parameter"),
        (
            {"stream": True, "stream_options": {"include_usage": "yes"}},
            "stream_options.include_usage",
            "invalid_value",
        ),
    ],
)
def test_openai_refusals_name_the_field(
    oai: openai.OpenAI, extra: dict[str, Any], param: str, code: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model=MODEL, messages=HELLO, **extra)
    assert (caught.value.param, caught.value.code) == (param, code)
    error = caught.value.body
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}


def test_an_unknown_parameter_is_refused_in_openais_words(oai: openai.OpenAI) -> None:
    """OpenAI refuses what it does not know (vLLM ignores it): so does batchd, saying so
    as OpenAI does and naming it."""
    with pytest.raises(openai.BadRequestError) as caught:
        oai.completions.create(model=MODEL, prompt=PROMPT, extra_body={"frobnicate": 1})
    assert caught.value.message.endswith(" - Unrecognized request argument supplied: frobnicate")
    assert (caught.value.param, caught.value.code) == ("frobnicate", "unknown_parameter")


def test_openais_neutral_values_are_accepted(oai: openai.OpenAI) -> None:
    """Documented parameters that change nothing batchd computes pass at their neutral
    value (refused otherwise, above), on chat and on the Responses API."""
    reply = oai.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        max_completion_tokens=2,
        user="u-1",
        safety_identifier="s-1",
        prompt_cache_key="k-1",
        modalities=["text"],
    )
    assert reply.choices[0].finish_reason == "length"
    response = oai.responses.create(model=MODEL, input="Hi", max_output_tokens=2, user="u-1")
    assert response.status == "incomplete"
    with pytest.raises(openai.BadRequestError) as caught:
        oai.responses.create(model=MODEL, input="Hi", user=7)  # type: ignore[arg-type]
    assert caught.value.param == "user"


def test_a_negative_seed_is_an_int64_and_reproducible(oai: openai.OpenAI) -> None:
    def text(seed: int) -> str:
        reply = oai.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1, seed=seed
        )
        return reply.choices[0].text

    assert text(-5) == text(-5) == text(2**63 - 5)  # folded into the job's range
    assert text(-(2**63)) == text(0)


def test_a_body_of_another_content_type_is_refused(gateway: Any) -> None:
    body = orjson.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
    headers = {"Authorization": f"Bearer {gateway.options.api_keys[0]}"}
    url = f"{gateway.base_url}/completions"
    for kind in ("application/x-www-form-urlencoded", "text/plain"):  # curl -d, a raw post
        reply = httpx.post(url, content=body, headers={**headers, "Content-Type": kind})
        assert reply.status_code == 400
        assert reply.json()["error"]["code"] == "unsupported_content_type"
    reply = httpx.post(
        url, content=body, headers={**headers, "Content-Type": "application/json; charset=utf-8"}
    )
    assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] == "length"


def test_a_null_max_tokens_is_openais_default_and_vllms_extras_apply(
    oai: openai.OpenAI,
) -> None:
    """A text completion's ``max_tokens: null`` is OpenAI's 16 (not the chat default);
    vLLM's ``ignore_eos`` and ``stop_token_ids`` reach the job."""
    reply = oai.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=None,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 16
    assert reply.choices[0].finish_reason == "length"
    forced = {"logit_bias": {"75": 100}, "stop_token_ids": [75]}  # the first token stops
    stopped = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, extra_body=forced)
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == ("", "stop")


def _joined(entries: list[Any]) -> tuple[str, bytes]:
    """The tokens' texts and their bytes, each joined."""
    return "".join(e["token"] for e in entries), b"".join(bytes(e["bytes"]) for e in entries)


def test_logprobs_list_the_content_tokens_not_the_end_token(
    smol: Any, smol_oai: openai.OpenAI
) -> None:
    """A chat answer that ends on ``<|im_end|>``: its logprobs join to its content, whole
    and streamed, and usage counts the end token all the same (vLLM's and mlx-lm's count);
    a text completion's ``tokens`` likewise join to its text."""
    body = {"model": SMOL, "messages": CAPITAL, "max_tokens": 40, "temperature": 0}
    whole = smol_oai.chat.completions.with_raw_response.create(
        **body, logprobs=True, top_logprobs=2
    ).http_response.json()
    choice = whole["choices"][0]
    content = choice["message"]["content"]
    assert choice["finish_reason"] == "stop" and "Paris" in content
    entries = choice["logprobs"]["content"]
    assert _joined(entries) == (content, content.encode())
    assert whole["usage"]["completion_tokens"] == len(entries) + 1  # the end token counts
    chunks = _sse(smol, "/chat/completions", {**body, "logprobs": True, "stream": True})
    streamed = [
        e for c in chunks for ch in c["choices"] for e in (ch["logprobs"] or {}).get("content", [])
    ]
    assert streamed == [
        {k: v for k, v in e.items() if k != "top_logprobs"} | {"top_logprobs": []} for e in entries
    ]
    template = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    text = smol_oai.completions.create(
        model=SMOL, prompt=template, max_tokens=40, temperature=0, logprobs=1
    )
    logprobs = text.choices[0].logprobs
    assert text.choices[0].finish_reason == "stop" and logprobs is not None
    assert "".join(logprobs.tokens or []) == text.choices[0].text == content
    assert text.usage is not None and text.usage.completion_tokens == len(entries) + 1


def test_logprob_bytes_are_the_tokens_own(smol_oai: openai.OpenAI) -> None:
    """CJK text comes as byte-level pieces, each only part of a character (its text
    U+FFFD): each entry's ``bytes`` are its piece's, so the bytes join into the content,
    and an alternative's bytes are its own too."""
    reply = smol_oai.chat.completions.with_raw_response.create(
        model=SMOL, messages=JAPANESE, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    ).http_response.json()
    content = reply["choices"][0]["message"]["content"]
    entries = reply["choices"][0]["logprobs"]["content"]
    assert any(e["token"] == "\ufffd" for e in entries)  # characters split over tokens
    assert b"".join(bytes(e["bytes"]) for e in entries).decode() == content
    replaced = "\ufffd".encode()
    for alt in [alt for e in entries for alt in e["top_logprobs"]]:
        assert bytes(alt["bytes"]).decode("utf-8", "replace") == alt["token"]
        assert bytes(alt["bytes"]) != replaced
