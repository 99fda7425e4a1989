"""Every job field is bounded at parse time, and names cannot reach into other keys."""

from __future__ import annotations

import pytest

from batchd.config.settings import SettingsError, load_settings
from batchd.daemon.cli import main
from batchd.producers.aio import AsyncClient
from batchd.producers.client import Client
from batchd.producers.errors import ValidationError
from batchd.producers.keys import Keys, is_name
from batchd.producers.schema import parse_job, protocol_schema
from support.redis_server import RedisServer

HOSTILE_PAYLOADS = [
    # (payload, the field the error must name)
    ('{"prompt":"x","metadata":{"u":' + str(2**127 + 12345) + "}}", "metadata"),  # > int64
    ('{"prompt":"x","metadata":{"a":[1e999,1e999]}}', "metadata"),
    ('{"prompt":"x","metadata":{"a":NaN}}', "metadata"),
    ('{"prompt":"x","metadata":' + '{"a":' * 40 + "1" + "}" * 40 + "}", "metadata"),
    ('{"prompt":"x","metadata":{"big":"' + str("y" * 20_000) + '"}}', "metadata"),
    ('{"prompt":"x","priority":' + str(10**30) + "}", "priority"),
    ('{"prompt":"x","priority":-' + str(10**30) + "}", "priority"),
    ('{"prompt":"x","temperature":NaN}', "temperature"),
    ('{"prompt":"x","temperature":1e999}', "temperature"),
    ('{"prompt":"x","ttl_s":Infinity}', "ttl_s"),
    ('{"prompt":"x","seed":' + str(2**64) + "}", "seed"),
    ('{"prompt":"x","max_tokens":' + str(2**70) + "}", "max_tokens"),
    ('{"prompt_token_ids":[1,' + str(2**40) + "]}", "prompt_token_ids.1"),
    ('{"prompt":"x","stop_token_ids":[-1]}', "stop_token_ids.0"),
    ('{"prompt":"x","stop":["' + str("s" * 2000) + '"]}', "stop.0"),
    ('{"prompt":"x","id":"victim:events"}', "id"),
    ('{"prompt":"x","id":"abc\\n"}', "id"),
    ('{"prompt":"x","id":"a*"}', "id"),
    ('{"prompt":"x","id":"{tag}"}', "id"),
    ('{"prompt":"x","metadata":' + "[" * 5000 + "]" * 5000 + "}", "job"),
]


@pytest.mark.parametrize(("payload", "field"), HOSTILE_PAYLOADS)
def test_hostile_fields_are_refused_naming_the_field(payload: str, field: str) -> None:
    with pytest.raises(ValidationError) as caught:
        parse_job(payload)
    assert caught.value.field == field, caught.value


def test_largest_legal_values_pass() -> None:
    job = parse_job(
        '{"prompt":"x","seed":' + str(2**63 - 1) + ',"priority":1000000000,'
        '"metadata":{"u":' + str(2**64 - 1) + ',"f":1.5}}'
    )
    assert job.seed == 2**63 - 1 and job.metadata["u"] == 2**64 - 1


@pytest.mark.parametrize(
    "name", ["x:events", "abc\n", "", "*", "a b", "{tag}", ".hidden", "x" * 129, "ü"]
)
def test_keys_refuse_names_that_are_not_names(name: str) -> None:
    assert not is_name(name)
    for build in (Keys().job, Keys().events, Keys().tokens, Keys().queue):
        with pytest.raises(ValidationError):
            build(name)


@pytest.mark.parametrize("name", ["a", "job-1.2_3", "1700000000000-0", "A" * 128])
def test_keys_accept_names(name: str) -> None:
    assert is_name(name) and Keys().job(name) == f"batchd:job:{name}"


def test_clients_and_cli_refuse_bad_names(redis_server: RedisServer) -> None:
    with Client(redis_server.url) as client:
        with pytest.raises(ValidationError, match="id"):
            client.submit("hi", job_id="victim:events")
        with pytest.raises(ValidationError, match="id"):
            client.status("victim:events")
        with pytest.raises(ValidationError, match="id"):
            client.handle("victim\n")  # refused at once, not at its first use
    with pytest.raises(ValidationError, match="id"):
        AsyncClient(redis_server.url).handle("a*")
        with pytest.raises(ValidationError, match="queue"):
            client.submit("hi", queue="a:b")
    with pytest.raises(ValidationError, match="queue"):
        Client(redis_server.url, queue="a b")
    assert main(["--redis-url", redis_server.url, "status", "victim:events"]) == 2
    assert main(["--redis-url", redis_server.url, "cancel", "x*"]) == 2
    assert list(redis_server.client().scan_iter("*")) == []


def test_settings_refuse_bad_queue_names() -> None:
    with pytest.raises(SettingsError, match="queues"):
        load_settings(queues=["good", "bad:name"])


def test_the_json_schema_states_the_charset() -> None:
    schema = protocol_schema()
    pattern = schema["keys"]["name_pattern"]
    assert schema["$defs"]["JobRequest"]["properties"]["id"]["anyOf"][0]["pattern"] == pattern
