"""Tool calling with the official openai client, against a real daemon on the tiny model.

The tiny model's weights are random, so what it says is noise: with ``tool_choice``
``required`` or a named function its output is held to the call's schema (the engine's
structured output), so every call parses and validates; with ``auto`` it answers text,
and how calls are read out of a model's text is tested on the parser itself.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
import openai
import orjson
import pytest
import redis

from batchd.producers.gateway.tools.calls import (
    ContentGate,
    ToolUse,
    call_schema,
    functions_of,
    parse_calls,
    tool_use,
)

MODEL = "tiny"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["c", "f"]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


def check_calls(message: Any) -> list[Any]:
    """The message's calls, each naming a tool and with arguments valid for it."""
    calls = message.tool_calls or []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return calls


def test_named_function_always_parses_and_validates(oai: openai.OpenAI) -> None:
    reply = oai.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=200,
        temperature=1.0,
        seed=3,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = check_calls(choice.message)
    assert [c.function.name for c in calls] == ["get_weather"]


def test_a_hundred_forced_calls_all_validate(aoai: openai.AsyncOpenAI) -> None:
    """required (one call or several) and named: 100 calls at temperature 1, each parsed
    and valid against its function's schema."""

    async def one(i: int) -> list[Any]:
        choice: Any = (
            {"type": "function", "function": {"name": "get_time"}} if i % 2 else "required"
        )
        reply = await aoai.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=i % 4 == 0,
            max_tokens=300,
            temperature=1.0,
            seed=i,
        )
        assert reply.choices[0].finish_reason == "tool_calls", reply.choices[0]
        return check_calls(reply.choices[0].message)

    async def run() -> list[list[Any]]:
        async with aoai:
            return await asyncio.gather(*(one(i) for i in range(100)))

    results = asyncio.run(run())
    assert all(results) and sum(len(r) for r in results) >= 100
    assert all(c.function.name == "get_time" for r in results[1::2] for c in r)


def test_parallel_required_calls_may_be_several(oai: openai.OpenAI) -> None:
    counts = set()
    for seed in range(12):
        reply = oai.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=400,
            temperature=1.0,
            seed=seed,
        )
        calls = check_calls(reply.choices[0].message)
        assert calls and len({c.id for c in calls}) == len(calls)
        counts.add(len(calls))
    assert max(counts) > 1  # parallel_tool_calls (default true) lets the model call several


def test_streamed_calls_come_as_tool_call_deltas(oai: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 200,
        "temperature": 0,
    }
    whole = oai.chat.completions.create(**kwargs)
    chunks = list(oai.chat.completions.create(**kwargs, stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].id and deltas[0].function and deltas[0].function.name
    arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
    expected = whole.choices[0].message.tool_calls
    assert expected is not None and arguments == expected[0].function.arguments
    assert deltas[0].id.startswith("call_")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # The SDK's own accumulator puts the same call together.
    with oai.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert message.tool_calls and message.tool_calls[0].function.arguments == arguments


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_streamed_chunks_carry_the_logprobs_of_their_tokens(
    oai: openai.OpenAI, choice: str
) -> None:
    """With tools and ``logprobs``, each token's logprobs go out with the first chunk sent
    at or after it (its content, or with a forced call the call's chunks), so the chunks
    carry every entry of the whole answer's ``logprobs.content`` once, in order."""
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": choice,
        "max_tokens": 200,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = oai.chat.completions.create(**kwargs).choices[0].logprobs
    assert whole is not None and whole.content
    chunks = [c.choices[0] for c in oai.chat.completions.create(**kwargs, stream=True) if c.choices]
    streamed = [e for c in chunks if c.logprobs for e in c.logprobs.content or []]
    assert streamed == whole.content
    if choice == "required":  # no content: the call's first chunk carries them
        assert chunks[-1].finish_reason == "tool_calls"
        assert any(c.delta.tool_calls and c.logprobs for c in chunks)


def test_a_tool_result_goes_back_to_the_model(oai: openai.OpenAI, gateway: Any) -> None:
    first = oai.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0,
    )
    call = check_calls(first.choices[0].message)[0]
    history: list[Any] = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'},
    ]
    second = oai.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    assert second.choices[0].finish_reason == "length" and second.choices[0].message.content
    # What the daemon was given: the call written back in the assistant turn, the result
    # as a tool message (for the chat template), and no tools described (choice none).
    job = last_job(gateway.redis_url)
    roles = [m["role"] for m in job["messages"]]
    assert roles == ["user", "assistant", "tool"]
    assert job["messages"][1]["content"].startswith("<tool_call>\n{")
    assert json.loads(job["messages"][1]["content"].split("\n")[1])["name"] == call.function.name
    assert job["messages"][2]["content"] == '{"temp_c": 21}'


def test_auto_hands_the_tools_to_the_daemon_and_answers_text(
    oai: openai.OpenAI, gateway: Any
) -> None:
    """The job carries the tools as they are and the messages untouched: the daemon gives
    them to the chat template (or describes them: tests/engine/test_chat_tools.py)."""
    reply = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, *ASK],
        tools=TOOLS,
        max_tokens=6,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    job = last_job(gateway.redis_url)
    assert job["messages"][0] == {"role": "system", "content": "Be brief."}
    assert job["tools"] == TOOLS
    # The daemon showed them to the model: the fixture's template has no tools, so they
    # are described in the system message, and the prompt is that much longer.
    plain = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, *ASK],
        max_tokens=1,
        temperature=0,
    )
    assert reply.usage is not None and plain.usage is not None
    assert reply.usage.prompt_tokens > plain.usage.prompt_tokens + 100


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].name"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_bad_tool_requests_are_400_naming_the_parameter(
    oai: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model=MODEL, messages=ASK, **extra)
    assert caught.value.param == param


def last_job(redis_url: str) -> dict[str, Any]:
    """The last job on the default queue, as the daemon read it."""
    client = redis.Redis.from_url(redis_url)
    try:
        ((_, fields),) = client.xrevrange("batchd:queue:default", count=1)
    finally:
        client.close()
    return dict(orjson.loads(fields[b"job"]))


# -- reading calls out of a model's text ---------------------------------------------------

USE = ToolUse(("get_weather", "get_time"), "auto")


@pytest.mark.parametrize(
    ("text", "content", "names"),
    [
        (
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
            None,
            ["get_time"],
        ),
        (
            'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
            "Let me check.",
            ["get_weather", "get_time"],
        ),
        # SmolLM2 writes a list in one block; the last block may lack its end tag.
        (
            '<tool_call>[{"name": "get_time", "arguments": {"zone": "CET"}}, '
            '{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
            None,
            ["get_time", "get_weather"],
        ),
        # Llama 3's JSON style: the whole answer, "parameters" for "arguments".
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, ["get_weather"]),
        ('<|python_tag|>{"name": "get_time", "parameters": {}}', None, ["get_time"]),
        ("It is sunny.", "It is sunny.", []),
        ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', None, []),
        ('{"city": "Paris"}', '{"city": "Paris"}', []),
    ],
)
def test_calls_are_read_in_the_hermes_and_json_styles(
    text: str, content: str | None, names: list[str]
) -> None:
    found_content, calls = parse_calls(text, USE)
    assert [c.name for c in calls] == names
    if names:
        assert found_content == content
        assert all(isinstance(json.loads(c.arguments), dict) for c in calls)
    else:
        assert found_content == text


def test_streamed_content_stops_where_a_call_may_begin() -> None:
    gate = ContentGate(USE)
    sent = [
        gate.feed(p)
        for p in [
            "Sure",
            ", one moment. <to",
            'ol_call>\n{"name": "get_time", ',
            '"arguments": {}}\n</tool_call>',
        ]
    ]
    assert "".join(sent) == "Sure, one moment. "
    content, calls, rest = gate.end()
    assert [c.name for c in calls] == ["get_time"] and content == "Sure, one moment." and rest == ""
    plain = ContentGate(USE)
    assert plain.feed("Hello <b>") + plain.feed("x</b>") == "Hello <b>x</b>"


def test_the_forced_call_schema() -> None:
    functions = functions_of(TOOLS)
    named = call_schema(
        functions, tool_use(functions, {"type": "function", "function": {"name": "get_time"}}, None)
    )
    assert named["properties"]["name"] == {"const": "get_time"}
    many = call_schema(functions, tool_use(functions, "required", None))
    assert many["type"] == "array" and len(many["items"]["anyOf"]) == 2
    one = call_schema(functions, tool_use(functions, "required", False))
    assert "anyOf" in one
