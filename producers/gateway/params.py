"""OpenAI request bodies -> batchd job fields, refusing what the engine cannot honour.

Every body key is either mapped onto a JobRequest field, accepted because it
changes nothing batchd computes (``user``, ``stream``, a neutral value such as
``best_of: 1``), or refused with a 400 naming it: a
client that asks for something batchd would not do must hear so, never get a
silently different answer. Defaults follow OpenAI's (temperature 1; 16
tokens for legacy completions), not JobRequest's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchd.producers.gateway.errors import APIError, invalid, unsupported

OPENAI_TEMPERATURE = 1.0
COMPLETIONS_MAX_TOKENS = 16
MESSAGE_ROLES = {"system", "user", "assistant", "tool"}

# Keys whose neutral value is accepted; anything else is refused (engine lacks it).
NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "best_of": lambda v: v in (None, 1),
    "echo": lambda v: v in (None, False),
    "suffix": lambda v: v in (None, ""),
    "tools": lambda v: not v,
    "tool_choice": lambda v: v in (None, "none"),
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none"),
    "parallel_tool_calls": lambda v: True,  # meaningless without tools
    "top_logprobs": lambda v: v in (None, 0),
    "store": lambda v: v in (None, False),
    "service_tier": lambda v: v in (None, "auto", "default"),
    "user": lambda v: True,  # an end-user id for abuse tracking: no effect on output
    "metadata": lambda v: v is None or isinstance(v, dict),  # tags: kept on the job
}
WHY_REFUSED = {
    "best_of": "greater than 1 is not supported yet",
    "metadata": "must be an object",
    "top_logprobs": "is not supported: the gateway has no tokenizer to name alternative "
    "tokens (logprobs: true gives each generated token's logprob)",
}
# OpenAI's sampling controls that map one to one onto job fields.
SAME_NAME = ("top_p", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "n")
# Sampling extras batchd has beyond OpenAI's set (vLLM takes the same names).
EXTRAS = ("top_k", "min_p", "repetition_penalty", "min_tokens", "priority")


@dataclass(frozen=True)
class Mapped:
    """A request turned into job fields, plus what the HTTP answer needs to know."""

    model: str
    job: dict[str, Any]
    stream: bool
    include_usage: bool
    logprobs: bool


def chat_request(body: dict[str, Any]) -> Mapped:
    """``POST /v1/chat/completions`` body -> job fields; raises APIError (400)."""
    job = {"messages": _messages(body.pop("messages", None))}
    max_tokens = body.pop("max_completion_tokens", None)
    legacy = body.pop("max_tokens", None)
    max_tokens = legacy if max_tokens is None else max_tokens
    logprobs = body.pop("logprobs", None)
    if logprobs not in (None, True, False):
        raise invalid("logprobs", "must be a boolean")
    return _common(body, job, max_tokens=max_tokens, logprobs=bool(logprobs))


def completion_request(body: dict[str, Any]) -> Mapped:
    """``POST /v1/completions`` body -> job fields; raises APIError (400)."""
    job = _prompt(body.pop("prompt", None))
    max_tokens = body.pop("max_tokens", COMPLETIONS_MAX_TOKENS)
    logprobs = body.pop("logprobs", None)
    if logprobs not in (None, 0) and not (isinstance(logprobs, int) and logprobs > 0):
        raise invalid("logprobs", "must be a non-negative integer")
    if isinstance(logprobs, int) and logprobs > 1:
        raise unsupported("logprobs", WHY_REFUSED["top_logprobs"].replace("logprobs: true", "1"))
    return _common(body, job, max_tokens=max_tokens, logprobs=bool(logprobs))


def _common(
    body: dict[str, Any], job: dict[str, Any], *, max_tokens: Any, logprobs: bool
) -> Mapped:
    model = body.pop("model", None)
    if not isinstance(model, str) or not model:
        raise invalid("model", "a model name is required")
    stream = body.pop("stream", False)
    if stream not in (True, False, None):
        raise invalid("stream", "must be a boolean")
    include_usage = _stream_options(body.pop("stream_options", None), stream=bool(stream))
    job.update(_prompt_logprobs(body.pop("prompt_logprobs", None), stream=bool(stream)))
    if max_tokens is not None:
        job["max_tokens"] = max_tokens
    temperature = body.pop("temperature", None)
    job["temperature"] = OPENAI_TEMPERATURE if temperature is None else temperature
    for name in (*SAME_NAME, *EXTRAS):
        value = body.pop(name, None)
        if value is not None:
            job[name] = value
    response_format = _response_format(body.pop("response_format", None))
    if response_format is not None:
        job["response_format"] = response_format
    stop = body.pop("stop", None)
    if stop is not None:
        job["stop"] = [stop] if isinstance(stop, str) else stop
    for name in list(body):
        if name in NEUTRAL and NEUTRAL[name](body[name]):
            continue
        if name in NEUTRAL:
            raise unsupported(name, WHY_REFUSED.get(name, "is not supported by batchd yet"))
        raise APIError(
            400, f"unrecognized request argument: {name}", param=name, code="unknown_parameter"
        )
    metadata = body.get("metadata")
    if isinstance(metadata, dict):
        job["metadata"] = metadata
    return Mapped(model, job, bool(stream), include_usage, logprobs)


def _response_format(raw: Any) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` as the job's: ``text`` is no constraint, ``json_object``
    passes as is, ``json_schema`` carries its ``schema`` (name and strict are OpenAI's
    bookkeeping: batchd always holds the output to the schema)."""
    if raw is None or raw == {"type": "text"}:
        return None
    if not isinstance(raw, dict):
        raise invalid("response_format", "must be an object")
    kind = raw.get("type")
    if kind == "json_object" and set(raw) == {"type"}:
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = raw.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise invalid("response_format", "json_schema needs an object with a 'schema'")
        return {"type": "json_schema", "json_schema": spec["schema"]}
    raise unsupported("response_format", "supports the types text, json_object and json_schema")


def _prompt_logprobs(value: Any, *, stream: bool) -> dict[str, bool]:
    """vLLM's ``prompt_logprobs`` as job fields: 0 (or true) gives each prompt token's own
    logprob; more would name alternatives, which needs a tokenizer the gateway lacks."""
    if value is None or value is False:
        return {}
    if value is not True and not (isinstance(value, int) and value >= 0):
        raise invalid("prompt_logprobs", "must be a non-negative integer")
    if value is not True and value != 0:
        raise unsupported("prompt_logprobs", "above 0 is not supported (no alternatives)")
    if stream:
        raise unsupported("prompt_logprobs", "is not supported with stream")
    return {"prompt_logprobs": True}


def _stream_options(options: Any, *, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise invalid("stream_options", "only allowed when stream is true")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise unsupported("stream_options", "supports only include_usage")
    return bool(options.get("include_usage"))


def _messages(raw: Any) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise invalid("messages", "a non-empty list of messages is required")
    out = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(where, "must be an object")
        role = "system" if message.get("role") == "developer" else message.get("role")
        if role not in MESSAGE_ROLES:
            raise invalid(f"{where}.role", f"unknown role {message.get('role')!r}")
        extra = set(message) - {"role", "content"}
        if extra:
            raise unsupported(f"{where}.{sorted(extra)[0]}")
        out.append({"role": role, "content": _content(message.get("content"), where)})
    return out


def _content(content: Any, where: str) -> str:
    """Text content; a list of parts is accepted when every part is text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise unsupported(f"{where}.content[{j}]", "is not text (only text is supported)")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise invalid(f"{where}.content", "must be a string or a list of text parts")


def _prompt(prompt: Any) -> dict[str, Any]:
    """A legacy prompt: a string, a list of one string, or token ids (one prompt only)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return {"prompt_token_ids": prompt}
    if isinstance(prompt, list) and len(prompt) > 1:
        raise unsupported("prompt", "with several prompts is not supported (one per request)")
    raise invalid("prompt", "must be a string or a list of token ids")
