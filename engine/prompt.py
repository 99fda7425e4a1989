"""A request's prompt as token ids, whichever of the three forms it came in.

One function for the engine (admitting a request) and the daemon (checking a
job's prompt before it takes a slot), so both refuse the same inputs with the
same words.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from batchd.engine.chat_tools import described_in_system, renders_tools
from batchd.engine.exceptions import InvalidRequest


def encode_prompt(
    tokenizer: Any,
    request_id: str,
    *,
    prompt: str | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    messages: Sequence[dict[str, Any]] | None = None,
    tools: Sequence[dict[str, Any]] | None = None,
) -> list[int]:
    """Text encoded, chat messages through the model's chat template, ids as given.

    Exactly one of the three; raises InvalidRequest if the prompt is empty or
    the tokenizer refuses it (its own error, whatever its type, is the input's
    fault: a chat template raising on a message it cannot render). ``tools``
    (with messages only) go to a template that renders them, and are described in
    the system message for one that does not (batchd.engine.chat_tools).
    """
    given = [x is not None for x in (prompt, prompt_token_ids, messages)]
    if sum(given) != 1:
        raise InvalidRequest(
            f"request {request_id!r}: give exactly one of prompt, prompt_token_ids, "
            f"messages (got {sum(given)})"
        )
    if tools and messages is None:
        raise InvalidRequest(f"request {request_id!r}: tools apply to chat messages only")
    try:
        if prompt is not None:
            ids = list(tokenizer.encode(prompt))
        elif messages is not None:
            ids = list(_chat_ids(tokenizer, messages, tools))
        else:
            ids = [int(t) for t in prompt_token_ids or ()]
    except Exception as exc:
        raise InvalidRequest(f"request {request_id!r}: cannot tokenize: {exc}") from exc
    if not ids:
        raise InvalidRequest(f"request {request_id!r}: the prompt is empty")
    return ids


def _chat_ids(
    tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
) -> Any:
    if not tools:
        return tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True
        )
    if renders_tools(tokenizer):
        return tokenizer.apply_chat_template(
            list(messages), tools=list(tools), add_generation_prompt=True, tokenize=True
        )
    return tokenizer.apply_chat_template(
        described_in_system(messages, tools), add_generation_prompt=True, tokenize=True
    )


def check_ids(request_id: str, ids: Sequence[int], vocab_size: int) -> None:
    """Raise InvalidRequest naming the ids outside the model's vocabulary, if any."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(
            f"request {request_id!r}: token ids {bad[:5]} outside the vocabulary [0, {vocab_size})"
        )
