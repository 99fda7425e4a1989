"""Property: no payload a producer can XADD hurts the daemon or another job.

One real redis-server and one real Worker (deterministic fake engine) take
generated hostile entries (random bytes, deep and wide JSON, huge and
non-finite numbers, control characters, ids and queue names with ``:``,
``{}``, ``*``, ``..`` and newlines, entries without a job field) interleaved
with valid jobs. After each batch: the daemon still runs, every valid job
finished with the right tokens, every invalid entry is dead-lettered with a
reason and acked, no key outside the prefix exists, and a finished job that
hostile entries name is untouched.
"""

from __future__ import annotations

import itertools
from typing import Any

import orjson
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchd.producers.errors import ValidationError
from batchd.producers.keys import CONSUMER_GROUP, JOB_FIELD, Keys
from batchd.producers.schema import parse_job
from support.daemon_harness import (
    FakeGenerator,
    enqueue,
    expected_fake_tokens,
    fast_settings,
    token_ids,
    wait_final,
    wait_until,
    worker_thread,
)
from support.redis_server import RedisServer

KEYS = Keys()
VICTIM = "victim"
NASTY_IDS = [VICTIM, f"{VICTIM}:events", f"{VICTIM}:tokens", "a{b}c", "*", "..", "x\n", "", "é"]
_ids = itertools.count()

text = st.text(alphabet=st.characters(codec="utf-8"), max_size=40)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    text,
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(text, inner, max_size=6),
    max_leaves=30,
)
FIELDS = [
    "id",
    "prompt",
    "messages",
    "prompt_token_ids",
    "max_tokens",
    "temperature",
    "priority",
    "seed",
    "stop",
    "metadata",
    "ttl_s",
    "logprobs",
    "queue",
]
job_like = st.dictionaries(st.sampled_from(FIELDS) | text, json_values, max_size=6) | st.builds(
    lambda job_id, extra: {"id": job_id, "prompt": "hi", **extra},
    st.sampled_from(NASTY_IDS),
    st.dictionaries(st.sampled_from(FIELDS[4:]), json_values, max_size=3),
)


def _raw_text(value: Any) -> bytes:
    """JSON with non-finite numbers and huge integers written out, as a careless producer
    in another language might."""
    try:
        body = orjson.dumps(value)
    except orjson.JSONEncodeError:
        body = repr(value).encode()
    return body


payloads = st.one_of(
    st.binary(max_size=200),
    job_like.map(_raw_text),
    st.sampled_from(
        [
            b'{"prompt": "x", "temperature": NaN}',
            b'{"prompt": "x", "priority": 1e999}',
            b'{"prompt": "x", "metadata": {"u": 340282366920938463463374607431768211455}}',
            b'{"id": "victim", "prompt": "x", "max_tokens": -1}',
            b'{"id": "victim:events", "prompt": "x"}',
            b'{"id": "victim\\n", "prompt": 5}',
            b"[" * 3000 + b"]" * 3000,
            b'{"id": "victim", "prompt": ',
        ]
    ),
)
entries = st.lists(
    st.tuples(payloads, st.sampled_from([JOB_FIELD, "other"])), min_size=1, max_size=8
)


def _is_valid(payload: bytes, field: str) -> bool:
    if field != JOB_FIELD:
        return False
    try:
        parse_job(payload)
    except ValidationError:
        return False
    return True


def _prefixed_keys_only(client: redis.Redis) -> list[bytes]:
    return [key for key in client.scan_iter("*") if not key.startswith(b"batchd:")]


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batch=entries)
def test_hostile_entries_never_hurt_the_daemon_or_other_jobs(
    redis_server: RedisServer, batch: list[tuple[bytes, str]]
) -> None:
    client = redis_server.client()
    with worker_thread(fast_settings(redis_server.url), FakeGenerator):
        if not client.exists(KEYS.job(VICTIM)):
            enqueue(client, KEYS, {"id": VICTIM, "prompt_token_ids": [1, 2], "max_tokens": 3})
            wait_final(client, KEYS, [VICTIM], timeout=20)
        victim = (client.hgetall(KEYS.job(VICTIM)), client.xrange(KEYS.events(VICTIM)))
        dead_before = client.xlen(KEYS.dead)
        valid: dict[str, list[int]] = {}
        invalid = 0
        for payload, field in batch:
            if not _is_valid(payload, field):  # a well-formed job is not what this is about
                client.xadd(KEYS.queue(), {field: payload})
                invalid += 1
            # A valid job after each hostile entry: the daemon must still be serving.
            job_id = f"ok{next(_ids)}"
            enqueue(client, KEYS, {"id": job_id, "prompt_token_ids": [3, 4, 5], "max_tokens": 4})
            valid[job_id] = expected_fake_tokens([3, 4, 5], None, 4)
        done = wait_final(client, KEYS, list(valid), timeout=30)
        wait_until(
            lambda: client.xlen(KEYS.dead) == dead_before + invalid,
            timeout=20,
            what=f"{invalid} dead letters",
        )
        wait_until(
            lambda: client.xpending(KEYS.queue(), CONSUMER_GROUP)["pending"] == 0,
            timeout=20,
            what="every entry acked",
        )
    for job_id, tokens in valid.items():
        assert token_ids(done[job_id]) == tokens, job_id
    for _, fields in client.xrange(KEYS.dead, "-", "+")[dead_before:]:
        assert fields.get(b"error"), fields
    assert (client.hgetall(KEYS.job(VICTIM)), client.xrange(KEYS.events(VICTIM))) == victim
    assert _prefixed_keys_only(client) == []
