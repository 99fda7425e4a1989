"""The wire protocol: every bad job names its field; the committed JSON Schema is current."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError as PydanticValidationError

from batchd.config.limits import LimitSettings
from batchd.config.settings import load_settings
from batchd.daemon.cli import main
from batchd.producers.errors import ValidationError
from batchd.producers.keys import Keys, event_id, seq_of
from batchd.producers.schema import (
    Choice,
    Event,
    FinishReason,
    JobState,
    JobStatus,
    encode_job,
    parse_job,
    protocol_schema,
    protocol_schema_json,
    sequence_seed,
    validate_job,
)

ROOT = Path(__file__).resolve().parents[2]
USER = {"role": "user", "content": "hi"}
TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def deep_tool(depth: int) -> dict[str, Any]:
    """A tool whose parameters' schema nests ``depth`` levels."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return {"type": "function", "function": {"name": "deep", "parameters": schema}}


@pytest.mark.parametrize(
    ("job", "field", "words"),
    [
        ({"prompt": 1}, "prompt", "valid string"),
        ({"prompt": "a", "max_tokens": "10"}, "max_tokens", "valid integer"),
        ({"prompt": "a", "max_tokens": True}, "max_tokens", "valid integer"),
        ({"prompt": "a", "temperature": "hot"}, "temperature", "valid number"),
        ({"prompt": "a", "ignore_eos": 1}, "ignore_eos", "valid boolean"),
        ({"prompt": "a", "metadata": [1]}, "metadata", "dictionary"),
        ({"prompt_token_ids": ["a"]}, "prompt_token_ids.0", "valid integer"),
        ({"prompt": "a", "bogus": 1}, "bogus", "unknown field"),
        ({"prompt": "a", "temperature": -0.1}, "temperature", "greater than or equal to 0"),
        ({"prompt": "a", "top_p": 0}, "top_p", "greater than 0"),
        ({"prompt": "a", "top_p": 1.5}, "top_p", "less than or equal to 1"),
        ({"prompt": "a", "min_p": 2}, "min_p", "less than or equal to 1"),
        ({"prompt": "a", "top_k": -1}, "top_k", "greater than or equal to 0"),
        ({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"prompt": "a", "logprobs": 21}, "logprobs", "less than or equal to 20"),
        ({"prompt": "a", "seed": -1}, "seed", "greater than or equal to 0"),
        ({"prompt": "a", "ttl_s": 0}, "ttl_s", "greater than 0"),
        ({"prompt": "a", "stop": [""]}, "stop", "must not be empty"),
        ({"prompt": "a", "id": "bad id!"}, "id", "pattern"),
        ({}, "job", "exactly one of prompt, messages, prompt_token_ids"),
        ({"prompt": "a", "messages": [USER]}, "job", "got prompt, messages"),
        ({"messages": []}, "messages", "at least 1"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "'user'"),
        ({"prompt": "a", "n": 0}, "n", "greater than or equal to 1"),
        ({"prompt": "a", "n": 17}, "n", "less than or equal to 16"),
        ({"prompt": "a", "n": 2.0}, "n", "valid integer"),
        ({"prompt": "a", "prompt_logprobs": 1}, "prompt_logprobs", "valid boolean"),
        ({"prompt": "a", "tools": [TOOL]}, "tools", "tools apply to messages only"),
        ({"messages": [USER], "tools": []}, "tools", "at least 1"),
        ({"messages": [USER], "tools": [{"type": "web"}]}, "tools.0.type", "'function'"),
        (
            {"messages": [USER], "tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools.0.function.name",
            "pattern",
        ),
        (
            {"messages": [USER], "tools": [TOOL] * 129},
            "tools",
            "at most 128",
        ),
        (
            {"messages": [USER], "tools": [deep_tool(100)]},
            "tools.function.parameters",
            "deep",
        ),
    ],
)
def test_bad_job_names_field(job: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(ValidationError) as err:
        validate_job(job)
    assert err.value.field == field
    assert words in str(err.value)
    assert str(err.value).startswith(f"{field}: ")
    # The same job as raw bytes off the queue gives the same verdict.
    with pytest.raises(ValidationError) as raw_err:
        parse_job(json.dumps(job).encode())
    assert raw_err.value.field == field


def test_limits_come_from_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHD_LIMITS__MAX_TOKENS_CAP", "100")
    monkeypatch.setenv("BATCHD_LIMITS__MAX_PROMPT_CHARS", "5")
    monkeypatch.setenv("BATCHD_LIMITS__MAX_MESSAGES", "1")
    monkeypatch.setenv("BATCHD_LIMITS__MAX_PROMPT_TOKENS", "2")
    limits = load_settings().limits
    cases = [
        ({"prompt": "a", "max_tokens": 101}, "max_tokens", "101 exceeds the cap 100"),
        ({"prompt": "abcdef", "max_tokens": 8}, "prompt", "6 characters exceed the limit 5"),
        ({"messages": [USER, USER], "max_tokens": 8}, "messages", "2 messages exceed"),
        ({"prompt_token_ids": [1, 2, 3], "max_tokens": 8}, "prompt_token_ids", "3 tokens"),
        ({"prompt": "a", "max_tokens": 40, "n": 3}, "n", "n=3 sequences of max_tokens=40"),
    ]
    for job, field, words in cases:
        with pytest.raises(ValidationError) as err:
            validate_job(job, limits)
        assert (err.value.field, words in str(err.value)) == (field, True)
        validate_job(job)  # no limits: fine


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        (b'{"prompt": "\xff\xfe"}', "not UTF-8"),
        (b'{"prompt": ', "invalid JSON"),
        (b"[1]", "object"),
        (b"null", "object"),
        (b'{"prompt": "' + b"a" * 2000 + b'"}', "exceeds the limit 1000"),
    ],
)
def test_bad_payloads(payload: bytes, words: str) -> None:
    with pytest.raises(ValidationError) as err:
        parse_job(payload, LimitSettings(max_message_bytes=1000))
    assert err.value.field == "job"
    assert words in str(err.value)


def test_encode_parse_round_trip() -> None:
    job = validate_job(
        {"id": "j1", "messages": [USER], "max_tokens": 4, "seed": 7, "metadata": {"k": [1]}}
    )
    assert parse_job(encode_job(job)) == job
    assert b'"seed":7' in encode_job(job)
    assert job.sampling()["seed"] == 7 and job.prompt_kind == "messages"


@given(
    seq=st.integers(min_value=0, max_value=10**9),
    text=st.text(max_size=20),
    token=st.integers(min_value=0, max_value=2**31),
)
def test_event_and_ids_round_trip(seq: int, text: str, token: int) -> None:
    event = Event(seq=seq, token_id=token, text=text)
    assert Event.decode(event.encode()) == event
    assert seq_of(event_id(seq)) == seq and seq_of(event_id(seq).encode()) == seq


_FINITE = st.floats(allow_nan=False, allow_infinity=False)
_LOGPROBS = st.one_of(st.none(), _FINITE)


@given(
    seq=st.integers(min_value=0, max_value=10**9),
    index=st.one_of(st.none(), st.integers(min_value=0, max_value=16)),
    token=st.one_of(st.none(), st.integers(min_value=0, max_value=2**31)),
    text=st.text(max_size=20),
    logprob=_LOGPROBS,
    top=st.one_of(
        st.none(),
        st.lists(st.tuples(st.integers(min_value=0, max_value=2**31), _FINITE), max_size=3),
    ),
    prompt=st.one_of(
        st.none(), st.lists(st.tuples(st.integers(min_value=0, max_value=99), _LOGPROBS))
    ),
    texts=st.one_of(
        st.none(), st.dictionaries(st.integers(min_value=0, max_value=2**31), st.text(max_size=4))
    ),
)
def test_token_events_encode_as_their_model_dump(
    seq: int,
    index: int | None,
    token: int | None,
    text: str,
    logprob: float | None,
    top: list[tuple[int, float]] | None,
    prompt: list[tuple[int, float | None]] | None,
    texts: dict[int, str] | None,
) -> None:
    """A daemon encodes token events field by field (one per job and step): the bytes
    are the model's own JSON dump, whatever is set."""
    event = Event(
        seq=seq,
        index=index,
        token_id=token,
        text=text,
        logprob=logprob,
        top_logprobs=top,
        prompt_logprobs=prompt,
        token_texts=texts,
    )
    assert event.encode() == orjson.dumps(event.model_dump(mode="json", exclude_none=True))
    assert Event.decode(event.encode()) == event


@pytest.mark.parametrize("bad", [float("-inf"), float("inf"), float("nan")])
def test_events_never_hold_a_number_json_cannot_carry(bad: float) -> None:
    """orjson writes NaN and infinities as null, which no reader takes back as a logprob:
    such an event is refused when it is made, never published unreadable."""
    for fields in (
        {"logprob": bad},
        {"top_logprobs": [(3, -0.5), (4, bad)]},
        {"prompt_logprobs": [(1, None), (2, bad)]},
    ):
        with pytest.raises(PydanticValidationError, match="finite"):
            Event(seq=0, token_id=3, text="x", **fields)


def test_sequence_events_round_trip_and_n1_events_do_not_change() -> None:
    token = Event(seq=4, index=2, token_id=7, text="x")
    ended = Choice(index=1, text="ab", finish_reason=FinishReason.length, completion_tokens=2)
    final = Event(seq=5, finish_reason=FinishReason.stop, choices=[ended])
    assert Event.decode(token.encode()) == token and Event.decode(final.encode()) == final
    assert Event(seq=0, token_id=7, text="x").encode() == b'{"seq":0,"token_id":7,"text":"x"}'


def test_sequence_seeds_are_documented_and_distinct() -> None:
    assert sequence_seed(42, 0) == 42
    assert len({sequence_seed(42, i) for i in range(16)}) == 16
    assert all(0 <= sequence_seed(2**63 - 1, i) < 2**63 for i in range(16))
    digest = hashlib.blake2b(b"42:3", digest_size=8).digest()
    assert sequence_seed(42, 3) == int.from_bytes(digest, "little") >> 1


def test_status_hash_round_trip() -> None:
    status = JobStatus(state=JobState.running, queue="q", cancel_requested=True, queued_at=1.5)
    stored = {k.encode(): v.encode() for k, v in status.to_hash().items()}
    assert stored[b"cancel_requested"] == b"1"
    assert JobStatus.from_hash(stored) == status
    assert JobState.cancelled.terminal and not JobState.queued.terminal
    assert Event(seq=3, finish_reason=FinishReason.stop).final


def test_key_names() -> None:
    keys = Keys("p")
    assert keys.queue() == "p:queue:default"
    assert (keys.job("j"), keys.events("j"), keys.tokens("j")) == (
        "p:job:j",
        "p:job:j:events",
        "p:job:j:tokens",
    )
    assert (keys.cancel, keys.dead, keys.daemon("c")) == ("p:cancel", "p:dead", "p:daemon:c")
    for _ in range(2):  # a refused id is refused every time (names are cached, refusals not)
        with pytest.raises(ValidationError, match="id"):
            keys.events("a:b")
    for bad in (["j"], 7):  # not a string, hashable or not
        with pytest.raises(ValidationError, match="id"):
            keys.job(bad)  # type: ignore[arg-type]
    assert Keys("q").events("j") == "q:job:j:events"  # the cache holds names per prefix


def test_a_chat_job_with_tools_round_trips() -> None:
    job = validate_job({"messages": [USER], "tools": [TOOL]})
    assert job.tools is not None and job.tools[0].function.name == "get_time"
    assert parse_job(encode_job(job)).tools == job.tools


def test_committed_schema_is_current() -> None:
    committed = (ROOT / "producers" / "protocol.schema.json").read_text()
    assert json.loads(committed) == protocol_schema()
    regenerate = "run: batchd schema > producers/protocol.schema.json"
    assert committed == protocol_schema_json(), regenerate


def test_schema_command_prints_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    printed = capsys.readouterr().out
    assert printed == (ROOT / "producers" / "protocol.schema.json").read_text()
    assert json.loads(printed)["$defs"]["JobRequest"]["additionalProperties"] is False


def test_a_reader_leaves_out_event_fields_it_does_not_know() -> None:
    """A newer daemon's event reaches an older reader: the unknown field is left out;
    an event built here still refuses it."""
    newer = orjson.dumps({"seq": 3, "token_id": 7, "text": "a", "from_a_newer_daemon": [1]})
    event = Event.decode(newer)
    assert (event.seq, event.token_id, event.text) == (3, 7, "a")
    assert "from_a_newer_daemon" not in event.model_dump()
    with pytest.raises(PydanticValidationError, match="from_a_newer_daemon"):
        Event.model_validate({"seq": 3, "from_a_newer_daemon": [1]})
