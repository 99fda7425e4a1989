"""OpenAI Batch API lines: one request each in, one response each out.

An input line is exactly ``{"custom_id", "method": "POST", "url", "body"}``; its body is
mapped as the online endpoint maps it (:mod:`batchd.producers.gateway.params`), so a
batch refuses what an online request would, and a line can never name a job id.
As OpenAI does, a gateway batch is validated whole before any line runs
(:func:`validation_errors`): a line that is not a JSON object, a repeated ``custom_id``
or a url other than the batch's endpoint fails the batch, each named in its ``errors``.
Then :class:`BatchLines` judges each line alone: a model the fleet does not serve or an
invalid body becomes one error record, and the others run. Its jobs' ids are an
HMAC of the line under the batch's secret (unguessable, and the same on a rerun), and
they belong to the batch's key. :func:`output_line` makes OpenAI's output or error
line of each record. No web framework here: the bulk worker imports this module.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable, Iterable
from typing import Any

import orjson

from batchd.config.limits import LimitSettings
from batchd.producers.bulk_run import LineSource
from batchd.producers.errors import ValidationError
from batchd.producers.gateway.errors import APIError
from batchd.producers.gateway.fleet import split_adapter
from batchd.producers.gateway.params import chat_request, completion_request, fill_max_tokens
from batchd.producers.gateway.refusals import failed, param_of
from batchd.producers.gateway.shapes import (
    CHAT,
    TEXT,
    add_prompt_logprobs,
    completion_id,
    finish_with_calls,
    tool_calls,
    usage_dict,
)
from batchd.producers.gateway.tools.calls import ToolUse, parse_calls
from batchd.producers.schema import JobRequest, Usage, validate_job

ENDPOINTS = {"/v1/chat/completions": CHAT, "/v1/completions": TEXT}
MAPPERS = {CHAT: chat_request, TEXT: completion_request}
LINE_FIELDS = ("custom_id", "method", "url", "body")
MAX_CUSTOM_ID_CHARS = 512
# The most lines a failed validation names (its errors live in the batch's record).
MAX_VALIDATION_ERRORS = 100


class LineError(ValidationError):
    """A batch line refused: ``field`` is the parameter, ``code`` and ``status`` what
    OpenAI's API would answer for it online."""

    def __init__(
        self, field: str, message: str, *, code: str = "invalid_value", status: int = 400
    ) -> None:
        super().__init__(field, message)
        self.code = code
        self.status = status


def is_openai_line(data: dict[str, Any]) -> bool:
    return "custom_id" in data and "body" in data


def custom_id_of(line: str | bytes) -> dict[str, Any]:
    """``{"custom_id": ...}`` of a line that failed to parse, when it has a string one (so
    its error line can still be matched to its request)."""
    try:
        data = orjson.loads(line)
    except orjson.JSONDecodeError:
        return {}
    if isinstance(data, dict) and isinstance(data.get("custom_id"), str):
        return {"custom_id": data["custom_id"]}
    return {}


def openai_job(
    data: dict[str, Any], *, endpoint: str | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(job fields, what the result line echoes) of one line; LineError naming the
    param. With ``endpoint``, the line's url must be it (a batch has one endpoint)."""
    extra = sorted(set(data) - set(LINE_FIELDS))
    if extra:
        raise LineError(extra[0], "is not a field of a batch line", code="unknown_parameter")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID_CHARS:
        raise LineError("custom_id", f"must be a string of 1 to {MAX_CUSTOM_ID_CHARS} characters")
    if data.get("method", "POST") != "POST":
        raise LineError("method", "only POST is supported")
    url = data.get("url")
    kind = ENDPOINTS.get(url) if isinstance(url, str) else None
    if kind is None:
        raise LineError("url", f"must be one of {', '.join(ENDPOINTS)}", code="invalid_url")
    if endpoint is not None and url != endpoint:
        raise LineError("url", f"must be the batch's endpoint {endpoint}", code="invalid_url")
    body = data.get("body")
    if not isinstance(body, dict):
        raise LineError("body", "must be a JSON object")
    try:
        mapped = MAPPERS[kind](dict(body))
    except APIError as exc:
        param = exc.param or "body"
        message = exc.message.removeprefix(f"{param}: ")
        raise LineError(param, message, code=exc.code or "invalid_value") from None
    if mapped.stream:
        raise LineError("stream", "a batch request cannot stream", code="unsupported_parameter")
    # A batch's output lines carry the texts, not the prompt or alternatives.
    alternatives = mapped.top_logprobs > (1 if kind == TEXT else 0)
    if mapped.echo is not None or alternatives:
        param = (
            "echo" if mapped.echo is not None else "logprobs" if kind == TEXT else "top_logprobs"
        )
        why = "is not supported in a batch (its output lines carry no logprobs)"
        raise LineError(param, why, code="unsupported_parameter")
    echo: dict[str, Any] = {"custom_id": custom_id, "url": url, "model": mapped.model}
    if mapped.tools is not None:
        echo["tools"] = mapped.tools.to_dict()
    return mapped.job, echo


def validation_errors(lines: Iterable[tuple[int, bytes]], endpoint: str) -> list[dict[str, Any]]:
    """OpenAI's ``errors.data`` (``{code, message, param, line}``) of the (line number,
    bytes) ``lines`` that fail a batch of ``endpoint`` before it runs, at most
    :data:`MAX_VALIDATION_ERRORS`; empty when it may run. Memory: its custom_ids."""
    errors: list[dict[str, Any]] = []
    first: dict[str, int] = {}  # custom_id -> the line that has it
    for line_no, raw in lines:
        fault = _line_fault(line_no, raw, endpoint, first)
        if fault is not None:
            code, param, message = fault
            errors.append({"code": code, "message": message, "param": param, "line": line_no})
            if len(errors) == MAX_VALIDATION_ERRORS:
                break
    return errors


def _line_fault(
    line_no: int, raw: bytes, endpoint: str, first: dict[str, int]
) -> tuple[str, str | None, str] | None:
    """(code, param, message) of what fails the batch in one line, or None."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return "invalid_json_line", None, f"This line is not parseable as valid JSON: {exc}"
    if not isinstance(data, dict):
        why = f"This line is a JSON {type(data).__name__}, not an object ({', '.join(LINE_FIELDS)})"
        return "invalid_json_line", None, why
    custom_id = data.get("custom_id")
    if isinstance(custom_id, str) and first.setdefault(custom_id, line_no) != line_no:
        why = (
            f"The custom_id {custom_id[:64]!r} repeats the one of line {first[custom_id]}: "
            "custom_id must be unique in a batch"
        )
        return "duplicate_custom_id", "custom_id", why
    url = data.get("url")
    if isinstance(url, str) and url != endpoint:  # no url at all: that line's own error
        return "invalid_url", "url", f"The url {url[:64]!r} is not the batch's endpoint {endpoint}"
    return None


class ServedModels:
    """The fleet's model names (:func:`~batchd.producers.gateway.fleet.names`), read
    again at most every ``refresh_s`` when a line names one not seen yet."""

    def __init__(self, read: Callable[[], dict[str, str]], *, refresh_s: float = 2.0) -> None:
        self.read = read
        self.refresh_s = refresh_s
        self.names: dict[str, str] = {}
        self.read_at = -float("inf")

    def resolve(self, requested: str) -> str | None:
        if requested not in self.names and time.monotonic() - self.read_at > self.refresh_s:
            self.names, self.read_at = self.read(), time.monotonic()
        return self.names.get(requested)


class BatchLines(LineSource):
    """The lines of one gateway batch (see the module doc)."""

    def __init__(
        self,
        *,
        endpoint: str,
        secret: str,
        key_id: str,
        models: ServedModels,
        limits: LimitSettings | None,
        default_max_tokens: int | None = None,
    ) -> None:
        self.default_max_tokens = default_max_tokens
        self.endpoint = endpoint
        self.secret = secret.encode()
        self.key_id = key_id
        self.models = models
        self.limits = limits

    def job_id(self, line_no: int, raw: bytes) -> str:
        mac = hmac.new(self.secret, str(line_no).encode() + b"\0" + raw, hashlib.sha256)
        return "b" + mac.hexdigest()[:40]

    def job(self, line_no: int, raw: bytes) -> tuple[JobRequest, dict[str, Any]]:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise LineError(
                "line", f"not UTF-8 (byte {exc.start})", code="invalid_encoding"
            ) from None
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise LineError("line", f"invalid JSON: {exc}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise LineError("line", f"expected a JSON object, got {type(data).__name__}")
        fields, echo = openai_job(data, endpoint=self.endpoint)
        model = self.models.resolve(echo["model"])
        if model is None:
            raise LineError(
                "model",
                f"the model {echo['model']!r} does not exist or no live daemon serves it",
                code="model_not_found",
                status=404,
            )
        echo["model"] = model
        adapter = split_adapter(model, self.models.names)[1]
        if adapter is not None:
            fields["adapter"] = adapter
        if self.default_max_tokens is not None:
            fill_max_tokens(
                fields, default=self.default_max_tokens, limits=self.limits, context=None
            )
        if fields.get("logit_bias"):
            echo["bias_ids"] = [int(t) for t in fields["logit_bias"] if str(t).isdigit()]
        try:
            job = validate_job({**fields, "id": self.job_id(line_no, raw)}, self.limits)
        except ValidationError as exc:
            raise LineError(param_of(exc.field), exc.message) from None
        return job, echo

    def refused(self, line_no: int, raw: bytes, exc: ValidationError) -> dict[str, Any]:
        return {
            "line": line_no,
            **custom_id_of(raw),
            "error": str(exc),  # "<param>: <why>", as the online API says it
            "field": exc.field,
            "code": getattr(exc, "code", "invalid_value"),
            "status": getattr(exc, "status", 400),
        }

    def remember(self, line_no: int, raw: bytes, record: dict[str, Any]) -> None:
        """Nothing to carry: custom_ids were checked over the whole file before the run
        (:func:`validation_errors`)."""


def output_line(record: dict[str, Any], *, created: int) -> tuple[bool, dict[str, Any]]:
    """(succeeded, OpenAI output line) of one bulk result record.

    A request the API refused (a bad line, a failed job) has a ``response`` with the
    status and error body the online API answers; a request that never ran (the batch
    expired or was cancelled first) has ``response`` null and an ``error``."""
    job_id = record.get("id") or f"line-{record['line']}"
    line: dict[str, Any] = {"id": f"batch_req_{job_id}", "custom_id": record.get("custom_id")}
    kind = ENDPOINTS.get(str(record.get("url")), CHAT)
    if "error" in record:
        line["response"], line["error"] = None, None
        reason = record.get("reason")
        if record.get("code") == "batch_expired" or reason in ("cancelled", "expired"):
            code = record.get("code") or f"batch_{reason}"
            line["error"] = {"code": code, "message": record["error"]}
        else:
            error = _error_of(record, kind)
            line["response"] = {
                "status_code": error.status,
                "request_id": job_id,
                "body": error.body(),
            }
        return False, line
    use = ToolUse.from_dict(record["tools"]) if record.get("tools") else None
    choices = []
    for index, end in enumerate(record.get("choices") or [record]):
        choice: dict[str, Any] = {
            "index": end.get("index", index),
            "finish_reason": end["finish_reason"],
            "logprobs": None,
        }
        if kind == CHAT and use is not None:
            content, calls = parse_calls(end["text"], use)
            choice["finish_reason"] = finish_with_calls(end["finish_reason"], calls)
            choice["message"] = {"role": "assistant", "content": content}
            if calls:
                choice["message"]["tool_calls"] = tool_calls(job_id, choice["index"], calls)
        elif kind == CHAT:
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


def _error_of(record: dict[str, Any], kind: str) -> APIError:
    """The online API's error for a refused line or a failed job."""
    if record.get("reason") is not None:
        return failed(
            str(record.get("id")),
            str(record["reason"]),
            record.get("detail"),
            kind=kind,
            bias_ids=record.get("bias_ids") or (),
        )
    field = record.get("field")
    status = int(record.get("status") or 400)
    code = record.get("code") or "invalid_value"
    return APIError(status, str(record["error"]), param=field, code=code)
