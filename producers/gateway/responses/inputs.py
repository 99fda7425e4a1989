"""The Responses API's ``input`` as chat messages.

``input`` is a string (one user message) or a list of items: messages (``role`` user,
system, developer or assistant; ``content`` a string or ``input_text`` / ``output_text``
parts, as an earlier answer's output items carry them: ``id``, ``status``, ``phase``,
``annotations`` and ``logprobs`` included), an earlier answer's ``function_call`` items and the
``function_call_output`` items that answer them. Image, file and audio parts are refused
with a 400 naming the part: batchd's models read text only.
"""

from __future__ import annotations

from typing import Any

from batchd.producers.gateway.errors import invalid, unsupported
from batchd.producers.gateway.tools.messages import content_text

TEXT_PARTS = ("input_text", "output_text", "text")
# Parts OpenAI documents that carry no text: named in the refusal, so a client knows why.
MEDIA_PARTS = ("input_image", "input_file", "input_audio")


def input_messages(raw: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages: consecutive function calls become one assistant message
    with several ``tool_calls``."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise invalid("input", "must be a string or a non-empty list of items")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(where, "must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(_call_output(item, where))
        else:
            raise unsupported(f"{where}.type", f"{kind!r} items are not supported")
    return messages


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise invalid(f"{where}.role", f"unknown role {role!r}")
    # ``phase`` labels an assistant message (commentary or final answer): no prompt text.
    extra = set(item) - {"type", "role", "content", "id", "status", "phase"}
    if extra:
        raise unsupported(f"{where}.{sorted(extra)[0]}")
    return {"role": role, "content": _text(item.get("content"), where)}


def _text(content: Any, where: str) -> str:
    if isinstance(content, list):
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in MEDIA_PARTS:
                raise unsupported(
                    f"{where}.content[{j}].type",
                    f"{kind!r} is not supported: batchd's models read text only",
                )
    return content_text(content, where, part_types=TEXT_PARTS)


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    name, call_id = item.get("name"), item.get("call_id")
    if not isinstance(name, str) or not isinstance(call_id, str):
        raise invalid(where, "a function_call item needs name and call_id")
    arguments = item.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise invalid(f"{where}.arguments", "must be a JSON string")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _call_output(item: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str):
        raise invalid(f"{where}.call_id", "must be the id of the call it answers")
    if not isinstance(output, str):
        output = _text(output, where)
    return {"role": "tool", "tool_call_id": call_id, "content": output}
