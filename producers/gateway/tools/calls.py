"""OpenAI tool calling on batchd jobs: tools into the job, tool calls out of the text.

**Tools in**: the job's ``tools`` field. The daemon gives them to the model's chat
template where it renders tools, and otherwise describes them in the system message in
the Hermes format, Qwen2.5's own words (batchd.engine.chat_tools). An earlier call is
written back in its assistant message as the Hermes format writes it,
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Qwen's and Hermes
models' templates write it so themselves), and a tool's result is a ``tool`` message,
which the model's chat template renders as it does (Qwen's wraps it in
``<tool_response>``).

**Reading calls** (:func:`parse_calls`): every ``<tool_call>`` block (a JSON object, or a
list of them, as SmolLM2 writes; the last block may lack its closing tag), or a whole
answer that is such JSON (Llama 3's JSON style, ``parameters`` for ``arguments``, maybe
after ``<|python_tag|>``). Only calls naming a function of the request count; anything
else stays text. Not read: Mistral's ``[TOOL_CALLS]``, Llama's ``<function=...>`` tags.

**Forcing a call**: with ``tool_choice`` ``required`` or a named function, the job's
output is held to a JSON schema (the engine's structured output): ``{"name", "arguments"}``
with ``name`` one of the allowed functions and ``arguments`` that function's
``parameters`` schema (a list of them with ``parallel_tool_calls``). Such a call always
parses and its arguments always validate.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

import orjson

from batchd.producers.gateway.errors import invalid, unsupported

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128
OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1+ may open a JSON call with it
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
MODES = ("none", "auto", "required")
# A function's fields; ``strict`` is accepted: a forced call is always held to its schema.
FUNCTION_FIELDS = {"name", "description", "parameters", "strict"}


def call_text(name: str, arguments: Any) -> str:
    """One call as the model writes it."""
    body = orjson.dumps({"name": name, "arguments": arguments}).decode()
    return f"{OPEN}\n{body}\n{CLOSE}"


@dataclass(frozen=True)
class ToolUse:
    """A request's tools, as far as its answer needs them: the functions' names, the
    ``mode`` (``auto``, ``required``, or ``function`` for a named one: ``forced``), and
    whether several calls may come at once."""

    names: tuple[str, ...]
    mode: str
    parallel: bool = True
    forced: str | None = None

    @property
    def constrained(self) -> bool:
        """The output is the calls' JSON (held to a schema), not free text."""
        return self.mode in ("required", "function")

    def to_dict(self) -> dict[str, Any]:
        return {
            "names": list(self.names),
            "mode": self.mode,
            "parallel": self.parallel,
            "forced": self.forced,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ToolUse:
        return cls(tuple(data["names"]), data["mode"], data["parallel"], data.get("forced"))


def functions_of(tools: Any, *, param: str = "tools", flat: bool = False) -> list[dict[str, Any]]:
    """The function definitions of OpenAI's ``tools`` (chat: ``{"type": "function",
    "function": {...}}``; Responses API, ``flat``: ``{"type": "function", "name": ...}``),
    each ``{"name", "description"?, "parameters"}``; 400 naming what is wrong."""
    if not isinstance(tools, list) or not tools:
        raise invalid(param, "must be a non-empty list of tools")
    if len(tools) > MAX_TOOLS:
        raise invalid(param, f"at most {MAX_TOOLS} tools")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"{param}[{i}]"
        spec = _spec(tool, where, flat=flat)
        name = spec.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise invalid(f"{where}.name", "must be 1-64 letters, digits, '_' or '-'")
        if name in seen:
            raise invalid(f"{where}.name", f"{name!r} is defined twice")
        seen.add(name)
        parameters = spec.get("parameters")
        if parameters is None:
            parameters = EMPTY_PARAMETERS
        if not isinstance(parameters, dict):
            raise invalid(f"{where}.parameters", "must be a JSON schema object")
        function: dict[str, Any] = {"name": name}
        if isinstance(spec.get("description"), str):
            function["description"] = spec["description"]
        function["parameters"] = parameters
        out.append(function)
    return out


def _spec(tool: Any, where: str, *, flat: bool) -> dict[str, Any]:
    """The function definition inside one tool; 400 for anything batchd does not know."""
    if not isinstance(tool, dict):
        raise invalid(where, "must be an object")
    if tool.get("type") != "function":
        raise unsupported(f"{where}.type", "other than 'function' is not supported")
    if flat:
        spec, extra, at = tool, set(tool) - FUNCTION_FIELDS - {"type"}, where
    else:
        outer = set(tool) - {"type", "function"}
        if outer:
            raise unsupported(f"{where}.{sorted(outer)[0]}")
        inner, at = tool.get("function"), f"{where}.function"
        if not isinstance(inner, dict):
            raise invalid(at, "must be an object")
        spec, extra = inner, set(inner) - FUNCTION_FIELDS
    if extra:
        raise unsupported(f"{at}.{sorted(extra)[0]}")
    return spec


def tool_use(
    functions: list[dict[str, Any]], choice: Any, parallel: Any, *, flat: bool = False
) -> ToolUse:
    """The request's :class:`ToolUse` from ``tool_choice`` and ``parallel_tool_calls``."""
    if parallel not in (None, True, False):
        raise invalid("parallel_tool_calls", "must be a boolean")
    names = tuple(f["name"] for f in functions)
    if choice is None:
        choice = "auto"
    if isinstance(choice, str):
        if choice not in MODES:
            raise invalid("tool_choice", f"must be one of {', '.join(MODES)} or a function")
        return ToolUse(names, choice, parallel is not False)
    if not isinstance(choice, dict) or choice.get("type") != "function":
        raise invalid("tool_choice", "must be none, auto, required or a function")
    name = choice.get("name") if flat else (choice.get("function") or {}).get("name")
    if name not in names:
        raise invalid("tool_choice", f"names no function of tools: {name!r}")
    return ToolUse(names, "function", False, forced=str(name))


def call_schema(functions: list[dict[str, Any]], use: ToolUse) -> dict[str, Any]:
    """The JSON schema a forced call's output is held to (see the module doc)."""
    allowed = [f for f in functions if use.forced is None or f["name"] == use.forced]
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in allowed
    ]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if use.parallel and use.mode == "required":
        return {"type": "array", "items": one, "minItems": 1}
    return one


def job_tools(functions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The job's ``tools`` for :func:`functions_of`'s functions (``strict`` dropped: a
    forced call is held to its schema anyway)."""
    return [
        {"type": "function", "function": {k: v for k, v in f.items() if k != "strict"}}
        for f in functions
    ]


def assistant_calls(calls: Any, where: str) -> list[str]:
    """An assistant message's ``tool_calls``, each as the model writes a call."""
    if not isinstance(calls, list):
        raise invalid(f"{where}.tool_calls", "must be a list")
    out = []
    for j, call in enumerate(calls):
        here = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid(here, "must be {id, type: function, function: {name, arguments}}")
        out.append(call_text(function["name"], _arguments(function.get("arguments"), here)))
    return out


def _arguments(raw: Any, where: str) -> Any:
    if isinstance(raw, dict):
        return raw
    if not isinstance(raw, str):
        raise invalid(f"{where}.function.arguments", "must be a JSON string")
    try:
        return orjson.loads(raw or "{}")
    except orjson.JSONDecodeError:
        return raw  # written back as the model gave it


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text


def parse_calls(text: str, use: ToolUse) -> tuple[str | None, list[Call]]:
    """(the text left as content, or None, and the calls) of one choice's ``text``."""
    names = set(use.names)
    if use.constrained:
        return _parse_forced(text, names)
    calls: list[Call] = []
    kept: list[str] = []
    end = 0
    for match in _BLOCK.finditer(text):
        found = _calls_in(match.group(1), names)
        if found is None:
            continue
        kept.append(text[end : match.start()])
        end = match.end()
        calls += found
    kept.append(text[end:])
    if not calls:
        whole = _calls_in(text.strip().removeprefix(PYTHON_TAG).strip(), names)
        if whole:
            return None, whole
    content = "".join(kept).strip()
    if not use.parallel:
        calls = calls[:1]
    return (content or None) if calls else text, calls


def _parse_forced(text: str, names: set[str]) -> tuple[str | None, list[Call]]:
    found = _calls_in(text.strip(), names)
    return (None, found) if found else (text, [])


def _calls_in(raw: str, names: set[str]) -> list[Call] | None:
    """The calls in one JSON text (an object or a list of them); None unless every item
    is a call of a known function."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    items = data if isinstance(data, list) else [data]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = orjson.loads(arguments)
            except orjson.JSONDecodeError:
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append(Call(str(item["name"]), orjson.dumps(arguments).decode()))
    return calls or None


def call_id(job_id: str, index: int, number: int) -> str:
    """A call's id: stable for a job's choice and call number, unguessable like the job."""
    digest = hashlib.sha256(f"{job_id}:{index}:{number}".encode()).hexdigest()
    return f"call_{digest[:24]}"


def holds_back(text: str) -> int:
    """How many characters at the end of streamed ``text`` might begin a call marker and
    must wait for the next token before they are sent as content."""
    for keep in range(min(len(OPEN), len(text)), 0, -1):
        if OPEN.startswith(text[-keep:]):
            return keep
    return 0


class ContentGate:
    """One choice's streamed text with tools: what may go out as content as it comes
    (text before anything that may be a call), and at the end the content left to send
    and the calls."""

    def __init__(self, use: ToolUse) -> None:
        self.use = use
        self.text = ""
        self.sent = 0

    def feed(self, piece: str) -> str:
        """The content that may go out now, given the next piece of text."""
        self.text += piece
        ready = self._ready()
        if ready <= self.sent:
            return ""
        out = self.text[self.sent : ready]
        self.sent = ready
        return out

    def _ready(self) -> int:
        text = self.text
        if self.use.constrained or text.lstrip()[:1] in ("{", "["):
            return 0  # the whole answer may be a call's JSON
        marker = text.find(OPEN)
        return marker if marker >= 0 else len(text) - holds_back(text)

    def end(self, full: str | None = None) -> tuple[str | None, list[Call], str]:
        """(the choice's content, its calls, the content not sent yet) once it ended;
        ``full`` is its whole text when the final event carries it."""
        text = full or self.text
        content, calls = parse_calls(text, self.use)
        sent = self.text[: self.sent]
        if (content or "").startswith(sent):
            rest = (content or "")[len(sent) :]
        else:
            stripped = sent.strip()
            rest = (content or "")[len(stripped) :] if (content or "").startswith(stripped) else ""
        return content, calls, rest
