"""Batch lines are judged one by one (security finding 7): every bad line is one error
line in OpenAI's shape and every other line runs; a file that is no batch input at all
is refused at upload. A real gateway, the real daemon, a real rq worker. (A line that is
no JSON object, a repeated custom_id or another endpoint's url fails the whole batch at
validation, as OpenAI's does: test_gateway_batches.test_a_batch_with_malformed_lines_...)

Before the fix a line naming another model (gpt-4o) ran and was labelled with it,
duplicate custom_ids and a completions line inside a chat batch were accepted, and one
line of invalid UTF-8 or one deeply nested json_schema failed the whole batch (status
failed, no output or error file) after three rq retries.
"""

from __future__ import annotations

from pathlib import Path

import openai
import orjson
import pytest
import redis
from rq.job import JobStatus
from rq.serializers import JSONSerializer

from batchd.producers.bulk_worker import SafeJob
from batchd.producers.gateway import files as files_module
from batchd.producers.gateway.options import GatewayOptions
from support.edge import KEY_A, MODEL, Edge, chat_line, edge, jsonl, lines_of, start_batch


def deep_line(custom_id: str, depth: int) -> bytes:
    """A chat line whose json_schema nests ``depth`` levels (by hand: orjson itself
    refuses to write past 254)."""
    schema = '{"type": "string"}'
    for _ in range(depth):
        schema = '{"type": "object", "properties": {"a": ' + schema + "}}"
    head = orjson.dumps(chat_line(custom_id, "x"))[:-2]  # without the closing "}}"
    return (
        head
        + b', "response_format": {"type": "json_schema", "json_schema": {"schema": '
        + (schema.encode() + b"}}}}")
    )


# (line, custom_id, status code, error code, param) of each line that must fail alone.
BAD = [
    (chat_line("gpt", "x", model="gpt-4o"), "gpt", 404, "model_not_found", "model"),
    (deep_line("deep", 300), "deep", 400, "invalid_value", "response_format"),
    (deep_line("deeper", 70), "deeper", 400, "invalid_value", "response_format"),
    (chat_line("temp", "x", temperature=-1), "temp", 400, "invalid_value", "temperature"),
    ({"prompt": "a plain batchd job"}, None, 400, "unknown_parameter", "prompt"),
    (chat_line("streamed", "x", stream=True), "streamed", 400, "unsupported_parameter", "stream"),
]


def test_each_bad_line_fails_alone_and_the_rest_run(keyed: Edge) -> None:
    a = keyed.oai(KEY_A)
    lines = [chat_line("good", "hello world", max_tokens=5)]
    lines += [line for line, *_ in BAD]
    lines.append(chat_line("good2", "second", max_tokens=3))
    batch = start_batch(a, jsonl(lines))
    keyed.work()

    done = a.batches.retrieve(batch.id)
    assert done.status == "completed", done
    assert done.request_counts is not None
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (len(lines), 2, len(BAD))
    output = lines_of(a, done.output_file_id)
    assert [o["custom_id"] for o in output] == ["good", "good2"]
    bodies = [o["response"]["body"] for o in output]
    assert [b["model"] for b in bodies] == [MODEL, MODEL]  # the served model's name
    assert bodies[0]["choices"][0]["message"]["content"] == "hello"
    errors = lines_of(a, done.error_file_id)
    assert len(errors) == len(BAD)
    for line, (_, custom_id, status, code, param) in zip(errors, BAD, strict=True):
        assert line["custom_id"] == custom_id and line["error"] is None, line
        assert line["id"].startswith("batch_req_")
        response = line["response"]
        assert response["status_code"] == status, line
        error = response["body"]["error"]
        assert (error["code"], error["param"]) == (code, param), line
        assert error["type"] == "invalid_request_error" and error["message"]
    runner = SafeJob.fetch(
        batch.id, connection=redis.Redis.from_url(keyed.redis_url), serializer=JSONSerializer
    )
    assert runner.get_status() == JobStatus.FINISHED and runner.retries_left == 3  # one go


def test_a_whole_file_problem_is_refused_at_upload(
    keyed: Edge, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = keyed.oai(KEY_A)
    for data in (b"no json here\n", b"\xff\xfe\x00binary\n", b"[1, 2]\n[3]\n", b"\n"):
        with pytest.raises(openai.BadRequestError) as raised:
            a.files.create(file=("in.jsonl", data), purpose="batch")
        assert isinstance(raised.value.body, dict) and raised.value.body["param"] == "file"
    monkeypatch.setattr(files_module, "MAX_BATCH_LINES", 3)
    with pytest.raises(openai.BadRequestError, match="exceed the limit of 3"):
        four = jsonl([chat_line(str(i), "x") for i in range(4)])
        a.files.create(file=("in.jsonl", four), purpose="batch")
    options = GatewayOptions(api_keys=[KEY_A], files_dir=tmp_path, max_file_bytes=1000)
    with edge(keyed.redis_url, options) as small:
        with pytest.raises(openai.APIStatusError) as too_big:
            small.oai(KEY_A).files.create(file=("in.jsonl", b"x" * 5000), purpose="batch")
        assert too_big.value.status_code == 413
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing was stored
