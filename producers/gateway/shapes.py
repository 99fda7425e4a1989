"""batchd events -> OpenAI response objects and stream chunks (chat and legacy text).

A chat completion's id is ``chatcmpl-<job id>`` and a text completion's
``cmpl-<job id>``, so a response can always be traced to its job.
``finish_reason`` is OpenAI's ``stop`` or ``length``; a job that ended
cancelled, failed or expired has no OpenAI completion and is reported as an error.
A job with ``n`` > 1 answers with n choices, each event's ``index`` naming its
choice; streamed, the final chunk carries every choice's finish_reason.
"""

from __future__ import annotations

import time
from typing import Any

from batchd.producers.schema import Event, Usage

CHAT = "chat.completion"
TEXT = "text_completion"


def completion_id(kind: str, job_id: str) -> str:
    return f"{'chatcmpl' if kind == CHAT else 'cmpl'}-{job_id}"


def usage_dict(usage: Usage | None) -> dict[str, int]:
    prompt = usage.prompt_tokens if usage else 0
    completion = usage.completion_tokens if usage else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


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

    def __init__(self, kind: str, job_id: str, model: str, *, logprobs: bool) -> None:
        self.kind = kind
        self.id = completion_id(kind, job_id)
        self.model = model
        self.logprobs = logprobs
        self.created = int(time.time())
        self.started: set[int] = set()  # choices whose first chunk went out

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _logprobs(self, tokens: list[Event]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        if self.kind == CHAT:
            return {
                "content": [
                    {"token": e.text, "logprob": e.logprob, "bytes": None, "top_logprobs": []}
                    for e in tokens
                ]
            }
        return {
            "tokens": [e.text for e in tokens],
            "token_logprobs": [e.logprob for e in tokens],
            "top_logprobs": None,
            "text_offset": None,
        }

    def whole(self, tokens: list[Event], final: Event) -> dict[str, Any]:
        """The non-streaming answer: each choice's full text, and the usage."""
        choices = []
        for index, text, reason in _ends(final):
            mine = [e for e in tokens if (e.index or 0) == index]
            choice: dict[str, Any] = {"index": index, "finish_reason": reason}
            text = text or "".join(e.text for e in mine)
            if self.kind == CHAT:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice["logprobs"] = self._logprobs(mine)
            choices.append(choice)
        out = self._envelope(self.kind, choices)
        prompt = next((e.prompt_logprobs for e in tokens if e.prompt_logprobs), None)
        if prompt is not None:
            add_prompt_logprobs(self.kind, out, prompt)
        out["usage"] = usage_dict(final.usage)
        return out

    def chunk(self, event: Event) -> dict[str, Any]:
        """A stream chunk for one token event (or, for the final event, every choice's
        finish_reason)."""
        if event.final:
            choices = [self._choice(i, "", reason) for i, _, reason in _ends(event)]
        else:
            choices = [self._choice(event.index or 0, event.text, None)]
            choices[0]["logprobs"] = self._logprobs([event])
        obj = "chat.completion.chunk" if self.kind == CHAT else TEXT
        return self._envelope(obj, choices)

    def _choice(self, index: int, text: str, reason: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "finish_reason": reason}
        if self.kind == CHAT:
            delta: dict[str, Any] = {"content": text} if text or index in self.started else {}
            if index not in self.started:
                delta = {"role": "assistant", "content": text}
            choice["delta"] = delta
        else:
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
