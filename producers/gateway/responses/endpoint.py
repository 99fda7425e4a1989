"""``POST /v1/responses``: the Responses API's core, on the same jobs as chat completions.

A request is read into the chat completion it amounts to (:func:`as_chat`) and mapped,
checked and submitted as one (:class:`~batchd.producers.gateway.online.Online`):

- ``input`` (:mod:`.inputs`); ``instructions`` is a system message in front;
- ``include`` and ``top_logprobs`` (logprobs), ``reasoning`` (none) (:mod:`.fields`);
  ``metadata`` checked as chat's (OpenAI's limits);
- ``max_output_tokens``, ``temperature``, ``top_p``, ``user``,
  ``text.format`` (``text``, ``json_object``, ``json_schema`` with its ``name``, as
  OpenAI requires: the output held to the schema), ``tools`` (functions),
  ``tool_choice``, ``parallel_tool_calls``, ``stream``, and batchd's sampling extras
  (``top_k``, ``min_p``, ``repetition_penalty``, ``priority``, ``seed``).

Nothing is stored: ``store: true``, ``previous_response_id``, ``conversation``,
``background``, ``prompt`` (a stored template) and the rest are refused with a 400 naming
the parameter, as is ``truncation: "auto"``. The answer is
OpenAI's response object, or its stream of events
(:mod:`batchd.producers.gateway.responses.shapes`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from batchd.producers.gateway.errors import APIError, invalid, unsupported
from batchd.producers.gateway.online import Online, read_json
from batchd.producers.gateway.params import EXTRAS, Mapped, chat_request
from batchd.producers.gateway.responses.fields import check_reasoning, echoed, logprobs_asked
from batchd.producers.gateway.responses.inputs import input_messages
from batchd.producers.gateway.responses.shapes import ResponseShaper, stream_events
from batchd.producers.gateway.stream import EventStream
from batchd.producers.result import FAILED_REASONS

ROUTE = "/v1/responses"
# Parameters that change nothing batchd computes, with the values that say so.
NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "store": lambda v: v in (None, False),
    "background": lambda v: v in (None, False),
    "service_tier": lambda v: v in (None, "auto", "default"),
    "truncation": lambda v: v in (None, "disabled"),
    "max_tool_calls": lambda v: v is None,
    "safety_identifier": lambda v: v is None or isinstance(v, str),
    # batchd's prefix cache needs no key, and lives in memory
    "prompt_cache_key": lambda v: v is None or isinstance(v, str),
    "prompt_cache_retention": lambda v: v in (None, "in_memory"),
    "prompt": lambda v: v is None,
    "context_management": lambda v: not v,
    "stream_options": lambda v: v is None or set(v) <= {"include_obfuscation"},
    "user": lambda v: v is None or isinstance(v, str),
}
WHY = {
    "store": "is not supported: batchd keeps no responses (send false or leave it out)",
    "previous_response_id": "is not supported: batchd keeps no responses; send the "
    "conversation in input",
    "conversation": "is not supported: batchd keeps no conversations",
    "background": "is not supported",
    "prompt": "is not supported: batchd keeps no prompt templates; send instructions and input",
    "truncation": "other than 'disabled' is not supported: a prompt too long for the model "
    "is refused",
    "safety_identifier": "must be a string",
    "prompt_cache_key": "must be a string",
    "user": "must be a string",
}
# Chat parameter -> what the Responses API calls it, for refusals.
PARAM_NAMES = {
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "stream_options": "stream_options",
}


class Responses:
    """The Responses endpoint of one gateway, on its online machinery."""

    def __init__(self, online: Online) -> None:
        self.online = online

    async def create(self, request: Request) -> Response:
        self.online.guard.owner(request)  # 401 before a byte of the body is read
        body = await read_json(self.online.guard, request)
        job = await self.online.submit(request, lambda: mapped(body))
        top = job.mapped.top_logprobs if job.mapped.logprobs else None
        shaper = ResponseShaper(
            job.handle.id, job.model, echoed(body), tools=job.mapped.tools, logprobs=top
        )
        if job.mapped.stream:
            return self._stream(job, shaper)
        try:
            tokens, final = await self.online.collect(request, job, ROUTE)
        finally:
            self.online.guard.release(job.caller)
        if final is None:
            return Response(status_code=499)
        if final.finish_reason in FAILED_REASONS:
            raise shaper.failure(final, job.mapped)
        return JSONResponse(shaper.whole(tokens, final))

    def _stream(self, job: Any, shaper: ResponseShaper) -> Response:
        ended = False

        async def events() -> Any:
            nonlocal ended
            async for chunk in stream_events(self.online, job, shaper, ROUTE):
                yield chunk
            ended = True

        async def cancel() -> None:
            await job.handle.cancel()

        return EventStream(
            events(),
            finished=lambda: ended,
            on_gone=cancel,
            on_close=lambda: self.online.guard.release(job.caller),
        )


def mapped(body: dict[str, Any]) -> Mapped:
    """The request as the chat completion it amounts to, mapped; 400 names the Responses
    API's parameter."""
    chat = as_chat(body)
    try:
        return chat_request(chat)
    except APIError as exc:
        raise renamed(exc) from None


def renamed(exc: APIError) -> APIError:
    if exc.param is None:
        return exc
    top = exc.param.split(".", 1)[0].split("[", 1)[0]
    if top not in PARAM_NAMES:
        return exc
    name = PARAM_NAMES[top] + exc.param[len(top) :]
    message = exc.message.replace(exc.param, name, 1)
    return APIError(exc.status, message, type=exc.type, param=name, code=exc.code)


def as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A chat completions body with the same meaning; 400 for what has none."""
    body = dict(body)
    chat: dict[str, Any] = {"model": body.pop("model", None)}
    messages = input_messages(body.pop("input", None))
    instructions = body.pop("instructions", None)
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid("instructions", "must be a string")
        messages.insert(0, {"role": "system", "content": instructions})
    chat["messages"] = messages
    if "max_output_tokens" in body:
        chat["max_completion_tokens"] = body.pop("max_output_tokens")
    top = body.pop("top_logprobs", None)
    if logprobs_asked(body.pop("include", None), top):
        chat.update(logprobs=True, top_logprobs=top)
    check_reasoning(body.pop("reasoning", None))
    for name in ("temperature", "top_p", "stream", "metadata", "parallel_tool_calls", *EXTRAS):
        if name in body:
            chat[name] = body.pop(name)
    if "seed" in body:
        chat["seed"] = body.pop("seed")
    response_format = text_format(body.pop("text", None))
    if response_format is not None:
        chat["response_format"] = response_format
    tools = body.pop("tools", None)
    if tools:
        chat["tools"] = [_chat_tool(t, f"tools[{i}]") for i, t in enumerate(tools)]
    if "tool_choice" in body:
        chat["tool_choice"] = _chat_choice(body.pop("tool_choice"))
    _refuse_the_rest(body)
    return chat


def _refuse_the_rest(body: dict[str, Any]) -> None:
    for name, value in body.items():
        if name in NEUTRAL and NEUTRAL[name](value):
            continue
        if name in NEUTRAL or name in WHY:
            raise unsupported(name, WHY.get(name, "is not supported by batchd"))
        raise APIError(
            400,
            f"Unrecognized request argument supplied: {name}",
            param=name,
            code="unknown_parameter",
        )


def text_format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise invalid("text", "must be {format: ...}")
    if text.get("verbosity") not in (None, "medium"):
        raise unsupported("text.verbosity")
    spec = text.get("format")
    if spec is None or spec == {"type": "text"}:
        return None
    if not isinstance(spec, dict):
        raise invalid("text.format", "must be an object")
    if spec.get("type") == "json_object":
        return {"type": "json_object"}
    if spec.get("type") == "json_schema":
        if not isinstance(spec.get("schema"), dict):
            raise invalid("text.format.schema", "a json_schema format needs its schema")
        if not isinstance(spec.get("name"), str):  # required by OpenAI (and its SDK's types)
            raise APIError(
                400,
                "Missing required parameter: 'text.format.name'.",
                param="text.format.name",
                code="missing_required_parameter",
            )
        return {"type": "json_schema", "json_schema": {"schema": spec["schema"]}}
    raise unsupported("text.format", "supports the types text, json_object and json_schema")


def _chat_tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise invalid(where, "must be an object")
    if tool.get("type") != "function":
        raise unsupported(f"{where}.type", "other than 'function' is not supported")
    extra = set(tool) - {"type", "name", "description", "parameters", "strict"}
    if extra:
        raise unsupported(f"{where}.{sorted(extra)[0]}")
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def _chat_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, str | None):
        return choice
    raise unsupported("tool_choice", "supports none, auto, required and a function")
