"""A job that ended without a completion, as the error OpenAI's API gives for the case.

A daemon refuses a request's own content at admission (a prompt too long for the
model, token ids outside its vocabulary, a chat request to a model without a chat
template): that is the caller's mistake, a 400 naming the parameter, never a 500
(which SDKs retry). What is left (a cancelled, expired or failed job) keeps its
status. Shared by the online endpoints and the Batch API's output lines; no web
framework here.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any

from batchd.producers.gateway.errors import APIError, invalid
from batchd.producers.gateway.shapes import CHAT
from batchd.producers.schema import JobRequest

FAILED_STATUS = {"error": 500, "cancelled": 409, "expired": 504}
# Job fields whose OpenAI parameter has another name.
_PARAM_OF = {"prompt_token_ids": "prompt"}
# The engine's refusals of a request's own tokens (batchd.engine.llm_engine).
_OUT_OF_VOCAB = re.compile(r"token ids \[([0-9, ]*)\] outside the vocabulary")
_NO_ROOM = "leaves no room in max_model_len"
# OpenAI's code for a prompt plus max_tokens longer than the model's context.
CONTEXT_EXCEEDED = "context_length_exceeded"


def param_of(field: str) -> str:
    """The request parameter behind a job field a validation error names
    (``prompt_token_ids.3`` is ``prompt``; ``temperature`` is ``temperature``)."""
    top = field.split(".", 1)[0]
    return _PARAM_OF.get(top, top)


def failed(
    job_id: str,
    reason: str,
    error: str | None,
    *,
    kind: str,
    bias_ids: Collection[int] = (),
) -> APIError:
    """The error of a job that ended ``reason`` (error, cancelled, expired) with the
    daemon's ``error`` text; ``bias_ids`` are the request's logit_bias token ids."""
    refused = _refusal(error or "", kind=kind, bias_ids=bias_ids) if reason == "error" else None
    if refused is not None:
        return refused
    detail = f": {error}" if error else ""
    return APIError(
        FAILED_STATUS.get(reason, 500),
        f"job {job_id} ended {reason}{detail}",
        type="server_error" if reason == "error" else "invalid_request_error",
        code=f"job_{reason}",
    )


def _refusal(error: str, *, kind: str, bias_ids: Collection[int]) -> APIError | None:
    prompt = "messages" if kind == CHAT else "prompt"
    field = error.split(":", 1)[0]
    if field in JobRequest.model_fields:  # a refusal naming the job field at fault first
        return invalid(prompt if field == "prompt" else field, f"refused by the daemon: {error}")
    vocab = _OUT_OF_VOCAB.search(error)
    if vocab is not None:
        bad = {int(t) for t in vocab.group(1).split(",") if t.strip()}
        param = "logit_bias" if bad & set(bias_ids) else prompt
        return invalid(param, f"token ids {sorted(bad)} are outside the model's vocabulary")
    if _NO_ROOM in error:
        return APIError(
            400,
            f"too long for the model: {error.split(': ', 1)[-1]}",
            param=prompt,
            code=CONTEXT_EXCEEDED,
        )
    return None


def context_exceeded(job: Mapping[str, Any], context: int | None) -> APIError | None:
    """OpenAI's refusal of a request that cannot fit the model's context length
    (``context``: live daemons' ``max_model_len``), or None. The gateway has no
    tokenizer: it counts the prompt where the request gives token ids, else at least
    one token. A text prompt that leaves no room is refused by the daemon with the same
    code (:func:`failed`); one that leaves less room than max_tokens ends at the context
    length (finish_reason ``length``)."""
    max_tokens = job.get("max_tokens")
    if not context or not isinstance(max_tokens, int):
        return None
    ids = job.get("prompt_token_ids")
    prompt = len(ids) if isinstance(ids, list) else None
    if (prompt or 1) + max_tokens <= context:
        return None
    param = "messages" if "messages" in job else "prompt"
    asked = (
        f"{prompt + max_tokens} tokens ({prompt} in the {param}, {max_tokens} in the completion)"
        if prompt is not None
        else f"at least {max_tokens + 1} tokens ({max_tokens} in the completion)"
    )
    return APIError(
        400,
        f"This model's maximum context length is {context} tokens. However, you requested "
        f"{asked}. Please reduce the length of the {param} or completion.",
        param=param,
        code=CONTEXT_EXCEEDED,
    )
