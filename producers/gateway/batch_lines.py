"""OpenAI Batch API lines: one request each in, one response each out.

An input line is ``{"custom_id", "method": "POST", "url", "body"}``; its body is
mapped exactly as the online endpoint maps it (:mod:`batchd.producers.gateway.params`),
so a batch refuses what an online request would. The result line batchd's bulk
run writes for it keeps ``custom_id``, ``url`` and ``model``, from which
:func:`output_line` makes OpenAI's output or error line. No web framework here:
the bulk worker imports this module.
"""

from __future__ import annotations

from typing import Any

import orjson

from batchd.producers.errors import ValidationError
from batchd.producers.gateway.errors import APIError
from batchd.producers.gateway.params import chat_request, completion_request
from batchd.producers.gateway.shapes import (
    CHAT,
    TEXT,
    add_prompt_logprobs,
    completion_id,
    usage_dict,
)
from batchd.producers.schema import Usage

ENDPOINTS = {"/v1/chat/completions": CHAT, "/v1/completions": TEXT}
MAPPERS = {CHAT: chat_request, TEXT: completion_request}


def is_openai_line(data: dict[str, Any]) -> bool:
    return "custom_id" in data and "body" in data


def custom_id_of(line: str) -> dict[str, Any]:
    """``{"custom_id": ...}`` of a line that failed to parse, when it has one (so its error
    line can still be matched to its request)."""
    try:
        data = orjson.loads(line)
    except orjson.JSONDecodeError:
        return {}
    return (
        {"custom_id": data["custom_id"]} if isinstance(data, dict) and "custom_id" in data else {}
    )


def openai_job(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(job fields, what the result line echoes); raises ValidationError naming the param."""
    echo = {"custom_id": data.get("custom_id"), "url": data.get("url")}
    if not isinstance(echo["custom_id"], str):
        raise ValidationError("custom_id", "must be a string")
    if data.get("method", "POST") != "POST":
        raise ValidationError("method", "only POST is supported", value=data.get("method"))
    kind = ENDPOINTS.get(str(data.get("url")))
    if kind is None:
        raise ValidationError(
            "url", f"must be one of {', '.join(ENDPOINTS)}", value=data.get("url")
        )
    body = data.get("body")
    if not isinstance(body, dict):
        raise ValidationError("body", "must be a JSON object")
    try:
        mapped = MAPPERS[kind](dict(body))
    except APIError as exc:
        raise ValidationError(exc.param or "body", exc.message) from None
    if mapped.stream:
        raise ValidationError("stream", "a batch request cannot stream")
    echo["model"] = mapped.model
    return mapped.job, echo


def output_line(record: dict[str, Any], *, created: int) -> tuple[bool, dict[str, Any]]:
    """(succeeded, OpenAI output line) of one bulk result record."""
    job_id = record.get("id") or f"line-{record['line']}"
    line: dict[str, Any] = {"id": f"batch_req_{job_id}", "custom_id": record.get("custom_id")}
    if "error" in record:
        reason = record.get("reason")
        code = record.get("code") or (f"job_{reason}" if reason else "invalid_request")
        line["response"] = None
        line["error"] = {"code": code, "message": record["error"]}
        return False, line
    kind = ENDPOINTS.get(str(record.get("url")), CHAT)
    choices = []
    for index, end in enumerate(record.get("choices") or [record]):
        choice: dict[str, Any] = {
            "index": end.get("index", index),
            "finish_reason": end["finish_reason"],
            "logprobs": None,
        }
        if kind == CHAT:
            choice["message"] = {"role": "assistant", "content": end["text"]}
        else:
            choice["text"] = end["text"]
        choices.append(choice)
    usage = record.get("usage") or {}
    body = {
        "id": completion_id(kind, job_id),
        "object": kind,
        "created": created,
        "model": record.get("model"),
        "choices": choices,
        "usage": usage_dict(Usage.model_validate(usage) if usage else None),
    }
    if record.get("prompt_logprobs"):
        add_prompt_logprobs(kind, body, record["prompt_logprobs"])
    line["response"] = {"status_code": 200, "request_id": job_id, "body": body}
    line["error"] = None
    return True, line
