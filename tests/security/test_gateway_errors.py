"""The caller's mistakes are OpenAI-shaped 4xx answers, never 500s (security finding 6).

Before the fix, with no keys configured, ``GET /v1/files/x`` answered 200 ``{}``; the
content, batch, cancel and create calls on unknown ids answered 500 (which the OpenAI
SDK retries); a json_schema nested 300 deep raised a TypeError (500 online, a bare
TypeError from Client.submit); and /v1/models showed the model's local path. A daemon
refusing out-of-vocabulary token ids is checked on the real engine in
tests/producers/gateway/test_gateway_refusals.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from batchd.producers.client import Client
from batchd.producers.errors import TooComplex
from support.edge import MODEL, Edge, jsonl

CHAT = "/v1/chat/completions"


def nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def deep_chat(depth: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"schema": nested_schema(depth)}},
    }


BATCH = {"endpoint": CHAT, "completion_window": "24h"}
# (method, path, JSON body or upload, status, error code, param)
TABLE: list[tuple[str, str, Any, int, str, str | None]] = [
    ("GET", "/v1/files/file-nope", None, 404, "file_not_found", "file_id"),
    ("GET", "/v1/files/file-nope/content", None, 404, "file_not_found", "file_id"),
    ("DELETE", "/v1/files/file-nope", None, 404, "file_not_found", "file_id"),
    ("GET", "/v1/files/a:b:c", None, 404, "file_not_found", "file_id"),
    ("GET", "/v1/batches/batch-nope", None, 404, "batch_not_found", "batch_id"),
    ("POST", "/v1/batches/batch-nope/cancel", None, 404, "batch_not_found", "batch_id"),
    ("GET", "/v1/batches/x:stop", None, 404, "batch_not_found", "batch_id"),
    ("GET", "/v1/batches?after=batch-nope", None, 404, "batch_not_found", "after"),
    (
        "POST",
        "/v1/batches",
        {"input_file_id": "file-nope", **BATCH},
        404,
        "file_not_found",
        "input_file_id",
    ),
    ("POST", "/v1/batches", {"input_file_id": 7, **BATCH}, 400, "invalid_value", "input_file_id"),
    ("POST", "/v1/batches", {"input_file_id": "f"}, 400, "invalid_value", "endpoint"),
    (
        "POST",
        "/v1/batches",
        {"input_file_id": "f", **BATCH, "completion_window": "1h"},
        400,
        "invalid_value",
        "completion_window",
    ),
    (
        "POST",
        "/v1/batches",
        {"input_file_id": "f", **BATCH, "metadata": {"k": 1}},
        400,
        "invalid_value",
        "metadata.k",
    ),
    (
        "POST",
        "/v1/batches",
        {"input_file_id": "f", **BATCH, "output_expires_after": {"anchor": "x", "seconds": 9}},
        400,
        "invalid_value",
        "output_expires_after.anchor",
    ),
    (
        "POST",
        "/v1/batches",
        {"input_file_id": "f", **BATCH, "id": "x"},
        400,
        "unknown_parameter",
        "id",
    ),
    ("GET", "/v1/batches?limit=0", None, 400, "invalid_value", "limit"),
    ("POST", "/v1/files", ("batch", b"not json at all\n"), 400, "invalid_value", "file"),
    ("POST", "/v1/files", ("batch", b"\n\n"), 400, "invalid_value", "file"),
    ("POST", "/v1/files", ("fine-tune", jsonl([{"a": 1}])), 400, "invalid_value", "purpose"),
    (
        "POST",
        "/v1/files?expires",
        ("batch", jsonl([{"a": 1}])),
        400,
        "invalid_value",
        "expires_after.seconds",
    ),
    ("POST", CHAT, b"{not json", 400, "invalid_json", None),
    ("POST", CHAT, deep_chat(300), 400, "invalid_value", "response_format"),
    ("POST", CHAT, deep_chat(70), 400, "invalid_value", "response_format"),
    ("POST", CHAT, {**deep_chat(1), "model": "gpt-4o"}, 404, "model_not_found", "model"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": [-1]}, 400, "invalid_value", "prompt"),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "code", "param"),
    TABLE,
    ids=[f"{m} {p} {s}" for m, p, _, s, _, _ in TABLE],
)
def test_error_shapes(
    keyless: Edge,
    method: str,
    path: str,
    body: Any,
    status: int,
    code: str,
    param: str | None,
) -> None:
    with keyless.http() as http:
        if isinstance(body, tuple):
            purpose, data = body
            form = {"purpose": purpose}
            if path.endswith("?expires"):
                form |= {"expires_after[anchor]": "created_at", "expires_after[seconds]": "5"}
            reply = http.post("/v1/files", data=form, files={"file": ("in.jsonl", data)})
        elif isinstance(body, bytes):
            reply = http.request(method, path, content=body)
        else:
            reply = http.request(method, path, json=body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error
    assert error["type"] == "invalid_request_error" and error["message"]


def test_models_never_show_a_local_path(keyless: Edge) -> None:
    with keyless.http() as http:
        listed = http.get("/v1/models").json()["data"]
    assert [m["id"] for m in listed] == [MODEL]
    assert all("/" not in str(m) for m in listed)


def test_a_deep_schema_is_a_clear_value_error_in_the_client(keyless: Edge) -> None:
    client = Client(keyless.redis_url)
    response_format = {"type": "json_schema", "json_schema": nested_schema(300)}
    with pytest.raises(TooComplex, match="nested deeper than 64 levels") as raised:
        client.submit("x", response_format=response_format)
    assert isinstance(raised.value, ValueError)
    assert raised.value.field == "response_format.json_schema"
