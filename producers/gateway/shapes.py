"""batchd events -> OpenAI response objects and stream chunks (chat and legacy text).

A chat completion's id is ``chatcmpl-<job id>`` and a text completion's
``cmpl-<job id>``, so a response can always be traced to its job.
``finish_reason`` is OpenAI's ``stop`` or ``length``; a job that ended
cancelled, failed or expired has no OpenAI completion and is reported as an error.
A job with ``n`` > 1 answers with n choices, each event's ``index`` naming its
choice; streamed, the final chunk carries every choice's finish_reason. With tools, a
choice's text is read for tool calls (:mod:`batchd.producers.gateway.tools.calls`): its
message gets ``tool_calls`` and ``finish_reason`` ``tool_calls``; streamed, text goes out
as it comes until a call may have begun, and the calls go out as ``tool_calls`` deltas
when the job ends.

Logprobs name each token by its own text (the events' ``token_texts``, which the daemon
decodes): chat's ``content`` entries with ``bytes`` (the token's own: the events'
``token_bytes`` for a piece of a character) and up to ``top_logprobs`` alternatives; a
text completion's ``tokens``, ``token_logprobs``, ``top_logprobs`` (the alternatives and
the sampled token, as OpenAI's) and ``text_offset``. They list the text's tokens: a stop
token (the event's ``stop_token``: eos...) adds no text and has no entry, though usage
counts it. A completion with ``echo`` starts each choice's text with the prompt
(streamed: its first chunk) and, with logprobs, its logprobs with the prompt's tokens
(the first one's logprob null, and no alternatives: the prompt's own token only).
"""

from __future__ import annotations

import time
from typing import Any

from batchd.producers.gateway.tools.calls import Call, ContentGate, ToolUse, call_id, parse_calls
from batchd.producers.schema import Event, Usage

CHAT = "chat.completion"
TEXT = "text_completion"


def completion_id(kind: str, job_id: str) -> str:
    return f"{'chatcmpl' if kind == CHAT else 'cmpl'}-{job_id}"


def usage_dict(usage: Usage | None) -> dict[str, Any]:
    """OpenAI's usage; ``prompt_tokens_details.cached_tokens`` when the daemon reports the
    prompt tokens its prefix cache held (``Usage.cached_tokens``)."""
    prompt = usage.prompt_tokens if usage else 0
    completion = usage.completion_tokens if usage else 0
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    cached = cached_tokens(usage)
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def cached_tokens(usage: Usage | None) -> int | None:
    """Prompt tokens served from the prefix cache, when the daemon says (None: it does
    not report them)."""
    value = getattr(usage, "cached_tokens", None) if usage is not None else None
    return int(value) if isinstance(value, int) else None


def tool_calls(job_id: str, index: int, calls: list[Call]) -> list[dict[str, Any]]:
    return [
        {
            "id": call_id(job_id, index, number),
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for number, call in enumerate(calls)
    ]


def finish_with_calls(reason: str, calls: list[Call]) -> str:
    return "tool_calls" if calls and reason == "stop" else reason


def token_text(event: Event) -> str:
    """The text of an event's token decoded alone (its ``text`` when the daemon did not
    name it: a job without token_texts)."""
    texts = event.token_texts or {}
    return texts.get(event.token_id, event.text) if event.token_id is not None else event.text


def alternatives(event: Event, count: int) -> list[tuple[int, str, float]]:
    """The event's first ``count`` top logprobs as (token id, text, logprob)."""
    texts = event.token_texts or {}
    top = (event.top_logprobs or [])[:count]
    return [(t, texts.get(t, f"token_id:{t}"), lp) for t, lp in top]


def token_bytes(event: Event, token_id: int | None, text: str) -> list[int]:
    """A token's own bytes: the daemon's ``token_bytes`` for a token that is part of a
    multi-byte character (its text shows U+FFFD), else its text's UTF-8."""
    raw = (event.token_bytes or {}).get(token_id) if token_id is not None else None
    return raw if raw is not None else list(text.encode("utf-8", "surrogatepass"))


def content_tokens(tokens: list[Event]) -> list[Event]:
    """The events whose tokens the logprobs list: all but a stop token (eos...), which is
    no part of the text (it counts in usage all the same)."""
    return [e for e in tokens if not e.stop_token]


def content_logprobs(tokens: list[Event], top: int) -> list[dict[str, Any]]:
    """OpenAI's per-token logprobs of a message's text (chat's ``logprobs.content``, the
    Responses API's ``output_text`` part): token, logprob, bytes and up to ``top``
    alternatives for each token but a stop token."""
    out = []
    for e in content_tokens(tokens):
        token = token_text(e)
        best = [
            {"token": t, "logprob": lp, "bytes": token_bytes(e, i, t)}
            for i, t, lp in alternatives(e, top)
        ]
        own = {"token": token, "logprob": e.logprob, "bytes": token_bytes(e, e.token_id, token)}
        out.append(own | {"top_logprobs": best})
    return out


def add_prompt_logprobs(
    kind: str, body: dict[str, Any], pairs: list[tuple[int, float | None]]
) -> None:
    """vLLM's ``prompt_logprobs``: null for the first prompt token, then ``{"<token id>":
    {"logprob": x}}`` per token; on the response for chat, on each choice for text."""
    shaped = [None] + [{str(token): {"logprob": lp}} for token, lp in pairs[1:]]
    if kind == CHAT:
        body["prompt_logprobs"] = shaped
    else:
        for choice in body["choices"]:
            choice["prompt_logprobs"] = shaped


class Shaper:
    """Builds one request's OpenAI objects; ``kind`` is :data:`CHAT` or :data:`TEXT`."""

    def __init__(
        self,
        kind: str,
        job_id: str,
        model: str,
        *,
        logprobs: bool,
        tools: ToolUse | None = None,
        top_logprobs: int = 0,
        echo: str | None = None,
        include_usage: bool = False,
    ) -> None:
        self.kind = kind
        self.job_id = job_id
        self.id = completion_id(kind, job_id)
        self.model = model
        self.logprobs = logprobs
        self.tools = tools
        self.top_logprobs = top_logprobs
        self.echo = echo
        self.include_usage = include_usage
        self.offsets: dict[int, int] = {}  # streamed: each choice's text offset so far
        self.created = int(time.time())
        self.started: set[int] = set()  # choices whose first chunk went out
        self.gates: dict[int, ContentGate] = {}  # with tools: each choice's text
        self.pending: dict[int, list[Event]] = {}  # with tools: tokens whose chunk waits

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """The fields every object and chunk shares; streamed with
        ``stream_options.include_usage``, each chunk's ``usage`` is null but the last's
        (OpenAI's: :meth:`usage_chunk`)."""
        out = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            out["usage"] = None
        return out

    def _logprobs(
        self, tokens: list[Event], *, index: int = 0, prompt: Event | None = None
    ) -> dict[str, Any] | None:
        """The logprobs of ``tokens`` (one choice's); for an echoed completion, ``prompt``
        (the event holding the prompt's logprobs) comes first."""
        if not self.logprobs:
            return None
        if self.kind == CHAT:
            return {"content": content_logprobs(tokens, self.top_logprobs)}
        tokens = content_tokens(tokens)
        texts: list[str] = []
        logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        if prompt is not None and prompt.prompt_logprobs:
            named = prompt.token_texts or {}
            for token_id, lp in prompt.prompt_logprobs:
                texts.append(named.get(token_id, f"token_id:{token_id}"))
                logprobs.append(lp)
                tops.append(None if lp is None else {texts[-1]: lp})
        for e in tokens:
            token = token_text(e)
            texts.append(token)
            logprobs.append(e.logprob)
            top = {t: lp for _, t, lp in alternatives(e, self.top_logprobs)}
            if e.logprob is not None:
                top[token] = e.logprob  # OpenAI's: the sampled token always among them
            tops.append(top)
        offset = self.offsets.get(index, 0)
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        self.offsets[index] = offset
        return {
            "tokens": texts,
            "token_logprobs": logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def whole(self, tokens: list[Event], final: Event) -> dict[str, Any]:
        """The non-streaming answer: each choice's full text, and the usage."""
        choices = []
        prompt = next((e for e in tokens if e.prompt_logprobs), None)
        for index, text, reason in _ends(final):
            mine = [e for e in tokens if (e.index or 0) == index]
            choice: dict[str, Any] = {"index": index, "finish_reason": reason}
            text = text or "".join(e.text for e in mine)
            if self.echo is not None:
                text = self.echo + text
            if self.kind == CHAT and self.tools is not None:
                content, calls = parse_calls(text, self.tools)
                choice["finish_reason"] = finish_with_calls(reason, calls)
                choice["message"] = {"role": "assistant", "content": content, "refusal": None}
                if calls:
                    choice["message"]["tool_calls"] = tool_calls(self.job_id, index, calls)
            elif self.kind == CHAT:
                choice["message"] = {"role": "assistant", "content": text, "refusal": None}
            else:
                choice["text"] = text
            self.offsets.pop(index, None)
            echoed = prompt if self.echo is not None else None
            choice["logprobs"] = self._logprobs(mine, index=index, prompt=echoed)
            choices.append(choice)
        out = self._envelope(self.kind, choices)
        if prompt is not None and prompt.prompt_logprobs and self.echo is None:
            add_prompt_logprobs(self.kind, out, prompt.prompt_logprobs)
        out["usage"] = usage_dict(final.usage)
        return out

    def chunks(self, event: Event) -> list[dict[str, Any]]:
        """The stream chunks one event makes (with tools, text may wait: see the module
        doc). With tools, a token's logprobs go out with the first chunk sent at or after
        it (its text's content, else the calls), so the chunks carry every token's
        logprobs once, as the whole answer lists them."""
        if self.tools is None or self.kind != CHAT:
            return [self.chunk(event)]
        if not event.final:
            index = event.index or 0
            self.pending.setdefault(index, []).append(event)
            content = self._gate(index).feed(event.text)
            return [self._envelope_chunk(index, {"content": content})] if content else []
        out: list[dict[str, Any]] = []
        reasons = {}
        for index, full, reason in _ends(event):
            _, calls, rest = self._gate(index).end(full)
            reasons[index] = finish_with_calls(reason, calls)
            sent = len(out)
            if rest or index not in self.started:
                # An empty opening chunk leaves the tokens' logprobs to the calls' chunk.
                carry = bool(rest) or not calls
                out.append(self._envelope_chunk(index, {"content": rest}, carry=carry))
            for number, item in enumerate(tool_calls(self.job_id, index, calls)):
                head = {"index": number, "id": item["id"], "type": "function"}
                head["function"] = {"name": item["function"]["name"], "arguments": ""}
                args = {"index": number, "function": {"arguments": item["function"]["arguments"]}}
                out.append(self._envelope_chunk(index, {"tool_calls": [head]}))
                out.append(self._envelope_chunk(index, {"tool_calls": [args]}))
            if len(out) == sent and content_tokens(self.pending.get(index, [])):
                out.append(self._envelope_chunk(index, {"content": ""}))
        choices: list[dict[str, Any]] = [
            {"index": i, "delta": {}, "finish_reason": r, "logprobs": None}
            for i, r in reasons.items()
        ]
        out.append(self._envelope("chat.completion.chunk", choices))
        return out

    def _gate(self, index: int) -> ContentGate:
        assert self.tools is not None
        return self.gates.setdefault(index, ContentGate(self.tools))

    def _envelope_chunk(
        self, index: int, delta: dict[str, Any], *, carry: bool = True
    ) -> dict[str, Any]:
        """A chunk of choice ``index`` with tools, carrying (with ``carry``) the logprobs
        of the tokens that waited for it (:meth:`chunks`; null when none did)."""
        if index not in self.started:
            delta = {"role": "assistant", **delta}
            self.started.add(index)
        waited = content_tokens(self.pending.pop(index, []) if carry else [])
        logprobs = self._logprobs(waited, index=index) if waited else None
        choice = {"index": index, "delta": delta, "finish_reason": None, "logprobs": logprobs}
        return self._envelope("chat.completion.chunk", [choice])

    def chunk(self, event: Event) -> dict[str, Any]:
        """A stream chunk for one token event (or, for the final event, every choice's
        finish_reason)."""
        if event.final:
            choices = [self._choice(i, "", reason) for i, _, reason in _ends(event)]
        else:
            index = event.index or 0
            choices = [self._choice(index, event.text, None)]
            choices[0]["logprobs"] = self._logprobs([event], index=index)
        obj = "chat.completion.chunk" if self.kind == CHAT else TEXT
        return self._envelope(obj, choices)

    def _choice(self, index: int, text: str, reason: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "finish_reason": reason}
        if self.kind == CHAT:
            # A token's delta has content (maybe empty: text held back); the last one's is
            # empty, as OpenAI's.
            delta: dict[str, Any] = {"content": text} if text or reason is None else {}
            if index not in self.started:
                delta = {"role": "assistant", "content": text}
            choice["delta"] = delta
        else:
            if self.echo is not None and index not in self.started:
                text = self.echo + text
                self.offsets[index] = len(self.echo)
            choice["text"] = text
        choice["logprobs"] = None
        self.started.add(index)
        return choice

    def usage_chunk(self, final: Event) -> dict[str, Any]:
        """``stream_options.include_usage``: a last chunk with no choices and the usage."""
        obj = "chat.completion.chunk" if self.kind == CHAT else TEXT
        out = self._envelope(obj, [])
        out["usage"] = usage_dict(final.usage)
        return out


def _ends(final: Event) -> list[tuple[int, str, str]]:
    """(index, full text, finish_reason) of each choice a final event ends."""
    if final.choices:
        return [(c.index, c.text, c.finish_reason.value) for c in final.choices]
    assert final.finish_reason is not None
    return [(0, final.text, final.finish_reason.value)]
