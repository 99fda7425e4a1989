"""batchd events -> OpenAI response objects and stream chunks (chat and legacy text).

A chat completion's id is ``chatcmpl-<job id>`` and a text completion's
``cmpl-<job id>``, so a response can always be traced to its job.
``finish_reason`` is OpenAI's ``stop`` or ``length``; a job that ended
cancelled, failed or expired has no OpenAI completion and is reported as an error.
"""

from __future__ import annotations

import time
from typing import Any

from producers.schema import Event, Usage

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


class Shaper:
    """Builds one request's OpenAI objects; ``kind`` is :data:`CHAT` or :data:`TEXT`."""

    def __init__(self, kind: str, job_id: str, model: str, *, logprobs: bool) -> None:
        self.kind = kind
        self.id = completion_id(kind, job_id)
        self.model = model
        self.logprobs = logprobs
        self.created = int(time.time())
        self.first = True

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
        """The non-streaming answer: the final event's full text and usage."""
        text = final.text if final.text else "".join(e.text for e in tokens)
        choice: dict[str, Any] = {"index": 0, "finish_reason": _reason(final)}
        if self.kind == CHAT:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(tokens)
        out = self._envelope(self.kind, [choice])
        out["usage"] = usage_dict(final.usage)
        return out

    def chunk(self, event: Event) -> dict[str, Any]:
        """A stream chunk for one token event (or the final event's finish_reason)."""
        reason = _reason(event) if event.final else None
        text = "" if event.final else event.text
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
        if self.kind == CHAT:
            delta: dict[str, Any] = {"content": text} if text or not self.first else {}
            if self.first:
                delta = {"role": "assistant", "content": text}
            choice["delta"] = delta
            obj = "chat.completion.chunk"
        else:
            choice["text"] = text
            obj = TEXT
        tokens = [event] if not event.final else []
        choice["logprobs"] = self._logprobs(tokens) if tokens else None
        self.first = False
        return self._envelope(obj, [choice])

    def usage_chunk(self, final: Event) -> dict[str, Any]:
        """``stream_options.include_usage``: a last chunk with no choices and the usage."""
        obj = "chat.completion.chunk" if self.kind == CHAT else TEXT
        out = self._envelope(obj, [])
        out["usage"] = usage_dict(final.usage)
        return out


def _reason(final: Event) -> str:
    assert final.finish_reason is not None
    return final.finish_reason.value
