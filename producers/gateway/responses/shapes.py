"""batchd events -> the Responses API's response object and its stream of events.

A response's id is ``resp_<job id>``, its message item's ``msg_<job id>``. Its output is
a message (``output_text``, when there is text) and one ``function_call`` item per tool
call. A job that ran out of ``max_output_tokens`` is ``incomplete`` (reason
``max_output_tokens``). ``usage.input_tokens_details.cached_tokens`` is the daemon's
prefix-cache count when it reports one, else 0, and ``cache_write_tokens`` 0 (the daemon
counts none; both fields are required). With ``include``
``message.output_text.logprobs`` the ``output_text`` part carries each token's logprobs
(a stop token left out), streamed with each delta.

Streamed (``stream: true``), the events are OpenAI's, each with its ``sequence_number``:
``response.created``, ``response.in_progress``, then for the text
``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta`` per token, ``.done`` events; for each call
``response.output_item.added``, ``response.function_call_arguments.delta`` and
``.done``, ``response.output_item.done``; last ``response.completed`` (or
``response.incomplete``, or ``response.failed`` with its error).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import orjson

from batchd.producers.gateway.errors import APIError, redis_failure
from batchd.producers.gateway.params import Mapped
from batchd.producers.gateway.refusals import failed
from batchd.producers.gateway.shapes import CHAT, cached_tokens, content_logprobs
from batchd.producers.gateway.stream import KEEPALIVE
from batchd.producers.gateway.tools.calls import Call, ContentGate, ToolUse, call_id, parse_calls
from batchd.producers.result import FAILED_REASONS
from batchd.producers.schema import Event, Usage

if TYPE_CHECKING:
    from batchd.producers.gateway.online import Online, Submitted


# The codes of a failed response's error that apply to a text model (OpenAI's set is these,
# and image and policy codes).
ERROR_CODES = {"server_error", "rate_limit_exceeded", "invalid_prompt"}


class ResponseShaper:
    """Builds one request's response object and stream events."""

    def __init__(
        self,
        job_id: str,
        model: str,
        echo: dict[str, Any],
        *,
        tools: ToolUse | None,
        logprobs: int | None = None,
    ) -> None:
        """``logprobs``: the alternatives per token when the request included the output's
        logprobs, else None (the parts' ``logprobs`` stay empty)."""
        self.job_id = job_id
        self.id = f"resp_{job_id}"
        self.message_id = f"msg_{job_id}"
        self.model = model
        self.echo = echo
        self.tools = tools
        self.created = int(time.time())
        self.gate = ContentGate(tools) if tools is not None else None
        self.logprobs = logprobs
        self.text = ""
        self.tokens: list[Event] = []
        self.seq = 0

    def envelope(self, status: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "model": self.model,
            "output": [],
            "usage": None,
            **self.echo,
        }

    def whole(self, tokens: list[Event], final: Event) -> dict[str, Any]:
        """The non-streaming answer."""
        text = final.text or "".join(e.text for e in tokens)
        content, calls = parse_calls(text, self.tools) if self.tools else (text, [])
        self.tokens = tokens
        return self.ended(final, content, calls)

    def ended(self, final: Event, content: str | None, calls: list[Call]) -> dict[str, Any]:
        """The response object of a job that ended with ``final``."""
        incomplete = final.finish_reason is not None and final.finish_reason.value == "length"
        out = self.envelope("incomplete" if incomplete else "completed")
        if incomplete:
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            out["completed_at"] = int(time.time())
        items: list[dict[str, Any]] = []
        if content:
            items.append(self.message(content, "incomplete" if incomplete else "completed"))
        items += [self.function_call(n, c, "completed") for n, c in enumerate(calls)]
        out["output"] = items
        out["usage"] = usage(final.usage)
        return out

    def message(self, text: str, status: str) -> dict[str, Any]:
        part = [self.part(text, self.tokens)]
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": part if text or status != "in_progress" else [],
        }

    def part(self, text: str, tokens: list[Event]) -> dict[str, Any]:
        """An ``output_text`` part, with the logprobs of ``tokens`` when asked for."""
        return {
            "type": "output_text",
            "text": text,
            "annotations": [],
            "logprobs": self.token_logprobs(tokens),
        }

    def token_logprobs(self, tokens: list[Event]) -> list[dict[str, Any]]:
        """OpenAI's logprobs of ``tokens`` (a stop token left out): token, bytes, logprob
        and ``top_logprobs`` alternatives; empty unless the request asked."""
        if self.logprobs is None:
            return []
        return content_logprobs(tokens, self.logprobs)

    def function_call(self, number: int, call: Call, status: str) -> dict[str, Any]:
        ident = call_id(self.job_id, 0, number)
        return {
            "type": "function_call",
            "id": f"fc_{ident.removeprefix('call_')}",
            "call_id": ident,
            "name": call.name,
            "arguments": call.arguments if status == "completed" else "",
            "status": status,
        }

    def failure(self, final: Event, mapped: Mapped) -> APIError:
        reason = final.finish_reason.value if final.finish_reason else "error"
        bias = [int(t) for t in (mapped.job.get("logit_bias") or {}) if str(t).isdigit()]
        return failed(self.job_id, reason, final.error, kind=CHAT, bias_ids=bias)

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n"


def usage(value: Usage | None) -> dict[str, Any]:
    prompt = value.prompt_tokens if value else 0
    completion = value.completion_tokens if value else 0
    return {
        "input_tokens": prompt,
        # The daemon counts no cache writes: 0, as the (required) field must be a number.
        "input_tokens_details": {
            "cached_tokens": cached_tokens(value) or 0,
            "cache_write_tokens": 0,
        },
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


async def stream_events(
    online: Online, job: Submitted, shaper: ResponseShaper, route: str
) -> AsyncIterator[bytes]:
    """The SSE lines of a streamed response, to its last event."""
    from batchd.producers.gateway.online import REDIS_ERRORS

    yield shaper.event("response.created", response=shaper.envelope("in_progress"))
    yield shaper.event("response.in_progress", response=shaper.envelope("in_progress"))
    try:
        async for chunk in _job_events(online, job, shaper, route):
            yield chunk
    except (APIError, *REDIS_ERRORS) as exc:
        error = exc if isinstance(exc, APIError) else redis_failure(exc)
        yield _failed_event(shaper, error)


def _failed_event(shaper: ResponseShaper, error: APIError) -> bytes:
    """``response.failed``: its ``error.code`` one of OpenAI's (the SDK's types list them),
    batchd's own code (``job_cancelled``...) at the head of the message."""
    body = shaper.envelope("failed")
    code = error.code if error.code in ERROR_CODES else "server_error"
    same = error.code in (None, code)
    message = error.message if same else f"{error.code}: {error.message}"
    body["error"] = {"code": code, "message": message}
    return shaper.event("response.failed", response=body)


async def _job_events(
    online: Online, job: Submitted, shaper: ResponseShaper, route: str
) -> AsyncIterator[bytes]:
    from batchd.producers.gateway.online import follow_events

    opened, first = False, True
    keepalive = online.options.sse_keepalive_s
    async with online.hub.subscribe(job.handle.id) as sub:
        async for event in follow_events(sub, keepalive):
            if event is None:
                yield KEEPALIVE
                continue
            if event.final:
                break
            if first:
                online.meter.token_sent(route, job.started)
                first = False
            shaper.text += event.text
            shaper.tokens.append(event)
            piece = shaper.gate.feed(event.text) if shaper.gate else event.text
            if not piece:
                continue
            if not opened:
                opened = True
                for chunk in _open_message(shaper):
                    yield chunk
            # Held text (tools) goes out later: its tokens' logprobs with the done events.
            yield _delta(shaper, piece, [] if shaper.gate else [event])
        else:
            return
    if event.finish_reason in FAILED_REASONS:
        yield _failed_event(shaper, shaper.failure(event, job.mapped))
        return
    for chunk in _close(shaper, event, opened):
        yield chunk


def _open_message(shaper: ResponseShaper) -> list[bytes]:
    item = shaper.message("", "in_progress")
    part = shaper.part("", [])
    return [
        shaper.event("response.output_item.added", output_index=0, item=item),
        shaper.event(
            "response.content_part.added",
            item_id=shaper.message_id,
            output_index=0,
            content_index=0,
            part=part,
        ),
    ]


def _delta(shaper: ResponseShaper, piece: str, tokens: list[Event]) -> bytes:
    return shaper.event(
        "response.output_text.delta",
        item_id=shaper.message_id,
        output_index=0,
        content_index=0,
        delta=piece,
        logprobs=shaper.token_logprobs(tokens),
    )


def _close(shaper: ResponseShaper, final: Event, opened: bool) -> list[bytes]:
    """The events after the last token: the text's end, each call, the response."""
    text = final.text or shaper.text
    if shaper.gate is not None:
        content, calls, rest = shaper.gate.end(text)
    else:
        content, calls, rest = text, [], ""
    response = shaper.ended(final, content, calls)
    out: list[bytes] = []
    if content and not opened:
        out += _open_message(shaper)
        rest = content
    if rest:
        out.append(_delta(shaper, rest, []))
    if content:
        where = {"item_id": shaper.message_id, "output_index": 0, "content_index": 0}
        part = shaper.part(content, shaper.tokens)
        logprobs = part["logprobs"]
        out.append(
            shaper.event("response.output_text.done", **where, text=content, logprobs=logprobs)
        )
        out.append(shaper.event("response.content_part.done", **where, part=part))
        out.append(
            shaper.event("response.output_item.done", output_index=0, item=response["output"][0])
        )
    first = 1 if content else 0
    for number, call in enumerate(calls):
        index = first + number
        done = response["output"][index]
        item = {**done, "arguments": "", "status": "in_progress"}
        out.append(shaper.event("response.output_item.added", output_index=index, item=item))
        ident = {"item_id": done["id"], "output_index": index}
        out.append(
            shaper.event("response.function_call_arguments.delta", **ident, delta=call.arguments)
        )
        out.append(
            shaper.event(
                "response.function_call_arguments.done",
                **ident,
                name=call.name,
                arguments=call.arguments,
            )
        )
        out.append(shaper.event("response.output_item.done", output_index=index, item=done))
    kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    out.append(shaper.event(kind, response=response))
    return out
