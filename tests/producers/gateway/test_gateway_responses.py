"""``/v1/responses`` with the official openai client, streaming and not, on the tiny model."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from test_gateway_tools import TOOLS, WEATHER, last_job

MODEL = "tiny"
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def test_text_input_gives_the_chat_completions_text(oai: openai.OpenAI) -> None:
    response = oai.responses.create(
        model=MODEL, input="Hello there", max_output_tokens=10, temperature=0
    )
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=10,
        temperature=0,
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == chat.choices[0].message.content
    assert response.status == "incomplete"  # it ran out of max_output_tokens
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 10
    assert response.usage.input_tokens == chat.usage.prompt_tokens  # type: ignore[union-attr]


def test_instructions_and_message_arrays(oai: openai.OpenAI, gateway: Any) -> None:
    response = oai.responses.create(
        model=MODEL,
        instructions="Answer in French.",
        input=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
            {"role": "user", "content": [{"type": "input_text", "text": "How are you?"}]},
        ],
        max_output_tokens=4,
        temperature=0,
    )
    assert response.output[0].type == "message"
    job = last_job(gateway.redis_url)
    assert job["messages"] == [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "How are you?"},
    ]
    assert job["max_tokens"] == 4


def test_text_format_json_schema_holds_the_output(oai: openai.OpenAI) -> None:
    response = oai.responses.create(
        model=MODEL,
        input="Pick a city",
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}},
        max_output_tokens=100,
        temperature=1.0,
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), CITY)


def test_a_named_tool_gives_a_function_call_item_and_its_output_goes_back(
    oai: openai.OpenAI, gateway: Any
) -> None:
    response = oai.responses.create(
        model=MODEL,
        input="Weather in Rome?",
        tools=FLAT_TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=200,
        temperature=1.0,
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    follow_up = oai.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "Weather in Rome?"},
            calls[0].model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 C"},
        ],
        tools=FLAT_TOOLS,  # type: ignore[arg-type]
        max_output_tokens=5,
        temperature=0,
    )
    assert follow_up.status == "incomplete" and follow_up.output_text
    job = last_job(gateway.redis_url)
    messages = job["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[2]["content"] == "21 C"
    assert [t["function"]["name"] for t in job["tools"]] == ["get_weather", "get_time"]


def test_streaming_events_build_the_same_response(oai: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "input": "Tell me a story",
        "max_output_tokens": 12,
        "temperature": 0,
    }
    whole = oai.responses.create(**kwargs)
    events = list(oai.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    done = [e for e in events if e.type == "response.output_text.done"]
    assert len(done) == 1 and done[0].text == text
    # The SDK's stream helper checks the events fit together and builds the response
    # (it needs a response.completed: an output that ends by itself).
    text_format: Any = {"format": {"type": "json_schema", "name": "city", "schema": CITY}}
    kwargs.update(text=text_format, max_output_tokens=100)
    whole = oai.responses.create(**kwargs)
    with oai.responses.stream(**kwargs) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == whole.output_text
    jsonschema.validate(json.loads(final.output_text), CITY)


def test_a_streamed_call(oai: openai.OpenAI) -> None:
    with oai.responses.stream(
        model=MODEL,
        input="Weather?",
        tools=FLAT_TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
        temperature=0,
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    calls = [item for item in final.output if item.type == "function_call"]
    assert len(calls) == 1
    schema = {"get_weather": WEATHER}.get(calls[0].name)
    if schema is not None:
        jsonschema.validate(json.loads(calls[0].arguments), schema)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"text": {"format": {"type": "regex"}}}, "text.format"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"background": True}, "background"),
    ],
)
def test_what_batchd_cannot_do_is_400_naming_it(
    oai: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"model": MODEL, "input": "Hi", **extra}
    with pytest.raises(openai.BadRequestError) as caught:
        oai.responses.create(**body)
    assert caught.value.param == param, caught.value
