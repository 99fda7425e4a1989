"""Tools reach the model: through a chat template that renders them, described in the
system message for one that does not (the tiny fixture's template, like SmolLM2's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import batchd.engine.preload  # noqa: F401  (OpenBLAS before MLX)

import pytest

from batchd.engine.chat_tools import renders_tools, tools_block
from batchd.engine.exceptions import InvalidRequest
from batchd.engine.models.loader import load
from batchd.engine.prompt import encode_prompt

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
# A template that reads ``tools``, in the shape Qwen2.5's takes (a tools section first).
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>tools\n{% for t in tools %}{{ t.function.name }}: "
    "{{ t.function.description }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Rome?"}]


@pytest.fixture
def tokenizer(tiny_model: Path) -> Any:
    """The engine's tokenizer (mlx-lm's wrapper) of the tiny fixture."""
    return load(str(tiny_model)).tokenizer


def set_template(tokenizer: Any, template: Any) -> None:
    tokenizer._tokenizer.chat_template = template  # the wrapped Hugging Face tokenizer's


def text_of(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids))


def test_a_template_that_reads_tools_renders_them_itself(tokenizer: Any) -> None:
    set_template(tokenizer, TOOLS_TEMPLATE)
    assert renders_tools(tokenizer)
    ids = encode_prompt(tokenizer, "r", messages=MESSAGES, tools=[WEATHER])
    text = text_of(tokenizer, ids)
    assert "<|im_start|>tools\nget_weather: The weather in a city." in text
    assert "<tools>" not in text  # not described a second time
    plain = text_of(tokenizer, encode_prompt(tokenizer, "r", messages=MESSAGES))
    assert "get_weather" not in plain


def test_a_template_without_tools_gets_them_in_the_system_message(tokenizer: Any) -> None:
    assert not renders_tools(tokenizer)  # the fixture's template, as SmolLM2's, has none
    text = text_of(tokenizer, encode_prompt(tokenizer, "r", messages=MESSAGES, tools=[WEATHER]))
    system = f"<|im_start|>system\nBe brief.\n\n{tools_block([WEATHER])}<|im_end|>"
    assert system in text
    assert '"name":"get_weather"' in text and "<tool_call>" in text
    # Without a system message, one is added first.
    alone = encode_prompt(tokenizer, "r", messages=MESSAGES[1:], tools=[WEATHER])
    assert text_of(tokenizer, alone).index("# Tools") < text_of(tokenizer, alone).index("Rome?")


def test_tools_need_chat_messages(tokenizer: Any) -> None:
    with pytest.raises(InvalidRequest, match="tools apply to chat messages only"):
        encode_prompt(tokenizer, "r", prompt="Rome?", tools=[WEATHER])


def test_named_templates_and_broken_ones(tokenizer: Any) -> None:
    set_template(tokenizer, {"default": TOOLS_TEMPLATE, "rag": "{{ documents }}"})
    assert renders_tools(tokenizer)
    set_template(tokenizer, "{% for m in messages %}")  # unclosed: the tokenizer refuses it
    assert not renders_tools(tokenizer)
    with pytest.raises(InvalidRequest, match="cannot tokenize"):
        encode_prompt(tokenizer, "r", messages=MESSAGES, tools=[WEATHER])
