"""OpenAI chat messages -> batchd's plain ``{role, content}`` messages.

Text content only (a string, or a list of text parts). ``developer`` is ``system``. An
assistant message's ``tool_calls`` are written into its content as the model writes
calls, and a ``tool`` message (its ``tool_call_id`` required) keeps the role ``tool``
for the model's chat template to render (:mod:`batchd.producers.gateway.tools.calls`).
Any other field is refused with a 400 naming it.
"""

from __future__ import annotations

from typing import Any

from batchd.producers.gateway.errors import invalid, unsupported
from batchd.producers.gateway.tools.calls import assistant_calls

MESSAGE_ROLES = {"system", "user", "assistant", "tool"}
# Fields a message may carry besides role and content, by role.
EXTRA_FIELDS = {"assistant": {"tool_calls"}, "tool": {"tool_call_id"}}


def chat_messages(raw: Any, *, param: str = "messages") -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise invalid(param, "a non-empty list of messages is required")
    return [one_message(m, f"{param}[{i}]") for i, m in enumerate(raw)]


def one_message(message: Any, where: str) -> dict[str, str]:
    if not isinstance(message, dict):
        raise invalid(where, "must be an object")
    role = "system" if message.get("role") == "developer" else message.get("role")
    if role not in MESSAGE_ROLES:
        raise invalid(f"{where}.role", f"unknown role {message.get('role')!r}")
    extra = set(message) - {"role", "content"} - EXTRA_FIELDS.get(role, set())
    if extra:
        raise unsupported(f"{where}.{sorted(extra)[0]}")
    calls = message.get("tool_calls")
    if role == "assistant" and calls:
        text = "" if message.get("content") is None else content_text(message["content"], where)
        parts = assistant_calls(calls, where)
        return {"role": role, "content": "\n".join([text, *parts] if text else parts)}
    if role == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise invalid(f"{where}.tool_call_id", "a tool message needs the id of its call")
    return {"role": role, "content": content_text(message.get("content"), where)}


def content_text(content: Any, where: str, *, part_types: tuple[str, ...] = ("text",)) -> str:
    """Text content; a list of parts is accepted when every part is text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in part_types:
                raise unsupported(f"{where}.content[{j}]", "is not text (only text is supported)")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise invalid(f"{where}.content", "must be a string or a list of text parts")
