"""The online endpoints driven by the official openai package (sync and async), against
a real redis-server and a real daemon on the tiny model."""

from __future__ import annotations

import asyncio
from typing import Any

import openai

from producers.client import Client

MODEL = "tiny"
HELLO = [{"role": "user", "content": "Hello there"}]


def test_chat_completion_is_the_jobs_text(gateway: Any, oai: openai.OpenAI) -> None:
    reply = oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert reply.usage is not None and reply.usage.completion_tokens == 12
    client = Client(gateway.redis_url)
    direct = client.submit(messages=HELLO, max_tokens=12, temperature=0.0)
    assert direct.result(timeout=60).text == choice.message.content
    assert client.status(reply.id.removeprefix("chatcmpl-")).state.value == "finished"
