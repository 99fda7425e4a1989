"""OpenAI request bodies -> batchd job fields, refusing what the engine cannot honour.

Every body key is either mapped onto a JobRequest field, accepted because it
changes nothing batchd computes (``user``, ``stream``, a neutral value such as
``best_of: 1``), or refused with a 400 naming it: a
client that asks for something batchd would not do must hear so, never get a
silently different answer. Values outside OpenAI's documented ranges are refused as
OpenAI refuses them (:data:`RANGES`). Defaults follow OpenAI's (temperature 1; 16
tokens for legacy completions), not JobRequest's; a chat completion without max_tokens
gets the gateway's ``default_max_tokens`` (:func:`fill_max_tokens`).

Logprobs are OpenAI's: chat ``logprobs: true`` with ``top_logprobs`` 0 to 20, completions
``logprobs`` 0 to 5 and ``echo``. The gateway has no tokenizer, so a job that answers
with logprobs asks the daemon for ``token_texts`` (each token's own text); ``echo``
with logprobs asks for the prompt's logprobs too. Penalties keep OpenAI's meaning
(the whole output, prompt excluded): the job's default ``penalty_window``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchd.config.limits import LimitSettings
from batchd.producers.gateway.errors import APIError, invalid, unsupported
from batchd.producers.gateway.tools.calls import (
    ToolUse,
    call_schema,
    functions_of,
    job_tools,
    tool_use,
)
from batchd.producers.gateway.tools.messages import chat_messages
from batchd.producers.schema import MAX_SEQUENCES

OPENAI_TEMPERATURE = 1.0
COMPLETIONS_MAX_TOKENS = 16
# OpenAI's documented ranges (inclusive): outside them OpenAI answers 400, and so do we.
RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    "n": (1, 128),
    "max_tokens": (1, 2**31 - 1),
    "max_completion_tokens": (1, 2**31 - 1),
    "top_logprobs": (0, 20),
    "seed": (-(2**63), 2**63 - 1),  # an int64; a negative one is folded (:func:`fold_seed`)
}
INTEGERS = {"n", "seed", "max_tokens", "max_completion_tokens", "top_logprobs"}
COMPLETIONS_MAX_LOGPROBS = 5
# OpenAI's bounds on metadata: pairs, characters of a key, characters of a value.
METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512
# OpenAI's bound on stop sequences (a job from batchd's own producers may carry more).
MAX_STOP = 4

# Keys whose neutral value is accepted; anything else is refused (engine lacks it).
NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "best_of": lambda v: v in (None, 1),
    "suffix": lambda v: v in (None, ""),
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none"),
    "store": lambda v: v in (None, False),
    "service_tier": lambda v: v in (None, "auto", "default"),
}
# Chat-only OpenAI parameters: accepted at their neutral value, else refused as unsupported
# (never as unknown: OpenAI documents them).
CHAT_NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "safety_identifier": lambda v: v is None or isinstance(v, str),  # abuse tracking
    "prompt_cache_key": lambda v: v is None or isinstance(v, str),  # the prefix cache needs none
    "modalities": lambda v: v in (None, ["text"]),
    "audio": lambda v: v is None,
    "prediction": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    "reasoning_effort": lambda v: v is None,
    "verbosity": lambda v: v is None,
}
WHY_REFUSED = {
    "safety_identifier": "must be a string",
    "prompt_cache_key": "must be a string",
    "modalities": 'supports only ["text"]',
    "best_of": "greater than 1 is not supported yet",
    "functions": "(deprecated) is not supported: use tools",
    "function_call": "(deprecated) is not supported: use tool_choice",
}
# OpenAI's sampling controls that map one to one onto job fields.
SAME_NAME = ("top_p", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "n")
# Sampling extras batchd has beyond OpenAI's set (vLLM takes the same names, but for
# batchd's penalty_window and sampling_order: docs/jobs.md, Sampling).
EXTRAS = (
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "priority",
    "penalty_window",
    "sampling_order",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "stop_token_ids",
    "ignore_eos",
)


@dataclass(frozen=True)
class Mapped:
    """A request turned into job fields, plus what the HTTP answer needs to know:
    ``top_logprobs`` alternatives per token (chat's top_logprobs, completions' logprobs)
    and, for a completion with ``echo``, the prompt to answer with."""

    model: str
    job: dict[str, Any]
    stream: bool
    include_usage: bool
    logprobs: bool
    tools: ToolUse | None = None
    top_logprobs: int = 0
    echo: str | None = None


def chat_request(body: dict[str, Any]) -> Mapped:
    """``POST /v1/chat/completions`` body -> job fields; raises APIError (400). Without
    max_tokens the job has none yet: see :func:`fill_max_tokens`."""
    messages = chat_messages(body.pop("messages", None))
    job: dict[str, Any] = {"messages": messages}
    check_ranges(body)
    max_tokens = body.pop("max_completion_tokens", None)
    legacy = body.pop("max_tokens", None)
    if max_tokens is not None and legacy is not None:
        raise APIError(
            400,
            "Setting 'max_tokens' and 'max_completion_tokens' at the same time is not supported.",
            param="max_tokens",
            code="invalid_parameter_combination",
        )
    max_tokens = legacy if max_tokens is None else max_tokens
    logprobs = body.pop("logprobs", None)
    if logprobs not in (None, True, False):
        raise invalid("logprobs", "must be a boolean")
    top = body.pop("top_logprobs", None)
    if top and not logprobs:
        raise invalid("top_logprobs", "requires logprobs: true")
    functions, use = chat_tools(body)
    for name, neutral in CHAT_NEUTRAL.items():
        if name in body and not neutral(body.pop(name)):
            raise unsupported(name, WHY_REFUSED.get(name, "is not supported by batchd yet"))
    mapped = _common(body, job, max_tokens=max_tokens, logprobs=bool(logprobs), top=top or 0)
    if use is None or use.mode == "none":
        return mapped
    return with_tools(mapped, functions, use)


def chat_tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]], ToolUse | None]:
    """The request's functions and :class:`ToolUse` (None without tools)."""
    tools = body.pop("tools", None)
    choice = body.pop("tool_choice", None)
    parallel = body.pop("parallel_tool_calls", None)
    if not tools:
        if choice not in (None, "none", "auto"):
            raise invalid("tool_choice", "names a tool but the request has no tools")
        return [], None
    functions = functions_of(tools)
    return functions, tool_use(functions, choice, parallel)


def with_tools(mapped: Mapped, functions: list[dict[str, Any]], use: ToolUse) -> Mapped:
    """``mapped`` with the tools described to the model and, for a forced call, its
    output held to the call's schema."""
    job = dict(mapped.job)
    if "response_format" in job:
        raise unsupported(
            "response_format", "cannot be combined with tools (one grammar holds an output)"
        )
    job["tools"] = job_tools(functions)
    if use.constrained:
        job["response_format"] = {
            "type": "json_schema",
            "json_schema": call_schema(functions, use),
        }
    return dataclasses.replace(mapped, job=job, tools=use)


def check_ranges(body: dict[str, Any]) -> None:
    """400 for a sampling value outside OpenAI's range (:data:`RANGES`), worded as
    OpenAI's; ``n`` above batchd's :data:`MAX_SEQUENCES` is refused as unsupported."""
    for name, value in body.items():
        if value is None:
            continue
        if name in INTEGERS and (isinstance(value, bool) or not isinstance(value, int)):
            raise invalid(name, f"must be an integer, got {value!r}")
        if name not in RANGES:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise invalid(name, f"must be a number, got {value!r}")
        low, high = RANGES[name]
        if value < low:
            raise _out_of_range(name, value, above=False, bound=low)
        if value > high:
            raise _out_of_range(name, value, above=True, bound=high)
    if isinstance(body.get("n"), int) and body["n"] > MAX_SEQUENCES:
        raise unsupported("n", f"above {MAX_SEQUENCES} is not supported by batchd")


def _out_of_range(name: str, value: Any, *, above: bool, bound: float) -> APIError:
    """OpenAI's words ("Invalid 'temperature': decimal above maximum value...") with the
    gateway's code for a bad value."""
    kind = "integer" if isinstance(value, int) else "decimal"
    side, word, op = ("above", "maximum", "<=") if above else ("below", "minimum", ">=")
    shown = bound if isinstance(bound, int) else f"{bound:g}"
    return APIError(
        400,
        f"Invalid '{name}': {kind} {side} {word} value. Expected a value {op} {shown}, "
        f"but got {value} instead.",
        param=name,
        code="invalid_value",
    )


def fill_max_tokens(
    job: dict[str, Any], *, default: int, limits: LimitSettings | None, context: int | None
) -> None:
    """Give a job without max_tokens the gateway's ``default``, held to what the job may
    ask for: the max_tokens cap shared by its n sequences, and the model's context
    length when a daemon's heartbeat tells it."""
    if "max_tokens" in job:
        return
    bound = default
    if limits is not None:
        bound = min(bound, max(1, limits.max_tokens_cap // int(job.get("n") or 1)))
    if context:
        bound = min(bound, max(1, context - 1))
    job["max_tokens"] = bound


def completion_request(body: dict[str, Any]) -> Mapped:
    """``POST /v1/completions`` body -> job fields; raises APIError (400)."""
    job = _prompt(body.pop("prompt", None))
    check_ranges(body)
    max_tokens = body.pop("max_tokens", None)
    if max_tokens is None:  # absent or null: OpenAI's default for completions
        max_tokens = COMPLETIONS_MAX_TOKENS
    logprobs = body.pop("logprobs", None)
    if logprobs is not None and (
        isinstance(logprobs, bool)
        or not isinstance(logprobs, int)
        or not 0 <= logprobs <= COMPLETIONS_MAX_LOGPROBS
    ):
        raise invalid("logprobs", f"must be an integer from 0 to {COMPLETIONS_MAX_LOGPROBS}")
    echo = body.pop("echo", None)
    if echo not in (None, True, False):
        raise invalid("echo", "must be a boolean")
    wants = logprobs is not None
    mapped = _common(body, job, max_tokens=max_tokens, logprobs=wants, top=logprobs or 0)
    if not echo:
        return mapped
    if "prompt" not in job:
        raise unsupported(
            "echo", "with a token-id prompt is not supported (the gateway has no tokenizer)"
        )
    if wants:
        if mapped.stream:
            raise unsupported("echo", "with logprobs is not supported with stream")
        mapped.job["prompt_logprobs"] = True
    return dataclasses.replace(mapped, echo=job["prompt"])


def _common(
    body: dict[str, Any], job: dict[str, Any], *, max_tokens: Any, logprobs: bool, top: int
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
    job.update(sampling(body))
    response_format = _response_format(body.pop("response_format", None))
    if response_format is not None:
        job["response_format"] = response_format
    job.update(_stop(body.pop("stop", None)))
    user = body.pop("user", None)
    if user is not None and not isinstance(user, str):
        raise invalid("user", f"must be a string, got {user!r}")
    metadata = body.pop("metadata", None)  # tags kept on the job
    check_metadata(metadata)
    refuse_the_rest(body)
    if metadata is not None:
        job["metadata"] = metadata
    if logprobs:
        # Name each token (and its alternatives) in the answer: the daemon decodes them.
        job["token_texts"] = True
        if top:
            job["logprobs"] = top
    return Mapped(model, job, bool(stream), include_usage, logprobs, top_logprobs=top)


def sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields of a body (popped): OpenAI's temperature default, the
    same-name controls and batchd's extras; ``top_p`` 0 is greedy."""
    temperature = body.pop("temperature", None)
    job = {"temperature": OPENAI_TEMPERATURE if temperature is None else temperature}
    for name in (*SAME_NAME, *EXTRAS):
        value = body.pop(name, None)
        if value is not None:
            job[name] = value
    if job.get("top_p") == 0:  # only the likeliest token: greedy
        del job["top_p"]
        job["temperature"] = 0.0
    seed = job.get("seed")
    if isinstance(seed, int) and seed < 0:
        job["seed"] = fold_seed(seed)
    return job


def check_metadata(metadata: Any) -> None:
    """400 for metadata beyond OpenAI's limits (:data:`METADATA_PAIRS` pairs, keys up to
    :data:`METADATA_KEY` characters, string values up to :data:`METADATA_VALUE`), worded
    as OpenAI's; the same for chat, completions, Responses and batches."""
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise invalid("metadata", "must be an object")
    if len(metadata) > METADATA_PAIRS:
        raise _too_long("metadata", f"at most {METADATA_PAIRS} properties", len(metadata))
    for key, value in metadata.items():
        if len(key) > METADATA_KEY:
            raise _too_long("metadata", f"keys of at most {METADATA_KEY} characters", len(key))
        if not isinstance(value, str):
            raise invalid(f"metadata.{key}", "must be a string")
        if len(value) > METADATA_VALUE:
            raise _too_long(f"metadata.{key}", f"at most {METADATA_VALUE} characters", len(value))


def _too_long(param: str, bound: str, got: int) -> APIError:
    return APIError(
        400,
        f"Invalid '{param}': too long. Expected {bound}, but got {got}.",
        param=param,
        code="invalid_value",
    )


def fold_seed(seed: int) -> int:
    """An OpenAI seed (an int64) as a job's (0 to 2**63 - 1): a negative one folded into
    the range, so it samples reproducibly as any other seed does."""
    return seed % 2**63


def _stop(stop: Any) -> dict[str, list[Any]]:
    """OpenAI's ``stop``: a string or a list of up to :data:`MAX_STOP` strings (each one
    checked by the job's validation)."""
    if stop is None:
        return {}
    if isinstance(stop, list) and len(stop) > MAX_STOP:
        raise invalid("stop", f"takes up to {MAX_STOP} sequences, got {len(stop)}")
    return {"stop": [stop] if isinstance(stop, str) else stop}


def refuse_the_rest(body: dict[str, Any], neutral: dict[str, Any] = NEUTRAL) -> None:
    """400 for what is left of a body: a known parameter's non-neutral value
    (unsupported), or an unknown parameter."""
    for name in list(body):
        if name in neutral and neutral[name](body[name]):
            continue
        if name in neutral:
            raise unsupported(name, WHY_REFUSED.get(name, "is not supported by batchd yet"))
        raise APIError(
            400,
            f"Unrecognized request argument supplied: {name}",
            param=name,
            code="unknown_parameter",
        )


def _response_format(raw: Any) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` as the job's: ``text`` is no constraint, ``json_object``
    passes as is, ``json_schema`` carries its ``schema`` (name and strict are OpenAI's
    bookkeeping: batchd always holds the output to the schema), and batchd's ``lenient``
    next to ``type`` (json_schema only) accepts keywords the grammar cannot enforce."""
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
        lenient = raw.get("lenient", False)
        if not isinstance(lenient, bool):
            raise invalid("response_format", "lenient must be a boolean")
        out = {"type": "json_schema", "json_schema": spec["schema"]}
        return out | {"lenient": True} if lenient else out
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
    include = options.get("include_usage")
    if include not in (None, True, False):
        raise invalid("stream_options.include_usage", "must be a boolean")
    return bool(include)


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
