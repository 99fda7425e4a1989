"""Function tools shown to a chat model: through its chat template, or described for it.

A chat template that reads ``tools`` (Qwen2.5 and Qwen3, Llama 3.1+, Mistral's, Hermes
models') writes them in the words and format its model was trained on, so the tools go
to the template as they are. A template that does not (SmolLM2's, most base models') would
drop them silently: then they are described in the system message in the Hermes format
(Qwen2.5's own words), which the gateway's tool-call reader understands, so a model
without native tools still sees them and can answer with ``<tool_call>`` blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.meta
import orjson


def renders_tools(tokenizer: Any) -> bool:
    """Whether ``tokenizer``'s chat template reads the ``tools`` variable."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one renders chats
        template = template.get("default")
    return isinstance(template, str) and _reads_tools(template)


@lru_cache(maxsize=16)
def _reads_tools(template: str) -> bool:
    try:
        parsed = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return False  # the tokenizer refuses to render it anyway, with its own error
    return "tools" in jinja2.meta.find_undeclared_variables(parsed)


def tools_block(tools: Sequence[dict[str, Any]]) -> str:
    """The tools' description, as Qwen2.5's chat template writes it."""
    lines = "\n".join(orjson.dumps(tool).decode() for tool in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def described_in_system(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """``messages`` with the tools described in the system message (added when none)."""
    block = tools_block(tools)
    if messages and messages[0]["role"] == "system":
        first = messages[0]["content"]
        return [{**messages[0], "content": f"{first}\n\n{block}"}, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]
