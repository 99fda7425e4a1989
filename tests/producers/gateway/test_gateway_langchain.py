"""LangChain's tool calling on the gateway: ``bind_tools`` and ``with_structured_output``
(whose default method is function calling), as an app built on LangChain uses them.

The tiny model's weights are random: a forced call is held to its schema by the engine,
so what comes back always parses; the text of an unforced answer is noise. ``strict``
gives the schemas ``additionalProperties: false``: without it a random model may write
property names until max_tokens, as the schema allows.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, Field

langchain_openai = pytest.importorskip("langchain_openai")

MODEL = "tiny"
API_KEY = "sk-test-gateway"


class Weather(BaseModel):
    """The weather in a city."""

    city: str = Field(json_schema_extra={"enum": ["Paris", "Rome", "Oslo"]})
    days: int = Field(ge=1, le=7)


def chat_model(gateway: Any, **kwargs: Any) -> Any:
    return langchain_openai.ChatOpenAI(
        model=MODEL,
        base_url=gateway.base_url,
        api_key=API_KEY,
        max_retries=0,
        temperature=1.0,
        seed=5,
        **kwargs,
    )


def test_bind_tools_with_a_forced_call_gives_a_valid_tool_call(gateway: Any) -> None:
    llm = chat_model(gateway, max_tokens=200).bind_tools(
        [Weather], tool_choice="Weather", strict=True
    )
    message = llm.invoke("What is the weather in Paris?")
    assert len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call["name"] == "Weather" and call["id"]
    Weather.model_validate(call["args"])


def test_with_structured_output_by_function_calling_gives_the_model(gateway: Any) -> None:
    llm = chat_model(gateway, max_tokens=200).with_structured_output(
        Weather, method="function_calling", strict=True
    )
    answers = [llm.invoke(f"Weather question {i}") for i in range(5)]
    assert all(isinstance(a, Weather) for a in answers)
    assert {a.city for a in answers} <= {"Paris", "Rome", "Oslo"}


def test_bind_tools_auto_answers_text_when_the_model_calls_nothing(gateway: Any) -> None:
    llm = chat_model(gateway, max_tokens=6).bind_tools([Weather])
    message = llm.invoke("Say hello.")
    assert message.response_metadata["finish_reason"] in ("length", "stop", "tool_calls")
    if message.response_metadata["finish_reason"] != "tool_calls":
        assert message.tool_calls == [] and isinstance(message.content, str)
