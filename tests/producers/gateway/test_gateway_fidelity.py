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
"""

from __future__ import annotations

import math
from typing import Any

import openai
import pytest

from batchd.producers.client import Client
from batchd.producers.errors import ValidationError

MODEL = "tiny"
HELLO = [{"role": "user", "content": "Hello there"}]
PROMPT = "Once upon a time"
UNIQUE = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 4}


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
