"""OpenAI bodies -> job fields, without Redis: what is mapped, what is refused."""

from __future__ import annotations

from typing import Any

import pytest

from batchd.config.limits import LimitSettings
from batchd.producers.gateway.errors import APIError
from batchd.producers.gateway.params import chat_request, completion_request, fill_max_tokens


def chat(**body: Any) -> Any:
    return chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body})


def test_chat_mapping_and_openai_defaults() -> None:
    mapped = chat(max_completion_tokens=5, stop="\\n", seed=3, priority=2, top_k=4)
    assert mapped.job["temperature"] == 1.0 and mapped.job["max_tokens"] == 5
    assert mapped.job["stop"] == ["\\n"] and mapped.job["priority"] == 2
    assert mapped.job["top_k"] == 4 and not mapped.stream
    parts = chat_request(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
        }
    )
    assert parts.job["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
    ]


def test_completion_prompt_forms() -> None:
    assert completion_request({"model": "m", "prompt": ["x"]}).job["prompt"] == "x"
    assert completion_request({"model": "m", "prompt": [1, 2]}).job["prompt_token_ids"] == [1, 2]
    assert completion_request({"model": "m", "prompt": "x"}).job["max_tokens"] == 16
    with pytest.raises(APIError) as caught:
        completion_request({"model": "m", "prompt": ["a", "b"]})
    assert caught.value.param == "prompt"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "lark", "grammar": "x"}}, "response_format"),
        ({"whatever": 1}, "whatever"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
        ),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"model": ""}, "model"),
        ({"metadata": "tag"}, "metadata"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": {"team": {"nested": 1}}}, "metadata.team"),
        ({"metadata": {"team": "v" * 513}}, "metadata.team"),
    ],
)
def test_refusals_name_the_param(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as caught:
        chat(**body)
    assert caught.value.status == 400 and caught.value.param == param


def test_metadata_at_openais_limits_is_kept_on_the_job() -> None:
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    assert chat(metadata=metadata).job["metadata"] == metadata


def test_neutral_values_are_accepted() -> None:
    mapped = chat(
        best_of=1, frequency_penalty=0, logit_bias={}, response_format={"type": "text"}, user="u"
    )
    assert "best_of" not in mapped.job


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"temperature": 5}, "temperature", "integer above maximum value. Expected a value <= 2"),
        ({"temperature": 2.5}, "temperature", "decimal above maximum value"),
        ({"top_p": -0.1}, "top_p", "decimal below minimum value. Expected a value >= 0"),
        ({"presence_penalty": 2.01}, "presence_penalty", "above maximum"),
        ({"frequency_penalty": -3}, "frequency_penalty", "below minimum"),
        ({"n": 0}, "n", "below minimum"),
        ({"n": 200}, "n", "<= 128"),
        ({"n": 17}, "n", "above 16 is not supported"),
        ({"max_tokens": 0}, "max_tokens", "below minimum"),
        ({"temperature": "hot"}, "temperature", "must be a number"),
        ({"seed": 1.5}, "seed", "must be an integer"),
    ],
)
def test_openai_ranges_are_enforced_in_openai_words(
    body: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(APIError) as caught:
        chat(**body)
    assert caught.value.status == 400 and caught.value.param == param
    assert words in caught.value.message


def test_range_edges_are_accepted_and_top_p_zero_is_greedy() -> None:
    mapped = chat(temperature=2, top_p=1, presence_penalty=-2, frequency_penalty=2, n=16)
    assert mapped.job["temperature"] == 2 and mapped.job["n"] == 16
    greedy = chat(top_p=0, temperature=0.7)
    assert greedy.job["temperature"] == 0.0 and "top_p" not in greedy.job


def test_default_max_tokens_is_held_to_the_cap_and_the_context() -> None:
    limits = LimitSettings(max_tokens_cap=4096)
    job: dict[str, Any] = {"n": 8}
    fill_max_tokens(job, default=1024, limits=limits, context=None)
    assert job["max_tokens"] == 512  # n sequences share the cap
    job = {}
    fill_max_tokens(job, default=1024, limits=limits, context=600)
    assert job["max_tokens"] == 599
    job = {"max_tokens": 7}
    fill_max_tokens(job, default=1024, limits=limits, context=600)
    assert job["max_tokens"] == 7  # given: never touched
    assert "max_tokens" not in chat().job  # chat leaves it to the gateway's default
