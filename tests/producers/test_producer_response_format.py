"""Structured output and the sampling controls on the wire: a bad response_format, bias or
penalty is refused at submit, naming the field and the problem, and nothing is enqueued;
a good one travels to the daemon as the engine's keyword arguments."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import fakeredis
import pytest

from batchd.daemon.cli import main
from batchd.producers.client import Client
from batchd.producers.errors import ValidationError
from batchd.producers.schema import JobRequest, parse_job
from support.redis_server import RedisServer
from support.schemas import LENIENT_ONLY

SCHEMA = {
    "type": "object",
    "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
    "required": ["tags"],
}


@pytest.mark.parametrize(
    ("options", "field", "problem"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"type": "strnig"}}},
            "response_format",
            "strnig",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"$ref": "#/nowhere"}}},
            "response_format",
            "nowhere",
        ),
        (
            {"response_format": {"type": "regex", "regex": "a(b"}},
            "response_format",
            "unclosed group",
        ),
        (
            {"response_format": {"type": "gbnf", "grammar": 'root ::= "a" b'}},
            "response_format",
            "not found",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "takes json_schema"),
        (
            {"response_format": {"type": "json_object", "regex": "x"}},
            "response_format",
            "no other field",
        ),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias", "not a token id"),
        ({"logit_bias": {"12": 101.0}}, "logit_bias", "not a token id"),
        ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal"),
        ({"min_tokens": -1}, "min_tokens", "greater than or equal"),
    ],
)
def test_refused_at_submit_naming_the_problem(
    fake_redis: fakeredis.FakeRedis, options: dict[str, Any], field: str, problem: str
) -> None:
    with pytest.raises(ValidationError) as err:
        Client(fake_redis).submit("hi", **options)
    assert err.value.field.startswith(field) and problem in str(err.value), str(err.value)
    assert fake_redis.keys("*") == []


@pytest.mark.parametrize("keyword", sorted(LENIENT_ONLY))
def test_lenient_schema_keywords_are_refused_unless_opted_in(
    fake_redis: fakeredis.FakeRedis, keyword: str
) -> None:
    """A keyword the grammar cannot enforce is refused clearly (naming it and the option),
    and accepted with ``lenient``, which reaches the daemon."""
    schema = LENIENT_ONLY[keyword]
    client = Client(fake_redis)
    with pytest.raises(ValidationError) as err:
        client.submit("hi", response_format={"type": "json_schema", "json_schema": schema})
    assert err.value.field == "response_format"
    assert keyword in str(err.value) and "lenient: true accepts it" in str(err.value)
    assert fake_redis.keys("*") == []
    lenient = {"type": "json_schema", "json_schema": schema, "lenient": True}
    client.submit("hi", response_format=lenient)
    (entry,) = fake_redis.xrange("batchd:queue:default")
    fmt = parse_job(entry[1][b"job"]).response_format
    assert fmt is not None and fmt.lenient
    with pytest.raises(ValidationError, match="lenient applies to type json_schema"):
        client.submit("hi", response_format={"type": "regex", "regex": "a", "lenient": True})


def test_a_valid_request_reaches_the_engine_fields(fake_redis: fakeredis.FakeRedis) -> None:
    job = Client(fake_redis).submit(
        "hi",
        response_format={"type": "json_schema", "json_schema": SCHEMA},
        logit_bias={"12": -100.0, "7": 2.5},
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        min_tokens=3,
        penalty_window=20,
        sampling_order="filters_first",
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        token_texts=True,
    )
    (entry,) = fake_redis.xrange("batchd:queue:default")
    request = parse_job(entry[1][b"job"])
    assert request.id == job.id
    sampling = request.sampling()
    assert sampling["logit_bias"] == ((12, -100.0), (7, 2.5))
    assert (
        sampling["presence_penalty"],
        sampling["frequency_penalty"],
        sampling["min_tokens"],
    ) == (0.5, -0.25, 3)
    assert {k: sampling[k] for k in ("penalty_window", "sampling_order")} == {
        "penalty_window": 20,
        "sampling_order": "filters_first",
    }
    assert not sampling["skip_special_tokens"] and not sampling["spaces_between_special_tokens"]
    assert sampling["token_texts"]
    # The defaults are OpenAI's penalties, vLLM's order and special-token handling.
    defaults = JobRequest(prompt="hi").sampling()
    assert defaults["penalty_window"] is None and defaults["sampling_order"] == "temperature_first"
    assert defaults["skip_special_tokens"] and defaults["spaces_between_special_tokens"]
    assert request.response_format is not None
    assert json.loads(request.response_format.source()) == SCHEMA


def test_every_kind_is_accepted() -> None:
    for fmt in (
        {"type": "json_object"},
        {"type": "regex", "regex": "[0-9]{3}"},
        {"type": "lark", "grammar": 'start: "yes" | "no"'},
        {"type": "gbnf", "grammar": 'root ::= "yes" | "no"'},
    ):
        assert JobRequest.model_validate({"prompt": "x", "response_format": fmt}).response_format


def test_cli_options(
    redis_server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    common = ["--redis-url", redis_server.url, "submit", "hi"]
    controls = ["--presence-penalty", "0.5", "--frequency-penalty", "0.25", "--min-tokens", "2"]
    bias = ["--logit-bias", "12=-100", "--logit-bias", "7=2.5"]
    assert main([*common, "--id", "a", "--json-schema", str(schema_file), *controls, *bias]) == 0
    regex = '{"type": "regex", "regex": "[0-9]+"}'
    assert main([*common, "--id", "b", "--response-format", regex]) == 0
    requests = [
        parse_job(fields[b"job"])
        for _, fields in redis_server.client().xrange("batchd:queue:default")
    ]
    assert requests[0].response_format and requests[0].response_format.json_schema == SCHEMA
    assert requests[0].sampling()["logit_bias"] == ((12, -100.0), (7, 2.5))
    assert (
        requests[0].presence_penalty,
        requests[0].frequency_penalty,
        requests[0].min_tokens,
    ) == (0.5, 0.25, 2)
    assert requests[1].response_format and requests[1].response_format.regex == "[0-9]+"
    capsys.readouterr()
    assert main([*common, "--response-format", '{"type": "regex", "regex": "a(b"}']) == 2
    assert "unclosed group" in capsys.readouterr().err
    assert main([*common, "--logit-bias", "7"]) == 2
    assert "ID=BIAS" in capsys.readouterr().err
