"""Request fields the Responses API has and chat completions has not, and what the
response object repeats of its request.

- ``include``: ``message.output_text.logprobs`` asks for logprobs (``top_logprobs``
  alternatives each, 0 to 20); the other includables name items batchd never makes
  (tool results, images, reasoning), so they change nothing.
- ``reasoning``: batchd's models do not reason; ``null``, ``{}`` or effort ``none`` is
  accepted and echoed as ``{effort: null, summary: null}``, any other effort refused.
"""

from __future__ import annotations

from typing import Any

from batchd.producers.gateway.errors import invalid, unsupported
from batchd.producers.gateway.params import check_ranges

LOGPROBS = "message.output_text.logprobs"
# OpenAI's other includables: output batchd never produces, so including it is a no-op.
NOTHING_TO_INCLUDE = {
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "message.input_image.image_url",
    "reasoning.encrypted_content",
    "web_search_call.action.sources",
    "web_search_call.results",
}


def logprobs_asked(include: Any, top: Any) -> bool:
    """Whether ``include`` asks for the output's logprobs; 400 for an unknown includable
    or a ``top_logprobs`` out of 0..20 (checked asked or not, as OpenAI does)."""
    check_ranges({"top_logprobs": top})
    if include is None:
        return False
    if not isinstance(include, list):
        raise invalid("include", "must be a list of strings")
    for i, name in enumerate(include):
        if name != LOGPROBS and name not in NOTHING_TO_INCLUDE:
            raise invalid(f"include[{i}]", f"{name!r} is not a value OpenAI documents")
    return LOGPROBS in include


def check_reasoning(reasoning: Any) -> None:
    """400 for a ``reasoning`` that asks for reasoning (batchd's models have none)."""
    if reasoning is None:
        return
    if not isinstance(reasoning, dict):
        raise invalid("reasoning", "must be an object")
    for name, value in reasoning.items():
        if name not in ("effort", "summary", "generate_summary"):
            raise unsupported(f"reasoning.{name}")
        if value not in (None, "none"):
            why = "is not supported: batchd's models do not reason"
            raise unsupported(f"reasoning.{name}", why)


def echoed(body: dict[str, Any]) -> dict[str, Any]:
    """What the response object repeats of its request (read before mapping pops it), with
    OpenAI's defaults for what the request left out."""
    return {
        "background": False,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": body.get("max_tool_calls"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "previous_response_id": None,
        "prompt_cache_key": body.get("prompt_cache_key"),
        "reasoning": {"effort": None, "summary": None},
        "safety_identifier": body.get("safety_identifier"),
        "service_tier": "default",
        "store": False,
        "temperature": _given(body, "temperature", 1.0),
        "text": {"format": {"type": "text"}, "verbosity": "medium", **(body.get("text") or {})},
        "tool_choice": _given(body, "tool_choice", "auto"),
        "tools": [_tool(t) for t in body.get("tools") or []],
        "top_logprobs": body.get("top_logprobs") or 0,
        "top_p": _given(body, "top_p", 1.0),
        "truncation": "disabled",
        "user": body.get("user"),
    }


def _given(body: dict[str, Any], name: str, default: Any) -> Any:
    """The request's value, OpenAI's default where it sent none or null."""
    value = body.get(name)
    return default if value is None else value


def _tool(tool: Any) -> Any:
    """A function tool as OpenAI echoes it: every field, ``strict`` true unless sent."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        return tool
    return {"description": None, "parameters": None, "strict": True, **tool}
