"""OpenAI bodies -> job fields, without Redis: what is mapped, what is refused."""

from __future__ import annotations

from typing import Any

import pytest

from batchd.producers.gateway.errors import APIError
from batchd.producers.gateway.params import chat_request, completion_request


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
    ],
)
def test_refusals_name_the_param(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as caught:
        chat(**body)
    assert caught.value.status == 400 and caught.value.param == param


def test_neutral_values_are_accepted() -> None:
    mapped = chat(
        best_of=1, frequency_penalty=0, logit_bias={}, response_format={"type": "text"}, user="u"
    )
    assert "best_of" not in mapped.job
