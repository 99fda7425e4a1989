"""``/v1/responses`` with the official openai client, streaming and not, on the tiny model
(and SmolLM2 where a model must end by itself), and raw httpx where the JSON itself is the
point."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import jsonschema
import openai
import orjson
import pytest
from conftest import API_KEY
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from test_gateway_tools import TOOLS, WEATHER, last_job

from batchd.producers.client import Client

STREAM_EVENT: TypeAdapter[ResponseStreamEvent] = TypeAdapter(ResponseStreamEvent)

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


UNSUPPORTED, INVALID, UNKNOWN = "unsupported_parameter", "invalid_value", "unknown_parameter"
IMAGE = {"type": "input_image", "image_url": "https://example.com/a.png"}


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", UNSUPPORTED),
        ({"store": True}, "store", UNSUPPORTED),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", UNSUPPORTED),
        ({"max_output_tokens": 0}, "max_output_tokens", INVALID),
        ({"temperature": 3}, "temperature", INVALID),
        ({"text": {"format": {"type": "regex"}}}, "text.format", UNSUPPORTED),
        (
            {"text": {"format": {"type": "json_schema", "schema": CITY}}},
            "text.format.name",
            "missing_required_parameter",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type", UNSUPPORTED),
        ({"background": True}, "background", UNSUPPORTED),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort", UNSUPPORTED),
        ({"truncation": "auto"}, "truncation", UNSUPPORTED),
        ({"prompt": {"id": "pmpt_1"}}, "prompt", UNSUPPORTED),
        ({"include": ["message.output_text.tokens"]}, "include[0]", INVALID),
        ({"top_logprobs": 21}, "top_logprobs", INVALID),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", INVALID),
        ({"metadata": {"k" * 65: "v"}}, "metadata", INVALID),
        ({"metadata": {"k": "v" * 513}}, "metadata.k", INVALID),
        ({"metadata": {"k": 1}}, "metadata.k", INVALID),
        (
            {"input": [{"role": "user", "content": [IMAGE]}]},
            "input[0].content[0].type",
            UNSUPPORTED,
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": [IMAGE]}]},
            "input[0].content[0].type",
            UNSUPPORTED,
        ),
        ({"frobnicate": 1}, "frobnicate", UNKNOWN),
    ],
)
def test_what_batchd_cannot_do_is_400_naming_it(
    oai: openai.OpenAI, extra: dict[str, Any], param: str, code: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.responses.create(model=MODEL, input="Hi", extra_body=extra)
    assert (caught.value.param, caught.value.code) == (param, code), caught.value


# Every field of OpenAI's response object, as a request that sets none of them gets it.
RESPONSE_FIELDS = {
    "id": None,
    "object": "response",
    "created_at": None,
    "status": None,
    "error": None,
    "incomplete_details": None,
    "instructions": None,
    "max_output_tokens": None,
    "max_tool_calls": None,
    "model": MODEL,
    "output": None,
    "parallel_tool_calls": True,
    "previous_response_id": None,
    "reasoning": {"effort": None, "summary": None},
    "service_tier": "default",
    "store": False,
    "temperature": 1.0,
    "text": {"format": {"type": "text"}, "verbosity": "medium"},
    "tool_choice": "auto",
    "tools": [],
    "top_logprobs": 0,
    "top_p": 1.0,
    "truncation": "disabled",
    "usage": None,
    "user": None,
    "metadata": {},
    "background": False,
    "safety_identifier": None,
    "prompt_cache_key": None,
}


def _post(gateway: Any, body: dict[str, Any]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.post(f"{gateway.base_url}/responses", json=body, headers=headers, timeout=60)


def _sse(text: str) -> list[dict[str, Any]]:
    return [orjson.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


def test_the_response_object_has_every_field_openai_returns(gateway: Any) -> None:
    body = {"model": MODEL, "input": "Hi"}
    whole = _post(gateway, {**body, "max_output_tokens": 3}).json()
    created = _sse(_post(gateway, {**body, "max_output_tokens": 3, "stream": True}).text)[0]
    for response in (whole, created["response"]):
        missing = set(RESPONSE_FIELDS) - set(response)
        assert not missing, missing
        for name, value in RESPONSE_FIELDS.items():
            if value is not None or name in ("error", "instructions", "user"):
                assert response[name] == value or name == "max_output_tokens", name
    assert whole["status"] == "incomplete" and whole["max_output_tokens"] == 3
    nulls = {"temperature": None, "top_p": None, "tool_choice": None, "max_output_tokens": 3}
    defaults = _post(gateway, {**body, **nulls}).json()
    assert (defaults["temperature"], defaults["top_p"], defaults["tool_choice"]) == (1, 1, "auto")
    Response.model_validate(whole)  # strict: every type as the SDK declares it
    assert created["response"]["status"] == "in_progress"
    # What the request sets comes back, and a function tool as OpenAI echoes it.
    sent = {
        "tools": FLAT_TOOLS[:1],
        "reasoning": {"effort": None},
        "include": ["reasoning.encrypted_content"],
        "top_logprobs": 3,
        "safety_identifier": "user-1",
        "prompt_cache_key": "k",
        "prompt_cache_retention": "in_memory",
        "metadata": {"team": "a"},
        "max_output_tokens": 3,
    }
    echoed = _post(gateway, {**body, **sent}).json()
    assert echoed["tools"] == [{"description": None, "strict": True, **FLAT_TOOLS[0]}]
    assert echoed["reasoning"] == {"effort": None, "summary": None}
    assert (echoed["safety_identifier"], echoed["prompt_cache_key"]) == ("user-1", "k")
    assert (echoed["top_logprobs"], echoed["metadata"]) == (3, {"team": "a"})
    assert echoed["output"][0]["content"][0]["logprobs"] == []  # not included: none
    Response.model_validate(echoed)
    # Every streamed event of a call, strictly as the SDK types it.
    called = {**body, "tools": FLAT_TOOLS, "tool_choice": "required", "stream": True}
    events = [STREAM_EVENT.validate_python(e) for e in _sse(_post(gateway, called).text)]
    assert events[-1].type == "response.completed"
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert done and set(done) == {"function_call"}


def _logprobs_of(oai: openai.OpenAI, **kwargs: Any) -> tuple[Any, list[Any]]:
    response = oai.responses.create(
        include=["message.output_text.logprobs"], top_logprobs=2, **kwargs
    )
    part = response.output[0].content[0]  # type: ignore[union-attr]
    assert part.type == "output_text" and part.logprobs is not None
    return response, part.logprobs


def test_included_logprobs_are_the_chat_completions_ones(oai: openai.OpenAI, gateway: Any) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "input": "Hello there", "temperature": 0}
    response, logprobs = _logprobs_of(oai, max_output_tokens=6, **kwargs)
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    expected = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert [lp.token for lp in logprobs] == [lp.token for lp in expected]
    assert [lp.logprob for lp in logprobs] == [lp.logprob for lp in expected]
    assert [lp.bytes for lp in logprobs] == [lp.bytes for lp in expected]
    assert [[t.token for t in lp.top_logprobs] for lp in logprobs] == [
        [t.token for t in lp.top_logprobs] for lp in expected
    ]
    assert "".join(lp.token for lp in logprobs) == response.output_text
    # Streamed: each delta carries its tokens' logprobs, the done event all of them.
    streamed_body = {
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
        "max_output_tokens": 6,
        "stream": True,
        **kwargs,
    }
    raw = _sse(_post(gateway, streamed_body).text)
    events = [STREAM_EVENT.validate_python(e) for e in raw]  # strict, as the SDK declares
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    streamed = [(lp.token, lp.logprob) for e in deltas for lp in e.logprobs]
    assert streamed == [(lp.token, lp.logprob) for lp in logprobs]
    assert all(len(lp.top_logprobs or []) == 2 for e in deltas for lp in e.logprobs)
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [lp.token for lp in done.logprobs] == [lp.token for lp in logprobs]


def test_logprobs_leave_out_the_end_token(smol_oai: openai.OpenAI) -> None:
    """SmolLM2 ends on its end token: counted in usage, no part of the text or logprobs."""
    response, logprobs = _logprobs_of(
        smol_oai, model="smollm2", input="Say hi.", max_output_tokens=60, temperature=0
    )
    assert response.status == "completed" and response.usage is not None
    assert len(logprobs) == response.usage.output_tokens - 1
    assert "".join(lp.token for lp in logprobs) == response.output_text
    assert all(lp.top_logprobs and lp.top_logprobs[0].logprob >= lp.logprob for lp in logprobs)


def test_an_answer_goes_back_as_input_as_the_agents_sdk_sends_it(
    oai: openai.OpenAI, gateway: Any
) -> None:
    """The Agents SDK replays earlier output items whole (ids, status, annotations)."""
    first = oai.responses.create(model=MODEL, input="Hi", max_output_tokens=3, temperature=0)
    replay = [item.model_dump() for item in first.output]
    follow = oai.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": "Hi"}, *replay, {"role": "user", "content": "More"}],
        max_output_tokens=3,
    )
    assert follow.output_text
    roles = [(m["role"], m["content"]) for m in last_job(gateway.redis_url)["messages"]]
    assert roles == [("user", "Hi"), ("assistant", first.output_text), ("user", "More")]


def test_a_job_that_fails_mid_stream_ends_with_response_failed(
    oai: openai.OpenAI, gateway: Any
) -> None:
    stream = oai.responses.create(  # no end token ends it first: only the cancel can
        model=MODEL,
        input="Go on",
        max_output_tokens=2000,
        temperature=1.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    events = []
    with Client(gateway.redis_url) as client:
        for event in stream:
            events.append(event)
            if event.type == "response.output_text.delta" and len(events) == 5:
                job_id = events[0].response.id.removeprefix("resp_")  # type: ignore[union-attr]
                threading.Thread(target=client.cancel, args=(job_id,)).start()
    last = events[-1]
    assert last.type == "response.failed", [e.type for e in events[-3:]]
    assert last.response.status == "failed" and last.response.error is not None
    assert last.response.error.code == "server_error"
    assert last.response.error.message.startswith("job_cancelled: ")
    STREAM_EVENT.validate_python(last.model_dump())
    assert [e.sequence_number for e in events] == list(range(len(events)))
